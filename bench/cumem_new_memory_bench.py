#!/usr/bin/env python3
"""What new device memory costs the copies around it (the wake's second ceiling).

    python bench/cumem_new_memory_bench.py TREE [--copy-gib 16] [--new-gib 8]
        [--piece-mib 384] [--reps 3] [--json-out FILE] [--python-include DIR]

Needs a CUDA GPU. Loads TREE's own cumem.py against its extension (built alone). COPY
bytes (the weights) and NEW bytes (a KV cache) are allocated in PIECE allocations under
two tags and put to sleep (the weights offloaded); the bench then maps and releases
their handles itself with the tree's create_and_map and unmap_and_release, as
wake_up and sleep do, and times the weights' host-to-device copy (synchronous
cudaMemcpy per piece, as wake_up copies) against the same copy into memory in use:

- ``in use``: the copy into the weights' memory, mapped and written before;
- ``new memory made just before``: the KV cache's handles created and mapped (untouched),
  then the copy at once;
- ``new memory made, 0.5 s pause``: the same with a pause between the maps and the copy;
- ``memory released just before``: the KV cache's memory released (it was mapped 0.5 s
  earlier), then the copy at once;
- ``copy, then new memory``: the copy, then the KV cache's maps, one timing for both
  (a wake that maps the discarded allocations last), against the copy alone;
- ``maps alone``: the KV cache's maps, synchronized;
- the first write into the KV cache's new memory right after its maps, against the
  same write into it once written;
- the same copy queued with ``cudaMemcpyAsync`` (one synchronize at the end): on the
  default stream and on a side stream into memory in use, then right after the release on
  the default stream, on a side stream, and split over two side streams, and right after
  the maps on a side stream (does another stream, or another copy engine, avoid the
  wait?).

Each row is the best of REPS; the weights' bytes are checked at the end.
"""

from __future__ import annotations

import argparse
import ctypes
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

MiB, GiB = 1 << 20, 1 << 30
H2D = 1  # cudaMemcpyHostToDevice


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--copy-gib", type=float, default=16.0)
    p.add_argument("--new-gib", type=float, default=8.0)
    p.add_argument("--piece-mib", type=int, default=384)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="cumem-new-memory-bench-"))
    ext = native.build_cumem_extension(args.tree.resolve(), work, python_include=args.python_include)
    cumem = loader.load(args.tree.resolve(), ext).cumem
    import torch

    alloc = cumem.CuMemAllocator.get_instance()
    piece = args.piece_mib * MiB
    n_w, n_k = int(args.copy_gib * GiB) // piece, int(args.new_gib * GiB) // piece
    with alloc.use_memory_pool("bench-weights"):
        ws = [torch.empty(piece // 8, dtype=torch.int64, device="cuda") for _ in range(n_w)]
    with alloc.use_memory_pool("bench-kv"):
        ks = [torch.empty(piece // 8, dtype=torch.int64, device="cuda") for _ in range(n_k)]
    for i, t in enumerate(ws):
        measure.fill(torch, t, i << 40)
    alloc.sleep(offload_tags=("bench-weights",))
    wd = [alloc.pointer_to_data[t.data_ptr()] for t in ws]
    kd = [alloc.pointer_to_data[t.data_ptr()] for t in ks]

    def maps(datas) -> None:
        for d in datas:
            cumem.create_and_map(d.handle)

    def release(datas) -> None:
        for d in datas:
            cumem.unmap_and_release(d.handle)

    def copy() -> None:
        for d in wd:
            cumem.libcudart.cudaMemcpy(d.handle[2], d.cpu_backup_tensor.data_ptr(), d.handle[1])

    mca = cumem.libcudart.lib.cudaMemcpyAsync
    mca.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    mca.restype = ctypes.c_int
    side = torch.cuda.Stream()
    side2 = torch.cuda.Stream()

    def queue(d, stream) -> None:
        err = mca(d.handle[2], d.cpu_backup_tensor.data_ptr(), d.handle[1], H2D, stream)
        if err:
            raise RuntimeError(f"cudaMemcpyAsync failed: {err}")

    def copy_async(stream) -> None:
        for d in wd:
            queue(d, stream)

    def copy_two_streams() -> None:
        for i, d in enumerate(wd):
            queue(d, (side if i % 2 else side2).cuda_stream)

    def remap_and_settle() -> None:  # the KV cache mapped again, the driver done with it
        time.sleep(0.5)
        maps(kd)
        torch.cuda.synchronize()
        time.sleep(0.5)

    def timed(fn) -> float:
        return measure.timed(torch, fn)

    maps(wd)
    copy()  # the weights' memory is now in use
    rows: dict[str, list[float]] = {k: [] for k in (
        "in_use", "new_just_before", "new_paused", "released_just_before", "copy_then_new",
        "maps_alone", "first_write", "write_in_use",
        "in_use_async_default", "in_use_async_side", "released_async_default", "released_async_side",
        "released_two_streams", "new_async_side")}
    for _ in range(args.reps):
        rows["in_use"].append(timed(copy))
        maps(kd)
        rows["new_just_before"].append(timed(copy))
        release(kd)
        maps(kd)
        torch.cuda.synchronize()
        time.sleep(0.5)
        rows["new_paused"].append(timed(copy))
        time.sleep(0.5)
        release(kd)
        rows["released_just_before"].append(timed(copy))
        time.sleep(0.5)
        rows["copy_then_new"].append(timed(lambda: (copy(), maps(kd))))
        rows["first_write"].append(timed(lambda: [t.fill_(1) for t in ks]))
        rows["write_in_use"].append(timed(lambda: [t.fill_(2) for t in ks]))
        release(kd)
        time.sleep(0.5)
        rows["maps_alone"].append(timed(lambda: maps(kd)))
        time.sleep(0.5)
        rows["in_use_async_default"].append(timed(lambda: copy_async(None)))
        rows["in_use_async_side"].append(timed(lambda: copy_async(side.cuda_stream)))
        release(kd)
        rows["released_async_default"].append(timed(lambda: copy_async(None)))
        remap_and_settle()
        release(kd)
        rows["released_async_side"].append(timed(lambda: copy_async(side.cuda_stream)))
        remap_and_settle()
        release(kd)
        rows["released_two_streams"].append(timed(copy_two_streams))
        time.sleep(0.5)
        maps(kd)
        rows["new_async_side"].append(timed(lambda: copy_async(side.cuda_stream)))
        release(kd)
        time.sleep(0.5)
    intact = all(measure.intact(torch, t, i << 40) for i, t in enumerate(ws))
    copy_bytes = n_w * piece
    best = {k: min(v) for k, v in rows.items()}
    f = {"copy_bytes": copy_bytes, "new_bytes": n_k * piece, "piece_bytes": piece, "intact": intact,
         "best_s": best, "all_s": rows,
         "copy_gbps": {k: copy_bytes / best[k] / 1e9 for k in
                       ("in_use", "new_just_before", "new_paused", "released_just_before", "copy_then_new")}}
    base = best["in_use"]
    print(f"{copy_bytes / GiB:.1f} GiB copied, {n_k * piece / GiB:.1f} GiB of new memory, {piece >> 20} MiB pieces:")
    for k in ("in_use", "new_just_before", "new_paused", "released_just_before", "copy_then_new"):
        print(f"  {k:<22} {best[k] * 1e3:7.1f} ms  {f['copy_gbps'][k]:5.1f} GB/s  ({best[k] / base:.3f}x in use)")
    for k in ("in_use_async_default", "in_use_async_side", "released_async_default", "released_async_side",
              "released_two_streams", "new_async_side"):
        print(f"  {k:<22} {best[k] * 1e3:7.1f} ms  ({best[k] / base:.3f}x in use)")
    for k in ("maps_alone", "first_write", "write_in_use"):
        print(f"  {k:<22} {best[k] * 1e3:7.1f} ms")
    print(f"  weights {'intact' if intact else 'CORRUPT'}")
    if args.json_out:
        args.json_out.write_text(json.dumps(f, indent=1, sort_keys=True))
    return 0 if intact else 1


if __name__ == "__main__":
    sys.exit(main())
