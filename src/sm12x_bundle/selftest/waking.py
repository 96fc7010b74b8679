"""Scenarios 3, 6 and 9: wakes that fail or repeat. A wake that runs out of memory part-way
and is retried; a wake of what is awake (a regression guard); a wake that meets memory
another process holds."""

from __future__ import annotations

import sys
import time

from .. import cmd
from .measure import GRANULARITY, MiB, brief, fill, first_line, free_bytes, intact, outcome

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
    taker = cmd.start([sys.executable, "-c", TAKER, str(2 * each + each // 2)], echo=False)
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
