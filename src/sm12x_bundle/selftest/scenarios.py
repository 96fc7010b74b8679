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
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import weakref
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


# Where the child writes its result (set by child.py): a scenario about to do what may
# kill the process (a use of unmapped memory, a pristine allocator out of memory)
# writes the outcome that such a death means there first, so that the parent reads it.
RESULT_PATH: str | None = None


# Callables handed to the extension, which keeps only borrowed references to them.
KEEP_ALIVE: list = []


def checkpoint(doc: dict) -> None:
    if RESULT_PATH is None:
        return
    tmp = RESULT_PATH + ".tmp"
    with open(tmp, "w") as f:
        json.dump({**doc, "provisional": True}, f, indent=2, sort_keys=True)
    os.replace(tmp, RESULT_PATH)


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


def pin_memory(cumem) -> bool:
    """Whether the tree's cumem.py pins its backups: 0.21.0 asks is_pin_memory_available(),
    0.33.0 reads PIN_MEMORY once at import."""
    if hasattr(cumem, "PIN_MEMORY"):
        return bool(cumem.PIN_MEMORY)
    return bool(cumem.is_pin_memory_available())


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
        pin_memory=pin_memory(loaded.cumem),
        vllm_version=getattr(sys.modules["vllm"], "__version__", None),
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

WAKE_FRESH_TARGET = 0.95  # of the H2D ceiling into freshly created memory (issue 13)


def speed_shortfalls(f: dict, target: float) -> list[str]:
    """What keeps the speed scenario from passing. A wake copies into memory it has just
    created, which the driver prepares first: it is held to the fresh-memory ceiling
    (issue 13), a sleep to the D2H one."""
    short = []
    if f["sleep_ratio"] < target:
        short.append(f"sleep below {target:.0%} of D2H")
    if f["wake_fresh_ratio"] < WAKE_FRESH_TARGET:
        short.append(f"wake below {WAKE_FRESH_TARGET:.0%} of fresh")
    return short


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
    pause = p.get("wake_after_s", 0.0)  # the driver may still be busy with what sleep() released

    def wake() -> float:
        time.sleep(pause)
        return timed(torch, alloc.wake_up)

    for _ in range(reps):
        wakes.append(wake())
        sleeps.append(timed(torch, sleep))
    wakes.append(wake())
    if not all(intact(torch, t, i << 40) for i, t in enumerate(ts)):
        return outcome("fail", "data did not round-trip through sleep and wake")
    # The ceiling: the same bytes in the same chunks, pinned host <-> device, now.
    hosts = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(k)]
    views = [t.view(torch.uint8) for t in ts]
    d2h = min(timed(torch, lambda: [h.copy_(v) for h, v in zip(hosts, views)]) for _ in range(reps))
    h2d = min(timed(torch, lambda: [v.copy_(h) for h, v in zip(hosts, views)]) for _ in range(reps))
    # The second ceiling: the first copy into memory the allocator has just created,
    # which is what a wake copies into (the driver still works on new memory then).
    from .speed import fresh_copy

    fresh = min(fresh_copy(torch, alloc, hosts, chunk, f"selftest-speed-fresh-{i}") for i in range(reps))

    def rate(seconds: float) -> float:
        return total / seconds / 1e9

    f = {
        "bytes": total, "chunk_bytes": chunk,
        "sleep_gbps": rate(min(sleeps)), "wake_gbps": rate(min(wakes)),
        "d2h_ceiling_gbps": rate(d2h), "h2d_ceiling_gbps": rate(h2d), "fresh_h2d_ceiling_gbps": rate(fresh),
        "first_sleep_s": first, "first_sleep_gbps": rate(first), "steady_sleep_s": min(sleeps),
        "first_sleep_extra_s": first - min(sleeps),
        "sleeps_s": sleeps, "wakes_s": wakes, "wake_after_s": pause,
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    f["wake_ratio"] = f["wake_gbps"] / f["h2d_ceiling_gbps"]
    f["wake_fresh_ratio"] = f["wake_gbps"] / f["fresh_h2d_ceiling_gbps"]
    f["sleep_ratio"] = f["sleep_gbps"] / f["d2h_ceiling_gbps"]
    words = (f"{total / GiB:.1f} GiB: wake {f['wake_gbps']:.1f} GB/s = {f['wake_ratio']:.0%} of H2D "
             f"{f['h2d_ceiling_gbps']:.1f}, {f['wake_fresh_ratio']:.0%} of fresh {f['fresh_h2d_ceiling_gbps']:.1f}; "
             f"sleep {f['sleep_gbps']:.1f} GB/s = {f['sleep_ratio']:.0%} of D2H {f['d2h_ceiling_gbps']:.1f}; "
             f"first sleep {first:.2f} s ({f['first_sleep_gbps']:.1f} GB/s)")
    short = speed_shortfalls(f, target)
    if short:
        return outcome("fail", f"{words}: {' and '.join(short)}", **f)
    return outcome("pass", words, **f)


# --- fault injection, without editing the code under test ------------------------------------


class HostAllocationFails:
    """Stands in for ``torch`` in the tree's cumem.py: its k-th CPU ``torch.empty`` (the
    pinned backup that sleep() takes) raises as a pinned host allocation does when host
    memory runs out. Keeps a weak reference to every backup, to tell when all are gone."""

    def __init__(self, torch, k: int | None = None) -> None:
        self.torch, self.k, self.calls, self.made = torch, k, 0, []

    def __getattr__(self, name):
        return getattr(self.torch, name)

    def empty(self, *args, **kwargs):
        if kwargs.get("device") != "cpu":
            return self.torch.empty(*args, **kwargs)
        self.calls += 1
        if self.k is not None and self.calls == self.k:
            raise RuntimeError(f"injected: pinned host allocation {self.k} failed (out of memory)")
        backup = self.torch.empty(*args, **kwargs)
        self.made.append(weakref.ref(backup))
        return backup

    def alive(self) -> int:
        """Backups still held (collected first)."""
        gc.collect()
        self.made = [r for r in self.made if r() is not None]
        return len(self.made)


@contextmanager
def failing_host_allocation(torch, cumem, k: int | None):
    host = HostAllocationFails(torch, k)
    cumem.torch = host
    try:
        yield host
    finally:
        cumem.torch = torch


class MapFails:
    """Stands in for cumem.py's create_and_map: the k-th call raises as a map out of
    memory does, before it creates anything."""

    def __init__(self, real, k: int) -> None:
        self.real, self.k, self.calls = real, k, 0

    def __call__(self, handle) -> None:
        self.calls += 1
        if self.calls == self.k:
            raise RuntimeError(f"injected: map {self.k} failed (out of memory)")
        self.real(handle)


@contextmanager
def failing_map(cumem, k: int):
    real = cumem.create_and_map
    cumem.create_and_map = MapFails(real, k)
    try:
        yield
    finally:
        cumem.create_and_map = real


def pinned_stats(torch) -> dict:
    """PyTorch's pinned host allocator's byte counts and cudaHostAlloc/free counts, for
    the record: a released backup goes back to its cache, so they tell what was reused."""
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return {}
    return {k: int(v) for k, v in stats.items() if k.endswith("bytes.current") or k.startswith("num_host")}


def delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0) for k in after}


def all_intact(torch, pairs) -> bool:
    """intact() for many (tensor, seed) pairs with one synchronize."""
    checks = [(t == torch.arange(seed, seed + t.numel(), dtype=torch.int64, device=t.device)).all()
              for t, seed in pairs]
    return bool(torch.stack(checks).all().item()) if checks else True


# --- 6 double wake (a regression guard) ---------------------------------------------------------


def double_wake(torch, cumem, p: dict) -> dict:
    alloc = cumem.CuMemAllocator.get_instance()
    n = p["guard_bytes"] // 8
    tags = ("selftest-double-weights", "selftest-double-kv")
    ts = []
    for tag in tags:
        with alloc.use_memory_pool(tag):
            ts.append(torch.empty(n, dtype=torch.int64, device="cuda"))
    fill(torch, ts[0], 3 << 40)
    torch.cuda.synchronize()
    alloc.sleep(offload_tags=tags[:1])
    alloc.wake_up(tags=[tags[0]])  # tag subsets, weights first
    alloc.wake_up(tags=[tags[1]])
    f: dict = {"bytes": 2 * p["guard_bytes"]}
    free_awake = free_bytes(torch)
    try:
        alloc.wake_up()  # everything is awake
        f["second_wake"] = "returned"
    except RuntimeError as exc:
        f["second_wake"] = brief(exc)
    # What a second wake asks of the extension: map an allocation that is mapped.
    weights = next(d for d in alloc.pointer_to_data.values() if d.tag == tags[0])
    try:
        cumem.create_and_map(weights.handle)
        f["map_of_mapped"] = "returned"
    except RuntimeError as exc:
        f["map_of_mapped"] = brief(exc)
    try:
        alloc.sleep(offload_tags=tags[:1])
        f["sleep_freed_bytes"] = free_bytes(torch) - free_awake
        alloc.wake_up()
    except RuntimeError as exc:
        return outcome("fail", f"after a second wake_up ({f['second_wake']}) and a map of a mapped allocation "
                               f"({f['map_of_mapped']}), the allocator broke: {first_line(exc)}", **f)
    if not intact(torch, ts[0], 3 << 40):
        return outcome("fail", "after a second wake_up, sleep and wake lost the offloaded bytes", **f)
    leaked = f["bytes"] - f["sleep_freed_bytes"]
    f["leaked_bytes"] = leaked
    leak = f"; sleep freed {leaked / MiB:.0f} MiB less than it holds (a physical handle leaked)" if leaked > GRANULARITY else ""
    return outcome("pass", f"second wake_up: {f['second_wake']}; map of a mapped allocation: {f['map_of_mapped']}; "
                           f"then sleep and wake round-tripped {p['guard_bytes'] // MiB} MiB intact{leak}", **f)


# --- 7 sleep failing part-way ------------------------------------------------------------------------


def failing_sleep(torch, cumem, p: dict) -> dict:
    alloc = cumem.CuMemAllocator.get_instance()
    count, each, k = p["sleep_count"], p["sleep_each"], p["sleep_fail_at"]
    tag = "selftest-sleep-fails"
    with alloc.use_memory_pool(tag):
        ts = [torch.empty(each // 8, dtype=torch.int64, device="cuda") for _ in range(count)]
    for i, t in enumerate(ts):
        fill(torch, t, (i + 7) << 40)
    torch.cuda.synchronize()
    pinned_before = pinned_stats(torch)
    with failing_host_allocation(torch, cumem, k) as host:
        try:
            alloc.sleep(offload_tags=(tag,))
        except RuntimeError as exc:
            error = first_line(exc)
        else:
            return outcome("error", f"sleep() succeeded: the injected failure of backup {k} was not reached")
    f = {"allocations": count, "each_bytes": each, "failed_backup": k, "error": error}
    what = f"sleep() failed at backup {k} of {count} ({brief(error, 90)})"
    checkpoint(outcome("fail", f"{what}; the process died when the tensors were next used", **f))
    try:
        lost = [i for i, t in enumerate(ts) if not intact(torch, t, (i + 7) << 40)]
    except RuntimeError as exc:
        return outcome("fail", f"{what}; the next use of the tensors faulted: {first_line(exc)}", **f)
    if lost:
        return outcome("fail", f"{what}; allocations {lost} lost their bytes", **f)
    f["backups_kept"] = host.alive()  # every backup the tree's cumem.py made went through `host`
    f["pinned_after_failed_sleep"] = delta(pinned_before, pinned_stats(torch))
    if f["backups_kept"]:
        return outcome("fail", f"{what}; it kept {f['backups_kept']} backups", **f)
    try:
        alloc.sleep(offload_tags=(tag,))
        f["pinned_after_retried_sleep"] = delta(pinned_before, pinned_stats(torch))
        alloc.wake_up()
    except RuntimeError as exc:
        return outcome("fail", f"{what}; the retried sleep and wake failed: {first_line(exc)}", **f)
    if not all(intact(torch, t, (i + 7) << 40) for i, t in enumerate(ts)):
        return outcome("fail", f"{what}; the retried sleep and wake lost bytes", **f)
    return outcome("pass", f"{what}: every allocation stayed mapped and intact, no backup kept; the retried "
                           f"sleep and wake round-tripped {count} x {each / MiB:.0f} MiB", **f)


# --- 8 MoE weight-load churn -----------------------------------------------------------------------


@contextmanager
def max_split_size_mb(torch, mb: int):
    """What vLLM 0.21.0's worker does around load_model (_scoped_allocator_max_split)."""
    setting = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setting(f"max_split_size_mb:{mb}")
    try:
        yield
    finally:
        setting(f"max_split_size_mb:{(2**64 - 1) // MiB}")


def moe_churn(torch, cumem, p: dict) -> dict:
    alloc = cumem.CuMemAllocator.get_instance()
    lo, hi, count, shard = p["churn_min"], p["churn_max"], p["churn_buffers"], p["churn_shard"]
    budget = p["churn_budget"]
    rng = random.Random(p.get("seed", 1))
    hog = torch.empty(max(free_bytes(torch) - budget, 0), dtype=torch.uint8, device="cuda")
    retries_before = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    f = {"budget_bytes": budget, "buffers": count, "min_bytes": lo, "max_bytes": hi, "max_split_size_mb": 20}
    shards, i, given_back = [], 0, []
    free_callback = alloc.python_free_callback

    def counted_free(ptr, *args):  # segments PyTorch gives back during the churn
        given_back.append(ptr)
        return free_callback(ptr, *args)

    alloc.python_free_callback = counted_free  # what use_memory_pool hands the extension
    KEEP_ALIVE.append(counted_free)  # the extension keeps a borrowed reference
    checkpoint(outcome("fail", "the process died during the weight-load churn", **f))
    try:
        with max_split_size_mb(torch, 20), alloc.use_memory_pool(tag="weights"):
            for i in range(count):
                buf = torch.empty(rng.randrange(lo, hi + 1, GRANULARITY) // 8, dtype=torch.int64, device="cuda")
                buf.fill_(i)  # a transient buffer: read into, converted, dropped
                shards.append(torch.empty(shard // 8, dtype=torch.int64, device="cuda"))
                fill(torch, shards[-1], (i + 1) << 40)
                del buf
                f["frees_during_churn"] = len(given_back)
        torch.cuda.synchronize()
    except RuntimeError as exc:
        f["retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before
        return outcome("fail", f"buffer {i + 1} of {count}: {brief(exc)}", **f)
    finally:
        alloc.python_free_callback = free_callback
    f["retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries_before
    if not (f["retries"] or f["frees_during_churn"]):
        return outcome("error", "no allocation ran out of memory under the budget: nothing was tested", **f)
    if not all(intact(torch, t, (i + 1) << 40) for i, t in enumerate(shards)):
        return outcome("fail", "the churn completed but the kept weights lost bytes", **f)
    try:  # and the engine can still sleep: no failed allocation is left registered
        alloc.sleep(offload_tags=("weights",))
        alloc.wake_up()
    except RuntimeError as exc:
        return outcome("fail", f"the churn completed ({f['retries']} out-of-memory retries), then sleep/wake "
                               f"failed: {first_line(exc)}", **f)
    if not all(intact(torch, t, (i + 1) << 40) for i, t in enumerate(shards)):
        return outcome("fail", "after the churn, sleep and wake lost the weights' bytes", **f)
    del hog
    return outcome("pass", f"{count} buffers of {lo / GiB:.1f}-{hi / GiB:.1f} GiB in a {budget / GiB:.1f} GiB budget "
                           f"(max_split_size_mb:20): {f['retries']} out-of-memory retries, "
                           f"{f['frees_during_churn']} frees (segments given back, failed maps taken back); weights intact through sleep and wake",
                   **f)


# --- 9 another process takes the memory ------------------------------------------------------------

TAKER = """import sys, torch
leave = int(sys.argv[1])
free = torch.cuda.mem_get_info()[0]
x = torch.empty(max(free - leave, 0), dtype=torch.uint8, device="cuda")
print("took", x.numel(), flush=True)
sys.stdin.read()
"""


def foreign_process(torch, cumem, p: dict) -> dict:
    alloc = cumem.CuMemAllocator.get_instance()
    count, each = p["foreign_count"], p["foreign_each"]
    tag = "selftest-foreign"
    with alloc.use_memory_pool(tag):
        ts = [torch.empty(each // 8, dtype=torch.int64, device="cuda") for _ in range(count)]
    for i, t in enumerate(ts):
        fill(torch, t, (i + 11) << 40)
    torch.cuda.synchronize()
    alloc.sleep(offload_tags=(tag,))
    taker = subprocess.Popen([sys.executable, "-c", TAKER, str(2 * each + each // 2)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        took = taker.stdout.readline().split()
        if not took or took[0] != "took":
            return outcome("error", "the other process did not take the memory")
        f = {"allocations": count, "each_bytes": each, "taken_bytes": int(took[1])}
        try:
            alloc.wake_up()
        except RuntimeError as exc:
            f["first_error"] = first_line(exc)
        else:
            return outcome("error", "wake_up succeeded while the other process held the memory", **f)
    finally:
        taker.stdin.close()
        taker.wait(timeout=120)
    deadline = time.monotonic() + 30
    while free_bytes(torch) < count * each + GRANULARITY and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        alloc.wake_up()
    except RuntimeError as exc:
        return outcome("fail", f"the other process exited; the retried wake_up failed: {first_line(exc)}", **f)
    if not all(intact(torch, t, (i + 11) << 40) for i, t in enumerate(ts)):
        return outcome("fail", "the retried wake_up succeeded but lost bytes", **f)
    return outcome("pass", f"wake_up failed while another process held the memory ({brief(f['first_error'], 80)}); "
                           f"it exited, and the retry restored {count} x {each / MiB:.0f} MiB intact", **f)


# --- 10 fault stress -------------------------------------------------------------------------------


def fault_layout(total_bytes: int, seed: int) -> list[tuple[str, int]]:
    """(tag, int64 elements) for fault stress: a few tensors per tag, 4 KiB to 8 MiB."""
    rng = random.Random(seed)
    layout = []
    for tag, share, _ in STRESS_TAGS:
        budget = int(total_bytes * share) // 8
        while budget > 0:
            n = min(budget, int(math.exp(rng.uniform(math.log(512), math.log(1 << 20)))))
            layout.append((tag, n))
            budget -= n
    return layout


class FaultStress:
    """The cycles of scenario 10 and what each checks."""

    def __init__(self, torch, cumem, p: dict) -> None:
        self.torch, self.cumem = torch, cumem
        self.alloc = cumem.CuMemAllocator.get_instance()
        self.seed = p.get("seed", 1)
        self.rng = random.Random(self.seed)
        # What to inject (all by default): a comma-separated subset of these, to bisect.
        self.inject = set(p.get("fault_inject", "host,map,double,subset,sweep").split(","))
        # Each in-flight sweep leaves a memory pool alive. With map failures injected too, the
        # process crashed in PyTorch (a segfault in torch.cuda.synchronize or in the pool's
        # snapshot) after about 250 of them on the H200 (docs/gpu-validation.md): capped.
        self.max_sweeps = p.get("fault_sweeps", 200)
        self.injected = {"host_allocation": 0, "map": 0, "double_wake": 0, "tag_subset_wake": 0, "inflight_sweep": 0}
        self.max_drift = 0
        self.spin = spin_cycles(torch, 0.5)
        _warm_up(torch, self.alloc)
        self.baseline = free_bytes(torch)
        self.tensors = []
        for tag, _, _ in STRESS_TAGS:
            with self.alloc.use_memory_pool(tag):
                self.tensors += [(tag, torch.empty(n, dtype=torch.int64, device="cuda"))
                                 for t, n in fault_layout(p["fault_bytes"], self.seed) if t == tag]

    def check(self, cycle: int, tags, what: str) -> None:
        pairs = [(t, seed_for(cycle, i)) for i, (tag, t) in enumerate(self.tensors) if tag in tags]
        if not all_intact(self.torch, pairs):
            raise AssertionError(f"{what}: bytes lost")

    def asleep_at_baseline(self, what: str) -> None:
        drift = self.baseline - free_bytes(self.torch)
        self.max_drift = max(self.max_drift, drift)
        if drift > GRANULARITY:
            raise AssertionError(f"{what}: asleep, device memory is {drift / MiB:.1f} MiB above its baseline")

    def sleep(self, cycle: int, offload: tuple[str, ...]) -> None:
        torch, rng = self.torch, self.rng
        backups = sum(1 for d in self.alloc.pointer_to_data.values() if d.tag in offload)
        if backups and rng.random() < 0.1 and "host" in self.inject:
            k = rng.randrange(1, backups + 1)
            what = f"a sleep that failed at backup {k} of {backups}"
            with failing_host_allocation(torch, self.cumem, k) as host:
                try:
                    self.alloc.sleep(offload_tags=offload)
                except RuntimeError as exc:
                    if "injected" not in str(exc):
                        raise
                else:
                    raise AssertionError(f"{what} did not fail")
            self.injected["host_allocation"] += 1
            self.check(cycle, [t for t, _, _ in STRESS_TAGS], f"after {what}")
            if host.alive():  # every backup the tree's cumem.py made went through `host`
                raise AssertionError(f"{what} kept {host.alive()} backups")
        self.alloc.sleep(offload_tags=offload)
        self.asleep_at_baseline(f"sleep of cycle {cycle}")

    def wake(self, cycle: int) -> None:
        rng = self.rng
        if rng.random() < 0.1 and "map" in self.inject:
            asleep = len(self.alloc.pointer_to_data)
            k = rng.randrange(1, asleep + 1)
            with failing_map(self.cumem, k):
                try:
                    self.alloc.wake_up()
                except RuntimeError as exc:
                    if "injected" not in str(exc):
                        raise
                else:
                    raise AssertionError(f"a wake with map {k} of {asleep} failing did not fail")
            self.injected["map"] += 1
            self.asleep_at_baseline(f"a wake that failed at map {k} of {asleep}")
        if rng.random() < 0.2 and "subset" in self.inject:
            tags = [t for t, _, _ in STRESS_TAGS]
            rng.shuffle(tags)
            for tag in tags:
                self.alloc.wake_up(tags=[tag])
            self.injected["tag_subset_wake"] += 1
        else:
            self.alloc.wake_up()
        if rng.random() < 0.1 and "double" in self.inject:
            self.alloc.wake_up()
            self.injected["double_wake"] += 1

    def cycle(self, cycle: int) -> None:
        torch = self.torch
        offload = offloaded(cycle, self.rng)
        torch.cuda._sleep(self.spin)
        for i, (_, t) in enumerate(self.tensors):
            fill(torch, t, seed_for(cycle, i))  # queued behind the spin: in flight at sleep()
        self.sleep(cycle, offload)
        self.wake(cycle)
        self.check(cycle, offload, f"cycle {cycle}")
        sweep = cycle % 10 == 0 and "sweep" in self.inject and self.injected["inflight_sweep"] < self.max_sweeps
        if sweep:  # the context-exit sweep frees with a write in flight
            with self.alloc.use_memory_pool(f"st-scratch-{cycle}"):
                s = torch.empty(self.rng.randrange(1, 8) * MiB // 8, dtype=torch.int64, device="cuda")
                torch.cuda._sleep(self.spin)
                s.fill_(cycle)
                del s
            self.injected["inflight_sweep"] += 1


def fault_stress(torch, cumem, p: dict) -> dict:
    cycles = p["fault_cycles"]
    run = FaultStress(torch, cumem, p)
    f = {"seed": run.seed, "tensors": len(run.tensors), "bytes": p["fault_bytes"], "cycles": cycles}
    print(f"fault-stress: seed {run.seed} (replay: --seed {run.seed})", flush=True)
    start, cycle = time.perf_counter(), 0
    try:
        for cycle in range(1, cycles + 1):
            run.cycle(cycle)
            if cycle % 500 == 0:
                print(f"fault-stress: cycle {cycle}, injected {run.injected}", flush=True)
        torch.cuda.synchronize()
    except (AssertionError, RuntimeError) as exc:
        f.update(cycle=cycle, injected=run.injected)
        return outcome("fail", f"seed {run.seed}, cycle {cycle}: {first_line(exc)}", **f)
    seconds = time.perf_counter() - start
    f.update(injected=run.injected, max_drift_bytes=run.max_drift, cycles_per_s=cycles / seconds, seconds=seconds)
    inj = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in run.injected.items())
    return outcome("pass", f"seed {run.seed}: {cycles} cycles ({cycles / seconds:.0f}/s), {len(run.tensors)} tensors "
                           f"in {len(STRESS_TAGS)} tags; injected {inj}: no other error, data exact every cycle, "
                           f"asleep within {max(run.max_drift, 0) / MiB:.1f} MiB of the baseline, no backup kept "
                           "after a failed sleep", **f)


RUNNERS = {
    "inflight-free": inflight_free,
    "stale-error": stale_error,
    "partial-wake": partial_wake,
    "stress": stress,
    "speed": speed,
    "double-wake": double_wake,
    "failing-sleep": failing_sleep,
    "moe-churn": moe_churn,
    "foreign-process": foreign_process,
    "fault-stress": fault_stress,
}
# Issue 13's and 24's scenarios, registered here: speed.py and ranks.py use the helpers above.
from .ranks import ranks
from .speed import first_sleep, rotation

RUNNERS.update({"first-sleep": first_sleep, "rotation": rotation, "ranks": ranks})
