"""Drive a built cumem_allocator extension against the fake libcuda (fake_libcuda.c).

Run in a fresh interpreter per scenario (the extension keeps global state):

    python cumem_scenarios.py FAKE_LIBCUDA EXTENSION SCENARIO

prints one JSON object with what happened. Entry points are called the way their
real callers do: my_malloc/my_free through ctypes as PyTorch's pluggable allocator
does, python_create_and_map/python_unmap_and_release as cumem.py does.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import sys

CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_ILLEGAL_ADDRESS = 700
SIZE = 1 << 20  # rounded up to the fake driver's 2 MiB granularity


class Harness:
    def __init__(self, libcuda_path: str, ext_path: str) -> None:
        # Loaded first and globally: the extension's DT_NEEDED libcuda.so.1 binds to it.
        self.cuda = ctypes.CDLL(libcuda_path, mode=ctypes.RTLD_GLOBAL)
        self.cuda.stub_fail_next.argtypes = [ctypes.c_char_p, ctypes.c_int]
        spec = importlib.util.spec_from_file_location("cumem_allocator", ext_path)
        self.ext = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.ext)
        lib = ctypes.CDLL(ext_path)
        self.my_malloc = lib.my_malloc
        self.my_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        self.my_malloc.restype = ctypes.c_void_p
        self.my_free = lib.my_free
        self.my_free.argtypes = [
            ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p
        ]
        self.my_free.restype = None
        self.handles: dict[int, tuple[int, int, int, int]] = {}
        self.released_by_allocator: set[int] = set()
        # The extension keeps borrowed references: hold the bound methods.
        self.callbacks = (self._malloc_callback, self._free_callback)
        self.ext.init_module(*self.callbacks)

    def _malloc_callback(self, handle: tuple[int, int, int, int]) -> None:
        self.handles[handle[2]] = handle

    def _free_callback(self, ptr: int) -> tuple[int, int, int, int]:
        handle = self.handles.pop(ptr)
        if ptr in self.released_by_allocator:  # as cumem.py answers for a merged run's member
            return (*handle[:3], 0)
        return handle

    def fail_next(self, fn: str, code: int) -> None:
        assert self.cuda.stub_fail_next(fn.encode(), code) == 0

    def malloc(self) -> int:
        return self.my_malloc(SIZE, 0, None) or 0

    def free(self, ptr: int) -> None:
        self.my_free(ptr, self.handles[ptr][1], 0, None)

    def call(self, fn, handle) -> str | None:
        """Run a Python entry point; return its error message, or None."""
        try:
            fn(*handle)
        except RuntimeError as exc:
            return str(exc)
        return None

    def counts(self) -> dict[str, int]:
        return {
            "handles": self.cuda.stub_live_handles(),
            "mappings": self.cuda.stub_live_mappings(),
            "reservations": self.cuda.stub_live_reservations(),
        }


def stale_after_free(h: Harness) -> dict:
    """A failing my_free (PyTorch path, can only print), then a healthy wake."""
    a, b = h.malloc(), h.malloc()
    hb = h.handles[b]
    assert h.call(h.ext.python_unmap_and_release, hb) is None  # b sleeps
    h.fail_next("cuMemUnmap", CUDA_ERROR_ILLEGAL_ADDRESS)
    h.free(a)
    before = h.counts()
    return {"wake_error": h.call(h.ext.python_create_and_map, hb),
            "before": before, "after": h.counts()}


def stale_after_malloc(h: Harness) -> dict:
    """A failing my_malloc (returns NULL to PyTorch), then a healthy wake."""
    b = h.malloc()
    hb = h.handles[b]
    assert h.call(h.ext.python_unmap_and_release, hb) is None
    h.fail_next("cuMemAddressReserve", CUDA_ERROR_OUT_OF_MEMORY)
    failed = h.malloc()
    return {"malloc_returned": failed,
            "wake_error": h.call(h.ext.python_create_and_map, hb),
            "after": h.counts()}


def own_error(h: Harness) -> dict:
    """After a stale failure on the free path, a wake that fails for its own
    reason must report its own error."""
    a, b = h.malloc(), h.malloc()
    hb = h.handles[b]
    assert h.call(h.ext.python_unmap_and_release, hb) is None
    h.fail_next("cuMemUnmap", CUDA_ERROR_ILLEGAL_ADDRESS)
    h.free(a)
    h.fail_next("cuMemMap", CUDA_ERROR_OUT_OF_MEMORY)
    return {"wake_error": h.call(h.ext.python_create_and_map, hb)}


def _wake_fails_at(h: Harness, fn: str) -> dict:
    b = h.malloc()
    hb = h.handles[b]
    assert h.call(h.ext.python_unmap_and_release, hb) is None
    asleep = h.counts()
    h.fail_next(fn, CUDA_ERROR_OUT_OF_MEMORY)
    error = h.call(h.ext.python_create_and_map, hb)
    after_failure = h.counts()
    retry_error = h.call(h.ext.python_create_and_map, hb)
    return {"asleep": asleep, "error": error, "after_failure": after_failure,
            "retry_error": retry_error, "after_retry": h.counts()}


def wake_map_fails(h: Harness) -> dict:
    return _wake_fails_at(h, "cuMemMap")


def wake_set_access_fails(h: Harness) -> dict:
    return _wake_fails_at(h, "cuMemSetAccess")


def malloc_map_fails(h: Harness) -> dict:
    h.fail_next("cuMemMap", CUDA_ERROR_OUT_OF_MEMORY)
    failed = h.malloc()
    return {"malloc_returned": failed, "after": h.counts(), "registered": len(h.handles)}


def wake_awake_allocation(h: Harness) -> dict:
    """create_and_map on an allocation that is still mapped (what a second wake_up
    asks of the extension), then a sleep and a wake of it."""
    a = h.malloc()
    ha = h.handles[a]
    error = h.call(h.ext.python_create_and_map, ha)
    after_failure = h.counts()
    sleep_error = h.call(h.ext.python_unmap_and_release, ha)
    asleep = h.counts()
    wake_error = h.call(h.ext.python_create_and_map, ha)
    return {"error": error, "after_failure": after_failure, "sleep_error": sleep_error,
            "asleep": asleep, "wake_error": wake_error, "awake": h.counts()}


def _creates(h: Harness) -> dict[str, int]:
    return {"fabric": h.cuda.stub_creates(0), "posix_fd": h.cuda.stub_creates(1), "other": h.cuda.stub_creates(2)}


def fabric_refused(h: Harness) -> dict:
    """A card that advertises fabric handles on a node that refuses them: three
    allocations made, then put to sleep and woken (create_and_map) twice."""
    h.cuda.stub_fabric(1, 1)
    ptrs = [h.malloc() for _ in range(3)]
    made = _creates(h)
    errors = []
    for _ in range(2):
        errors += [h.call(h.ext.python_unmap_and_release, h.handles[p]) for p in ptrs]
        errors += [h.call(h.ext.python_create_and_map, h.handles[p]) for p in ptrs]
    return {"made": made, "woken_twice": _creates(h), "errors": [e for e in errors if e], "counts": h.counts()}


def fabric_granted(h: Harness) -> dict:
    """A node where fabric handles are granted: every allocation asks for one."""
    h.cuda.stub_fabric(1, 0)
    ptrs = [h.malloc() for _ in range(3)]
    errors = [h.call(h.ext.python_unmap_and_release, h.handles[p]) for p in ptrs]
    errors += [h.call(h.ext.python_create_and_map, h.handles[p]) for p in ptrs]
    return {"creates": _creates(h), "errors": [e for e in errors if e]}


def healthy_round_trip(h: Harness) -> dict:
    a = h.malloc()
    ha = h.handles[a]
    allocated = h.counts()
    sleep_error = h.call(h.ext.python_unmap_and_release, ha)
    asleep = h.counts()
    wake_error = h.call(h.ext.python_create_and_map, ha)
    awake = h.counts()
    h.free(a)
    return {"allocated": allocated, "sleep_error": sleep_error, "asleep": asleep,
            "wake_error": wake_error, "awake": awake, "freed": h.counts()}


def merged_run(h: Harness) -> dict:
    """cumem-run-reservations, run with VLLM_CUMEM_MERGE_RUNS=1: three allocations, carved
    back to back from one region, put to sleep, woken as one run (one map over their three
    ranges); the middle one freed while the run is mapped, its release left to the
    allocator (a slot of 0); the run unmapped; the middle range given back."""
    ptrs = [h.malloc() for _ in range(3)]
    size = h.handles[ptrs[0]][1]
    out: dict = {"back_to_back": [b - a for a, b in zip(ptrs, ptrs[1:])] == [size, size]}
    out["sleep_errors"] = [e for e in (h.call(h.ext.python_unmap_and_release, h.handles[p]) for p in ptrs) if e]
    slot = ctypes.c_ulonglong(0)
    run = (0, 3 * size, ptrs[0], ctypes.addressof(slot))
    out["map_error"] = h.call(h.ext.python_create_and_map, run)
    out["mapped"] = h.counts()
    middle = h.handles[ptrs[1]]
    h.released_by_allocator.add(ptrs[1])
    h.free(ptrs[1])
    out["after_free"] = h.counts()
    out["unmap_error"] = h.call(h.ext.python_unmap_and_release, run)
    out["free_range_error"] = h.call(h.ext.python_free_reserved, middle)
    out["released"] = h.counts()
    for p in (ptrs[0], ptrs[2]):  # the others, woken alone and freed as usual
        h.call(h.ext.python_create_and_map, h.handles[p])
        h.free(p)
    out["freed"] = h.counts()
    return out


SCENARIOS = {f.__name__: f for f in (
    stale_after_free, stale_after_malloc, own_error, wake_map_fails,
    wake_set_access_fails, malloc_map_fails, wake_awake_allocation, healthy_round_trip,
    fabric_refused, fabric_granted, merged_run,
)}

if __name__ == "__main__":
    libcuda_path, ext_path, scenario = sys.argv[1:4]
    result = SCENARIOS[scenario](Harness(libcuda_path, ext_path))
    print(json.dumps(result))
