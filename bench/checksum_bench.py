#!/usr/bin/env python3
"""GB/s of the sleep's checksum (cumem-skip-unchanged) against a device-to-device copy.

For each size (GiB): a copy of the buffer into another (its GB/s counts the bytes copied,
and the memory traffic is twice that: a read and a write), then the checksum of the same
buffer, as one span and as spans of --span-mib (a model's allocations), each the full call
the sleep makes (descriptors, one launch, the per-span sums read back to the host). The
ratio is the checksum's bytes read per second over the copy's traffic per second: the
share of the card's memory bandwidth it reaches. The first size also tries a few launch
shapes (programs per SM, warps) and keeps the fastest. One JSON line per measurement.

    python3 bench/checksum_bench.py [--module PATH] [--sizes 1 4 12]
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
    args = parser.parse_args()
    ck = load(args.module)
    shape = {"programs_per_sm": 8, "num_warps": 8}
    for i, gib in enumerate(args.sizes):
        n = int(gib * (1 << 30))
        buf = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
        copy_s = copy_seconds(buf, args.repeat)
        if i == 0:
            shape = fastest_shape(ck, buf, args.repeat)
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


def fastest_shape(ck, buf, repeat: int) -> dict:
    results = {}
    for per_sm in (4, 8, 16):
        for warps in (4, 8):
            checksum = ck.Checksum(programs_per_sm=per_sm, num_warps=warps)
            spans = [(buf.data_ptr(), buf.numel())]
            results[(per_sm, warps)] = best_seconds(lambda c=checksum, s=spans: c.sums(s, buf.device), repeat)
            print(json.dumps({"shape_trial": {"programs_per_sm": per_sm, "num_warps": warps},
                              "gbps": round(buf.numel() / results[(per_sm, warps)] / 1e9, 1)}), flush=True)
    per_sm, warps = min(results, key=results.get)
    return {"programs_per_sm": per_sm, "num_warps": warps}


if __name__ == "__main__":
    raise SystemExit(main())
