#!/usr/bin/env python3
"""A wake right after a sleep, and a model load beside the backup pool's pinning.

    python bench/cumem_sleep_wake_bench.py TREE [--size-gib 16] [--piece-mib 384]
        [--reps 3] [--tags weights,bench-plain] [--pin-gib 16] [--json-out FILE]
        [--python-include DIR]

Needs a CUDA GPU. Loads TREE's own cumem.py (the patched tree) against its extension
(built alone). Part 1, per tag (``weights`` takes its backups from patch 0005's pool,
any other tag from PyTorch's pinned allocator): SIZE bytes in PIECE allocations, then
REPS rounds of each pairing of a sleep and a wake, the wake starting the instant the
sleep returns; each is timed against the same process's pinned ceilings. Sleeps:

- ``burst``: the tree's sleep() (every backup copied, then every allocation released);
- ``burst-reversed``: the same, released newest first;
- ``per-allocation``: copy one, release it, as vLLM 0.21.0 sleeps (not transactional);
- ``burst-pause``: the tree's sleep() and a 2 s pause before the wake.

Wakes: ``tree`` (the tree's wake_up; the 0.21.0 series of 2026-11-22 mapped all, then
copied), ``pipelined`` (map k+1 while k's cudaMemcpyAsync runs on a side stream),
``batched`` (map all, then every cudaMemcpyAsync on one stream, one synchronize). The
tree's sleep() discards every other awake allocation and its wake_up maps them again, so
under the second tag its rows also discard and create the first tag's memory; the
bench's own sleeps and wakes touch only the tag under test. After one burst sleep the
free device memory that cudaMemGetInfo reports is polled for 0.5 s (does the driver
still work on what was released?).

Part 2: what a model load waits on while the pool pins. A main thread loops on one
64 MiB allocation (cuMemCreate + cuMemMap through the tree's extension, a 64 MiB copy
in, cuMemUnmap + release) while a pool pins PIN bytes in the background, with the pool's
settings and with fewer threads, chunked registration and a niced pinning thread; the
loop's step times (median, max) and how many steps ran are reported per phase.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from sm12x_bundle import native  # noqa: E402
from sm12x_bundle.selftest import loader, measure  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30
H2D = 1


class Bench:
    def __init__(self, torch, cumem, tag: str, size: int, piece: int) -> None:
        self.torch, self.cumem, self.tag = torch, cumem, tag
        self.alloc = cumem.CuMemAllocator.get_instance()
        with self.alloc.use_memory_pool(tag):
            self.ts = [torch.empty(piece // 8, dtype=torch.int64, device="cuda") for _ in range(size // piece)]
        for i, t in enumerate(self.ts):
            measure.fill(torch, t, i << 40)
        self.items = [(t.data_ptr(), self.alloc.pointer_to_data[t.data_ptr()]) for t in self.ts]
        self.bytes = len(self.ts) * piece
        lib = cumem.libcudart.lib
        self.memcpy_async = lib.cudaMemcpyAsync
        self.memcpy_async.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                      ctypes.c_void_p]
        self.memcpy_async.restype = ctypes.c_int
        self.side = torch.cuda.Stream()

    # -- sleeps: each leaves every allocation asleep with its backup ---------------------
    def sleep_burst(self) -> None:
        self.alloc.sleep(offload_tags=(self.tag,))

    def _backup(self, ptr, data) -> None:
        data.cpu_backup_tensor = self.alloc._backup_for(data)
        self.cumem.libcudart.cudaMemcpy(data.cpu_backup_tensor.data_ptr(), ptr, data.handle[1])

    def sleep_burst_reversed(self) -> None:
        self.torch.cuda.synchronize()
        for ptr, data in self.items:
            self._backup(ptr, data)
        for _, data in reversed(self.items):
            self.cumem.unmap_and_release(data.handle)
            data.asleep = True
        self._tidy()

    def sleep_per_allocation(self) -> None:
        self.torch.cuda.synchronize()
        for ptr, data in self.items:
            self._backup(ptr, data)
            self.cumem.unmap_and_release(data.handle)
            data.asleep = True
        self._tidy()

    def _tidy(self) -> None:
        if hasattr(self.alloc, "backup_pool") and self.alloc.backup_pool is not None:
            self.alloc.backup_pool.before_sleep((self.tag,))
        gc.collect()
        self.torch.cuda.empty_cache()

    # -- wakes -------------------------------------------------------------------------------
    def wake_tree(self) -> None:
        self.alloc.wake_up()

    def _copy_async(self, ptr, data, stream) -> None:
        err = self.memcpy_async(ptr, data.cpu_backup_tensor.data_ptr(), data.handle[1], H2D, stream)
        if err:
            raise RuntimeError(f"cudaMemcpyAsync failed: {err}")

    def _woken(self) -> None:
        for _, data in self.items:
            data.asleep = False
            data.cpu_backup_tensor = None

    def wake_pipelined(self) -> None:
        for ptr, data in self.items:
            self.cumem.create_and_map(data.handle)
            self._copy_async(ptr, data, self.side.cuda_stream)
        self.side.synchronize()
        self._woken()

    def wake_batched(self) -> None:
        for _, data in self.items:
            self.cumem.create_and_map(data.handle)
        stream = self.torch.cuda.current_stream().cuda_stream
        for ptr, data in self.items:
            self._copy_async(ptr, data, stream)
        self.torch.cuda.synchronize()
        self._woken()

    def intact(self) -> bool:
        return all(measure.intact(self.torch, t, i << 40) for i, t in enumerate(self.ts))

    def ceilings(self, reps: int) -> dict:
        torch, timed = self.torch, measure.timed
        views = [t.view(torch.uint8) for t in self.ts]
        hosts = [torch.empty(v.numel(), dtype=torch.uint8, pin_memory=True) for v in views]
        d2h = min(timed(torch, lambda: [h.copy_(v) for h, v in zip(hosts, views)]) for _ in range(reps))
        h2d = min(timed(torch, lambda: [v.copy_(h) for h, v in zip(hosts, views)]) for _ in range(reps))
        hosts.clear()
        getattr(torch._C, "_host_emptyCache", lambda: None)()  # host memory for the rest
        return {"d2h_gbps": self.bytes / d2h / 1e9, "h2d_gbps": self.bytes / h2d / 1e9}

    def free_after_burst(self) -> list:
        """cudaMemGetInfo's free bytes over the 0.5 s after a burst sleep returns."""
        self.sleep_burst()
        t0, seen = time.perf_counter(), []
        while (t := time.perf_counter() - t0) < 0.5:
            seen.append((round(t, 4), self.torch.cuda.mem_get_info()[0]))
            time.sleep(0.005)
        self.wake_tree()
        return seen


PAIRS = (("burst", "tree"), ("per-allocation", "tree"), ("burst-reversed", "tree"), ("burst-pause", "tree"),
         ("burst", "pipelined"), ("burst", "batched"), ("per-allocation", "pipelined"))


def run_pairs(b: Bench, reps: int) -> dict:
    sleeps = {"burst": b.sleep_burst, "burst-reversed": b.sleep_burst_reversed,
              "per-allocation": b.sleep_per_allocation, "burst-pause": b.sleep_burst}
    wakes = {"tree": b.wake_tree, "pipelined": b.wake_pipelined, "batched": b.wake_batched}
    torch, timed = b.torch, measure.timed
    b.sleep_burst()  # the first sleep (the pool, or PyTorch's host cache, gets its memory)
    b.wake_tree()
    out = {f"{s}+{w}": {"sleep_s": [], "wake_s": []} for s, w in PAIRS}
    for _ in range(reps):  # rounds alternate the pairings, so that drift spreads over all
        for s, w in PAIRS:
            r = out[f"{s}+{w}"]
            r["sleep_s"].append(timed(torch, sleeps[s]))
            if s == "burst-pause":
                time.sleep(2.0)
            r["wake_s"].append(timed(torch, wakes[w]))
            if not b.intact():
                raise SystemExit(f"{s}+{w}: the data did not round-trip")
    return out


# -- part 2: the load beside the pinning -----------------------------------------------------
def probe_loop(cumem, handle, host, stop: threading.Event, steps: list) -> None:
    """What a model load does to the driver: one allocation made, filled and released."""
    while not stop.is_set():
        t0 = time.perf_counter()
        cumem.unmap_and_release(handle)
        cumem.create_and_map(handle)
        cumem.libcudart.cudaMemcpy(handle[2], host.data_ptr(), handle[1])
        steps.append((t0, time.perf_counter() - t0))


def pin_variant(pool_mod, nbytes: int, device: int, threads: int, chunk: int, nice: bool) -> dict:
    mem = pool_mod.HostMemory(threads=threads)
    times = {}
    if nice:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    t0 = time.perf_counter()
    addr = mem.map(nbytes)
    mem.populate(addr, nbytes)
    times["populate_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    step = chunk or nbytes
    for off in range(0, nbytes, step):
        mem.register(addr + off, min(step, nbytes - off), device)
    times["register_s"] = time.perf_counter() - t1
    for off in range(0, nbytes, step):
        mem.unregister(addr + off)
    mem.unmap(addr, nbytes)
    return times


def load_beside_pinning(torch, cumem, pin_bytes: int) -> dict:
    import importlib

    pool_mod = importlib.import_module("vllm.device_allocator.cumem_backup_pool")
    alloc = cumem.CuMemAllocator.get_instance()
    with alloc.use_memory_pool("bench-probe"):
        probe = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    handle = alloc.pointer_to_data[probe.data_ptr()].handle
    host = torch.empty(64 * MiB, dtype=torch.uint8, pin_memory=True)
    variants = {"none": None, "pool (16 threads, one register)": (16, 0, False),
                "4 threads": (4, 0, False), "16 threads, register per 1 GiB": (16, GiB, False),
                "16 threads, niced": (16, 0, True)}
    out = {}
    for name, v in variants.items():
        stop, result, steps = threading.Event(), {}, []
        if v is None:
            work = lambda: time.sleep(1.0)
        else:
            work = lambda v=v, result=result: result.update(pin_variant(pool_mod, pin_bytes, 0, *v))
        th = threading.Thread(target=work)
        prober = threading.Thread(target=probe_loop, args=(cumem, handle, host, stop, steps))
        prober.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        th.start()
        th.join()
        t1 = time.perf_counter()
        stop.set()
        prober.join()
        during = [dt for start, dt in steps if t0 <= start < t1]
        out[name] = {"pin_wall_s": t1 - t0, **result, "probe_steps": len(during),
                     "probe_median_ms": statistics.median(during) * 1e3 if during else None,
                     "probe_max_ms": max(during) * 1e3 if during else None,
                     "probe_step_ms": [round(dt * 1e3, 2) for start, dt in steps if t0 <= start < t1][:400]}
        print(f"  {name:<34} pin {t1 - t0:5.2f} s {result}: probe {len(during)} steps, median "
              f"{out[name]['probe_median_ms'] or 0:.2f} ms, max {out[name]['probe_max_ms'] or 0:.1f} ms", flush=True)
    del probe
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--size-gib", type=float, default=16.0)
    p.add_argument("--piece-mib", type=int, default=384)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tags", default="weights,bench-plain")
    p.add_argument("--pin-gib", type=float, default=16.0, help="0: leave part 2 out")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cumem-sleep-wake-bench-"))
    ext = native.build_cumem_extension(args.tree.resolve(), work, python_include=args.python_include)
    loaded = loader.load(args.tree.resolve(), ext)
    import torch

    cumem = loaded.cumem
    piece = args.piece_mib * MiB
    size = int(args.size_gib * GiB) // piece * piece
    figures: dict = {"bytes": size, "piece_bytes": piece, "tags": {}}
    for tag in args.tags.split(","):
        b = Bench(torch, cumem, tag, size, piece)
        ceil = b.ceilings(args.reps)
        pairs = run_pairs(b, args.reps)
        polled = b.free_after_burst()
        figures["tags"][tag] = {"ceilings": ceil, "pairs": pairs, "free_after_burst": polled}
        print(f"tag {tag}: {b.bytes / GiB:.1f} GiB, D2H {ceil['d2h_gbps']:.1f} GB/s, H2D {ceil['h2d_gbps']:.1f} GB/s")
        for name, r in pairs.items():
            w = [b.bytes / s / 1e9 / ceil["h2d_gbps"] for s in r["wake_s"]]
            sl = [b.bytes / s / 1e9 / ceil["d2h_gbps"] for s in r["sleep_s"]]
            r["wake_ratios"], r["sleep_ratios"] = w, sl
            print(f"  {name:<26} wake {' '.join(f'{x:.3f}' for x in w)} of H2D; "
                  f"sleep {' '.join(f'{x:.3f}' for x in sl)} of D2H", flush=True)
        frees = [f for _, f in polled]
        print(f"  free after a burst sleep: first {frees[0] / GiB:.2f} GiB, last {frees[-1] / GiB:.2f} GiB, "
              f"{len(frees)} polls")
    if args.pin_gib > 0:
        print("load beside the pinning:")
        figures["load_beside_pinning"] = load_beside_pinning(torch, cumem, int(args.pin_gib * GiB))
    if args.json_out:
        args.json_out.write_text(json.dumps(figures, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
