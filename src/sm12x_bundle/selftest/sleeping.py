"""Scenarios 7 and 8: sleeps and loads under pressure. A sleep whose pinned backups run out
part-way, and the weight-load churn of a MoE model under a memory budget."""

from __future__ import annotations

import random
from contextlib import contextmanager

from .faults import failing_host_allocation
from .measure import (
    GRANULARITY,
    GiB,
    KEEP_ALIVE,
    MiB,
    brief,
    checkpoint,
    delta,
    fill,
    first_line,
    free_bytes,
    intact,
    outcome,
    pinned_stats,
)

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
    failed = _weights_survive(torch, alloc, shards, f)
    if failed:
        return failed
    del hog
    return outcome("pass", f"{count} buffers of {lo / GiB:.1f}-{hi / GiB:.1f} GiB in a {budget / GiB:.1f} GiB budget "
                           f"(max_split_size_mb:20): {f['retries']} out-of-memory retries, "
                           f"{f['frees_during_churn']} frees (segments given back, failed maps taken back); weights intact through sleep and wake",
                   **f)


def _weights_survive(torch, alloc, shards: list, f: dict) -> dict | None:
    """The kept weights intact after the churn, and through a sleep and wake (no failed
    allocation is left registered); the failing outcome, or None."""
    if not all(intact(torch, t, (i + 1) << 40) for i, t in enumerate(shards)):
        return outcome("fail", "the churn completed but the kept weights lost bytes", **f)
    try:
        alloc.sleep(offload_tags=("weights",))
        alloc.wake_up()
    except RuntimeError as exc:
        return outcome("fail", f"the churn completed ({f['retries']} out-of-memory retries), then sleep/wake "
                               f"failed: {first_line(exc)}", **f)
    if not all(intact(torch, t, (i + 1) << 40) for i, t in enumerate(shards)):
        return outcome("fail", "after the churn, sleep and wake lost the weights' bytes", **f)
    return None
