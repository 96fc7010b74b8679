"""The scenarios, run in the child against a tree's own cumem.py on a real GPU.

Each takes (torch, the tree's cumem module, the planned sizes) and returns
``outcome(kind, reason, **figures)``. torch is passed in, never imported here, so
the pure parts (layouts, seeds) are testable without it.

Data is checked exactly: every pool tensor is int64 and holds ``seed, seed+1, ...``
(written by ``torch.arange(..., out=t)``), and a check compares it, a chunk at a
time, with the same sequence built again.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import random
import sys
import tempfile
import time
from contextlib import contextmanager

MiB, GiB = 1 << 20, 1 << 30
GRANULARITY = 2 * MiB
CHUNK = 1 << 25  # int64 elements compared at a time (256 MiB)
STRESS_TAGS = (  # (tag, share of the bytes, when it is offloaded rather than discarded)
    ("st-weights", 0.40, "always"),
    ("st-kv", 0.30, "never"),
    ("st-adapter", 0.15, "even cycles"),
    ("st-draft", 0.15, "at random"),
)


def outcome(kind: str, reason: str, **figures) -> dict:
    return {"outcome": kind, "reason": reason, "figures": figures}


def first_line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def brief(text: str, limit: int = 110) -> str:
    """One error for a table cell: its first line, cut at ``limit`` characters."""
    text = first_line(text)
    return text if len(text) <= limit else text[: limit - 3].rstrip() + "..."


# --- helpers on the GPU -----------------------------------------------------------------


def fill(torch, t, seed: int) -> None:
    torch.arange(seed, seed + t.numel(), dtype=torch.int64, device=t.device, out=t)


def intact(torch, t, seed: int) -> bool:
    n = t.numel()
    for start in range(0, n, CHUNK):
        stop = min(n, start + CHUNK)
        expect = torch.arange(seed + start, seed + stop, dtype=torch.int64, device=t.device)
        if not torch.equal(t[start:stop], expect):
            return False
    return True


def spin_cycles(torch, ms: float) -> int:
    """Clock cycles for ``torch.cuda._sleep`` to keep the GPU busy about ``ms``."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 20_000_000
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return max(1000, int(n / max(start.elapsed_time(end), 1e-3) * ms))


def free_bytes(torch) -> int:
    return torch.cuda.mem_get_info()[0]


def timed(torch, fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


@contextmanager
def captured_stderr():
    """Capture what is written to fd 2 (the extension prints its CUDA errors with
    std::cerr), then pass it on."""
    sys.stderr.flush()
    saved = os.dup(2)
    box: list[str] = []
    with tempfile.TemporaryFile() as f:
        os.dup2(f.fileno(), 2)
        try:
            yield box
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            f.seek(0)
            text = f.read().decode(errors="replace")
            sys.stderr.write(text)
            box.append(text)


def driver_version() -> str:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        buf = ctypes.create_string_buffer(96)
        if nvml.nvmlInit_v2() == 0 and nvml.nvmlSystemGetDriverVersion(buf, 96) == 0:
            return buf.value.decode()
    except (OSError, AttributeError):
        pass
    return "unknown"


# --- the probe ---------------------------------------------------------------------------


def probe(torch, loaded) -> dict:
    import vllm.platforms

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info()
    return outcome(
        "pass",
        "cumem is available",
        gpu=props.name,
        capability=f"{props.major}.{props.minor}",
        driver=driver_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=sys.version.split()[0],
        free_bytes=free,
        total_bytes=total,
        cumem_py=loaded.cumem.__file__,
        extension=loaded.extension,
        vllm_file=loaded.vllm_file,
        placeholders=loaded.placeholders,
        # A source tree has no installed metadata, so vLLM's CUDA platform plugin
        # (which reads the installed version) does not activate; cumem.py asks the
        # platform only is_rocm() and is_pin_memory_available().
        platform=type(vllm.platforms.current_platform).__name__,
        pin_memory=bool(loaded.cumem.is_pin_memory_available()),
    )


# --- 1 in-flight free ----------------------------------------------------------------------


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
    pool, allocator = alloc.allocator_and_pools.pop("selftest-stale-drop")
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


# --- 3 partial wake --------------------------------------------------------------------------


def partial_wake(torch, cumem, p: dict) -> dict:
    alloc = cumem.CuMemAllocator.get_instance()
    count, each = p["partial_count"], p["partial_each"]
    with alloc.use_memory_pool("selftest-partial"):
        ts = [torch.empty(each // 8, dtype=torch.int64, device="cuda") for _ in range(count)]
    for i, t in enumerate(ts):
        fill(torch, t, (i + 1) << 40)
    torch.cuda.synchronize()
    alloc.sleep(offload_tags=("selftest-partial",))
    # Take the memory so that two allocations fit and the third does not.
    hog = torch.empty(free_bytes(torch) - (2 * each + each // 2), dtype=torch.uint8, device="cuda")
    free_before = free_bytes(torch)
    try:
        alloc.wake_up()
    except RuntimeError as exc:
        first_error = first_line(exc)
    else:
        return outcome("error", f"wake_up succeeded with {free_before / MiB:.0f} MiB free for "
                                f"{count} x {each / MiB:.0f} MiB: no partial wake to test")
    kept = free_before - free_bytes(torch)
    figures = {"first_error": first_error, "kept_mapped_bytes": kept, "allocations": count, "each_bytes": each}
    del hog
    torch.cuda.empty_cache()
    leak = f"; the failed wake_up kept {kept / MiB:.0f} MiB mapped" if kept > GRANULARITY else ""
    try:
        alloc.wake_up()
    except RuntimeError as exc:
        return outcome("fail", f"the retried wake_up failed: {first_line(exc)}{leak}", **figures)
    lost = [i for i, t in enumerate(ts) if not intact(torch, t, (i + 1) << 40)]
    if lost:
        return outcome("fail", f"the retried wake_up succeeded but allocations {lost} lost their bytes{leak}", **figures)
    if leak:
        return outcome("fail", f"the retry succeeded, but the failed wake_up had kept {kept / MiB:.0f} MiB "
                               "mapped that no other allocation could use", **figures)
    return outcome("pass", f"the failed wake_up ({brief(first_error)}) left free memory as before it "
                           f"({kept / MiB:+.0f} MiB); the retry restored {count} x {each / MiB:.0f} MiB intact",
                   **figures)


# --- 4 stress -------------------------------------------------------------------------------


def stress_layout(total_bytes: int, seed: int) -> list[tuple[str, int]]:
    """(tag, int64 elements) for the stress pools: each tag's share of the bytes in
    tensors of log-uniform sizes from 4 KiB to a third of the share."""
    rng = random.Random(seed)
    layout = []
    for tag, share, _ in STRESS_TAGS:
        budget = int(total_bytes * share) // 8
        biggest = max(budget // 3, 1024)
        while budget > 0:
            n = min(budget, int(math.exp(rng.uniform(math.log(512), math.log(biggest)))))
            layout.append((tag, n))
            budget -= n
    return layout


def offloaded(cycle: int, rng: random.Random) -> tuple[str, ...]:
    """The tags a stress cycle offloads; the others are discarded."""
    chosen = []
    for tag, _, when in STRESS_TAGS:
        coin = rng.random() < 0.5  # drawn every cycle, so the sequence does not depend on the rules
        if when == "always" or (when == "even cycles" and cycle % 2 == 0) or (when == "at random" and coin):
            chosen.append(tag)
    return tuple(chosen)


def seed_for(cycle: int, index: int) -> int:
    return (cycle << 40) + (index << 30)


def _warm_up(torch, alloc) -> None:
    """Load every kernel and driver path the cycles use, so that the baseline
    taken after it does not move by their first use."""
    w = torch.empty(1 << 18, dtype=torch.int64, device="cuda")
    fill(torch, w, 5)
    intact(torch, w, 5)
    torch.cuda._sleep(1000)
    w.fill_(1)
    del w
    with alloc.use_memory_pool("st-warmup"):
        w = torch.empty(1 << 18, dtype=torch.int64, device="cuda")
        fill(torch, w, 5)
        del w
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def stress(torch, cumem, p: dict) -> dict:
    alloc = cumem.CuMemAllocator.get_instance()
    cycles, seed = p["stress_cycles"], p.get("seed", 1)
    spin = spin_cycles(torch, 1.0)  # about 1 ms of GPU work ahead of each cycle's writes
    _warm_up(torch, alloc)
    baseline = free_bytes(torch)
    layout = stress_layout(p["stress_bytes"], seed)
    tensors = []
    for tag, _, _ in STRESS_TAGS:
        with alloc.use_memory_pool(tag):
            tensors += [(tag, torch.empty(n, dtype=torch.int64, device="cuda")) for t, n in layout if t == tag]
    rng = random.Random(seed)
    max_drift, sweeps, cycle = 0, 0, 0
    start = time.perf_counter()
    figures = {"tensors": len(tensors), "bytes": p["stress_bytes"], "tags": [t for t, _, _ in STRESS_TAGS]}
    try:
        for cycle in range(1, cycles + 1):
            offload = offloaded(cycle, rng)
            torch.cuda._sleep(spin)
            for i, (_, t) in enumerate(tensors):
                fill(torch, t, seed_for(cycle, i))  # queued behind the spin: in flight at sleep()
            alloc.sleep(offload_tags=offload)
            drift = baseline - free_bytes(torch)
            max_drift = max(max_drift, drift)
            if drift > GRANULARITY:
                return outcome("fail", f"cycle {cycle}: asleep, device memory is {drift / MiB:.1f} MiB above "
                                       f"its baseline", cycle=cycle, max_drift_bytes=max_drift, **figures)
            alloc.wake_up()
            for i, (tag, t) in enumerate(tensors):
                if tag in offload and not intact(torch, t, seed_for(cycle, i)):
                    return outcome("fail", f"cycle {cycle}: tensor {i} of {tag} lost its bytes", cycle=cycle, **figures)
            if cycle % 10 == 0:  # the context-exit sweep with a write in flight
                with alloc.use_memory_pool(f"st-scratch-{cycle}"):
                    s = torch.empty(rng.randrange(1, 16) * MiB // 8, dtype=torch.int64, device="cuda")
                    torch.cuda._sleep(spin)
                    s.fill_(cycle)
                    del s
                sweeps += 1
        torch.cuda.synchronize()
    except RuntimeError as exc:
        return outcome("fail", f"cycle {cycle}: {first_line(exc)}", cycle=cycle, **figures)
    seconds = time.perf_counter() - start
    figures.update(cycles=cycles, sweeps=sweeps, max_drift_bytes=max_drift, cycles_per_s=cycles / seconds)
    return outcome("pass", f"{cycles} cycles ({cycles / seconds:.0f}/s), {len(tensors)} tensors in "
                           f"{len(STRESS_TAGS)} tags, {p['stress_bytes'] // MiB} MiB, {sweeps} in-flight sweeps: "
                           f"data exact every cycle, asleep within {max(max_drift, 0) / MiB:.1f} MiB of the baseline",
                   **figures)


# --- 5 speed -----------------------------------------------------------------------------------


def speed(torch, cumem, p: dict) -> dict:
    alloc = cumem.CuMemAllocator.get_instance()
    total, chunk, reps = p["speed_bytes"], p["speed_chunk"], p.get("speed_reps", 3)
    target = p.get("speed_target", 0.9)
    k = total // chunk
    with alloc.use_memory_pool("selftest-speed"):
        ts = [torch.empty(chunk // 8, dtype=torch.int64, device="cuda") for _ in range(k)]
    for i, t in enumerate(ts):
        fill(torch, t, i << 40)

    def sleep() -> None:
        alloc.sleep(offload_tags=("selftest-speed",))

    first = timed(torch, sleep)  # pins the host memory for the backups
    wakes, sleeps = [], []
    for _ in range(reps):
        wakes.append(timed(torch, alloc.wake_up))
        sleeps.append(timed(torch, sleep))
    wakes.append(timed(torch, alloc.wake_up))
    if not all(intact(torch, t, i << 40) for i, t in enumerate(ts)):
        return outcome("fail", "data did not round-trip through sleep and wake")
    # The ceiling: the same bytes in the same chunks, pinned host <-> device, now.
    hosts = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(k)]
    views = [t.view(torch.uint8) for t in ts]
    d2h = min(timed(torch, lambda: [h.copy_(v) for h, v in zip(hosts, views)]) for _ in range(reps))
    h2d = min(timed(torch, lambda: [v.copy_(h) for h, v in zip(hosts, views)]) for _ in range(reps))

    def rate(seconds: float) -> float:
        return total / seconds / 1e9

    f = {
        "bytes": total, "chunk_bytes": chunk,
        "sleep_gbps": rate(min(sleeps)), "wake_gbps": rate(min(wakes)),
        "d2h_ceiling_gbps": rate(d2h), "h2d_ceiling_gbps": rate(h2d),
        "first_sleep_s": first, "first_sleep_gbps": rate(first), "steady_sleep_s": min(sleeps),
        "first_sleep_extra_s": first - min(sleeps),
        "sleeps_s": sleeps, "wakes_s": wakes,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    f["wake_ratio"] = f["wake_gbps"] / f["h2d_ceiling_gbps"]
    f["sleep_ratio"] = f["sleep_gbps"] / f["d2h_ceiling_gbps"]
    words = (f"{total / GiB:.1f} GiB: wake {f['wake_gbps']:.1f} GB/s = {f['wake_ratio']:.0%} of H2D "
             f"{f['h2d_ceiling_gbps']:.1f}; sleep {f['sleep_gbps']:.1f} GB/s = {f['sleep_ratio']:.0%} of D2H "
             f"{f['d2h_ceiling_gbps']:.1f}; first sleep {first:.2f} s ({f['first_sleep_gbps']:.1f} GB/s)")
    if f["wake_ratio"] < target or f["sleep_ratio"] < target:
        return outcome("fail", f"{words}: below {target:.0%} of the ceiling", **f)
    return outcome("pass", words, **f)


RUNNERS = {
    "inflight-free": inflight_free,
    "stale-error": stale_error,
    "partial-wake": partial_wake,
    "stress": stress,
    "speed": speed,
}
