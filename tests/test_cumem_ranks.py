"""Sleep and wake_up across ranks (both lanes' 0006), on CPU: 2, 3 and 4 ranks over gloo.

Each rank is a process holding the lane's real patched CuMemAllocator against the fake
device of test_cumem_patches (rankkit.py). Every play injects a failure into one rank
(or two) at one step and asserts all or nothing: after the failed call every rank holds
exactly what it held before (every allocation's state, its bytes on the device and in its
backup), every rank raised the same sentence naming the failed rank(s), the allocation
and the cause; the retry succeeds, and every rank ends with the bytes it started with.
Each play also runs on the lane's series without 0006 ("series": every rank sleeps or
wakes on its own, as collective_rpc makes it do), where it shows the split: the failed
rank rolled back, the others did not.
"""

from __future__ import annotations

import ast
import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from contextlib import suppress
from enum import Enum
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import rankkit  # noqa: E402
from lanekit import LANES, REPO, lane_tree  # noqa: E402, F401
from test_cumem_patches import LAYOUT, FakeCuda, load_cumem  # noqa: E402

from sm12x_bundle.outputs.tree import write_tree  # noqa: E402
from sm12x_bundle.series.patch import Series, load_series  # noqa: E402

pytestmark = pytest.mark.integration

FIX = "cumem-rank-transactions"
FAILING = ("sleep-host-oom", "sleep-copy", "sleep-raises", "sleep-two-fail",
           "wake-map-oom", "wake-copy", "wake-raises")
# What each play's sentence must name: the allocation and the cause.
NAMES = {
    "sleep-host-oom": ("failed to back up the allocation (tag 'weights', 8192 bytes)", "out of memory"),
    "sleep-copy": ("failed to copy the allocation (tag 'weights', 8192 bytes)", "illegal memory access"),
    "sleep-raises": ("injected: the worker raised", ""),
    "sleep-two-fail": ("failed to back up the allocation (tag 'weights', 8192 bytes)", "out of memory"),
    "wake-map-oom": ("failed to map the allocation (tag 'weights', 12288 bytes)", "out of memory"),
    "wake-copy": ("failed to copy the allocation (tag 'weights', 8192 bytes)", "CUDART error: out of memory"),
    "wake-raises": ("injected: the worker raised", ""),
}
PLAYS = FAILING + ("sleep-commit-unmap", "wake-abort-unmap", "steady")
# (lane, variant, world): the patched tree at 2, 3 and 4 ranks; the series without 0006 at 3.
RUNS = [(lane, "patched", world) for lane in LANES for world in (2, 3, 4)] + [
    (lane, "series", 3) for lane in LANES]
TIMEOUT = 4.0  # the agreement's, in the plays where a rank is absent or late


@pytest.fixture(scope="session")
def rank_tree(lane_tree, default_context, tmp_path_factory):
    """("series" | "patched", lane) -> the lane's tree without 0006, or with the whole series."""
    made: dict[str, Path] = {}

    def tree(lane: str, variant: str) -> Path:
        if variant == "patched":
            return lane_tree(lane, "patched")
        if lane not in made:
            full = load_series(REPO / "patches" / lane / "series")
            before = [p.id for p in full.patches].index(FIX)  # and what builds on it
            out = tmp_path_factory.mktemp(f"series-{lane}") / "vllm"
            write_tree(Series(full.file, full.patches[:before]), default_context.source(lane), out)
            made[lane] = out
        return made[lane]

    return tree


@pytest.fixture(scope="session")
def ranks(rank_tree, tmp_path_factory):
    """ranks(lane, variant, world, plays, **job) -> every rank's document; run once each."""
    done: dict[tuple, list[dict]] = {}
    counter = itertools.count()

    def run(lane: str, variant: str, world: int, plays: tuple[str, ...], **job) -> list[dict]:
        key = (lane, variant, world, plays, tuple(sorted(job.items())))
        if key not in done:
            out = tmp_path_factory.mktemp(f"ranks-{next(counter)}")
            job = {"tree": str(rank_tree(lane, variant)), "variant": variant, "plays": list(plays),
                   "store": str(out / "store"), "out": str(out), "timeout": 60.0,
                   "absent_timeout": TIMEOUT, **job}
            docs = rankkit.run_ranks(world, job)
            for d in docs:
                assert "crash" not in d, f"rank {d['rank']} crashed:\n{d['crash']}"
            done[key] = docs
        return done[key]

    return run


def plays_of(variant: str) -> tuple[str, ...]:
    """Every play, then (patched) a rank late past the timeout, then a rank that dies."""
    return PLAYS + (("late",) if variant == "patched" else ()) + ("dies",)


def play(ranks, lane, variant, world, name) -> list[dict]:
    docs = ranks(lane, variant, world, plays_of(variant))
    if name == "dies":
        assert docs[-1].get("plays", {}).get(name) is None  # it died before it wrote anything
        return [d["plays"][name] for d in docs[:-1]]
    return [d["plays"][name] for d in docs]


def same_sentence(docs: list[dict]) -> str:
    errors = {d["error"] for d in docs}
    assert len(errors) == 1, f"the ranks raised different errors: {errors}"
    error = errors.pop()
    assert error and error.startswith("RankTransactionError: CuMemAllocator: "), error
    return error


def assert_split(docs: list[dict], failed: set[int]) -> None:
    """What the series without 0006 shows: the failed ranks raised and rolled back, the
    others did not raise and are in the new state."""
    assert {r for r, d in enumerate(docs) if d["error"]} == failed
    assert all(docs[r]["after"] == docs[r]["before"] for r in failed)
    assert all(d["after"] != d["before"] for r, d in enumerate(docs) if r not in failed)


def weights(snapshot_bytes: list) -> list:
    return [snapshot_bytes[i] for i in rankkit.WEIGHTS]


# --- a failure at each step, in one rank (or two) ------------------------------------------------


@pytest.mark.parametrize("lane,variant,world", RUNS)
@pytest.mark.parametrize("name", FAILING)
def test_a_failed_part_leaves_every_rank_as_before(ranks, lane, variant, world, name):
    docs = play(ranks, lane, variant, world, name)
    failed = {world - 1} | ({0} if name == "sleep-two-fail" else set())
    if variant == "series":
        assert_split(docs, failed)
        return
    error = same_sentence(docs)
    op = name.split("-")[0].replace("wake", "wake_up")
    listed = ", ".join(map(str, sorted(failed)))
    span = "0-3" if world == 4 else ("0-2" if world == 3 else "0, 1")
    assert f"{op} failed on rank {listed} of ranks {span} (" in error
    for r in failed:
        assert f"rank {r}: " in error
    allocation, cause = NAMES[name]
    assert allocation in error and cause in error
    assert error.endswith("can be retried" if op == "sleep" else "can be retried once GPU memory is free")
    for d in docs:  # exactly as before the call, bytes and backups included
        assert d["after"] == d["before"]
        assert d["retry"] is None and d["finish"] is None
        assert weights(d["final"]) == weights(d["start"])


@pytest.mark.parametrize("lane,variant,world", RUNS)
def test_a_commit_that_cannot_unmap_keeps_that_allocation_awake_and_every_rank_asleep(ranks, lane, variant, world):
    """Every rank agreed to sleep; the last rank's first unmap fails in the commit. Undoing
    the others would split the ranks: the allocation stays mapped with its bytes, awake,
    the call succeeds everywhere, and the wake restores the rest."""
    docs = play(ranks, lane, variant, world, "sleep-commit-unmap")
    if variant == "series":
        assert_split(docs, {world - 1})
        return
    assert [d["error"] for d in docs] == [None] * world
    for r, d in enumerate(docs):
        for i, (asleep, mapped, dev, backup) in enumerate(d["after"]):
            kept = r == world - 1 and i == rankkit.WEIGHTS[0]
            assert (asleep, mapped, backup is None) == (not kept, kept, True if kept else i in rankkit.KV)
            if kept:
                assert dev == d["before"][i][2]
        assert d["finish"] is None and weights(d["final"]) == weights(d["start"])


@pytest.mark.parametrize("lane,variant,world", RUNS)
def test_an_abort_that_cannot_unmap_keeps_that_allocation_awake(ranks, lane, variant, world):
    """The last rank's wake fails; rank 0, undoing its part, cannot unmap its newest
    allocation (the kv cache). It keeps it awake, so the retried wake does not map it
    twice: the retry succeeds on every rank and every byte comes back."""
    docs = play(ranks, lane, variant, world, "wake-abort-unmap")
    if variant == "series":
        assert_split(docs, {world - 1})
        return
    same_sentence(docs)
    for r, d in enumerate(docs):
        if r != 0:
            assert d["after"] == d["before"]
        else:
            changed = [i for i, (a, b) in enumerate(zip(d["after"], d["before"])) if a != b]
            assert changed == rankkit.KV and d["after"][rankkit.KV[0]][:2] == [False, True]
        assert d["retry"] is None and d["finish"] is None
        assert weights(d["final"]) == weights(d["start"])


@pytest.mark.parametrize("lane,variant,world", RUNS)
def test_steady_sleep_and_wake_across_ranks(ranks, lane, variant, world):
    docs = play(ranks, lane, variant, world, "steady")
    for d in docs:
        assert d["errors"] == [] and weights(d["final"]) == weights(d["start"])
        # one agreement per call on the patched tree, none on the series
        assert len(d["agreements"]) == (40 if variant == "patched" else 0)


@pytest.mark.parametrize("lane", LANES)
def test_four_ranks_as_a_grid_of_tp_and_pp_groups(ranks, lane):
    """TP=2 x PP=2: the agreement runs over the TP group, then the PP group, and still
    reaches every rank."""
    plays = ("sleep-host-oom", "wake-map-oom", "steady")
    docs = ranks(lane, "patched", 4, plays, layout="grid")
    for name in plays[:2]:
        ds = [d["plays"][name] for d in docs]
        error = same_sentence(ds)
        assert "failed on rank 3 of ranks 0-3 (rank 3: " in error
        assert all(d["after"] == d["before"] for d in ds)
        assert all(d["retry"] is None and weights(d["final"]) == weights(d["start"]) for d in ds)
    assert all(d["plays"]["steady"]["errors"] == [] for d in docs)


# --- a rank that is not there -----------------------------------------------------------------------


@pytest.mark.parametrize("lane,variant,world", RUNS)
def test_a_rank_that_dies_before_the_agreement(ranks, lane, variant, world):
    survivors = play(ranks, lane, variant, world, "dies")
    if variant == "series":  # they slept without it
        assert all(s["error"] is None and s["after"] != s["before"] for s in survivors)
        return
    for s in survivors:
        assert s["error"] and "did not hear from every rank" in s["error"]
        assert s["after"] == s["before"]  # awake with every byte, as before
        assert s["seconds"] < 2 * TIMEOUT + 5  # bounded: no hang


@pytest.mark.parametrize("lane,variant,world", [run for run in RUNS if run[1] == "patched"])
def test_a_rank_that_arrives_after_the_others_gave_up_does_not_commit_alone(ranks, lane, variant, world):
    """The last rank stalls past the timeout, then sleeps successfully. A collective the
    others gave up on can still complete on it with what they sent before; the second
    round (their vote: 0) stops it from committing alone. Every rank ends awake."""
    ds = play(ranks, lane, variant, world, "late")
    assert all(d["error"] for d in ds), [d["error"] for d in ds]
    assert all(d["after"] == d["before"] for d in ds)


# --- one rank: the lane's own transactions, nothing else ------------------------------------------


def load_ranks_module(tree: Path):
    return rankkit.load_ranks_module(tree)


@pytest.mark.parametrize("lane", LANES)
def test_one_rank_runs_the_lanes_own_sleep_and_wake_up(lane_tree, lane, monkeypatch):
    tree = lane_tree(lane, "patched")
    mod = load_ranks_module(tree)
    assert not dist.is_initialized()
    fakes = []
    for way in ("plain", "across"):
        fake = FakeCuda()
        alloc = load_cumem(tree, fake, monkeypatch, f"_cumem_one_{way}").CuMemAllocator()
        addrs = [fake.my_malloc(alloc, size, tag) for tag, size in LAYOUT]
        data = {a: bytes(fake.memory[a]) for a in addrs}
        fake.events.clear()
        if way == "plain":
            alloc.sleep(offload_tags=("weights",))
            alloc.wake_up()
        else:
            monkeypatch.setattr(mod, "run_across_ranks", _never)
            monkeypatch.setattr(alloc, "prepare_sleep", _never)
            mod.sleep_across_ranks(alloc, ("weights",))
            mod.wake_up_across_ranks(alloc, None)
        assert all(bytes(fake.memory[a]) == data[a] for (tag, _), a in zip(LAYOUT, addrs) if tag == "weights")
        fakes.append([kind for kind, _ in fake.events])
    assert fakes[0] == fakes[1]  # the same maps, unmaps and synchronizes, in the same order


def _never(*args, **kwargs):
    raise AssertionError("a one-rank call must run the lane's own sleep() and wake_up(), nothing else")


def test_the_timeout_comes_from_the_environment(lane_tree, monkeypatch, caplog):
    mod = load_ranks_module(lane_tree("0.21.0", "patched"))
    monkeypatch.delenv("VLLM_SM12X_RANK_AGREEMENT_TIMEOUT", raising=False)
    assert mod.timeout_s() == 300.0
    monkeypatch.setenv("VLLM_SM12X_RANK_AGREEMENT_TIMEOUT", "12.5")
    assert mod.timeout_s() == 12.5
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("VLLM_SM12X_RANK_AGREEMENT_TIMEOUT", bad)
        with caplog.at_level(logging.WARNING):
            assert mod.timeout_s() == 300.0
        assert f"VLLM_SM12X_RANK_AGREEMENT_TIMEOUT={bad!r} is not a positive number" in caplog.text


def test_a_report_round_trips_through_its_bytes(lane_tree):
    mod = load_ranks_module(lane_tree("0.21.0", "patched"))
    long = "é" * 400  # cut inside a two-byte character: decoded with a replacement
    buf = torch.cat([mod._encode(0, None), mod._encode(7, "map failed: out of memory"), mod._encode(2, long),
                     torch.zeros(mod.REPORT_BYTES, dtype=torch.uint8)])
    got = mod._decode(buf)
    assert got[:2] == [(0, None), (7, "map failed: out of memory")]
    assert got[2][0] == 2 and got[2][1].startswith("é" * 200) and len(got) == 3


# --- the executor reads every reply before it raises (both lanes' multiproc_executor.py) -----------


class Status(Enum):
    SUCCESS = 0
    FAILURE = 1
    FAILURE_WITH_KV_OUTPUT = 2


class ReplyQueue:
    def __init__(self) -> None:
        self.replies: deque = deque()

    def dequeue(self, timeout=None):
        return self.replies.popleft()


def collective_rpc(tree: Path):
    """The tree's own MultiprocExecutor.collective_rpc and FutureWrapper, compiled alone
    (annotations dropped: they name classes this test does not import)."""
    source = (tree / "vllm/v1/executor/multiproc_executor.py").read_text()
    module = ast.parse(source)
    classes = {n.name: n for n in module.body if isinstance(n, ast.ClassDef)}
    method = next(n for n in classes["MultiprocExecutor"].body
                  if isinstance(n, ast.FunctionDef) and n.name == "collective_rpc")
    body = [_unannotated(classes["FutureWrapper"]), _unannotated(method)]
    code = compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), "<collective_rpc>", "exec")
    namespace = {"time": time, "deque": deque, "Future": Future, "InvalidStateError": InvalidStateError,
                 "suppress": suppress, "partial": partial, "WorkerProc": SimpleNamespace(ResponseStatus=Status),
                 "KVConnectorOutput": type("KVConnectorOutput", (), {})}
    exec(code, namespace)
    return namespace["collective_rpc"]


def _unannotated(node):
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n.returns = None
            for a in n.args.args + n.args.kwonlyargs + n.args.posonlyargs:
                a.annotation = None
        if isinstance(n, ast.ClassDef):
            n.bases = [b for b in n.bases if isinstance(b, ast.Name) and b.id == "Future"]
    for parent in ast.walk(node):
        for field, value in ast.iter_fields(parent):
            if isinstance(value, list):
                setattr(parent, field, [ast.Assign(targets=[v.target], value=v.value, lineno=v.lineno)
                                        if isinstance(v, ast.AnnAssign) and v.value is not None else v
                                        for v in value])
    return node


@pytest.mark.parametrize("lane", LANES)
@pytest.mark.parametrize("variant", ["series", "patched"])
def test_a_retry_after_every_worker_failed_reads_its_own_replies(rank_tree, lane, variant):
    rpc = collective_rpc(rank_tree(lane, variant))
    queues = [ReplyQueue() for _ in range(4)]
    executor = SimpleNamespace(
        rpc_broadcast_mq=SimpleNamespace(enqueue=lambda message: None), response_mqs=queues, is_failed=False,
        futures_queue=deque(),
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(enable_fault_tolerance=False)))
    for r, q in enumerate(queues):  # every rank raised the agreed sentence
        q.replies.append((Status.FAILURE, f"wake_up failed on rank 3 (seen by rank {r})"))
    with pytest.raises(RuntimeError, match=r"seen by rank 0"):
        rpc(executor, "wake_up")
    for q in queues:  # the retry succeeded on every rank
        q.replies.append((Status.SUCCESS, "woken"))
    if variant == "series":  # rank 1's reply to the first call is taken for the retry's
        with pytest.raises(RuntimeError, match=r"seen by rank 1"):
            rpc(executor, "wake_up")
        return
    assert rpc(executor, "wake_up") == ["woken"] * 4
    assert all(not q.replies for q in queues)
