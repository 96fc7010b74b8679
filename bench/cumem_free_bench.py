#!/usr/bin/env python3
"""What the stream-aware free costs: a pool sweep of 2,000 small segments, pristine vs patched.

    python bench/cumem_free_bench.py PRISTINE_TREE PATCHED_TREE [--segments 2000]
        [--rounds 2] [--reps 5] [--json-out FILE] [--python-include DIR]

Needs a CUDA GPU. Each tree's cumem extension is built alone (native.py) and its own
cumem.py is loaded against it (the selftest's loader), in worker processes that
alternate between the trees (pristine, patched, pristine, ...) so that drift in the
machine hits both alike. A worker fills a fresh pool with 2 x SEGMENTS tensors of
1 MiB (PyTorch packs two into each 2 MiB segment), frees them, and times the exit of
``use_memory_pool``: the context-exit sweep, which unmaps and releases every free
segment through the free callback. The patched tree synchronizes the device once per
sweep; the pristine one not at all. Figure of merit (target): the
median patched sweep over the median pristine sweep, measured in this one run, at
most 1.05.

For information it also times the PyTorch free path: a pool of free segments dropped,
so that PyTorch releases each one through the extension's my_free (the patched free
callback synchronizes once per call there, as upstream does since 0.26.0).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

TARGET = 1.05


# --- the worker (one tree, one process) -----------------------------------------------


def _segments(torch, alloc, tag: str, segments: int):
    """Enter a fresh pool, fill it with segments of two 1 MiB tensors; return the
    context (still open) and the tensors."""
    cm = alloc.use_memory_pool(tag)
    cm.__enter__()
    ts = [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(2 * segments)]
    return cm, ts


def sweep_once(torch, alloc, tag: str, segments: int) -> tuple[float, int]:
    cm, ts = _segments(torch, alloc, tag, segments)
    count = len(alloc.allocator_and_pools[tag][0].snapshot())
    before = len(alloc.pointer_to_data)
    del ts
    torch.cuda.synchronize()
    start = time.perf_counter()
    cm.__exit__(None, None, None)
    seconds = time.perf_counter() - start
    swept = before - len(alloc.pointer_to_data)
    if swept != count:
        raise RuntimeError(f"the sweep released {swept} of {count} segments")
    return seconds, count


def drop_once(torch, alloc, tag: str, segments: int, keep: list) -> tuple[float, int]:
    cm, ts = _segments(torch, alloc, tag, segments)
    cm.__exit__(None, None, None)  # nothing free yet: the sweep has nothing to do
    del ts
    torch.cuda.synchronize()
    before = len(alloc.pointer_to_data)
    pool, allocator = alloc.allocator_and_pools.pop(tag)
    keep.append(allocator)  # the allocator must outlive its pool
    start = time.perf_counter()
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    seconds = time.perf_counter() - start
    return seconds, before - len(alloc.pointer_to_data)


def worker(args: argparse.Namespace) -> None:
    from sm12x_bundle.selftest import loader

    loaded = loader.load(args.tree, args.extension)
    import torch

    alloc = loaded.cumem.CuMemAllocator.get_instance()
    keep: list = []
    sweep_once(torch, alloc, "warm-sweep", args.segments)
    drop_once(torch, alloc, "warm-drop", args.segments, keep)
    sweeps = [sweep_once(torch, alloc, f"sweep-{i}", args.segments) for i in range(args.reps)]
    drops = [drop_once(torch, alloc, f"drop-{i}", args.segments, keep) for i in range(args.reps)]
    doc = {
        "sweep_s": [s for s, _ in sweeps], "sweep_segments": [n for _, n in sweeps],
        "drop_s": [s for s, _ in drops], "drop_segments": [n for _, n in drops],
    }
    args.out.write_text(json.dumps(doc))


# --- the driver ------------------------------------------------------------------------


def build(tree: Path, work: Path, label: str, python_include: Path | None) -> Path:
    from sm12x_bundle import native

    return native.build_cumem_extension(tree, work / label, python_include=python_include)


def run_worker(tree: Path, ext: Path, args: argparse.Namespace, out: Path) -> dict:
    from sm12x_bundle.selftest.runner import child_env

    argv = [sys.executable, __file__, "--worker", "--tree", str(tree), "--extension", str(ext),
            "--segments", str(args.segments), "--reps", str(args.reps), "--out", str(out)]
    subprocess.run(argv, check=True, env=child_env())
    return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pristine", type=Path, nargs="?")
    p.add_argument("patched", type=Path, nargs="?")
    p.add_argument("--segments", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2, help="worker processes per tree, alternating")
    p.add_argument("--reps", type=int, default=5, help="timed sweeps per worker, after one warm-up")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path, help="the folder holding Python.h (default: this Python's)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--extension", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    if args.pristine is None or args.patched is None:
        p.error("give the PRISTINE and PATCHED trees")
    trees = {"pristine": args.pristine.resolve(), "patched": args.patched.resolve()}
    runs: dict[str, dict[str, list]] = {k: {"sweep_s": [], "drop_s": [], "segments": []} for k in trees}
    with tempfile.TemporaryDirectory(prefix="cumem-free-bench-") as tmp:
        work = Path(tmp)
        exts = {label: build(tree, work, label, args.python_include) for label, tree in trees.items()}
        for r in range(args.rounds):
            for label, tree in trees.items():
                doc = run_worker(tree, exts[label], args, work / f"{label}-{r}.json")
                runs[label]["sweep_s"] += doc["sweep_s"]
                runs[label]["drop_s"] += doc["drop_s"]
                runs[label]["segments"] += doc["sweep_segments"] + doc["drop_segments"]
                print(f"round {r + 1} {label:<8} sweep median {statistics.median(doc['sweep_s']) * 1e3:7.2f} ms"
                      f"  drop median {statistics.median(doc['drop_s']) * 1e3:7.2f} ms"
                      f"  ({doc['sweep_segments'][0]} segments)", flush=True)
    med = {k: {m: statistics.median(v[m]) for m in ("sweep_s", "drop_s")} for k, v in runs.items()}
    sweep_ratio = med["patched"]["sweep_s"] / med["pristine"]["sweep_s"]
    drop_ratio = med["patched"]["drop_s"] / med["pristine"]["drop_s"]
    segments = sorted(set(runs["pristine"]["segments"] + runs["patched"]["segments"]))
    print(f"\npool sweep of {', '.join(map(str, segments))} segments, median of {len(runs['pristine']['sweep_s'])} sweeps per tree:")
    for label in trees:
        m = med[label]["sweep_s"]
        print(f"  {label:<8} {m * 1e3:8.2f} ms  ({m / segments[0] * 1e6:.1f} us per segment)")
    verdict = "ok" if sweep_ratio <= TARGET else "MISSED"
    print(f"  patched / pristine = {sweep_ratio:.3f}   (target <= {TARGET}: {verdict})")
    print("pool dropped (PyTorch frees each segment through my_free), for information:")
    for label in trees:
        print(f"  {label:<8} {med[label]['drop_s'] * 1e3:8.2f} ms")
    print(f"  patched / pristine = {drop_ratio:.3f}")
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "segments": segments, "runs": runs, "medians": med, "sweep_ratio": sweep_ratio,
            "drop_ratio": drop_ratio, "target": TARGET, "holds": sweep_ratio <= TARGET,
        }, indent=2, sort_keys=True))
    return 0 if sweep_ratio <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
