"""The CUDA driver's virtual-memory calls through ctypes, timed one kind at a time.

A wake's maps are vLLM's extension calling ``cuMemCreate``, ``cuMemMap`` and
``cuMemSetAccess`` once per allocation. ``bench/cumem_map_bench.py`` times those calls in
a bare process; ``call_times`` times the same calls inside an engine's worker (the probe
``sm12x_maps``), on address ranges of its own, so that the two can be set side by side.
Standard library only: the worker imports it by name. Enum values are read from the
toolkit's ``cuda.h`` (``CUDA_HOME``, default /usr/local/cuda), not written here.
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
import time
from pathlib import Path

ENUMS = ("CU_MEM_ALLOCATION_TYPE_PINNED", "CU_MEM_LOCATION_TYPE_DEVICE", "CU_MEM_HANDLE_TYPE_NONE",
         "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", "CU_MEM_HANDLE_TYPE_FABRIC",
         "CU_MEM_ACCESS_FLAGS_PROT_READWRITE",
         "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED",
         "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED")
GRANULE = 2 << 20  # the granularity of device memory on every card these checks run on


class VmmError(Exception):
    """A driver call failed, or cuda.h lacks an enum; the message names which."""


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


def cuda_header() -> Path:
    return Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include" / "cuda.h"


def cuda_enums(header: Path) -> dict[str, int]:
    """The values of ENUMS as cuda.h defines them (NAME = value, in its enums)."""
    text = header.read_text(errors="replace")
    out = {}
    for name in ENUMS:
        m = re.search(rf"\b{name}\s*=\s*(0x[0-9a-fA-F]+|\d+)", text)
        if not m:
            raise VmmError(f"{name} not found in {header}")
        out[name] = int(m.group(1), 0)
    return out


class Driver:
    """The VMM calls of the driver API, checked; one device, its current context."""

    def __init__(self, device: int, enums: dict[str, int]) -> None:
        self.lib, self.e, self.device = ctypes.CDLL("libcuda.so.1"), enums, device
        self.ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(self.ctx)), "cuCtxGetCurrent")
        self.access = AccessDesc(Location(enums["CU_MEM_LOCATION_TYPE_DEVICE"], device),
                                 enums["CU_MEM_ACCESS_FLAGS_PROT_READWRITE"])

    @staticmethod
    def check(rc: int, what: str) -> None:
        if rc:
            raise VmmError(f"{what} failed: CUresult {rc}")

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

    def release(self, handle: int) -> None:
        self.check(self.lib.cuMemRelease(ctypes.c_ulonglong(handle)), "cuMemRelease")

    def map(self, addr: int, size: int, handle: int) -> None:
        self.check(self.lib.cuMemMap(ctypes.c_ulonglong(addr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                                     ctypes.c_ulonglong(handle), ctypes.c_ulonglong(0)), "cuMemMap")

    def set_access(self, addr: int, size: int) -> None:
        self.check(self.lib.cuMemSetAccess(ctypes.c_ulonglong(addr), ctypes.c_size_t(size),
                                           ctypes.byref(self.access), ctypes.c_size_t(1)), "cuMemSetAccess")

    def try_set_access(self, addr: int, size: int) -> int:
        """cuMemSetAccess's CUresult: whether one call may cover a range is what is asked."""
        return self.lib.cuMemSetAccess(ctypes.c_ulonglong(addr), ctypes.c_size_t(size), ctypes.byref(self.access),
                                       ctypes.c_size_t(1))

    def try_unmap(self, addr: int, size: int) -> int:
        return self.lib.cuMemUnmap(ctypes.c_ulonglong(addr), ctypes.c_size_t(size))

    def unmap_release(self, addr: int, size: int, handle: int) -> None:
        self.check(self.lib.cuMemUnmap(ctypes.c_ulonglong(addr), ctypes.c_size_t(size)), "cuMemUnmap")
        self.release(handle)

    def reserve(self, size: int, hint: int = 0, alignment: int = 0) -> int:
        """A fresh address range; ``hint``: where to place it if free (the driver may not);
        ``alignment``: 0 for the driver's default."""
        addr = ctypes.c_ulonglong()
        self.check(self.lib.cuMemAddressReserve(ctypes.byref(addr), ctypes.c_size_t(size), ctypes.c_size_t(alignment),
                                                ctypes.c_ulonglong(hint), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        return addr.value

    def free_range(self, addr: int, size: int) -> None:
        self.check(self.lib.cuMemAddressFree(ctypes.c_ulonglong(addr), ctypes.c_size_t(size)), "cuMemAddressFree")

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


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) each thread of this process has used, by 'tid name'."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{task.name} {name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out


def busiest_threads(before: dict[str, float], after: dict[str, float], seconds: float) -> list[list]:
    """[thread, share of the interval on a CPU] for the threads that used any, busiest first."""
    used = {t: after[t] - before.get(t, 0.0) for t in after}
    return [[t, round(u / seconds, 3)] for t, u in sorted(used.items(), key=lambda kv: -kv[1]) if u > 0][:8]


def extension_pass(ext, drv: Driver, ranges) -> tuple[float, float]:
    """(create_and_map s, unmap_and_release s) of the extension over every range."""
    handles = [ctypes.c_ulonglong() for _ in ranges]
    mapped = timed(lambda: [ext.python_create_and_map(drv.device, s, a, ctypes.addressof(h))
                            for (a, s), h in zip(ranges, handles)])
    released = timed(lambda: [ext.python_unmap_and_release(drv.device, s, a, ctypes.addressof(h))
                              for (a, s), h in zip(ranges, handles)])
    return mapped, released


def driver_pass(drv: Driver, ranges, rdma: bool, fabric: bool) -> dict:
    row: dict = {}
    got: dict = {}
    row["create as the extension does"] = timed(lambda: got.update(r=as_the_extension(drv, ranges, rdma, fabric)))
    handles, row["fabric refusals"] = got["r"]
    for h in handles:
        drv.release(h)
    posix = drv.prop("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", rdma)
    row["create, POSIX FD handle (no fabric request)"] = timed(lambda: got.update(p=[
        drv.create(s, posix) for _, s in ranges]))
    for rc, h in got["p"]:
        drv.check(rc, "cuMemCreate")
        drv.release(h)
    if fabric:  # the request alone, refused or granted
        ask = drv.prop("CU_MEM_HANDLE_TYPE_FABRIC", rdma)
        row["create, fabric handle request alone"] = timed(lambda: got.update(f=[
            drv.create(s, ask) for _, s in ranges]))
        for rc, h in got["f"]:
            if rc == 0:
                drv.release(h)
    row["create, no handle type"] = timed(lambda: got.update(h=plain_create(drv, ranges)))
    row["map"] = timed(lambda: [drv.map(a, s, h) for (a, s), h in zip(ranges, got["h"])])
    row["set access"] = timed(lambda: [drv.set_access(a, s) for a, s in ranges])
    row["unmap and release"] = timed(lambda: [drv.unmap_release(a, s, h) for (a, s), h in zip(ranges, got["h"])])
    return row


def call_times(device: int, count: int, size: int, ext=None, reps: int = 3, busy=None) -> dict:
    """The VMM calls over COUNT fresh ranges of SIZE bytes, best of REPS (seconds for all
    COUNT): the extension's create_and_map and unmap_and_release (when ``ext`` is given),
    the same from a new thread and, for each of ``busy`` (name: a function that queues
    copies and returns one that waits for them, QueuedCopies.start), while those copies
    run, as a wake's maps do; each
    driver call apart; and one set-access and one unmap call over back-to-back ranges
    against one call for each (span_pass). With the process's threads that used a CPU
    during the extension's first pass, and how many threads it has."""
    drv = Driver(device, cuda_enums(cuda_header()))
    size = -(-size // GRANULE) * GRANULE
    ranges = [(drv.reserve(size), size) for _ in range(count)]
    rdma = bool(drv.attribute("CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED"))
    fabric = bool(drv.attribute("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED"))
    out: dict = {"count": count, "size": size, "rdma_with_vmm": rdma, "fabric_supported": fabric,
                 "threads": threading.active_count(), "os_threads": len(os.listdir("/proc/self/task"))}
    try:
        reps_done = []
        for i in range(reps):
            row = {}
            if ext is not None:
                cpu, start = thread_cpu(), time.perf_counter()
                row["extension create_and_map"], row["extension unmap_and_release"] = extension_pass(ext, drv, ranges)
                if i == 0:
                    out["cpu_during_first_pass"] = busiest_threads(cpu, thread_cpu(), time.perf_counter() - start)
                row["extension create_and_map, new thread"] = _in_new_thread(ext, drv, ranges)
                for name, start in (busy or {}).items():
                    wait = start()
                    row[f"extension create_and_map, {name} running"] = extension_pass(ext, drv, ranges)[0]
                    out.setdefault("copies_still_running_after_the_maps", {}).setdefault(name, []).append(wait())
            row.update(driver_pass(drv, ranges, rdma, fabric))
            row.update(span_pass(drv, ranges, rdma, out))
            reps_done.append(row)
    finally:
        for addr, s in ranges:
            drv.free_range(addr, s)
    out["best_s"] = {k: min(r[k] for r in reps_done) for k in reps_done[0]}
    return out


class _Span:
    """Device memory at an address, for torch.as_tensor (the CUDA array interface, v2)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 2}


def back_to_back(ranges) -> list:
    """The longest run of ranges each starting where the one before it ends."""
    best, run = [], []
    for r in sorted(ranges):
        run = run + [r] if run and run[-1][0] + run[-1][1] == r[0] else [r]
        best = run if len(run) > len(best) else best
    return best


def span_pass(drv: Driver, ranges, rdma: bool, out: dict) -> dict:
    """Over the longest run of back-to-back ranges (each reserved apart, as the allocator
    reserves each allocation's), mapped each to its own memory: cuMemSetAccess and cuMemUnmap
    once for each range, then once for the whole run. Whether the driver takes one call
    over ranges reserved apart is recorded in ``out`` (CUresults: 0 = it does)."""
    run = back_to_back(ranges)
    out["back_to_back_run"] = len(run)
    if len(run) < 2:
        return {}
    start, size = run[0][0], run[-1][0] + run[-1][1] - run[0][0]
    posix = drv.prop("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR", rdma)

    def mapped() -> list[int]:
        handles = []
        for addr, n in run:
            rc, h = drv.create(n, posix)
            drv.check(rc, "cuMemCreate")
            drv.map(addr, n, h)
            handles.append(h)
        return handles

    row: dict = {}
    handles = mapped()
    row["set access, a call for each back-to-back range"] = timed(lambda: [drv.set_access(a, n) for a, n in run])
    row["unmap, a call for each back-to-back range"] = timed(lambda: [drv.check(drv.try_unmap(a, n), "cuMemUnmap")
                                                                       for a, n in run])
    for h in handles:
        drv.release(h)
    handles, rc = mapped(), {}
    row["set access, one call over the run"] = timed(lambda: rc.update(access=drv.try_set_access(start, size)))
    if rc["access"]:
        for a, n in run:
            drv.set_access(a, n)
    row["unmap, one call over the run"] = timed(lambda: rc.update(unmap=drv.try_unmap(start, size)))
    if rc["unmap"]:
        for a, n in run:
            drv.check(drv.try_unmap(a, n), "cuMemUnmap")
    for h in handles:
        drv.release(h)
    out["one_call_over_the_run_cuda_result"] = {"set access": rc["access"], "unmap": rc["unmap"]}
    return row


class QueuedCopies:
    """Host-to-device copies from pinned memory on a stream of their own, queued at once, as
    a wake's copies run while it maps: by the copy engine (cudaMemcpyAsync, as the wake
    copies) or by a kernel that reads the pinned memory through its device address (SMs
    reading over the link; no copy engine). ``torch`` is passed in: this module imports only
    the standard library."""

    BY = ("copy engine", "kernel")

    def __init__(self, torch, device: int, nbytes: int = 1 << 30, copies: int = 8, by: str = "copy engine") -> None:
        if by not in self.BY:
            raise ValueError(f"copies by {by!r}: one of {', '.join(self.BY)}")
        self.torch, self.copies, self.by = torch, copies, by
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream(device)
        # Pinned host memory has the same address on the device (unified addressing).
        self.host_on_device = torch.as_tensor(_Span(self.host.data_ptr(), nbytes),
                                              device=self.dev.device).view(torch.int64)

    def _copy_once(self) -> None:
        if self.by == "copy engine":
            self.dev.copy_(self.host, non_blocking=True)
        else:  # an elementwise kernel: each thread loads 16 bytes of host memory
            self.torch.bitwise_or(self.host_on_device, 0, out=self.dev.view(self.torch.int64))

    def gbps(self) -> float:
        """The copies' rate alone, in GB/s (10^9 bytes per second)."""
        cuda = self.torch.cuda
        begin, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        with cuda.stream(self.stream):
            self._copy_once()  # warm
            begin.record()
            for _ in range(self.copies):
                self._copy_once()
            end.record()
        end.synchronize()
        return self.copies * self.dev.numel() / (begin.elapsed_time(end) * 1e-3) / 1e9

    def start(self):
        """Queue the copies; returns a function that waits for them and says whether they
        were still running when it was called."""
        with self.torch.cuda.stream(self.stream):
            for _ in range(self.copies):
                self._copy_once()

        def wait() -> bool:
            running = not self.stream.query()
            self.stream.synchronize()
            return running
        return wait


def _in_new_thread(ext, drv: Driver, ranges) -> float:
    got: dict = {}

    def work():
        try:
            drv.in_thread()
            got["s"] = extension_pass(ext, drv, ranges)[0]
        except Exception as exc:  # noqa: BLE001  (raised again in the caller's thread)
            got["error"] = exc

    t = threading.Thread(target=work, name="sm12x-maps")
    t.start()
    t.join()
    if "error" in got:
        raise got["error"]
    return got["s"]
