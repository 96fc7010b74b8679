# SPDX-License-Identifier: Apache-2.0
# sm12x-bundle patch 0005: pinned host backups for CuMemAllocator.sleep(),
# sized exactly to the bytes offloaded and pinned before the first sleep.
"""Backups for sleep mode that cost no more host memory than the bytes they hold.

Unpatched, ``sleep()`` makes each backup with ``torch.empty(..., pin_memory=True)``:
PyTorch's caching host allocator rounds every block up to a power of two and pins
it at that moment, so the first sleep of a process runs at the speed the host can
populate and pin new pages (a few GB/s) rather than at the link's, and the backups
can take up to twice the bytes offloaded.

Here, when a memory pool whose tag is offloaded on sleep (``weights`` unless
``VLLM_SM12X_BACKUP_POOL_TAGS`` says otherwise) closes, a background thread maps
exactly that many bytes of anonymous memory, asks for transparent huge pages,
populates the pages from several threads and registers them with
``cudaHostRegister``. ``sleep()`` then carves each backup out of that region, so the
first sleep is the copies alone. A backup goes back to the pool when its tensor is
dropped (after a wake, or when a failed sleep lets its backups go), through a
finalizer that runs once, so no caller can free it twice. Backups that do not fit
(more bytes offloaded than prepared) fall back to the unpatched allocation.

The pool holds its bytes from the end of the model load until the process exits.
A sleep that offloads none of the pool's tags (level 2) releases it, so a process
that never offloads holds no pinned memory after its first sleep, as unpatched.
``VLLM_SM12X_BACKUP_POOL=0`` turns all of this off: sleep() allocates its backups
as vLLM 0.21.0 does.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
import weakref
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

logger = logging.getLogger(__name__)

_PROT_RW, _MAP_PRIVATE_ANON = 0x3, 0x22
_MADV_HUGEPAGE, _MADV_POPULATE_WRITE = 14, 23
_HOST_REGISTER_DEFAULT = 0  # the thread sets the allocations' device first
# Pages are faulted in this many bytes per call: each call holds the process's
# memory-map lock, which the engine's own CUDA calls (cuMemMap) also need while
# it starts; one call per thread over gigabytes stalled them for seconds.
_POPULATE_STEP = 64 << 20
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _env(name: str, default: str) -> str:
    try:  # registered in vllm/envs.py; read through it where vLLM is importable
        from vllm import envs

        return str(getattr(envs, name))
    except (ImportError, AttributeError):
        return os.getenv(name, default)


def enabled() -> bool:
    return _env("VLLM_SM12X_BACKUP_POOL", "1").strip().lower() not in ("0", "false", "off", "")


def pool_tags() -> tuple[str, ...]:
    raw = _env("VLLM_SM12X_BACKUP_POOL_TAGS", "weights")
    return tuple(t.strip() for t in raw.split(",") if t.strip())


_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED (cuda.h)


@contextlib.contextmanager
def relaxed_capture_mode():
    """Let this thread's CUDA calls run while another thread captures a CUDA graph.

    The pool pins while the engine goes on loading, and the engine captures its CUDA
    graphs in the default (global) capture mode: there, cudaHostRegister from any other
    thread is refused (error 900) and invalidates the capture, so graph capture failed
    whenever the pinning was still running (vLLM 0.33.0's test_cudagraph_pool_sleep).
    In relaxed mode this thread may make the call; it enqueues nothing on the capturing
    stream. The thread's previous mode is put back."""
    try:
        exchange = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
    except (OSError, AttributeError):  # no driver: no capture to disturb either
        yield
        return
    exchange.argtypes = [ctypes.POINTER(ctypes.c_int)]
    mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
    relaxed = exchange(ctypes.byref(mode)) == 0
    try:
        yield
    finally:
        if relaxed:
            exchange(ctypes.byref(mode))


class HostMemory:
    """Anonymous host memory pinned for the GPU: what a region is made of. The two
    CUDA calls are attributes so that tests without a GPU can stand in for them."""

    def __init__(self, threads: int | None = None) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.threads = threads or min(16, os.cpu_count() or 1)

    def map(self, nbytes: int) -> int:
        addr = self.libc.mmap(None, nbytes, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
        if addr is None or addr == ctypes.c_void_p(-1).value:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of {nbytes} bytes failed: {os.strerror(err)}")
        return addr

    def unmap(self, addr: int, nbytes: int) -> None:
        self.libc.munmap(addr, nbytes)

    def populate(self, addr: int, nbytes: int) -> None:
        """Huge pages where the kernel allows them (fewer faults, faster pinning),
        then every page faulted in from several threads: the kernel backs and zeroes
        the pages in parallel, where cudaHostRegister would do it on one thread."""
        self.libc.madvise(addr, nbytes, _MADV_HUGEPAGE)
        step = -(-nbytes // self.threads // PAGE) * PAGE
        spans = [(addr + o, min(step, nbytes - o)) for o in range(0, nbytes, step)]

        def touch(span: tuple[int, int]) -> None:
            # ctypes calls drop the GIL, so the threads fault pages in parallel.
            start, end = span[0], span[0] + span[1]
            for a in range(start, end, _POPULATE_STEP):
                n = min(_POPULATE_STEP, end - a)
                if self.libc.madvise(a, n, _MADV_POPULATE_WRITE) != 0:
                    ctypes.memset(a, 0, n)  # kernels before 5.14

        with ThreadPoolExecutor(len(spans)) as ex:
            list(ex.map(touch, spans))

    def register(self, addr: int, nbytes: int, device: int) -> None:
        torch.cuda.set_device(device)
        with relaxed_capture_mode():
            err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, _HOST_REGISTER_DEFAULT)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: CUDA error {int(err)}")

    def unregister(self, addr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(addr)


class Region:
    """One pinned mapping and the free spans inside it (offset -> length)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.addr: int | None = None  # set once pinned
        self.free: dict[int, int] = {0: nbytes}
        self.error: BaseException | None = None
        self.pin_s: float | None = None  # how long the background pinning took

    def take(self, nbytes: int) -> int | None:
        for off in sorted(self.free):
            length = self.free[off]
            if length >= nbytes:
                del self.free[off]
                if length > nbytes:
                    self.free[off + nbytes] = length - nbytes
                return off
        return None

    def give_back(self, off: int, nbytes: int) -> None:
        if any(o <= off < o + n or off <= o < off + nbytes for o, n in self.free.items()):
            raise RuntimeError(f"backup span {off}+{nbytes} returned twice")
        self.free[off] = nbytes
        merged: dict[int, int] = {}
        for o in sorted(self.free):
            last = max(merged) if merged else None
            if last is not None and last + merged[last] == o:
                merged[last] += self.free[o]
            else:
                merged[o] = self.free[o]
        self.free = merged

    def in_use(self) -> int:
        return self.nbytes - sum(self.free.values())


class BackupPool:
    """Pinned host memory for sleep()'s backups, prepared while the model loads."""

    def __init__(self, tags: Iterable[str] = ("weights",), memory: HostMemory | None = None) -> None:
        self.tags = tuple(tags)
        self.memory = memory or HostMemory()
        self.regions: list[Region] = []
        self.pending: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.fallback_bytes = 0  # backed up outside the pool (it was short)

    @classmethod
    def from_env(cls) -> BackupPool | None:
        """The pool, or None when VLLM_SM12X_BACKUP_POOL=0 (0.21.0's behaviour)."""
        if not enabled():
            return None
        try:
            return cls(pool_tags())
        except OSError as exc:  # no libc mmap: not Linux
            logger.warning("sleep-mode backup pool unavailable: %s", exc)
            return None

    # -- while the model loads -----------------------------------------------------
    def prepare(self, tag: str, tag_bytes: int, device: int) -> None:
        """A memory pool with ``tag`` closed holding ``tag_bytes``: pin what the pool
        lacks for them, in the background."""
        if tag not in self.tags:
            return
        missing = tag_bytes - self.capacity()
        if missing <= 0:
            return
        region = Region(missing)
        with self.lock:
            self.regions.append(region)
        th = threading.Thread(target=self._pin, args=(region, device), daemon=True,
                              name="vllm-sm12x-backup-pool")
        self.pending.append(th)
        th.start()

    def _pin(self, region: Region, device: int) -> None:
        addr, start = None, time.perf_counter()
        try:
            addr = self.memory.map(region.nbytes)
            self.memory.populate(addr, region.nbytes)
            self.memory.register(addr, region.nbytes, device)
            region.addr, region.pin_s = addr, time.perf_counter() - start
        except Exception as exc:  # noqa: BLE001  (the sleep falls back; the model load goes on)
            region.error = exc
            if addr is not None:
                self.memory.unmap(addr, region.nbytes)
            logger.warning("sleep-mode backup pool: pinning %d bytes failed (%s); "
                           "sleep() allocates those backups itself", region.nbytes, exc)

    def wait(self) -> None:
        for th in self.pending:
            th.join()
        self.pending.clear()
        with self.lock:
            self.regions = [r for r in self.regions if r.error is None]

    # -- sleep -----------------------------------------------------------------------
    def before_sleep(self, offload_tags: Iterable[str]) -> bool:
        """Wait for the pinning when this sleep offloads one of the pool's tags;
        otherwise let the pool go (a level-2 sleep keeps no backups) and say so."""
        if set(offload_tags) & set(self.tags):
            self.wait()
            return True
        self.release()
        return False

    def take(self, nbytes: int) -> torch.Tensor | None:
        """A uint8 tensor of exactly ``nbytes`` in pinned pool memory, or None when
        the pool has no span that large. The span returns to the pool when the
        tensor is dropped."""
        if self.pending:
            self.wait()
        with self.lock:
            for region in self.regions:
                if region.addr is None:
                    continue
                off = region.take(nbytes)
                if off is not None:
                    break
            else:
                self.fallback_bytes += nbytes
                return None
        buf = (ctypes.c_uint8 * nbytes).from_address(region.addr + off)
        tensor = torch.frombuffer(buf, dtype=torch.uint8)
        weakref.finalize(tensor, self._give_back, region, off, nbytes)
        return tensor

    def _give_back(self, region: Region, off: int, nbytes: int) -> None:
        with self.lock:
            region.give_back(off, nbytes)

    # -- bookkeeping -------------------------------------------------------------------
    def capacity(self) -> int:
        with self.lock:
            return sum(r.nbytes for r in self.regions if r.error is None)

    def in_use(self) -> int:
        with self.lock:
            return sum(r.in_use() for r in self.regions)

    def release(self) -> None:
        """Unpin and unmap every region none of whose backups is alive."""
        self.wait()
        with self.lock:
            keep = []
            for r in self.regions:
                if r.in_use():
                    keep.append(r)
                    continue
                if r.addr is not None:
                    self.memory.unregister(r.addr)
                    self.memory.unmap(r.addr, r.nbytes)
                r.addr = None
            self.regions = keep
