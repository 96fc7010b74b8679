"""What runs inside the engine core process, sent there by ``LLM.collective_rpc``.

Each function takes the worker (vLLM passes it first) and returns plain data. cloudpickle
sends them by reference, so the engine core imports this module by name: it must stay
importable with the standard library alone (vllm and torch are imported inside).

The host-memory fault: the k-th backup that ``CuMemAllocator.sleep`` takes raises, as a
pinned host allocation does when host memory runs out. Where the allocator takes its
backups through ``_backup_for`` (the patched cumem.py: pool or fallback alike), that call
fails; where it calls ``torch.empty(..., device="cpu")`` inside ``sleep`` (pristine 0.21.0
and 0.33.0), that call fails: the same point of the same sleep, reached in each release's
own way, with the code under test unchanged.
"""

from __future__ import annotations

import gc
import os

OFFLOADED = "weights"
_FAULT: dict = {}


class _FailingTorch:
    """Stands in for ``torch`` inside cumem.py: its k-th CPU ``empty`` raises."""

    def __init__(self, torch, fault: dict) -> None:
        self._torch, self._fault = torch, fault

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def empty(self, *args, **kwargs):
        if str(kwargs.get("device")) == "cpu":
            _count_or_fail(self._fault, args[0] if args else None)
        return self._torch.empty(*args, **kwargs)


def _count_or_fail(fault: dict, nbytes) -> None:
    fault["calls"] += 1
    if fault["calls"] == fault["fails_at"]:
        fault["fired"] = True
        raise RuntimeError(f"injected fault: out of host memory for sleep backup #{fault['fails_at']} ({nbytes} bytes)")


def _allocator():
    from vllm.device_allocator import cumem

    return cumem, cumem.CuMemAllocator.get_instance()


def install_host_failure(worker, at: str | int = "middle") -> dict:
    """Make the ``at``-th backup of the next sleep fail ("middle": half-way through the weights)."""
    remove_host_failure(worker)
    cumem, alloc = _allocator()
    count = sum(1 for d in alloc.pointer_to_data.values() if d.tag == OFFLOADED)
    k = count // 2 + 1 if at == "middle" else int(at)
    fault = {"calls": 0, "fails_at": k, "fired": False, "allocations": count}
    if hasattr(alloc, "_backup_for"):
        real = alloc._backup_for

        def backup_for(data):
            _count_or_fail(fault, data.handle[1])
            return real(data)

        alloc._backup_for = backup_for
        fault["where"] = "CuMemAllocator._backup_for"
        fault["undo"] = lambda: delattr(alloc, "_backup_for")
    else:
        real_torch = cumem.torch
        cumem.torch = _FailingTorch(real_torch, fault)
        fault["where"] = "torch.empty(device='cpu') in CuMemAllocator.sleep"
        fault["undo"] = lambda: setattr(cumem, "torch", real_torch)
    _FAULT.update(fault)
    return _public(fault)


def install_on_rank(worker, at: str | int = "middle", rank: int | str | None = None) -> dict:
    """The fault on the worker of ``rank`` alone (None or "": every rank); the reply names the rank."""
    mine = int(getattr(worker, "rank", 0))
    if rank not in (None, "") and int(rank) != mine:
        return {"installed": False, "rank": mine}
    return {**install_host_failure(worker, at), "installed": True, "rank": mine}


def remove_host_failure(worker) -> dict:
    """Undo the fault; say whether it fired and how many backups were asked for."""
    if not _FAULT:
        return {"installed": False}
    _FAULT.pop("undo")()
    out = _public(_FAULT)
    _FAULT.clear()
    return out


def _public(fault: dict) -> dict:
    return {k: v for k, v in fault.items() if k != "undo"}


def allocator_state(worker) -> dict:
    """The allocator by tag (allocations, bytes, asleep, backed up, runs of back-to-back
    addresses), its backup pool, the device's memory and PyTorch's pinned host memory, as
    the engine core sees them."""
    import torch

    cumem, alloc = _allocator()
    tags: dict = {}
    for data in alloc.pointer_to_data.values():
        t = tags.setdefault(data.tag, {"allocations": 0, "bytes": 0, "asleep": 0, "backed_up_bytes": 0})
        t["allocations"] += 1
        t["bytes"] += data.handle[1]
        # The patched allocator says "asleep", 0.33.0's "is_asleep"; pristine 0.21.0 keeps no flag.
        asleep = getattr(data, "asleep", getattr(data, "is_asleep", None))
        if asleep is None or t["asleep"] is None:
            t["asleep"] = None
        else:
            t["asleep"] += bool(asleep)
        if data.cpu_backup_tensor is not None:
            t["backed_up_bytes"] += data.handle[1]
    for tag, t in tags.items():
        t["address_runs"] = address_runs((ptr, d.handle[1]) for ptr, d in alloc.pointer_to_data.items() if d.tag == tag)
    free, total = torch.cuda.mem_get_info()
    return {"rank": int(getattr(worker, "rank", 0)), "pid": os.getpid(), "tags": tags, "free_bytes": free, "total_bytes": total, "backup_pool": _pool(alloc),
            "pinned": _pinned(torch), "cumem_py": cumem.__file__, "extension": cumem.lib_name, **_last_sleep(alloc)}


def address_runs(ranges) -> int:
    """How many runs of back-to-back address ranges (start, size) there are: the fewest calls
    a driver call that takes one contiguous range could cover them with."""
    runs, end = 0, None
    for start, size in sorted(ranges):
        runs += start != end
        end = start + size
    return runs


def _last_sleep(alloc) -> dict:
    """What the last sleep copied and skipped and how long its checksum took (the
    unchanged-skip's allocator records it, unless VLLM_CUMEM_SKIP_UNCHANGED=0), each stage of the
    last sleep and of the last wake (the patched allocator's last_sleep_stages and
    last_wake_up_stages) and its background fill; None where the allocator keeps no such record."""
    keys = ("last_sleep_copied_bytes", "last_sleep_skipped_bytes", "last_sleep_checksum_s", "last_sleep_stages",
            "last_wake_up_stages")
    return {**{k: getattr(alloc, k, None) for k in keys}, "background_fill": _background_fill(alloc)}


def _background_fill(alloc) -> dict | None:
    """The skip's fill of the backups while the engine serves, before its first sleep
    (filled_bytes, seconds, state, dropped); None where the allocator starts none."""
    fill = getattr(alloc, "background_fill", None)
    figures = getattr(fill, "figures", None)
    return figures() if callable(figures) else None


def _pool(alloc) -> dict | None:
    pool = getattr(alloc, "backup_pool", None)
    if pool is None:
        return None
    # Still pinning (threads alive) when a sleep comes: that sleep waits for it.
    regions = getattr(pool, "regions", [])
    return {"capacity_bytes": pool.capacity(), "in_use_bytes": pool.in_use(),
            "fallback_bytes": getattr(pool, "fallback_bytes", None),
            "pinning": sum(th.is_alive() for th in getattr(pool, "pending", [])),
            "pin_s": sum(getattr(r, "pin_s", None) or 0.0 for r in regions)}


def _pinned(torch) -> dict:
    try:
        stats = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return {}
    return {k: int(v) for k, v in stats.items() if k.endswith("bytes.current") or k.startswith("num_host")}


def worker_pid(worker) -> dict:
    return {"rank": int(getattr(worker, "rank", 0)), "pid": os.getpid()}


def gc_collect_time(worker) -> dict:
    """One full ``gc.collect()`` in this worker process, timed apart from everything else:
    vLLM 0.21.0's ``CuMemAllocator.sleep`` ends with one, which walks every object the
    worker's heap holds unless it was frozen (``gc.freeze``: the patched series freezes it
    after warm-up); ``frozen`` says how many objects the collection skipped for that."""
    import time

    start = time.perf_counter()
    gc.collect()
    seconds = time.perf_counter() - start
    return {"rank": int(getattr(worker, "rank", 0)), "pid": os.getpid(), "seconds": seconds,
            "frozen": gc.get_freeze_count()}


def map_call_times(worker, count: int | str = 200, size_mib: int | str = 12, only_rank: int | str = "") -> dict:
    """The calls a wake's maps make (vLLM's extension's ``create_and_map``, and each driver
    call apart; the extension's also while 8 GiB of host-to-device copies run, as a wake's
    maps run beside its copies, by the copy engine and by a kernel, with each one's rate), timed in this worker over ``count`` fresh address ranges of
    ``size_mib`` MiB (vmm.call_times), so that they can be set beside the same calls in a bare process
    (bench/cumem_map_bench.py). The memory is released and the ranges freed before it returns.
    With ``only_rank`` set, the other ranks time nothing: that rank's calls run alone, where
    a wake's run on every rank at once."""
    import torch

    from . import vmm

    rank = int(getattr(worker, "rank", 0))
    if str(only_rank) != "" and int(only_rank) != rank:
        return {"rank": rank, "pid": os.getpid(), "skipped": True}

    try:
        from vllm import cumem_allocator as ext
    except ImportError:  # no extension: the driver's calls alone
        ext = None
    device = torch.cuda.current_device()
    copies = {by: vmm.QueuedCopies(torch, device, by=by) for by in vmm.QueuedCopies.BY}  # 1 GiB a side each
    try:
        rates = {by: c.gbps() for by, c in copies.items()}
        times = vmm.call_times(device, int(count), int(size_mib) << 20, ext,
                               busy={f"copies by the {by}": c.start for by, c in copies.items()})
    finally:
        del copies
        torch.cuda.empty_cache()
    return {"rank": rank, "pid": os.getpid(), "copy_gbps": rates, **times}


def reload_dummy_weights(worker) -> dict:
    """The engine's own dummy loader over the model again: the same seeded values."""
    from vllm.model_executor.model_loader import get_model_loader

    runner = worker.model_runner
    model, config = runner.get_model(), worker.vllm_config
    loader = get_model_loader(config.load_config)
    with _current_config(config):
        loader.load_weights(model, config.model_config)
    gc.collect()
    return {"loader": type(loader).__name__}


def perturb_weights(worker, seed: int | str = 1) -> dict:
    """Change a weight in place, as a fine-tune step or a LoRA merge would: the rows of this
    rank's lm_head shard rolled by ``seed`` rows, so every greedy token moves (logit v becomes
    logit v - seed). The tensor keeps its address: the change is in the allocation the
    allocator backed up, which a sleep must copy again. lm_head, not the embedding: no cached
    prefix's KV depends on it, so the tokens after the change are the new weight's alone. A
    rank without an lm_head (an early pipeline stage) changes nothing and says so."""
    import torch

    rank = int(getattr(worker, "rank", 0))
    found = [(n, p) for n, p in worker.model_runner.get_model().named_parameters() if n.endswith("lm_head.weight")]
    if not found:
        return {"rank": rank, "changed": None}
    name, param = found[0]
    with torch.no_grad():
        param.data.copy_(torch.roll(param.data, shifts=int(seed), dims=0))
    if param.is_cuda:
        torch.cuda.synchronize()  # done before the reply, so the next sleep sees the change
    return {"rank": rank, "changed": name, "shape": list(param.shape), "rows_rolled": int(seed)}


def _current_config(config):
    from contextlib import nullcontext

    try:
        from vllm.config import set_current_vllm_config
    except ImportError:
        return nullcontext()
    return set_current_vllm_config(config)


__all__ = ["allocator_state", "gc_collect_time", "install_host_failure", "install_on_rank", "perturb_weights", "reload_dummy_weights",
           "remove_host_failure", "worker_pid"]
