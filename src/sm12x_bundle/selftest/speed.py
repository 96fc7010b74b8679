"""Scenario 5: sleep and wake throughput against the pinned-copy ceilings measured in the
same process, and the first sleep's cost."""

from __future__ import annotations

import os
import time

from .measure import GiB, fill, intact, outcome, timed

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
