"""Scenario 13: sleep and wake_up across ranks, all ranks or none.

Several processes, each a rank with its own CuMemAllocator from the tree, agree over
gloo as the ranks of a tensor-parallel engine do: one rank per GPU when the node has
several (as operators run TP=4), four ranks on one GPU otherwise. Each holds four
offloaded allocations and one discarded (a KV cache), filled with its own sequence.
The ranks run three times, each time in fresh processes:

- sleep: the last rank's host memory runs out at its 2nd pinned backup;
- wake: all asleep, another process takes the memory that the last rank's wake needs
  (on one GPU: once the other ranks have woken), so its wake fails;
- steady (only where the tree has ``cumem_ranks.py``): sleep and wake cycles, the tree's
  own one-rank sleep()/wake_up() against the same across the ranks, and the agreement's
  time within them: a benchmark figure, not a pass criterion.

A failed call passes when every rank raised, every rank is as before the call (every
allocation mapped after a failed sleep, none after a failed wake, as the driver says:
``cuPointerGetAttribute(MAPPED)``, so a split rank's memory is never touched), the bytes
are intact, and the retry restores every byte. Where the tree has no ``cumem_ranks.py``
(pristine), each rank calls its own sleep()/wake_up(), as vLLM's ``collective_rpc``
makes it do, and the scenario shows the split.

Each rank is ``python -m sm12x_bundle.selftest.ranks PHASE --rank N ...``; it writes
``rank-N.json`` and leaves at once (``os._exit``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

from .. import cmd
from ..errors import CommandError
from ..fsutil import temp_folder

MiB, GiB = 1 << 20, 1 << 30
GRANULARITY = 2 * MiB
WEIGHTS, KV = "selftest-ranks-weights", "selftest-ranks-kv"
PIECES = 4  # offloaded allocations per rank, besides one discarded
ONE_GPU_RANKS = 4
MAX_RANKS = 8
AGREEMENT_TIMEOUT_S = 120.0  # the last rank of the wake waits for the others first
LAUNCH_LIMIT_S = 480.0
CYCLES = 10
CU_POINTER_ATTRIBUTE_MAPPED = 13  # cuda.h: 1 when the address is mapped to memory
TAKER = """import sys, torch
torch.cuda.set_device(int(sys.argv[2]))
free = torch.cuda.mem_get_info()[0]
x = torch.empty(max(free - int(sys.argv[1]), 0), dtype=torch.uint8, device="cuda")
print("took", x.numel(), flush=True)
sys.stdin.read()
"""


# --- the plan: pure, tested without a GPU ------------------------------------------------------


def plan_world(gpus: int) -> int:
    """One rank per GPU when there are several (at most 8); four on one GPU."""
    if gpus < 1:
        raise ValueError("no GPU")
    return min(gpus, MAX_RANKS) if gpus > 1 else ONE_GPU_RANKS


def plan_each(free_bytes: int, world: int, gpus: int) -> int:
    """Bytes of each of a rank's five allocations: 256 MiB, or less so that the ranks
    sharing a GPU, and the memory the wake's failure needs taken, fit in a quarter of
    what is free."""
    per_gpu = -(-world // gpus)
    each = min(256 * MiB, free_bytes // (4 * per_gpu * (PIECES + 1)))
    return max(each // GRANULARITY * GRANULARITY, GRANULARITY)


def all_or_nothing(states: list[dict]) -> str | None:
    """None when the ranks agree: every one raised or none did, and every one is wholly
    mapped or wholly unmapped, the same; else what split them."""
    raised = {s["rank"] for s in states if s["error"]}
    if raised and len(raised) != len(states):
        return f"rank {_list(raised)} raised, rank {_list({s['rank'] for s in states} - raised)} did not"
    shapes = {s["rank"]: _shape(s["mapped"]) for s in states}
    if len(set(shapes.values())) > 1 or "partly mapped" in shapes.values():
        return "; ".join(f"rank {r} {shape}" for r, shape in sorted(shapes.items()))
    return None


def _shape(mapped: list[bool]) -> str:
    if all(mapped):
        return "awake (every allocation mapped)"
    if not any(mapped):
        return "asleep (none mapped)"
    return "partly mapped"


def _list(ranks) -> str:
    return ", ".join(map(str, sorted(ranks)))


# --- the rank's process --------------------------------------------------------------------------


class Rank:
    """This process's allocator, its tensors, and how the tree's worker calls it."""

    def __init__(self, torch, cumem, me: int, world: int, each: int, timeout: float) -> None:
        import torch.distributed as dist

        self.torch, self.cumem, self.me, self.world, self.dist = torch, cumem, me, world, dist
        self.alloc = cumem.CuMemAllocator.get_instance()
        with self.alloc.use_memory_pool(WEIGHTS):
            self.weights = [torch.empty(each // 8, dtype=torch.int64, device="cuda") for _ in range(PIECES)]
        with self.alloc.use_memory_pool(KV):
            self.kv = torch.empty(each // 8, dtype=torch.int64, device="cuda")
        for i, t in enumerate(self.weights):
            torch.arange(self.seed(i), self.seed(i) + t.numel(), dtype=torch.int64, device="cuda", out=t)
        torch.cuda.synchronize()
        self.across = _ranks_module()
        self.agreement = self.across.Agreement([dist.group.WORLD], me, timeout) if self.across else None
        self.libcuda = ctypes.CDLL("libcuda.so.1")

    def seed(self, i: int) -> int:
        return ((self.me + 1) << 44) + (i << 36)

    def call(self, op: str) -> str | None:
        """sleep (offloading the weights) or wake_up, as the tree's worker does; the error."""
        try:
            if self.across and op == "sleep":
                self.across.sleep_across_ranks(self.alloc, (WEIGHTS,), self.agreement)
            elif self.across:
                self.across.wake_up_across_ranks(self.alloc, None, self.agreement)
            elif op == "sleep":
                self.alloc.sleep(offload_tags=(WEIGHTS,))
            else:
                self.alloc.wake_up(None)
        except Exception as exc:  # noqa: BLE001  (judged with the other ranks')
            return _first_line(exc)
        return None

    def mapped(self) -> list[bool]:
        """Per allocation of this scenario, whether the driver has it mapped."""
        out = []
        for ptr, data in self.alloc.pointer_to_data.items():
            if data.tag in (WEIGHTS, KV):
                value = ctypes.c_uint64(0)
                rc = self.libcuda.cuPointerGetAttribute(ctypes.byref(value), CU_POINTER_ATTRIBUTE_MAPPED,
                                                        ctypes.c_uint64(ptr))
                out.append(rc == 0 and value.value != 0)
        return out

    def intact(self) -> bool:
        torch = self.torch
        return all(torch.equal(t, torch.arange(self.seed(i), self.seed(i) + t.numel(), dtype=torch.int64,
                                               device=t.device)) for i, t in enumerate(self.weights))

    def state(self, error: str | None) -> list[dict]:
        """This rank's error and mappings, and every other rank's (gathered over gloo)."""
        mine = {"rank": self.me, "error": error, "mapped": self.mapped()}
        states: list = [None] * self.world
        self.dist.all_gather_object(states, mine)
        return states


def _ranks_module():
    try:
        from vllm.device_allocator import cumem_ranks
    except ImportError:  # a tree without the rank patch: each rank on its own
        return None
    return cumem_ranks


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0]


# --- the three phases (in every rank) --------------------------------------------------------------


def phase_sleep(rank: Rank, args) -> dict:
    from .faults import failing_host_allocation

    victim = rank.me == rank.world - 1
    rank.dist.barrier()
    with failing_host_allocation(rank.torch, rank.cumem, 2 if victim else None):
        states = rank.state(rank.call("sleep"))
    return _after_failure(rank, states, "sleep", expect_mapped=True)


def _after_failure(rank: Rank, states: list[dict], op: str, expect_mapped: bool) -> dict:
    doc = {"failed_call": states, "split": all_or_nothing(states)}
    if not doc["split"] and not states[0]["error"]:
        doc["unreached"] = "no rank raised: the injected failure was not reached"
    if doc["split"] or doc.get("unreached"):
        return doc
    if any(m != expect_mapped for s in states for m in s["mapped"]):
        doc["split"] = "every rank raised, but not every rank is as before the call"
        return doc
    if expect_mapped:
        doc["intact_after_failure"] = rank.intact()
    doc["retry"] = rank.state(rank.call(op))
    if op == "sleep":
        doc["wake"] = rank.state(rank.call("wake_up"))
    doc["intact"] = rank.intact() if all(rank.mapped()) else False
    return doc


def phase_wake(rank: Rank, args) -> dict:
    clean = rank.state(rank.call("sleep"))
    if any(s["error"] for s in clean):
        return {"clean_sleep": clean, "split": "the sleep before the wake failed"}
    victim = rank.me == rank.world - 1
    taker = _take(rank, args) if victim else None
    rank.dist.barrier()  # the memory is taken
    if victim and args.gpus == 1:
        _wait_for_the_others(rank, args)
    states = rank.state(rank.call("wake_up"))
    if taker is not None:
        taker.stdin.close()
        taker.wait(timeout=120)
        _wait_free(rank.torch, (PIECES + 2) * args.each)
    rank.dist.barrier()  # the memory is back
    return _after_failure(rank, states, "wake_up", expect_mapped=False)


def _take(rank: Rank, args) -> subprocess.Popen[str]:
    """Another process takes this GPU's memory but what the other ranks' wake needs (one
    GPU) and half an allocation. Started as scenario 9 starts its own (it must live on
    while the wake runs)."""
    others = (rank.world - 1) * (PIECES + 1) * args.each if args.gpus == 1 else 0
    leave = others + args.each // 2
    device = rank.torch.cuda.current_device()
    taker = cmd.start([sys.executable, "-c", TAKER, str(leave), str(device)], echo=False)
    line = taker.stdout.readline().split()
    if not line or line[0] != "took":
        raise RuntimeError("the other process did not take the memory")
    return taker


def _wait_for_the_others(rank: Rank, args, limit: float = 60.0) -> None:
    """On one GPU: until the other ranks have mapped their part, so that the memory left
    is too little for this rank's alone."""
    _wait(lambda: rank.torch.cuda.mem_get_info()[0] < args.each, limit)


def _wait_free(torch, need: int, limit: float = 60.0) -> None:
    _wait(lambda: torch.cuda.mem_get_info()[0] >= need, limit)


def _wait(ready, limit: float) -> None:
    deadline = time.monotonic() + limit
    while not ready() and time.monotonic() < deadline:
        time.sleep(0.05)


def phase_steady(rank: Rank, args) -> dict:
    if rank.across is None:
        return {"skipped": "the tree has no cumem_ranks.py"}
    agreements: list[float] = []
    decide = rank.agreement.decide

    def timed(failure):
        start = time.perf_counter()
        try:
            return decide(failure)
        finally:
            agreements.append(time.perf_counter() - start)

    rank.agreement.decide = timed
    errors = [e for e in (rank.call("sleep"), rank.call("wake_up")) if e]  # the first sleep pins its backups
    own = _cycles(rank, lambda: [_own(rank, "sleep"), _own(rank, "wake_up")], errors)
    agreements.clear()
    across = _cycles(rank, lambda: [rank.call("sleep"), rank.call("wake_up")], errors)
    return {"own_swap_s": own, "across_swap_s": across, "agreement_s": list(agreements),
            "errors": errors, "intact": rank.intact()}


def _own(rank: Rank, op: str) -> str | None:
    """The tree's one-rank sleep() or wake_up(), with no agreement."""
    try:
        rank.alloc.sleep(offload_tags=(WEIGHTS,)) if op == "sleep" else rank.alloc.wake_up(None)
    except Exception as exc:  # noqa: BLE001
        return _first_line(exc)
    return None


def _cycles(rank: Rank, swap, errors: list[str]) -> list[float]:
    times = []
    for _ in range(CYCLES):
        rank.dist.barrier()  # the ranks swap together, as an engine's do
        start = time.perf_counter()
        errors += [e for e in swap() if e]
        rank.torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


PHASES = {"sleep": phase_sleep, "wake": phase_wake, "steady": phase_steady}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sm12x_bundle.selftest.ranks")
    p.add_argument("phase", choices=sorted(PHASES))
    for name in ("--rank", "--world", "--each", "--gpus"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=AGREEMENT_TIMEOUT_S)
    p.add_argument("--tree", type=Path)
    p.add_argument("--extension", type=Path)
    return p.parse_args(argv)


def rank_main(argv: list[str] | None = None) -> None:
    from . import loader

    args = parse(argv)
    out = args.out / f"rank-{args.rank}.json"
    doc: dict = {"rank": args.rank}
    try:
        loaded = loader.load(args.tree, args.extension)
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(args.rank % args.gpus)
        dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank,
                                world_size=args.world, timeout=timedelta(seconds=args.timeout + 120))
        rank = Rank(torch, loaded.cumem, args.rank, args.world, args.each, args.timeout)
        doc.update(PHASES[args.phase](rank, args))
        doc["rank"] = args.rank
    except Exception as exc:  # noqa: BLE001  (the scenario reads it)
        doc["crash"] = _first_line(exc)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(out)
    sys.stdout.flush()
    os._exit(0)


# --- the scenario (in the selftest's child) ------------------------------------------------------------


def ranks(torch, cumem, p: dict) -> dict:
    from .measure import outcome

    gpus = torch.cuda.device_count()
    world = plan_world(gpus)
    free = min(torch.cuda.mem_get_info(d)[0] for d in range(min(gpus, world)))
    each = plan_each(free, world, gpus)
    across = Path(cumem.__file__).with_name("cumem_ranks.py").is_file()
    f: dict = {"ranks": world, "gpus": gpus, "each_bytes": each, "pieces": PIECES, "across_ranks": across}
    phases = ("sleep", "wake", "steady") if across else ("sleep", "wake")
    with temp_folder("sm12x-ranks-") as work:  # locked and marked: a killed run's is removed by the next
        docs = {ph: launch(cumem, ph, world, gpus, each, Path(work) / ph) for ph in phases}
    kind, reason = judge(docs, world)
    f.update(figures(docs))
    f["phases"] = docs
    return outcome(kind, f"{world} ranks on {gpus} GPU(s), {PIECES} x {each / MiB:.0f} MiB offloaded each: {reason}",
                   **f)


def launch(cumem, phase: str, world: int, gpus: int, each: int, work: Path) -> list[dict]:
    """Run one phase in ``world`` fresh processes; each rank's document."""
    work.mkdir(parents=True)
    tree = Path(cumem.__file__).resolve().parents[2]
    base = [sys.executable, "-m", "sm12x_bundle.selftest.ranks", phase, "--world", str(world),
            "--each", str(each), "--gpus", str(gpus), "--store", str(work / "store"), "--out", str(work)]
    if (tree / "csrc").is_dir():  # a source tree with its extension built alone; else the installed vLLM
        base += ["--tree", str(tree), "--extension", str(Path(cumem.lib_name).resolve())]

    def one(r: int) -> str | None:
        try:
            cmd.run(base + ["--rank", str(r)], timeout=LAUNCH_LIMIT_S, echo=False)
        except CommandError as exc:
            return _first_line(exc)
        return None

    with ThreadPoolExecutor(world) as pool:
        died = list(pool.map(one, range(world)))
    return [_read(work / f"rank-{r}.json", r, died[r]) for r in range(world)]


def _read(path: Path, r: int, died: str | None) -> dict:
    if path.is_file():
        return json.loads(path.read_text())
    return {"rank": r, "crash": died or "the rank's process left no result"}


def judge(docs: dict[str, list[dict]], world: int) -> tuple[str, str]:
    """pass / fail / error, and why, from every phase's rank documents."""
    crashed = [(ph, d) for ph, ds in docs.items() for d in ds if "crash" in d]
    if crashed:
        ph, d = crashed[0]
        return "error", f"{ph}: rank {d['rank']} could not run: {d['crash']}"
    words = []
    for ph in ("sleep", "wake"):
        d = docs[ph][0]  # every rank saw the same states; rank 0 tells
        what = "a sleep whose host memory ran out on the last rank" if ph == "sleep" else \
            "a wake that met memory another process held on the last rank's GPU"
        if d.get("split"):
            return "fail", f"{what}: the ranks split ({d['split']})"
        if d.get("unreached"):
            return "error", f"{what}: {d['unreached']}"
        if not all(x.get("intact") and x.get("intact_after_failure", True) and not _raised(x) for x in docs[ph]):
            return "fail", f"{what}: every rank undid its part, but the retry did not restore every byte"
        words.append(f"{what} failed on every rank and left each as before; the retry restored every byte")
    steady = [d for d in docs.get("steady", []) if "own_swap_s" in d]
    bad = [d for d in steady if d["errors"] or not d["intact"]]
    if bad:
        return "fail", f"steady cycles on rank {bad[0]['rank']}: " + (
            bad[0]["errors"][0] if bad[0]["errors"] else "the weights lost their bytes")
    return "pass", "; ".join(words) + _steady_words(figures(docs))


def _raised(doc: dict) -> bool:
    return any(s["error"] for key in ("retry", "wake") for s in doc.get(key, []))


def figures(docs: dict[str, list[dict]]) -> dict:
    """The steady phase's medians, over every rank's cycles: the swap by the tree's own
    sleep()/wake_up(), the same across the ranks, and the agreement in it."""
    steady = [d for d in docs.get("steady", []) if "own_swap_s" in d]
    if not steady:
        return {}
    own = statistics.median(t for d in steady for t in d["own_swap_s"])
    across = statistics.median(t for d in steady for t in d["across_swap_s"])
    agree = statistics.median(t for d in steady for t in d["agreement_s"])
    return {"own_swap_median_s": own, "across_swap_median_s": across, "agreement_median_s": agree,
            "agreement_share_of_swap": 2 * agree / own, "steady_intact": all(d["intact"] for d in steady)}


def _steady_words(f: dict) -> str:
    if not f:
        return ""
    return (f"; steady swap {f['own_swap_median_s'] * 1e3:.1f} ms on each rank's own, "
            f"{f['across_swap_median_s'] * 1e3:.1f} ms across the ranks, of which the two agreements "
            f"{2 * f['agreement_median_s'] * 1e3:.2f} ms ({f['agreement_share_of_swap']:.1%} of the own swap)")


if __name__ == "__main__":
    rank_main()
