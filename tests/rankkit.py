"""The ranks of an engine on CPU: each a process holding a lane's real CuMemAllocator.

``run_ranks`` starts ``world`` processes (spawned, gloo over a file store). Each loads the
lane tree's own ``vllm/device_allocator/cumem.py`` against :class:`FakeCuda` (as
test_cumem_patches does) and, on the patched tree, its ``cumem_ranks.py``; then runs the
named plays in order and writes what it saw to ``rank-N.json``. A play allocates
test_cumem_patches' LAYOUT with random bytes, brings the allocator to the play's starting
state, injects a failure into the chosen ranks and calls sleep or wake_up as the lane's
worker does: without the rank patch (variant "series"), each rank calls its own
``sleep()``/``wake_up()``, as ``collective_rpc`` does; with it ("patched"), each calls
``sleep_across_ranks``/``wake_up_across_ranks``. It records the error and a snapshot of
every allocation (asleep, mapped, digest of its bytes on the device and in its backup)
before and after, then retries without the failure and completes the cycle.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_cumem_patches import (
    LAYOUT,
    FakeCuda,
    HostAllocationFails,
    is_asleep,
    load_cumem,
)

OFFLOAD = ("weights",)
KV = [i for i, (tag, _) in enumerate(LAYOUT) if tag not in OFFLOAD]
WEIGHTS = [i for i, (tag, _) in enumerate(LAYOUT) if tag in OFFLOAD]


class Rank:
    """One rank's allocator, its fake device, and how the lane's worker calls it."""

    def __init__(self, tree: Path, variant: str, ranks_mod, agreement, play: str, mp) -> None:
        self.fake = FakeCuda()
        self.mod = load_cumem(tree, self.fake, mp, f"_cumem_rank_{play.replace('-', '_')}")
        self.alloc = self.mod.CuMemAllocator()
        self.variant, self.ranks_mod, self.agreement = variant, ranks_mod, agreement
        self.addrs = [self.fake.my_malloc(self.alloc, size, tag) for tag, size in LAYOUT]

    def call(self, op: str) -> str | None:
        """sleep (offloading the weights) or wake_up; the error it raised, or None."""
        try:
            if self.variant == "patched":
                if op == "sleep":
                    self.ranks_mod.sleep_across_ranks(self.alloc, OFFLOAD, self.agreement)
                else:
                    self.ranks_mod.wake_up_across_ranks(self.alloc, None, self.agreement)
            elif op == "sleep":
                self.alloc.sleep(offload_tags=OFFLOAD)
            else:
                self.alloc.wake_up(None)
        except Exception as exc:  # noqa: BLE001  (recorded, judged by the test)
            return f"{type(exc).__name__}: {exc}"
        return None

    def snapshot(self) -> list:
        """Per allocation: asleep, mapped, digest on the device, digest of the backup."""
        out = []
        for a in self.addrs:
            d = self.alloc.pointer_to_data[a]
            dev = _digest(bytes(self.fake.memory[a])) if a in self.fake.memory else None
            backup = None if d.cpu_backup_tensor is None else _digest(d.cpu_backup_tensor.numpy().tobytes())
            out.append([bool(is_asleep(d)), a in self.fake.memory, dev, backup])
        return out

    def device_bytes(self) -> list:
        return [_digest(bytes(self.fake.memory[a])) if a in self.fake.memory else None for a in self.addrs]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


# --- injections: each returns an undo ----------------------------------------------------------


def inject(rank: Rank, what: str, variant: str, op: str):
    fake, alloc, mod = rank.fake, rank.alloc, rank.mod
    if what == "host-oom":  # the 2nd pinned backup of sleep fails: host memory ran out
        host = HostAllocationFails(2)
        mod.torch = host
        return lambda: setattr(mod, "torch", torch)
    if what == "copy-out":  # the D2H copy of the 2nd weight fails
        return _failing_copy(fake, rank.addrs[WEIGHTS[1]], into_device=False)
    if what == "map-oom":  # the 3rd map of wake_up fails: another process holds the memory
        fake.fail_map_at = fake.map_calls + 3
        return lambda: setattr(fake, "fail_map_at", None)
    if what == "copy-in":  # the H2D copy of the 2nd weight fails
        fake.fail_copy_to = rank.addrs[WEIGHTS[1]]
        return lambda: setattr(fake, "fail_copy_to", None)
    if what == "raises":  # the rank's part raises something that is not CUDA's
        name = {"patched": "prepare_", "series": ""}[variant] + op

        def raising(*args, **kwargs):
            raise ValueError("injected: the worker raised before its part was done")

        setattr(alloc, name, raising)
        return lambda: delattr(alloc, name)
    if what == "unmap":  # the next unmap fails (in sleep's commit, or in a wake's abort)
        fake.fail_unmap_at = fake.unmap_calls + 1
        return lambda: setattr(fake, "fail_unmap_at", None)
    raise ValueError(what)


def _failing_copy(fake: FakeCuda, addr: int, into_device: bool):
    real = fake.cudaMemcpy

    def copy(dst, src, count):
        if (dst if into_device else src) == addr:
            raise RuntimeError("CUDART error: an illegal memory access was encountered")
        real(dst, src, count)

    fake.cudaMemcpy = copy
    return lambda: setattr(fake, "cudaMemcpy", real)


# --- plays ------------------------------------------------------------------------------------
# name: (the call, the injection, which ranks get it: "last", "first+last", "pair" (the last
# fails, rank 0 fails its abort's unmap)).
PLAYS = {
    "sleep-host-oom": ("sleep", "host-oom", "last"),
    "sleep-copy": ("sleep", "copy-out", "last"),
    "sleep-raises": ("sleep", "raises", "last"),
    "sleep-two-fail": ("sleep", "host-oom", "first+last"),
    "sleep-commit-unmap": ("sleep", "unmap", "last"),
    "wake-map-oom": ("wake_up", "map-oom", "last"),
    "wake-copy": ("wake_up", "copy-in", "last"),
    "wake-raises": ("wake_up", "raises", "last"),
    "wake-abort-unmap": ("wake_up", "map-oom", "pair"),
    "steady": ("sleep", None, "none"),
}


# The last rank stalls past the agreement's timeout, or dies, before its part of a sleep
# ("dies" kills a rank: last in a job).
ABSENT = ("late", "dies")


def victims(who: str, world: int) -> dict[int, str]:
    """rank -> which injection it gets (the play's, or "unmap" for the pair's rank 0)."""
    return {"last": {world - 1: "play"}, "first+last": {0: "play", world - 1: "play"},
            "pair": {world - 1: "play", 0: "unmap"}, "none": {}}[who]


def play(name: str, rank: Rank, me: int, world: int, variant: str) -> dict:
    op, what, who = PLAYS[name]
    start = rank.device_bytes()
    if op == "wake_up":
        _expect_ok(rank.call("sleep"), "the clean sleep before the play")
    before = rank.snapshot()
    mine = victims(who, world).get(me)
    undo = inject(rank, what if mine == "play" else "unmap", variant, op) if mine else None
    error = rank.call(op)
    if undo:
        undo()
    after = rank.snapshot()
    retry = rank.call(op) if error else None
    if op == "sleep":  # wake, to see the offloaded bytes come back
        finish = rank.call("wake_up")
    else:  # the wake was the play: sleep and wake once more, to see the bytes survive that too
        finish = rank.call("sleep") or rank.call("wake_up")
    return {"error": error, "retry": retry, "finish": finish, "before": before, "after": after,
            "start": start, "final": rank.device_bytes()}


def _expect_ok(error: str | None, what: str) -> None:
    if error:
        raise RuntimeError(f"{what} failed: {error}")


def steady(rank: Rank, cycles: int) -> dict:
    """Sleep and wake ``cycles`` times; the time of each agreement and of each call."""
    start, timings = rank.device_bytes(), []
    decide = rank.agreement.decide if rank.agreement else None
    spent = []

    def timed_decide(failure):
        t = time.perf_counter()
        try:
            return decide(failure)
        finally:
            spent.append(time.perf_counter() - t)

    if rank.agreement:
        rank.agreement.decide = timed_decide
    errors = []
    try:
        for _ in range(cycles):
            t = time.perf_counter()
            errors += [e for e in (rank.call("sleep"), rank.call("wake_up")) if e]
            timings.append(time.perf_counter() - t)
    finally:
        if rank.agreement:
            del rank.agreement.decide
    return {"errors": errors, "start": start, "final": rank.device_bytes(), "agreements": spent,
            "cycles": timings}


# --- the process --------------------------------------------------------------------------------


def load_ranks_module(tree: Path):
    path = tree / "vllm/device_allocator/cumem_ranks.py"
    spec = importlib.util.spec_from_file_location("_cumem_ranks_under_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def groups_for(world: int, me: int, layout: str) -> list:
    """The agreement's groups: the world, or (4 ranks) a 2 x 2 grid of TP and PP groups."""
    if layout == "world":
        return [dist.group.WORLD]
    tp = [dist.new_group([0, 1]), dist.new_group([2, 3])][me // 2]
    pp = [dist.new_group([0, 2]), dist.new_group([1, 3])][me % 2]
    return [tp, pp]


def rank_main(me: int, world: int, job: dict) -> None:
    out = Path(job["out"]) / f"rank-{me}.json"
    doc: dict = {"rank": me, "plays": {}}
    # As vLLM's engine does once started (freeze_gc_heap): the gc.collect() of every
    # sleep does not walk torch's objects.
    gc.collect()
    gc.freeze()
    try:
        dist.init_process_group("gloo", init_method=f"file://{job['store']}", rank=me, world_size=world,
                                timeout=timedelta(seconds=60))
        tree, variant = Path(job["tree"]), job["variant"]
        ranks_mod = load_ranks_module(tree) if variant == "patched" else None
        groups = groups_for(world, me, job.get("layout", "world")) if ranks_mod else None
        mp = pytest.MonkeyPatch()
        for name in job["plays"]:
            dist.barrier()
            timeout = job["absent_timeout"] if name in ABSENT else job["timeout"]
            agreement = ranks_mod.Agreement(groups, me, timeout) if ranks_mod else None
            rank = Rank(tree, variant, ranks_mod, agreement, name, mp)
            doc["plays"][name] = _one(name, rank, me, world, variant, job)
            _write(out, doc)
    except BaseException:  # noqa: BLE001  (the test reads it)
        doc["crash"] = traceback.format_exc()
    _write(out, doc)
    os._exit(0)  # no teardown: a peer may be gone, and gloo's would wait for it


def _one(name: str, rank: Rank, me: int, world: int, variant: str, job: dict) -> dict:
    if name == "steady":
        return steady(rank, job.get("cycles", 20))
    if name in ABSENT:
        return _absent(name, rank, me, world, job)
    return play(name, rank, me, world, variant)


def _absent(name: str, rank: Rank, me: int, world: int, job: dict) -> dict:
    """The last rank dies (or stalls past the timeout) before its part of a sleep."""
    before = rank.snapshot()
    if me == world - 1:
        if name == "dies":
            os._exit(0)
        time.sleep(job["absent_timeout"] + 2.0)
    t = time.monotonic()
    error = rank.call("sleep")
    return {"error": error, "seconds": time.monotonic() - t, "before": before, "after": rank.snapshot()}


def _write(out: Path, doc: dict) -> None:
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(out)


def run_ranks(world: int, job: dict, limit: float = 240.0) -> list[dict]:
    """Run the job in ``world`` spawned processes; each rank's document (a rank that
    died before writing one: {"rank": N, "missing": True})."""
    # A fork server that has imported torch (and run nothing) starts each rank in a
    # fraction of a second; spawn would import torch once per rank (seconds each).
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    procs = [ctx.Process(target=rank_main, args=(r, world, job)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    if hung:
        raise AssertionError(f"{len(hung)} rank(s) still running after {limit:g} s: a hang")
    docs = []
    for r in range(world):
        path = Path(job["out"]) / f"rank-{r}.json"
        docs.append(json.loads(path.read_text()) if path.is_file() else {"rank": r, "missing": True})
    return docs
