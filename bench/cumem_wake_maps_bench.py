#!/usr/bin/env python3
"""A tree's own wake with an engine's allocation layout, outside any engine: what each map costs.

    python bench/cumem_wake_maps_bench.py TREE [--weights 500x12] [--kv 123x25] [--reps 3]
        [--other none,release,release-hog] [--json-out FILE] [--python-include DIR]

Needs a CUDA GPU. Loads TREE's own cumem.py against its extension (built alone), allocates
the weights (COUNTxMIB allocations, tag ``weights``) and the KV cache (tag ``kv_cache``)
as a rank of an engine-check model does (0.21.0, TP=2, 12 GiB: about 500 weight allocations
of 12 MiB and 123 KV-cache allocations of 25 MiB), then REPS times: sleep (the weights
offloaded), wake, and the wake's own stage record (``last_wake_up_stages``: the maps of the
restored and of the emptied allocations, the copies' span), with every ``create_and_map``
call timed on the host clock.

``--other`` says what happens between the sleep and the wake:

- ``none``: nothing (the bench's process made and released every page itself);
- ``release``: another process takes as many bytes as the sleep released (``cudaMalloc``,
  written), then frees them just before the wake, as the other engine of a rotation does;
- ``release-hog``: the same, with the rest of the card's free memory held by that process
  throughout, so that the wake can only have the pages the other process has just freed.

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

    alloc.sleep(offload_tags=("weights",))
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
    return {"wake_s": wake_s, "stages": stages, "maps": len(calls),
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

        reps = run(args, cumem, modes[0])
        result = {"gpu": torch.cuda.get_device_name(), "weights": list(args.weights), "kv": list(args.kv),
                  "skip_unchanged": os.environ.get("VLLM_CUMEM_SKIP_UNCHANGED", "0"),
                  "modes": {modes[0]: reps}}
        print(f"{modes[0]}: " + "; ".join(
            f"wake {r['wake_s'] * 1e3:.1f} ms, {r['maps']} maps {r['map_total_s'] * 1e3:.1f} ms "
            f"(median {r['map_median_us']:.0f} us, max {r['map_max_us']:.0f} us), stages "
            + ", ".join(f"{k} {v:.4f}" for k, v in r["stages"].items() if k.endswith("_s"))
            for r in reps), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
