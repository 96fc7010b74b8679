"""Scenario 5: sleep and wake throughput against the pinned-copy ceilings measured in the
same process, and the first sleep's cost."""

from __future__ import annotations

import os
import time

from .measure import GiB, fill, intact, outcome, timed

WAKE_FRESH_TARGET = 0.95  # of the H2D ceiling into freshly created memory (a wake creates it)


def speed_shortfalls(f: dict, target: float) -> list[str]:
    """What keeps the speed scenario from passing. A wake copies into memory it has just
    created, which the driver prepares first: it is held to the fresh-memory ceiling, a
    sleep to the D2H one."""
    short = []
    if f["sleep_ratio"] < target:
        short.append(f"sleep below {target:.0%} of D2H")
    if f["wake_fresh_ratio"] < WAKE_FRESH_TARGET:
        short.append(f"wake below {WAKE_FRESH_TARGET:.0%} of fresh")
    return short


def speed(torch, cumem, p: dict) -> dict:
    alloc = cumem.CuMemAllocator.get_instance()
    total, chunk, reps = p["speed_bytes"], p["speed_chunk"], p.get("speed_reps", 3)
    with alloc.use_memory_pool("selftest-speed"):
        ts = [torch.empty(chunk // 8, dtype=torch.int64, device="cuda") for _ in range(total // chunk)]
    for i, t in enumerate(ts):
        fill(torch, t, i << 40)
    first, sleeps, wakes = _sleeps_and_wakes(torch, alloc, reps, p.get("wake_after_s", 0.0))
    if not all(intact(torch, t, i << 40) for i, t in enumerate(ts)):
        return outcome("fail", "data did not round-trip through sleep and wake")
    d2h, h2d, fresh = _ceilings(torch, alloc, ts, chunk, reps)

    def rate(seconds: float) -> float:
        return total / seconds / 1e9

    f = {
        "bytes": total, "chunk_bytes": chunk,
        "sleep_gbps": rate(min(sleeps)), "wake_gbps": rate(min(wakes)),
        "d2h_ceiling_gbps": rate(d2h), "h2d_ceiling_gbps": rate(h2d), "fresh_h2d_ceiling_gbps": rate(fresh),
        "first_sleep_s": first, "first_sleep_gbps": rate(first), "steady_sleep_s": min(sleeps),
        "first_sleep_extra_s": first - min(sleeps),
        "sleeps_s": sleeps, "wakes_s": wakes, "wake_after_s": p.get("wake_after_s", 0.0),
        "pytorch_cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    f["wake_ratio"] = f["wake_gbps"] / f["h2d_ceiling_gbps"]
    f["wake_fresh_ratio"] = f["wake_gbps"] / f["fresh_h2d_ceiling_gbps"]
    f["sleep_ratio"] = f["sleep_gbps"] / f["d2h_ceiling_gbps"]
    return _judged(f, p.get("speed_target", 0.9))


def _sleeps_and_wakes(torch, alloc, reps: int, pause: float) -> tuple[float, list[float], list[float]]:
    """The first sleep (it pins the backups' host memory), then ``reps`` wakes and sleeps, and a
    last wake; each wake after ``pause`` s (the driver may still work on what sleep() released)."""

    def sleep() -> float:
        return timed(torch, lambda: alloc.sleep(offload_tags=("selftest-speed",)))

    def wake() -> float:
        time.sleep(pause)
        return timed(torch, alloc.wake_up)

    first, wakes, sleeps = sleep(), [], []
    for _ in range(reps):
        wakes.append(wake())
        sleeps.append(sleep())
    wakes.append(wake())
    return first, sleeps, wakes


def _ceilings(torch, alloc, ts: list, chunk: int, reps: int) -> tuple[float, float, float]:
    """Seconds for the same bytes in the same chunks, pinned host <-> device, now: D2H, H2D
    into memory in use, and H2D into memory the allocator has just created (what a wake copies
    into: the driver still works on new memory then)."""
    hosts = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in ts]
    views = [t.view(torch.uint8) for t in ts]
    d2h = min(timed(torch, lambda: [h.copy_(v) for h, v in zip(hosts, views)]) for _ in range(reps))
    h2d = min(timed(torch, lambda: [v.copy_(h) for h, v in zip(hosts, views)]) for _ in range(reps))
    fresh = min(fresh_copy(torch, alloc, hosts, chunk, f"selftest-speed-fresh-{i}") for i in range(reps))
    return d2h, h2d, fresh


def _judged(f: dict, target: float) -> dict:
    words = (f"{f['bytes'] / GiB:.1f} GiB: wake {f['wake_gbps']:.1f} GB/s = {f['wake_ratio']:.0%} of H2D "
             f"{f['h2d_ceiling_gbps']:.1f}, {f['wake_fresh_ratio']:.0%} of fresh {f['fresh_h2d_ceiling_gbps']:.1f}; "
             f"sleep {f['sleep_gbps']:.1f} GB/s = {f['sleep_ratio']:.0%} of D2H {f['d2h_ceiling_gbps']:.1f}; "
             f"first sleep {f['first_sleep_s']:.2f} s ({f['first_sleep_gbps']:.1f} GB/s)")
    short = speed_shortfalls(f, target)
    if short:
        return outcome("fail", f"{words}: {' and '.join(short)}", **f)
    return outcome("pass", words, **f)


def fresh_copy(torch, alloc, hosts: list, piece: int, tag: str) -> float:
    """H2D into memory the allocator has just created and mapped (a new pool), the
    first copy into it: what a wake copies into. Each call needs its own tag: a second
    pool under one tag would drop the first, whose segments the sweep already released."""

    with alloc.use_memory_pool(tag):
        dst = [torch.empty(piece, dtype=torch.uint8, device="cuda") for _ in hosts]
        torch.cuda.synchronize()
        seconds = timed(torch, lambda: [d.copy_(h) for d, h in zip(dst, hosts)])
        dst.clear()  # freed inside the pool: its sweep releases the memory
    return seconds


# --- 7 rotation -----------------------------------------------------------------------------
