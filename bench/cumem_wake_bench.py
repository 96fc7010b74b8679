#!/usr/bin/env python3
"""Where wake_up's time goes, and what overlapping its two halves would give.

    python bench/cumem_wake_bench.py TREE [--size-gib 8] [--chunk-mib 512]
        [--reps 3] [--json-out FILE] [--python-include DIR]

Needs a CUDA GPU. Loads TREE's own cumem.py against its extension (built alone) and,
with SIZE asleep in CHUNK allocations (their pinned backups kept), times:

- the host-to-device ceiling: the backups copied into one device buffer;
- ``wake_up()`` as the tree has it (pristine 0.21.0: each allocation mapped, then
  copied; patched: every allocation mapped, then every copy);
- its halves apart: create_and_map of every allocation, then every copy;
- an overlapped wake: create_and_map of allocation k+1 on the CPU while the copy of
  allocation k runs (cudaMemcpyAsync on a side stream), one synchronize at the end;
- where the copies' own gap to the ceiling comes from: every copy queued with
  cudaMemcpyAsync (host-to-device kind) on one stream and one synchronize; the copies
  after a pause of PAUSE seconds behind the maps (time for anything the driver does to
  new physical memory in the background); and the copies repeated into the same
  mappings once they have been written (memory no longer fresh).

Between runs every allocation is unmapped again (its backup kept), so each run
starts from the same sleeping state; the data is checked after the last one.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from sm12x_bundle import native  # noqa: E402
from sm12x_bundle.selftest import loader, measure  # noqa: E402

CUDA_MEMCPY_H2D = 1
CUDA_MEMCPY_DEFAULT = 4


def best(torch, fn, reps: int) -> float:
    return min(measure.timed(torch, fn) for _ in range(reps))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--size-gib", type=float, default=8.0)
    p.add_argument("--chunk-mib", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path)
    p.add_argument("--pause", type=float, default=0.5, help="seconds between the maps and the copies (default 0.5)")
    args = p.parse_args()
    # Kept: PyTorch opens the extension by its path each time a pool is made.
    work = Path(tempfile.mkdtemp(prefix="cumem-wake-bench-"))
    ext = native.build_cumem_extension(args.tree.resolve(), work, python_include=args.python_include)
    loaded = loader.load(args.tree.resolve(), ext)
    import torch

    cumem = loaded.cumem
    gc.collect()
    gc.freeze()
    alloc = cumem.CuMemAllocator.get_instance()
    chunk = args.chunk_mib << 20
    k = int(args.size_gib * (1 << 30)) // chunk
    total = k * chunk
    with alloc.use_memory_pool("wake-bench"):
        ts = [torch.empty(chunk // 8, dtype=torch.int64, device="cuda") for _ in range(k)]
    for i, t in enumerate(ts):
        measure.fill(torch, t, i << 40)
    alloc.sleep(offload_tags=("wake-bench",))
    datas = [alloc.pointer_to_data[t.data_ptr()] for t in ts]
    backups = [d.cpu_backup_tensor for d in datas]

    def h2d_ceiling() -> float:  # the buffer is gone before the wakes need the memory
        dev = torch.empty(chunk, dtype=torch.uint8, device="cuda")
        return best(torch, lambda: [dev.copy_(b) for b in backups], args.reps)

    h2d = h2d_ceiling()
    torch.cuda.empty_cache()

    def unmap_all() -> None:
        for d in datas:
            cumem.unmap_and_release(d.handle)

    def map_all() -> None:
        for d in datas:
            cumem.create_and_map(d.handle)

    def copy_all() -> None:
        for d in datas:
            cumem.libcudart.cudaMemcpy(d.handle[2], d.cpu_backup_tensor.data_ptr(), d.handle[1])

    memcpy_async = cumem.libcudart.lib.cudaMemcpyAsync
    memcpy_async.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    memcpy_async.restype = ctypes.c_int
    side = torch.cuda.Stream()

    def overlapped() -> None:
        for d in datas:
            cumem.create_and_map(d.handle)
            err = memcpy_async(d.handle[2], d.cpu_backup_tensor.data_ptr(), d.handle[1], CUDA_MEMCPY_DEFAULT,
                               side.cuda_stream)
            if err:
                raise RuntimeError(f"cudaMemcpyAsync failed: {err}")
        side.synchronize()

    def copy_all_async() -> None:
        stream = torch.cuda.current_stream().cuda_stream
        for d in datas:
            err = memcpy_async(d.handle[2], d.cpu_backup_tensor.data_ptr(), d.handle[1], CUDA_MEMCPY_H2D, stream)
            if err:
                raise RuntimeError(f"cudaMemcpyAsync failed: {err}")

    figures: dict = {"bytes": total, "chunk_bytes": chunk, "allocations": k}
    batched, paused, rewritten = [], [], []
    for _ in range(args.reps):
        map_all()
        batched.append(measure.timed(torch, copy_all_async))
        rewritten.append(measure.timed(torch, copy_all))
        unmap_all()
        map_all()
        torch.cuda.synchronize()
        time.sleep(args.pause)
        paused.append(measure.timed(torch, copy_all))
        unmap_all()
    maps, copies, overl = [], [], []
    for _ in range(args.reps):
        maps.append(measure.timed(torch, map_all))
        copies.append(measure.timed(torch, copy_all))
        unmap_all()
    for _ in range(args.reps):
        overl.append(measure.timed(torch, overlapped))
        unmap_all()
    overl.append(measure.timed(torch, overlapped))  # left mapped: check the bytes
    intact = all(measure.intact(torch, t, i << 40) for i, t in enumerate(ts))
    unmap_all()
    wakes = []
    for _ in range(args.reps):  # the tree's own wake_up, then back to sleep (backups from the host cache)
        wakes.append(measure.timed(torch, alloc.wake_up))
        alloc.sleep(offload_tags=("wake-bench",))

    def gbps(seconds: float) -> float:
        return total / seconds / 1e9

    figures.update(
        h2d_ceiling_gbps=gbps(h2d), wake_up_gbps=gbps(min(wakes)),
        create_and_map_s=min(maps), copies_s=min(copies), map_then_copy_gbps=gbps(min(maps) + min(copies)),
        overlapped_gbps=gbps(min(overl)), overlapped_intact=intact,
        create_and_map_us_per_mib=min(maps) / (total >> 20) * 1e6,
        wakes_s=wakes, maps_s=maps, copies_s_all=copies, overlapped_s=overl,
        batched_async_gbps=gbps(min(batched)), after_pause_gbps=gbps(min(paused)),
        rewritten_gbps=gbps(min(rewritten)), pause_s=args.pause,
        batched_async_s=batched, after_pause_s=paused, rewritten_s=rewritten,
    )
    f = figures
    print(f"{total / 2**30:.1f} GiB in {k} x {chunk >> 20} MiB allocations:")
    print(f"  H2D ceiling              {f['h2d_ceiling_gbps']:6.1f} GB/s")
    print(f"  wake_up() of the tree    {f['wake_up_gbps']:6.1f} GB/s  ({f['wake_up_gbps'] / f['h2d_ceiling_gbps']:.0%})")
    print(f"  create_and_map alone     {f['create_and_map_s'] * 1e3:6.1f} ms  "
          f"({f['create_and_map_us_per_mib']:.2f} us per MiB)")
    print(f"  copies alone             {gbps(f['copies_s']):6.1f} GB/s")
    print(f"  overlapped (map k+1 while k copies)  {f['overlapped_gbps']:6.1f} GB/s  "
          f"({f['overlapped_gbps'] / f['h2d_ceiling_gbps']:.0%}), data {'intact' if intact else 'CORRUPT'}")
    for label, key in (("copies batched (async, one sync)", "batched_async_gbps"),
                       (f"copies after a {args.pause:g} s pause", "after_pause_gbps"),
                       ("copies into written mappings", "rewritten_gbps")):
        print(f"  {label:<34} {f[key]:6.1f} GB/s  ({f[key] / f['h2d_ceiling_gbps']:.0%})")
    if args.json_out:
        args.json_out.write_text(json.dumps(figures, indent=2, sort_keys=True))
    sys.stdout.flush()
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
