#!/usr/bin/env python3
"""Where a sleep's checksum call spends its time, with a tree's own allocator and layout.

    python bench/cumem_checksum_sleep_bench.py TREE [--weights 435x29] [--kv 124x50]
        [--reps 7] [--pauses 0,0.3,1] [--json-out FILE] [--python-include DIR]

Needs a CUDA GPU. Loads TREE's own cumem.py against its extension (built alone), with the
skip of unchanged allocations on (the series' cumem-skip-unchanged), allocates the weights
(COUNTxMIB allocations, tag ``weights``) and the KV cache (tag ``kv_cache``), and sleeps
and wakes twice, so that the allocations are backed up, checksummed and mapped as the
series maps them after a wake (merged runs where the tree merges them). The process's heap
is frozen (``gc.freeze()``), as an engine's is. Then it times the call a sleep makes to
find what it need not copy (``SkipUnchanged.unchanged``):

- ``as a sleep makes it``: the keys' device copies dropped and torch's cache emptied
  before each call, as every sleep starts; REPS calls back to back;
- ``keys and cache kept``: the same call with neither dropped (what holding them across a
  sleep would give);
- ``the whole blocks' kernel alone`` (``Checksum.whole_values``, its inputs on the device);
- ``the pieces``: the call's steps one by one, each waited for (laying out, the
  descriptors' and keys' uploads, the output's allocation, the kernel, the scan, the sums,
  the read back);
- ``after a wake``: for each PAUSE (seconds), REPS times: sleep, wake, the pause, then the
  call as a sleep makes it (``first``) and the same call again at once (``again``). A
  ``first`` longer than ``again`` at every pause is not work the driver finishes in the
  background: it comes with the first call since the wake, the first to read what the
  wake mapped.

At the end the kernel's sums of five allocations are compared with the torch reference,
and every allocation must be found unchanged. It changes nothing: it measures.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import checksum_bench  # noqa: E402
import cumem_wake_maps_bench as wake_bench  # noqa: E402
from cumem_wake_maps_bench import layout  # noqa: E402
from sm12x_bundle import native  # noqa: E402
from sm12x_bundle.selftest import loader  # noqa: E402


def pauses(text: str) -> list[float]:
    return wake_bench.pauses(text, unit="seconds", example="0,0.3,1")


def ms(seconds: list[float]) -> dict:
    values = [s * 1e3 for s in seconds]
    return {"median_ms": statistics.median(values), "min_ms": min(values), "max_ms": max(values),
            "all_ms": [round(v, 3) for v in values]}


class Bench:
    def __init__(self, cumem, weights, kv) -> None:
        import torch

        self.torch = torch
        self.alloc = cumem.CuMemAllocator.get_instance()
        self.skip = self.alloc.skip_unchanged
        if self.skip is None:
            raise SystemExit("cumem_checksum_sleep_bench: this tree's allocator does not skip "
                             "unchanged allocations (no cumem-skip-unchanged, or its switch is off)")
        self.ck = sys.modules[type(self.skip.checksum).__module__]
        (wn, wsize), (kn, ksize) = weights, kv
        with self.alloc.use_memory_pool("weights"):
            self.held = [torch.full((wsize,), i % 251, dtype=torch.uint8, device="cuda") for i in range(wn)]
        with self.alloc.use_memory_pool("kv_cache"):
            self.held += [torch.empty(ksize, dtype=torch.uint8, device="cuda") for _ in range(kn)]
        gc.freeze()
        for _ in range(2):  # backed up and checksummed; then mapped as a wake maps them
            self.alloc.sleep(offload_tags=("weights",))
            self.alloc.wake_up()
        self.backed = [(p, d) for p, d in self.alloc.pointer_to_data.items() if d.tag == "weights"]
        self.device = torch.device("cuda", torch.cuda.current_device())

    def timed(self, fn) -> float:
        self.torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        self.torch.cuda.synchronize()
        return time.perf_counter() - start

    def as_a_sleep(self) -> float:
        """The call's seconds, the keys dropped and the cache emptied before it (untimed)."""
        self.skip.checksum.release()
        self.torch.cuda.empty_cache()
        return self.timed(lambda: self.skip.unchanged(self.backed))

    def kept(self, reps: int) -> list[float]:
        checksum = self.skip.checksum
        release = checksum.release
        checksum.release = lambda: None  # the keys stay on the device
        try:
            return [self.timed(lambda: self.skip.unchanged(self.backed)) for _ in range(reps)]
        finally:
            checksum.release = release

    def kernel_alone(self, reps: int) -> list[float]:
        launch = checksum_bench.whole_kernel(self.ck, self.skip.checksum, self.spans(), self.device)
        return [self.timed(launch) for _ in range(reps)]

    def spans(self) -> list[tuple[int, int]]:
        return [(p, d.handle[1]) for p, d in self.backed]

    def pieces(self) -> dict[str, float]:
        """The call's steps, each waited for (Checksum._kernel_sums, laid open)."""
        torch, c, ck, dev = self.torch, self.skip.checksum, self.ck, self.device
        c.release()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        seconds, last = {}, time.perf_counter()

        def step(name):
            nonlocal last
            torch.cuda.synchronize()
            now = time.perf_counter()
            seconds[name] = now - last
            last = now

        laid = c.lay_out(self.spans(), dev)
        step("lay out")
        up = [ck._upload(x, dev) for x in laid]
        step("upload the descriptors")
        c._keys_on(dev)
        step("upload the keys")
        whole = torch.empty(2, up[0].numel() + 1, dtype=torch.int64, device=dev)
        whole[:, 0] = 0
        step("allocate the output")
        c.whole_values(up[0], up[1], whole, dev)
        step("kernel")
        for row in whole:
            row.cumsum_(0)
        step("scan")
        sums = (whole[:, up[3]] - whole[:, up[2]]).t() % ck.P
        step("sums")
        sums.tolist()
        step("read back")
        return seconds

    def after_a_wake(self, pause: float) -> tuple[float, float]:
        self.alloc.sleep(offload_tags=("weights",))
        self.alloc.wake_up()
        self.torch.cuda.synchronize()
        time.sleep(pause)
        return self.as_a_sleep(), self.as_a_sleep()

    def check(self) -> dict:
        c, torch = self.skip.checksum, self.torch
        some = self.backed[:3] + self.backed[-2:]
        equal = all(c.sums([(p, d.handle[1])], self.device).tolist()[0]
                    == c.reference(self.ck.device_view(p, d.handle[1], self.device)).tolist()
                    for p, d in some)
        same = self.skip.unchanged(self.backed)
        torch.cuda.synchronize()
        return {"kernel_equals_reference": equal, "unchanged": len(same), "allocations": len(self.backed)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--weights", type=layout, default=layout("435x29"))
    p.add_argument("--kv", type=layout, default=layout("124x50"))
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--pauses", type=pauses, default=pauses("0,0.3,1"),
                   help="seconds between a wake and the call after it (comma-separated)")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path)
    args = p.parse_args()
    if args.reps < 1:
        p.error("--reps must be at least 1")
    ext = native.build_cumem_extension(args.tree.resolve(), Path(tempfile.mkdtemp(prefix="cumem-checksum-sleep-")),
                                       python_include=args.python_include)
    cumem = loader.load(args.tree.resolve(), ext).cumem
    import torch

    b = Bench(cumem, args.weights, args.kv)
    result = {"gpu": torch.cuda.get_device_name(), "weights": list(args.weights), "kv": list(args.kv),
              "allocations": len(b.backed)}
    result["as a sleep makes it"] = ms([b.as_a_sleep() for _ in range(args.reps)])
    result["keys and cache kept"] = ms(b.kept(args.reps))
    result["the whole blocks' kernel alone"] = ms(b.kernel_alone(args.reps))
    rows = [b.pieces() for _ in range(args.reps)]
    result["the pieces"] = {name: ms([r[name] for r in rows]) for name in rows[0]}
    result["after a wake"] = {}
    for pause in args.pauses:
        runs = [b.after_a_wake(pause) for _ in range(args.reps)]
        result["after a wake"][f"pause {pause:g} s"] = {"first": ms([f for f, _ in runs]),
                                                       "again": ms([a for _, a in runs])}
    result["check"] = b.check()
    for name in ("as a sleep makes it", "keys and cache kept", "the whole blocks' kernel alone"):
        print(f"{name}: median {result[name]['median_ms']:.2f} ms "
              f"({result[name]['min_ms']:.2f}-{result[name]['max_ms']:.2f})", flush=True)
    for name, row in result["the pieces"].items():
        print(f"  {name}: median {row['median_ms']:.3f} ms", flush=True)
    for name, row in result["after a wake"].items():
        print(f"after a wake, {name}: first call median {row['first']['median_ms']:.2f} ms "
              f"({row['first']['min_ms']:.2f}-{row['first']['max_ms']:.2f}), the call after it "
              f"{row['again']['median_ms']:.2f} ms ({row['again']['min_ms']:.2f}-{row['again']['max_ms']:.2f})",
              flush=True)
    print(f"check: {result['check']}", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, sort_keys=True))
    ok = result["check"]["kernel_equals_reference"] and result["check"]["unchanged"] == len(b.backed)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
