#!/usr/bin/env python3
"""A tree's own wake with an engine's allocation layout, outside any engine: what each map costs.

    python bench/cumem_wake_maps_bench.py TREE [--weights 500x12] [--kv 123x25] [--reps 3]
        [--other none,release,release-hog] [--order as-is] [--json-out FILE]
        [--python-include DIR]

Needs a CUDA GPU. Loads TREE's own cumem.py against its extension (built alone), allocates
the weights (COUNTxMIB allocations, tag ``weights``) and the KV cache (tag ``kv_cache``)
as a rank of an engine-check model does (0.21.0, TP=2, 12 GiB: about 500 weight allocations
of 12 MiB and 123 KV-cache allocations of 25 MiB), then REPS times: sleep (the weights
offloaded), wake, and the wake's own stage record (``last_wake_up_stages``: the maps of the
restored and of the emptied allocations, the copies' span), with every ``create_and_map``
call timed on the host clock; each sleep is timed too, with its own record
(``last_sleep_stages``: its unmaps, how many). The environment's switches apply
(``VLLM_CUMEM_SKIP_UNCHANGED``, ``VLLM_CUMEM_MERGE_RUNS``: each is recorded).

``--other`` says what happens between the sleep and the wake:

- ``none``: nothing (the bench's process made and released every page itself);
- ``release``: another process takes as many bytes as the sleep released (``cudaMalloc``,
  written), then frees them just before the wake, as the other engine of a rotation does;
- ``release-hog``: the same, with the rest of the card's free memory held by that process
  throughout, so that the wake can only have the pages the other process has just freed.

``--order`` says in what order the wake maps and copies (a series' tree only; the maps'
spread is the tree's own record):

- ``as-is``: the tree's own wake (each allocation with a backup mapped, its copy queued at
  once, then the discarded ones mapped);
- ``groupN``: N allocations with a backup mapped, then their N copies queued, and so on;
- ``maps-first``: every allocation with a backup mapped, then all their copies queued, then
  the discarded ones mapped while those copies run.

The driver's map calls wait for the copies queued before them: with ``group4`` the first
map of each four waits for the four copies before it, the other three do not.

In engines the wake's maps cost 0.4-0.5 ms per allocation (docs/results.md), against
86 us per 32 MiB allocation for the same extension call in a bare process
(bench/cumem_map_bench.py). This bench says whether the wake's own code, or memory
just freed by another process, accounts for the difference. It changes nothing: it measures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from sm12x_bundle import native  # noqa: E402
from sm12x_bundle.selftest import loader  # noqa: E402

MiB = 1 << 20
OTHERS = ("none", "release", "release-hog")


def order(text: str) -> str:
    if text in ("as-is", "maps-first") or (text.startswith("group") and text[5:].isdigit() and int(text[5:]) > 0):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected as-is, maps-first or groupN (N at least 1), such as group4")


def use_order(cumem, name: str) -> None:
    """Make the tree's allocator wake in the order ``name`` (see --order)."""
    if name == "as-is":
        return
    cls = cumem.CuMemAllocator
    if not hasattr(cls, "_map_and_copy_back") or not hasattr(cumem, "CallTimes"):
        raise SystemExit("cumem_wake_maps_bench: --order needs a tree with the series' wake "
                         "(CuMemAllocator._map_and_copy_back and CallTimes)")
    group = None if name == "maps-first" else int(name[5:])
    cls._map_and_copy_back = lambda self, restored, emptied, woken: ordered_wake(
        cumem, self, restored, emptied, woken, group)


def ordered_wake(cumem, alloc, restored, emptied, woken, group) -> dict:
    """The series' wake with its maps and queued copies in another order: ``group`` maps,
    then their copies (None: every map of a backed-up allocation, then every copy)."""
    import torch

    maps = {"map_restored": cumem.CallTimes(), "map_emptied": cumem.CallTimes()}
    pending, first_copy = [], None

    def queue_copies():
        nonlocal first_copy
        for ptr, data in pending:
            first_copy = first_copy or time.perf_counter()
            alloc._wake_step("copy", ptr, data, woken, cumem._queue_copy_back)
        pending.clear()

    for stage, allocations in (("map_restored", restored), ("map_emptied", emptied)):
        for ptr, data in allocations:
            start = time.perf_counter()
            alloc._wake_step("map", ptr, data, woken, cumem.create_and_map)
            maps[stage].since(start)
            if data.cpu_backup_tensor is not None:
                pending.append((ptr, data))
                if group is not None and len(pending) >= group:
                    queue_copies()
        queue_copies()
    for device in {d.handle[0] for _, d in restored}:
        torch.cuda.synchronize(device)
    copy_s = time.perf_counter() - first_copy if first_copy else 0.0
    return {**maps["map_restored"].record("map_restored"), **maps["map_emptied"].record("map_emptied"),
            "copy_s": copy_s, "copied_bytes": sum(d.handle[1] for _, d in restored)}


def layout(text: str) -> tuple[int, int]:
    """'500x12' -> (500, 12 MiB in bytes)."""
    try:
        count, mib = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected COUNTxMIB, such as 500x12") from None
    if count < 1 or mib < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: the count and the size must be at least 1")
    return count, mib * MiB


def other_process(conn, device: int, hog: bool) -> None:
    """The other engine: on "take N", hold N written bytes; on "free", free them."""
    import torch

    torch.cuda.set_device(device)
    held = None
    if hog:
        free, _ = torch.cuda.mem_get_info()
        held_rest = torch.empty(free - conn.recv(), dtype=torch.uint8, device="cuda")
        conn.send(held_rest.numel())
    while True:
        msg = conn.recv()
        if msg[0] == "take":
            held = torch.empty(msg[1], dtype=torch.uint8, device="cuda")
            held.fill_(7)
            torch.cuda.synchronize()
        elif msg[0] == "free":
            held = None
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
        else:
            return
        conn.send("ok")


def timed_calls(cumem) -> list[float]:
    """Time every create_and_map the wake makes (the module global it calls)."""
    seconds: list[float] = []
    real = cumem.create_and_map

    def timed(handle):
        start = time.perf_counter()
        try:
            return real(handle)
        finally:
            seconds.append(time.perf_counter() - start)

    cumem.create_and_map = timed
    return seconds


def one_rep(alloc, calls: list[float], other, released: int) -> dict:
    import torch

    start = time.perf_counter()
    alloc.sleep(offload_tags=("weights",))
    sleep_s = time.perf_counter() - start
    sleep_stages = dict(getattr(alloc, "last_sleep_stages", {}) or {})
    if other is not None:
        other.send(("take", released))
        other.recv()
        other.send(("free",))
        other.recv()
    calls.clear()
    start = time.perf_counter()
    alloc.wake_up()
    torch.cuda.synchronize()
    wake_s = time.perf_counter() - start
    stages = dict(getattr(alloc, "last_wake_up_stages", {}) or {})
    return {"sleep_s": sleep_s, "sleep_stages": sleep_stages, "wake_s": wake_s, "stages": stages, "maps": len(calls),
            "map_median_us": statistics.median(calls) * 1e6, "map_max_us": max(calls) * 1e6,
            "map_total_s": sum(calls)}


def run(args, cumem, other_mode: str) -> list[dict]:
    import torch

    alloc = cumem.CuMemAllocator.get_instance()
    calls = timed_calls(cumem)
    (wn, wsize), (kn, ksize) = args.weights, args.kv
    with alloc.use_memory_pool("weights"):
        weights = [torch.full((wsize,), i % 251, dtype=torch.uint8, device="cuda") for i in range(wn)]
    with alloc.use_memory_pool("kv_cache"):
        kv = [torch.empty(ksize, dtype=torch.uint8, device="cuda") for _ in range(kn)]
    released = wn * wsize + kn * ksize
    conn = proc = None
    if other_mode != "none":
        conn, child = mp.get_context("spawn").Pipe()
        proc = mp.get_context("spawn").Process(
            target=other_process, args=(child, torch.cuda.current_device(), other_mode == "release-hog"))
        proc.start()
        if other_mode == "release-hog":
            conn.send(released + (512 * MiB))  # what the hog leaves free
            conn.recv()
    try:
        reps = [one_rep(alloc, calls, conn, released) for _ in range(args.reps)]
    finally:
        if proc is not None:
            conn.send(("quit",))
            proc.join(30)
    assert all(t.numel() == ksize for t in kv)  # the KV cache was held throughout
    bad = [i for i, t in enumerate(weights) if int(t[0]) != i % 251 or int(t[-1]) != i % 251]
    if bad:
        raise SystemExit(f"cumem_wake_maps_bench: {len(bad)} weight allocations lost their bytes")
    return reps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--weights", type=layout, default=layout("500x12"))
    p.add_argument("--kv", type=layout, default=layout("123x25"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--other", default="none,release,release-hog",
                   help=f"comma-separated, of {', '.join(OTHERS)}")
    p.add_argument("--order", type=order, default="as-is",
                   help="the wake's order of maps and copies: as-is, groupN or maps-first")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path)
    args = p.parse_args()
    modes = args.other.split(",")
    if any(m not in OTHERS for m in modes):
        p.error(f"--other {args.other!r}: each must be one of {', '.join(OTHERS)}")
    work = Path(tempfile.mkdtemp(prefix="cumem-wake-maps-bench-"))
    if len(modes) > 1:  # one process per mode: each starts from a card it has not touched
        result = {"modes": {}}
        for mode in modes:
            out = work / f"{mode}.json"
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--other", mode, "--json-out", str(out)],
                           check=True)
            one = json.loads(out.read_text())
            result = {**one, "modes": {**result["modes"], **one["modes"]}}
    else:
        ext = native.build_cumem_extension(args.tree.resolve(), work, python_include=args.python_include)
        cumem = loader.load(args.tree.resolve(), ext).cumem
        import torch

        use_order(cumem, args.order)
        reps = run(args, cumem, modes[0])
        result = {"gpu": torch.cuda.get_device_name(), "weights": list(args.weights), "kv": list(args.kv),
                  "skip_unchanged": os.environ.get("VLLM_CUMEM_SKIP_UNCHANGED", "unset"),
                  "merge_runs": os.environ.get("VLLM_CUMEM_MERGE_RUNS", "unset"), "order": args.order,
                  "modes": {modes[0]: reps}}
        print(f"{modes[0]}: " + "; ".join(
            f"sleep {r['sleep_s'] * 1e3:.1f} ms ({r['sleep_stages'].get('unmapped', '?')} unmaps "
            f"{r['sleep_stages'].get('unmap_s', 0) * 1e3:.1f} ms), "
            f"wake {r['wake_s'] * 1e3:.1f} ms, {r['maps']} maps {r['map_total_s'] * 1e3:.1f} ms "
            f"(median {r['map_median_us']:.0f} us, max {r['map_max_us']:.0f} us), stages "
            + ", ".join(f"{k} {v:.4f}" for k, v in r["stages"].items() if k.endswith("_s"))
            for r in reps), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
