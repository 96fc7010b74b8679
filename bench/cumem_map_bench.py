#!/usr/bin/env python3
"""Where a wake's maps spend their time: per allocation, per driver call, per thread.

    python bench/cumem_map_bench.py TREE [--count 200] [--size-mib 32] [--threads 2 4 8]
        [--reps 3] [--json-out FILE] [--python-include DIR]

Needs a CUDA GPU and libcuda.so.1; reads the driver's enum values from cuda.h
(CUDA_HOME, default /usr/local/cuda). Loads TREE's own cumem.py against its extension
(built alone), allocates COUNT allocations of SIZE MiB under one tag and puts them to
sleep with nothing offloaded: their physical memory is released and their address
ranges stay reserved, as in a sleeping engine. Then, over all COUNT address ranges,
best of REPS, each timed on the host clock:

- ``extension``: the tree's create_and_map for each (what wake_up calls), then its
  unmap_and_release;
- ``attributes``: the two cuDeviceGetAttribute calls create_and_map makes each time
  (GPUDirect RDMA with VMM, fabric handles);
- ``create as the extension does``: cuMemCreate with the handle type and RDMA flag the
  extension asks for (fabric where the attribute says so, then POSIX file descriptors
  when fabric is refused: the refusals are counted);
- ``create, no handle type``: cuMemCreate asking for no shareable handle and no RDMA flag;
- ``map`` and ``set access``: cuMemMap and cuMemSetAccess of each range;
- ``unmap and release``;
- ``threads T``: create (no handle type), map and set access split over T host threads
  (ctypes releases the GIL), each with the primary context current.

An engine's weights are hundreds of allocations: in engine runs a wake's maps cost about
half a millisecond per allocation (docs/results.md), where 16 allocations of 512 MiB
mapped in 4-11 ms. This bench says which call that time is in, and whether threads or
another handle type would take it away. It changes nothing: it measures.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from sm12x_bundle import native  # noqa: E402
from sm12x_bundle.selftest import loader  # noqa: E402

ENUMS = ("CU_MEM_ALLOCATION_TYPE_PINNED", "CU_MEM_LOCATION_TYPE_DEVICE", "CU_MEM_HANDLE_TYPE_NONE",
         "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", "CU_MEM_HANDLE_TYPE_FABRIC",
         "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
         "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
         "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED")


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class Prop(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def cuda_enums(header: Path) -> dict[str, int]:
    """The values of ENUMS as cuda.h defines them (NAME = value, in its enums)."""
    text = header.read_text(errors="replace")
    out = {}
    for name in ENUMS:
        m = re.search(rf"\b{name}\s*=\s*(0x[0-9a-fA-F]+|\d+)", text)
        if not m:
            raise SystemExit(f"cumem_map_bench: {name} not found in {header}")
        out[name] = int(m.group(1), 0)
    return out


class Driver:
    """The VMM calls of the driver API, checked; one device."""

    def __init__(self, device: int, enums: dict[str, int]) -> None:
        self.lib, self.e, self.device = ctypes.CDLL("libcuda.so.1"), enums, device
        self.ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(self.ctx)), "cuCtxGetCurrent")
        self.access = AccessDesc(Location(enums["CU_MEM_LOCATION_TYPE_DEVICE"], device),
                                 enums["CU_MEM_ACCESS_FLAGS_PROT_READWRITE"])

    @staticmethod
    def check(rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what} failed: CUresult {rc}")

    def attribute(self, name: str) -> int:
        value = ctypes.c_int()
        rc = self.lib.cuDeviceGetAttribute(ctypes.byref(value), self.e[name], self.device)
        return value.value if rc == 0 else 0

    def prop(self, handle_type: str, rdma: bool) -> Prop:
        p = Prop()
        p.type = self.e["CU_MEM_ALLOCATION_TYPE_PINNED"]
        p.location = Location(self.e["CU_MEM_LOCATION_TYPE_DEVICE"], self.device)
        p.requestedHandleTypes = self.e[handle_type]
        p.allocFlags.gpuDirectRDMACapable = int(rdma)
        return p

    def create(self, size: int, prop: Prop) -> tuple[int, int]:
        """(CUresult, handle): the caller decides what a refusal means."""
        handle = ctypes.c_ulonglong()
        rc = self.lib.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(prop),
                                  ctypes.c_ulonglong(0))
        return rc, handle.value

    def map(self, addr: int, size: int, handle: int) -> None:
        self.check(self.lib.cuMemMap(ctypes.c_ulonglong(addr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                     ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0)), "cuMemMap")

    def set_access(self, addr: int, size: int) -> None:
        self.check(self.lib.cuMemSetAccess(ctypes.c_ulonglong(addr), ctypes.c_size_t(size),
                                           ctypes.byref(self.access), ctypes.c_size_t(1)), "cuMemSetAccess")

    def unmap_release(self, addr: int, size: int, handle: int) -> None:
        self.check(self.lib.cuMemUnmap(ctypes.c_ulonglong(addr), ctypes.c_size_t(size)), "cuMemUnmap")
        self.check(self.lib.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")

    def in_thread(self) -> None:
        self.check(self.lib.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def as_the_extension(drv: Driver, ranges, rdma: bool, fabric: bool) -> tuple[list[int], int]:
    """cuMemCreate as create_and_map asks: fabric first where supported, POSIX FDs when
    fabric is refused. Returns the handles and the number of refusals."""
    handles, refused = [], 0
    for _, size in ranges:
        rc, h = drv.create(size, drv.prop("CU_MEM_HANDLE_TYPE_FABRIC" if fabric else
                                          "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", rdma))
        if rc and fabric:
            refused += 1
            rc, h = drv.create(size, drv.prop("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", rdma))
        drv.check(rc, "cuMemCreate")
        handles.append(h)
    return handles, refused


def plain_create(drv: Driver, ranges) -> list[int]:
    prop = drv.prop("CU_MEM_HANDLE_TYPE_NONE", False)
    out = []
    for _, size in ranges:
        rc, h = drv.create(size, prop)
        drv.check(rc, "cuMemCreate")
        out.append(h)
    return out


def one_rep(drv: Driver, cumem, datas, ranges, threads: list[int], rdma: bool, fabric: bool) -> dict:
    import torch

    row = {"extension": timed(lambda: [cumem.create_and_map(d.handle) for d in datas])}
    torch.cuda.synchronize()
    for d in datas:
        cumem.unmap_and_release(d.handle)
    row["attributes"] = timed(lambda: [drv.attribute(n) for _ in ranges for n in (
        "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
        "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED")])
    got: dict = {}
    row["create as the extension does"] = timed(lambda: got.update(r=as_the_extension(drv, ranges, rdma, fabric)))
    handles, row["fabric refusals"] = got["r"]
    for (addr, size), h in zip(ranges, handles):
        drv.check(drv.lib.cuMemRelease(ctypes.c_ulonglong(h)), "cuMemRelease")
    row["create, no handle type"] = timed(lambda: got.update(h=plain_create(drv, ranges)))
    handles = got["h"]
    row["map"] = timed(lambda: [drv.map(a, s, h) for (a, s), h in zip(ranges, handles)])
    row["set access"] = timed(lambda: [drv.set_access(a, s) for a, s in ranges])
    torch.cuda.synchronize()
    row["unmap and release"] = timed(lambda: [drv.unmap_release(a, s, h) for (a, s), h in zip(ranges, handles)])
    for t in threads:
        row[f"threads {t}"] = threaded(drv, ranges, t)
    return row


def threaded(drv: Driver, ranges, t: int) -> float:
    """create (no handle type), map and set access of every range over T threads."""
    import torch

    parts = [ranges[i::t] for i in range(t)]

    def work(part):
        drv.in_thread()
        hs = plain_create(drv, part)
        for (a, s), h in zip(part, hs):
            drv.map(a, s, h)
            drv.set_access(a, s)
        return hs

    with ThreadPoolExecutor(t) as pool:
        start = time.perf_counter()
        handles = list(pool.map(work, parts))
        seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    for part, hs in zip(parts, handles):
        for (a, s), h in zip(part, hs):
            drv.unmap_release(a, s, h)
    return seconds


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--count", type=int, default=200)
    p.add_argument("--size-mib", type=int, default=32)
    p.add_argument("--threads", type=int, nargs="*", default=[2, 4, 8])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path)
    args = p.parse_args()
    enums = cuda_enums(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include/cuda.h")
    work = Path(tempfile.mkdtemp(prefix="cumem-map-bench-"))
    ext = native.build_cumem_extension(args.tree.resolve(), work, python_include=args.python_include)
    cumem = loader.load(args.tree.resolve(), ext).cumem
    import torch

    alloc = cumem.CuMemAllocator.get_instance()
    size = args.size_mib << 20
    with alloc.use_memory_pool("map-bench"):
        ts = [torch.empty(size, dtype=torch.uint8, device="cuda") for _ in range(args.count)]
    alloc.sleep(offload_tags=())  # nothing offloaded: every range released, still reserved
    datas = [alloc.pointer_to_data[t.data_ptr()] for t in ts]
    ranges = [(d.handle[2], d.handle[1]) for d in datas]
    drv = Driver(torch.cuda.current_device(), enums)
    rdma = bool(drv.attribute("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"))
    fabric = bool(drv.attribute("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"))
    reps = [one_rep(drv, cumem, datas, ranges, args.threads, rdma, fabric) for _ in range(args.reps)]
    alloc.wake_up()  # the allocator's own state again: every range mapped by it
    best = {k: min(r[k] for r in reps) for k in reps[0]}
    result = {"gpu": torch.cuda.get_device_name(), "count": args.count, "size_mib": args.size_mib,
              "rdma_with_vmm": rdma, "fabric_supported": fabric, "best_s": best, "reps": reps}
    print(f"{args.count} allocations of {args.size_mib} MiB on {result['gpu']} "
          f"(RDMA with VMM: {rdma}, fabric handles: {fabric}), best of {args.reps}:")
    for k, v in best.items():
        if k == "fabric refusals":
            print(f"  {k:<30} {v}")
        else:
            print(f"  {k:<30} {v * 1e3:8.2f} ms  {v / args.count * 1e6:8.1f} us each")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
