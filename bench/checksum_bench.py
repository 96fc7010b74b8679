#!/usr/bin/env python3
"""GB/s of the sleep's checksum (cumem-skip-unchanged) against a device-to-device copy.

For each size (GiB): a copy of the buffer into another (its GB/s counts the bytes copied,
and the memory traffic is twice that: a read and a write), then the checksum of the same
buffer, as one span and as spans of --span-mib (a model's allocations), each the full call
the sleep makes (descriptors, the launches, the per-span sums read back to the host). The
ratio is the checksum's bytes read per second over the copy's traffic per second: the
share of the card's memory bandwidth it reaches. The largest size first tries every launch
shape (32-bit words per block x warps x programs per SM x blocks in flight per program,
the module's defaults among them) on the largest size, one JSON line each, with the kernel
timed alone beside the full call, and measures the sizes with the fastest; the module's
defaults (BLOCK, NUM_WARPS, PER_SM, STAGES) are to be set from that line. One JSON line per
measurement.

Each size's lines also give the call as a sleep makes it (as_a_sleep_s, on the host's
clock): the keys' device copies dropped and torch's cache emptied before it, as they are
at every sleep. --no-sweep measures the module's own shape, for any version of it.

    python3 bench/checksum_bench.py [--module PATH] [--sizes 1 4 12] [--no-sweep]
        [--blocks 2048 4096] [--warps 4 8] [--per-sm 4 8 16] [--stages 1 2 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import time
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
    parser.add_argument("--blocks", type=int, nargs="+", default=[2048, 4096],
                        help="32-bit words per block (a power of two)")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--per-sm", type=int, nargs="+", default=[4, 8, 16], help="programs per SM")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3],
                        help="whole blocks in flight per program")
    parser.add_argument("--no-sweep", action="store_true",
                        help="the module's own launch shape (any version of the module), no sweep")
    args = parser.parse_args()
    ck = load(args.module)
    shape = {}  # the module's defaults, unless the sweep finds a faster shape
    # The sweep on the largest size: a small one is the call's fixed costs as much as the kernel.
    sizes = sorted(args.sizes, reverse=True)
    for i, gib in enumerate(sizes):
        n = int(gib * (1 << 30))
        buf = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
        copy_s = copy_seconds(buf, args.repeat)
        if i == 0 and not args.no_sweep:
            shape = fastest_shape(ck, buf, copy_s, args)
        checksum = ck.Checksum(**shape)
        step = args.span_mib << 20
        layouts = {"one span": [(buf.data_ptr(), n)],
                   f"{args.span_mib} MiB spans": [(buf.data_ptr() + o, min(step, n - o)) for o in range(0, n, step)]}
        for name, spans in layouts.items():
            s = best_seconds(lambda c=checksum, s=spans, d=buf.device: c.sums(s, d).tolist(), args.repeat)
            as_a_sleep = sleep_seconds(checksum, spans, buf.device, args.repeat)
            print(json.dumps({
                "device": torch.cuda.get_device_name(), "gib": gib, "layout": name,
                "module": args.module.name, **(shape or {"shape": "the module's defaults"}),
                "checksum_s": round(s, 5), "checksum_gbps": round(n / s / 1e9, 1),
                "as_a_sleep_s": round(as_a_sleep, 5),
                "copy_s": round(copy_s, 5), "copy_gbps": round(n / copy_s / 1e9, 1),
                "copy_traffic_gbps": round(2 * n / copy_s / 1e9, 1),
                "ratio_to_copy_traffic": round((n / s) / (2 * n / copy_s), 3)}), flush=True)
        buf = None
        torch.cuda.empty_cache()
    return 0


def sleep_seconds(checksum, spans, device, repeat: int) -> float:
    """The call as a sleep makes it, on the host's clock: the keys' device copies dropped
    (release(), as every sleep ends) and torch's cache emptied (as the sleep before did),
    so that the call uploads and allocates what it uses anew."""
    times = []
    for _ in range(repeat + 1):  # the first builds the descriptors: a sleep's are laid out
        checksum.release()       # by the background fill
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        start = time.perf_counter()
        checksum.sums(spans, device).tolist()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def copy_seconds(buf: torch.Tensor, repeat: int) -> float:
    """A device-to-device copy of ``buf``: the ceiling (its memory traffic is 2x its bytes)."""
    out = torch.empty_like(buf)
    return best_seconds(lambda: out.copy_(buf), repeat)


def equals_reference(checksum, buf: torch.Tensor) -> bool:
    """The kernel's sums of the first MiB and 3 bytes (an odd tail) are the reference's."""
    n = min(buf.numel(), (1 << 20) + 3)
    kernel = checksum.sums([(buf.data_ptr(), n)], buf.device).tolist()
    return kernel == [checksum.reference(buf[:n]).tolist()]


def fastest_shape(ck, buf, copy_s: float, args) -> dict:
    """Every shape of the sweep on one span of ``buf``, one JSON line each (the full call's
    GB/s, and the kernel's alone against the copy's traffic); the fastest full call."""
    defaults = (ck.BLOCK, ck.NUM_WARPS, ck.PER_SM, ck.STAGES)
    results = {}
    spans = [(buf.data_ptr(), buf.numel())]
    for shape in itertools.product(args.blocks, args.warps, args.per_sm, args.stages):
        checksum = ck.Checksum(*shape)
        results[shape] = best_seconds(lambda c=checksum: c.sums(spans, buf.device).tolist(), args.repeat)
        kernel_s = best_seconds(whole_kernel(ck, checksum, spans, buf.device), args.repeat)
        print(json.dumps({"shape_trial": dict(zip(("block", "num_warps", "per_sm", "stages"), shape)),
                          "gib": round(buf.numel() / (1 << 30), 3),
                          "module_default": shape == defaults,
                          "kernel_equals_reference": equals_reference(checksum, buf),
                          "gbps": round(buf.numel() / results[shape] / 1e9, 1),
                          "kernel_gbps": round(buf.numel() / kernel_s / 1e9, 1),
                          "kernel_ratio_to_copy_traffic": round(copy_s / (2 * kernel_s), 3)}), flush=True)
    return dict(zip(("block", "num_warps", "per_sm", "stages"), min(results, key=results.get)))


def whole_kernel(ck, checksum, spans, device):
    """The whole blocks' launch alone, on descriptors already on the device: what the
    kernel reads per second, without the call's uploads, scan and read-back."""
    addrs, index, *_ = (ck._upload(x, device) for x in checksum.lay_out(spans, device))
    out = torch.empty(ck.HASHES, addrs.numel() + 1, dtype=torch.int64, device=device)
    return lambda: checksum.whole_values(addrs, index, out, device)


if __name__ == "__main__":
    raise SystemExit(main())
