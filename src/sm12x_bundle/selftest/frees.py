"""Scenarios 1 and 2: frees that go wrong. A free while a write into the memory is still
queued (the context-exit sweep, then sleep()), and a free that fails on PyTorch's path
followed by a healthy wake_up."""

from __future__ import annotations

import ctypes
import gc
import time

from .measure import MiB, captured_stderr, fill, first_line, intact, outcome, spin_cycles

def inflight_free(torch, cumem, p: dict) -> dict:
    alloc = cumem.CuMemAllocator.get_instance()
    n = p["inflight_bytes"] // 8
    ms = p.get("spin_ms", 200.0)
    spin = spin_cycles(torch, ms)
    f: dict = {"spin_ms": ms, "spin_cycles": spin}
    try:
        with alloc.use_memory_pool("selftest-inflight-sweep"):
            x = torch.empty(n, dtype=torch.int64, device="cuda")
            x_ptr = x.data_ptr()
            torch.cuda._sleep(spin)
            x.fill_(7)  # queued behind the spin
            del x  # back to the pool; the context-exit sweep unmaps the segment
            queued = time.perf_counter()
        f["sweep_ms_after_queueing"] = (time.perf_counter() - queued) * 1e3
        f["sweep_released_the_segment"] = x_ptr not in alloc.pointer_to_data
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return outcome("fail", f"the context-exit sweep unmapped memory a queued write still used: {first_line(exc)}",
                       step="sweep", **f)
    with alloc.use_memory_pool("selftest-inflight-sleep"):
        y = torch.empty(n, dtype=torch.int64, device="cuda")
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:  # a fault of the sweep, reported late
        return outcome("fail", f"a write queued before the context-exit sweep faulted: {first_line(exc)}",
                       step="after sweep", **f)
    try:
        torch.cuda._sleep(spin)
        y.fill_(7)
        alloc.sleep(offload_tags=())  # discards y while the write is queued
        torch.cuda.synchronize()
        alloc.wake_up()
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return outcome("fail", f"sleep() unmapped memory a queued write still used: {first_line(exc)}",
                       step="sleep", **f)
    swept = "" if f["sweep_released_the_segment"] else " (the sweep did not release the segment)"
    return outcome("pass", f"no CUDA error after the context-exit sweep{swept} nor after sleep(), each with a "
                           f"write queued behind {ms:.0f} ms of GPU work", **f)


# --- 2 stale error ---------------------------------------------------------------------------


def kept_pool(kept) -> tuple:
    """(MemPool, allocator) of a tag's one memory pool: 0.21.0 keeps the pair per tag,
    0.33.0 a list of pairs (one per use_memory_pool of the tag)."""
    return kept[0] if isinstance(kept, list) else kept


def stale_error(torch, cumem, p: dict) -> dict:
    alloc = cumem.CuMemAllocator.get_instance()
    n = p["stale_bytes"] // 8
    with alloc.use_memory_pool("selftest-stale-keep"):
        keep = torch.empty(n, dtype=torch.int64, device="cuda")
    with alloc.use_memory_pool("selftest-stale-drop"):
        drop = torch.empty(n, dtype=torch.int64, device="cuda")
    fill(torch, keep, 1 << 40)
    torch.cuda.synchronize()
    alloc.sleep(offload_tags=("selftest-stale-keep",))
    drop_ptr = drop.data_ptr()
    del drop
    # Drop the pool while asleep: PyTorch releases its cached segment through the
    # extension's my_free, whose unmap fails (the segment is not mapped).
    pool, allocator = kept_pool(alloc.allocator_and_pools.pop("selftest-stale-drop"))
    with captured_stderr() as printed:
        del pool
        gc.collect()
        torch.cuda.empty_cache()
    printed_text, path = printed[0], "pool dropped while asleep"
    if drop_ptr in alloc.pointer_to_data:
        # This PyTorch kept the pool's segment: free it the way its pluggable
        # allocator does, through the extension's my_free.
        lib = ctypes.CDLL(cumem.lib_name)
        lib.my_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        lib.my_free.restype = None
        with captured_stderr() as printed:
            lib.my_free(drop_ptr, alloc.pointer_to_data[drop_ptr].handle[1], torch.cuda.current_device(), None)
        printed_text, path = printed[0], "my_free called as PyTorch's pluggable allocator calls it"
    if drop_ptr in alloc.pointer_to_data:
        return outcome("error", "the segment was not freed: the PyTorch free path was not reached")
    failed = [line for line in printed_text.splitlines() if "CUDA Error" in line]
    if not failed:
        return outcome("error", "the free on the PyTorch path did not fail: nothing to go stale")
    try:
        alloc.wake_up()
    except RuntimeError as exc:
        return outcome("fail", f"wake_up raised '{first_line(exc)}', the error of the earlier failed free "
                               "(nothing is wrong with the wake)", failed_free=failed[0], path=path)
    finally:
        del allocator
    if not intact(torch, keep, 1 << 40):
        return outcome("fail", "wake_up succeeded but the offloaded bytes did not round-trip",
                       failed_free=failed[0], path=path)
    return outcome("pass", f"the free failed on the PyTorch path ({path}: {failed[0]}); the next wake_up "
                           f"succeeded and {p['stale_bytes'] // MiB} MiB round-tripped", failed_free=failed[0], path=path)
