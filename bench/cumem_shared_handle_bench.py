#!/usr/bin/env python3
"""Which part of a sleep's unmaps and a wake's maps is paid per physical allocation, and
which per mapping: the driver calls over COUNT address ranges of SIZE MiB, two ways.

    python bench/cumem_shared_handle_bench.py [--count 373] [--size-mib 16]
        [--chunk-mib 512 0] [--reps 3] [--json-out FILE]

Needs a CUDA GPU, PyTorch and libcuda.so.1; reads the driver's enum values from cuda.h
(CUDA_HOME, default /usr/local/cuda). Bare process; no vLLM tree.

- ``own``: each range reserved apart, as vLLM's allocator reserves each allocation, with
  its own physical allocation (cuMemCreate asking for POSIX file-descriptor handles, as the
  extension does where fabric handles are refused), mapped, access set; then unmapped and
  released. Each call timed apart.
- ``hinted run, one handle``: COUNT ranges reserved apart, each asked for where the one
  before it ends; where all came back to back, one physical allocation mapped over all of
  them in one call (whether the driver takes it is recorded), one set-access, one unmap;
  before that unmap, what a free of one of them would meet is recorded: the CUresults of
  unmapping its range alone and of freeing its address range while the run maps it.
- ``one run, C MiB handles`` (``one run, one handle`` for C = 0): the COUNT ranges carved
  from one reservation, back to back, with a physical allocation for every C MiB of them
  (0: one for all), each mapped over its part of the run; one set-access and one unmap
  over the whole run.

One physical allocation cannot back ranges that lie apart: cuMemMap takes no offset into
a physical allocation (CUDA's documentation: "currently must be zero"; on an H200 with
driver 580.159.04, on 2026-11-28, this bench's first form, which tried it, got 801, not
supported). Merging needs the allocations back to back in the address space: carved from
one reservation, or reserved apart where each follows the last (the hinted run).

After each way's maps, every range is written and read back through PyTorch (the CUDA
array interface): a way that maps memory the GPU cannot use fails here, not later.

It changes nothing: it measures whether merging a wake's allocations into fewer physical
ones would take the per-allocation cost out of the sleep and the wake (docs/results.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from sm12x_bundle.enginecheck.vmm import (  # noqa: E402
    GRANULE, Driver, VmmError, _Span, back_to_back, cuda_enums, cuda_header, timed)


def map_at(drv: Driver, addr: int, size: int, offset: int, handle: int) -> None:
    drv.check(drv.lib.cuMemMap(ctypes.c_ulonglong(addr), ctypes.c_size_t(size), ctypes.c_size_t(offset),
                               ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0)), "cuMemMap")


def unmap(drv: Driver, addr: int, size: int) -> None:
    drv.check(drv.try_unmap(addr, size), "cuMemUnmap")


def usable(torch, ranges) -> bool:
    """Every range written with its own byte and read back."""
    views = [torch.as_tensor(_Span(a, s), device="cuda") for a, s in ranges]
    for i, v in enumerate(views):
        v.fill_(i % 251)
    torch.cuda.synchronize()
    return all(int(v[0]) == i % 251 and int(v[-1]) == i % 251 for i, v in enumerate(views))


def create(drv: Driver, size: int, rdma: bool) -> int:
    rc, h = drv.create(size, drv.prop("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", rdma))
    drv.check(rc, "cuMemCreate")
    return h


def own(torch, drv: Driver, ranges, rdma: bool) -> dict:
    row: dict = {}
    got: dict = {}
    row["create"] = timed(lambda: got.update(h=[create(drv, s, rdma) for _, s in ranges]))
    row["map"] = timed(lambda: [drv.map(a, s, h) for (a, s), h in zip(ranges, got["h"])])
    row["set access"] = timed(lambda: [drv.set_access(a, s) for a, s in ranges])
    row["usable"] = usable(torch, ranges)
    row["unmap"] = timed(lambda: [unmap(drv, a, s) for a, s in ranges])
    row["release"] = timed(lambda: [drv.release(h) for h in got["h"]])
    return row


def one_run(torch, drv: Driver, count: int, size: int, rdma: bool, chunk: int) -> dict:
    """The COUNT ranges carved back to back from one reservation; physical allocations of
    CHUNK bytes (whole ranges; 0: one for all), each mapped over its part of the run; one
    set-access and one unmap over the whole run."""
    total = count * size
    per = max(1, chunk // size) if chunk else count
    parts = [(i * size, min(per, count - i) * size) for i in range(0, count, per)]
    base = drv.reserve(total)
    try:
        row: dict = {"physical allocations": len(parts)}
        got: dict = {}
        row["create"] = timed(lambda: got.update(h=[create(drv, n, rdma) for _, n in parts]))
        row["map"] = timed(lambda: [drv.map(base + off, n, h) for (off, n), h in zip(parts, got["h"])])
        row["set access"] = timed(lambda: drv.set_access(base, total))
        row["usable"] = usable(torch, [(base + i * size, size) for i in range(count)])
        row["unmap"] = timed(lambda: unmap(drv, base, total))
        row["release"] = timed(lambda: [drv.release(h) for h in got["h"]])
        return row
    finally:
        drv.free_range(base, total)


def hinted_run(torch, drv: Driver, count: int, size: int, rdma: bool, out: dict, alignment: int = 0) -> dict:
    """COUNT ranges reserved apart, each asked for where the one before it ends (the hint a
    patched allocator would give); where they all came back to back, one physical
    allocation mapped over all of them in one call. Records how many came back to back and
    the CUresult of that one map (0: the driver maps across ranges reserved apart)."""
    ranges, end, freed = [], 0, set()
    try:
        for _ in range(count):
            ranges.append((drv.reserve(size, hint=end, alignment=alignment), size))
            end = ranges[-1][0] + size
        run = len(back_to_back(ranges))
        out["hinted_back_to_back"] = run
        if run != count:
            return {}
        base, total, row, got = ranges[0][0], count * size, {"physical allocations": 1}, {}
        row["create"] = timed(lambda: got.update(h=create(drv, total, rdma)))
        row["map"] = timed(lambda: got.update(rc=drv.lib.cuMemMap(
            ctypes.c_ulonglong(base), ctypes.c_size_t(total), ctypes.c_size_t(0), ctypes.c_ulonglong(got["h"]),
            ctypes.c_ulonglong(0))))
        out["hinted_one_map_cuda_result"] = got["rc"]
        if got["rc"]:
            drv.release(got["h"])
            return {}
        row["set access"] = timed(lambda: drv.set_access(base, total))
        row["usable"] = usable(torch, ranges)
        freed.update(one_member_let_go(drv, ranges, out))
        rest = total - (size if out["unmap_one_range_of_the_run_cuda_result"] == 0 else 0)
        row["unmap"] = timed(lambda: unmap(drv, base, rest))
        row["release"] = timed(lambda: drv.release(got["h"]))
        return row
    finally:
        for a, s in ranges:
            if a not in freed:
                drv.free_range(a, s)


def one_member_let_go(drv: Driver, ranges, out: dict) -> set:
    """What a free of one allocation inside a run mapped as one would meet: the CUresults
    of unmapping the last range alone, then of freeing its address range while the run
    still maps it (0: taken). Returns the ranges whose address range was freed."""
    addr, size = ranges[-1]
    out["unmap_one_range_of_the_run_cuda_result"] = drv.try_unmap(addr, size)
    rc = drv.lib.cuMemAddressFree(ctypes.c_ulonglong(addr), ctypes.c_size_t(size))
    out["free_one_address_range_under_the_run_cuda_result"] = rc
    return {addr} if rc == 0 else set()


def best(reps: list[dict]) -> dict:
    return {k: (min(r[k] for r in reps) if isinstance(reps[0][k], float) else reps[0][k]) for k in reps[0]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=373, help="address ranges (default 373: a TP=2 rank's "
                   "weight allocations in the 12 GiB rotation of docs/results.md)")
    p.add_argument("--size-mib", type=int, default=16, help="MiB each, rounded up to 2 MiB (default 16)")
    p.add_argument("--chunk-mib", type=int, nargs="*", default=[512, 0],
                   help="MiB of the run per physical allocation (0: one for all; default 512 0)")
    p.add_argument("--alignment-mib", type=int, default=0,
                   help="the hinted run's reservations ask for this alignment (default 0: the driver's own)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    try:
        enums = cuda_enums(cuda_header())
    except VmmError as exc:
        raise SystemExit(f"cumem_shared_handle_bench: {exc}") from None
    import torch

    torch.zeros(1, device="cuda")  # the primary context, as an engine's worker has it
    drv = Driver(torch.cuda.current_device(), enums)
    rdma = bool(drv.attribute("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"))
    size = -(-(args.size_mib << 20) // GRANULE) * GRANULE
    ranges = [(drv.reserve(size), size) for _ in range(args.count)]
    ways: dict = {}
    found: dict = {}
    try:
        for _ in range(args.reps):
            ways.setdefault("own", []).append(own(torch, drv, ranges, rdma))
            hinted = hinted_run(torch, drv, args.count, size, rdma, found, args.alignment_mib << 20)
            if hinted:
                ways.setdefault("hinted run, one handle", []).append(hinted)
            for c in args.chunk_mib:
                ways.setdefault(f"one run, {c} MiB handles" if c else "one run, one handle", []).append(
                    one_run(torch, drv, args.count, size, rdma, c << 20))
    finally:
        for a, s in ranges:
            drv.free_range(a, s)
    result = {"gpu": torch.cuda.get_device_name(), "count": args.count, "size": size, "rdma_with_vmm": rdma,
              "alignment_mib": args.alignment_mib,
              "best_s": {w: best(r) for w, r in ways.items()}, "reps": ways, **found}
    print(f"{args.count} ranges of {size >> 20} MiB on {result['gpu']}, best of {args.reps} (ms for all); "
          f"reserved with a hint, {found.get('hinted_back_to_back')} came back to back; one map over them: "
          f"CUresult {found.get('hinted_one_map_cuda_result', 'not tried')}; one range of it unmapped alone: "
          f"{found.get('unmap_one_range_of_the_run_cuda_result', 'not tried')}, its address range freed under "
          f"the run: {found.get('free_one_address_range_under_the_run_cuda_result', 'not tried')}")
    for way, row in result["best_s"].items():
        calls = "  ".join(f"{k} {v * 1e3:.2f}" for k, v in row.items() if isinstance(v, float))
        wake = sum(row[k] for k in ("create", "map", "set access"))
        sleep = row["unmap"] + row["release"]
        print(f"  {way:<12} wake's calls {wake * 1e3:7.2f}  sleep's calls {sleep * 1e3:7.2f}  ({calls}; "
              f"physical allocations {row.get('physical allocations', args.count)}; "
              f"usable {row['usable']})")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
