"""What every allocator scenario measures with: results, checkpoints, the data pattern,
GPU timing and the host's memory.

Data is checked exactly: every pool tensor is int64 and holds ``seed, seed+1, ...``
(written by ``torch.arange(..., out=t)``), and a check compares it, a chunk at a time,
with the same sequence built again. torch is passed in, never imported here, so the
pure parts are testable without it.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

MiB, GiB = 1 << 20, 1 << 30
GRANULARITY = 2 * MiB
CHUNK = 1 << 25  # int64 elements compared at a time (256 MiB)


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


def pin_memory(cumem) -> bool:
    """Whether the tree's cumem.py pins its backups: 0.21.0 asks is_pin_memory_available(),
    0.33.0 reads PIN_MEMORY once at import."""
    if hasattr(cumem, "PIN_MEMORY"):
        return bool(cumem.PIN_MEMORY)
    return bool(cumem.is_pin_memory_available())


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


def host_used() -> int:
    """Host memory in use (MemTotal grows as these VMs use memory: MemAvailable alone
    gives no delta)."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        info[key] = int(rest.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def rss() -> int:
    """This process's resident memory: pinned backups count in it (cudaHostAlloc's and
    the pool's pages alike), the driver's own bookkeeping and other processes do not."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0
