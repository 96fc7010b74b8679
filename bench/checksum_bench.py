#!/usr/bin/env python3
"""GB/s of the sleep's checksum (cumem-skip-unchanged) against a device-to-device copy.

For each size (GiB): a copy of the buffer into another (its GB/s counts the bytes copied,
and the memory traffic is twice that: a read and a write), then the checksum of the same
buffer, as one span and as spans of --span-mib (a model's allocations), each the full call
the sleep makes (descriptors, one launch, the per-span sums read back to the host). The
ratio is the checksum's bytes read per second over the copy's traffic per second: the
share of the card's memory bandwidth it reaches. The first size also tries every launch
shape (32-bit words per block x warps x blocks per program, the module's defaults among
them), one JSON line each, and measures the sizes with the fastest; the module's defaults
(BLOCK, NUM_WARPS, GROUP) are to be set from that line. One JSON line per measurement.

    python3 bench/checksum_bench.py [--module PATH] [--sizes 1 4 12]
        [--blocks 1024 2048 4096] [--warps 4 8] [--groups 1 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

DEFAULT = (Path(__file__).resolve().parents[1]
           / "patches/fixes/cumem-skip-unchanged/new/vllm/device_allocator/cumem_checksum.py")


def load(path: Path):
    spec = importlib.util.spec_from_file_location("cumem_checksum", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def best_seconds(fn, repeat: int) -> float:
    fn()  # compile, warm
    times = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", type=Path, default=DEFAULT, help="cumem_checksum.py to load")
    parser.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 12], help="GiB")
    parser.add_argument("--span-mib", type=int, default=48)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096],
                        help="32-bit words per block (a power of two)")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--groups", type=int, nargs="+", default=[1, 4], help="blocks per program")
    args = parser.parse_args()
    ck = load(args.module)
    shape = {"block": ck.BLOCK, "num_warps": ck.NUM_WARPS, "group": ck.GROUP}
    for i, gib in enumerate(args.sizes):
        n = int(gib * (1 << 30))
        buf = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
        copy_s = copy_seconds(buf, args.repeat)
        if i == 0:
            shape = fastest_shape(ck, buf, args)
        checksum = ck.Checksum(**shape)
        step = args.span_mib << 20
        layouts = {"one span": [(buf.data_ptr(), n)],
                   f"{args.span_mib} MiB spans": [(buf.data_ptr() + o, min(step, n - o)) for o in range(0, n, step)]}
        for name, spans in layouts.items():
            s = best_seconds(lambda c=checksum, s=spans, d=buf.device: c.sums(s, d).tolist(), args.repeat)
            print(json.dumps({
                "device": torch.cuda.get_device_name(), "gib": gib, "layout": name, **shape,
                "checksum_s": round(s, 5), "checksum_gbps": round(n / s / 1e9, 1),
                "copy_s": round(copy_s, 5), "copy_gbps": round(n / copy_s / 1e9, 1),
                "copy_traffic_gbps": round(2 * n / copy_s / 1e9, 1),
                "ratio_to_copy_traffic": round((n / s) / (2 * n / copy_s), 3)}), flush=True)
        buf = None
        torch.cuda.empty_cache()
    return 0


def copy_seconds(buf: torch.Tensor, repeat: int) -> float:
    """A device-to-device copy of ``buf``: the ceiling (its memory traffic is 2x its bytes)."""
    out = torch.empty_like(buf)
    return best_seconds(lambda: out.copy_(buf), repeat)


def equals_reference(checksum, buf: torch.Tensor) -> bool:
    """The kernel's sums of the first MiB and 3 bytes (an odd tail) are the reference's."""
    n = min(buf.numel(), (1 << 20) + 3)
    kernel = checksum.sums([(buf.data_ptr(), n)], buf.device).tolist()
    return kernel == [checksum.reference(buf[:n]).tolist()]


def fastest_shape(ck, buf, args) -> dict:
    """Every shape of the sweep on one span of ``buf``, one JSON line each; the fastest."""
    defaults = (ck.BLOCK, ck.NUM_WARPS, ck.GROUP)
    results = {}
    spans = [(buf.data_ptr(), buf.numel())]
    for block in args.blocks:
        for warps in args.warps:
            for group in args.groups:
                checksum = ck.Checksum(block=block, num_warps=warps, group=group)
                shape = (block, warps, group)
                results[shape] = best_seconds(lambda c=checksum: c.sums(spans, buf.device).tolist(), args.repeat)
                print(json.dumps({"shape_trial": {"block": block, "num_warps": warps, "group": group},
                                  "module_default": shape == defaults,
                                  "kernel_equals_reference": equals_reference(checksum, buf),
                                  "gbps": round(buf.numel() / results[shape] / 1e9, 1)}), flush=True)
    block, warps, group = min(results, key=results.get)
    return {"block": block, "num_warps": warps, "group": group}


if __name__ == "__main__":
    raise SystemExit(main())
