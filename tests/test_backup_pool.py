"""Patch 0005: sleep()'s backups from a pool pinned before the first sleep.

The pool's bookkeeping runs for real on the CPU: the host memory is a real anonymous
mapping, populated by real threads; only the two CUDA calls (cudaHostRegister and
cudaHostUnregister) are stood in for, recorded. Through cumem.py, the patched tree's
own file runs against test_cumem_patches' FakeCuda (the C extension and libcudart).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import needs
import pytest

torch = needs.module("torch")

from test_cumem_patches import LAYOUT, FakeCuda, assert_woken_intact, load_cumem

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "patches/fixes/cumem-backup-pool/new"  # in step with the patch: tests/test_generated.py
MODULE = Path("vllm/device_allocator/cumem_backup_pool.py")
MiB = 1 << 20


def load_pool_module(path: Path, name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    return mod


class Pinning:
    """What the CUDA runtime was asked to pin and unpin."""

    def __init__(self, fail: bool = False) -> None:
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.fail = fail

    def install(self, mod, monkeypatch) -> None:
        pin = self

        def register(self, addr, nbytes, device):
            if pin.fail:
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: CUDA error 2")
            pin.registered.append((addr, nbytes, device))

        def unregister(self, addr):
            pin.unregistered.append(addr)

        monkeypatch.setattr(mod.HostMemory, "register", register)
        monkeypatch.setattr(mod.HostMemory, "unregister", unregister)


@pytest.fixture
def pool_mod(monkeypatch):
    monkeypatch.delenv("VLLM_SM12X_BACKUP_POOL", raising=False)
    monkeypatch.delenv("VLLM_SM12X_BACKUP_POOL_TAGS", raising=False)
    return load_pool_module(SOURCE / MODULE, "_backup_pool_under_test", monkeypatch)


@pytest.fixture
def pinning(pool_mod, monkeypatch) -> Pinning:
    p = Pinning()
    p.install(pool_mod, monkeypatch)
    return p


# --- the pool alone ------------------------------------------------------------------------------


def test_pool_is_exactly_the_bytes_of_its_tag(pool_mod, pinning):
    pool = pool_mod.BackupPool(("weights",))
    size = 3 * 384 * MiB // 64  # 18 MiB: not a power of two, as weight allocations are not
    pool.prepare("weights", size, device=0)
    pool.prepare("kv_cache", 64 * MiB, device=0)  # not a pool tag: nothing pinned for it
    pool.wait()
    assert pool.capacity() == size
    assert [(n, d) for _, n, d in pinning.registered] == [(size, 0)]
    pool.prepare("weights", size, device=0)  # the same bytes again: nothing more
    pool.prepare("weights", size + 2 * MiB, device=0)  # grown: only the difference
    pool.wait()
    assert [n for _, n, _ in pinning.registered] == [size, 2 * MiB]
    assert pool.capacity() == size + 2 * MiB


def test_backups_are_exact_spans_that_return_when_dropped(pool_mod, pinning):
    pool = pool_mod.BackupPool(("weights",))
    pool.prepare("weights", 10 * MiB, device=0)
    a, b = pool.take(6 * MiB), pool.take(4 * MiB)
    assert (a.numel(), b.numel()) == (6 * MiB, 4 * MiB) and pool.in_use() == 10 * MiB
    base = pinning.registered[0][0]
    assert {a.data_ptr(), b.data_ptr()} == {base, base + 6 * MiB}
    a.fill_(7)
    b.fill_(9)
    assert int(a.sum()) == 7 * 6 * MiB and int(b[0]) == 9  # the bytes are host memory
    assert pool.take(1) is None and pool.fallback_bytes == 1  # full: the caller allocates itself
    del a
    assert pool.in_use() == 4 * MiB
    del b
    assert pool.in_use() == 0
    assert pool.regions[0].free == {0: 10 * MiB}  # coalesced: one span again
    assert pool.take(10 * MiB).numel() == 10 * MiB


def test_a_span_returned_twice_is_refused(pool_mod):
    region = pool_mod.Region(8 * MiB)
    off = region.take(4 * MiB)
    region.give_back(off, 4 * MiB)
    with pytest.raises(RuntimeError, match="returned twice"):
        region.give_back(off, 4 * MiB)
    assert region.free == {0: 8 * MiB}


def test_failed_pinning_leaves_no_memory_and_falls_back(pool_mod, monkeypatch):
    unmapped = []
    Pinning(fail=True).install(pool_mod, monkeypatch)
    monkeypatch.setattr(pool_mod.HostMemory, "unmap", lambda self, addr, n: unmapped.append(n))
    pool = pool_mod.BackupPool(("weights",))
    pool.prepare("weights", 4 * MiB, device=0)
    assert pool.take(4 * MiB) is None
    assert pool.capacity() == 0 and pool.regions == [] and unmapped == [4 * MiB]


def test_a_sleep_that_offloads_none_of_its_tags_releases_the_pool(pool_mod, pinning):
    pool = pool_mod.BackupPool(("weights",))
    pool.prepare("weights", 4 * MiB, device=0)
    assert pool.before_sleep(("weights",)) is True and pool.capacity() == 4 * MiB
    assert pool.before_sleep(()) is False  # level 2: no backups kept at all
    assert pool.capacity() == 0 and pinning.unregistered == [pinning.registered[0][0]]


def test_the_pool_is_off_when_the_switch_says_so(pool_mod, monkeypatch):
    assert pool_mod.BackupPool.from_env() is not None
    monkeypatch.setenv("VLLM_SM12X_BACKUP_POOL", "0")
    assert pool_mod.BackupPool.from_env() is None
    monkeypatch.setenv("VLLM_SM12X_BACKUP_POOL", "1")
    monkeypatch.setenv("VLLM_SM12X_BACKUP_POOL_TAGS", "weights, selftest")
    assert pool_mod.BackupPool.from_env().tags == ("weights", "selftest")


def test_envs_registers_the_switches(patched_tree, monkeypatch):
    envs = load_pool_module(patched_tree / "vllm/envs.py", "_envs_under_test", monkeypatch)
    monkeypatch.delenv("VLLM_SM12X_BACKUP_POOL", raising=False)
    assert envs.VLLM_SM12X_BACKUP_POOL is True and envs.VLLM_SM12X_BACKUP_POOL_TAGS == "weights"
    monkeypatch.setenv("VLLM_SM12X_BACKUP_POOL", "0")
    assert envs.VLLM_SM12X_BACKUP_POOL is False


# --- through the patched cumem.py ----------------------------------------------------------------


@pytest.fixture
def fake() -> FakeCuda:
    return FakeCuda()


def patched_alloc(patched_tree, fake, monkeypatch):
    mod = load_pool_module(patched_tree / MODULE, "vllm.device_allocator.cumem_backup_pool", monkeypatch)
    pin = Pinning()
    pin.install(mod, monkeypatch)
    cumem = load_cumem(patched_tree, fake, monkeypatch, "_cumem_under_test_0005")
    return cumem.CuMemAllocator(), pin


def loaded(fake, alloc):
    """LAYOUT, each tag in its own memory pool as vLLM's worker does; the weights'
    pool pinned by the time the pools have closed."""
    addrs = {}
    for tag in ("weights", "kv_cache"):
        with alloc.use_memory_pool(tag):
            for i, (t, size) in enumerate(LAYOUT):
                if t == tag:
                    addrs[i] = fake.my_malloc(alloc, size, tag)
    addrs = [addrs[i] for i in range(len(LAYOUT))]
    if getattr(alloc, "backup_pool", None) is not None:
        alloc.backup_pool.wait()  # the engine's start-up, during which the pinning runs
    return addrs, {a: bytes(fake.memory[a]) for a in addrs}


WEIGHTS = sum(n for t, n in LAYOUT if t == "weights")


def test_sleep_backs_up_into_the_pool_and_wake_gives_it_back(patched_tree, fake, monkeypatch):
    alloc, pin = patched_alloc(patched_tree, fake, monkeypatch)
    addrs, data = loaded(fake, alloc)
    pool = alloc.backup_pool
    assert [n for _, n, _ in pin.registered] == [WEIGHTS]  # exactly the weights, before any sleep
    alloc.sleep(offload_tags=("weights",))
    assert pool.in_use() == WEIGHTS and pool.fallback_bytes == 0
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)
    assert pool.in_use() == 0
    alloc.sleep(offload_tags=("weights",))  # later sleeps reuse the same memory
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)
    assert len(pin.registered) == 1 and pool.capacity() == WEIGHTS


def test_failed_sleep_returns_every_span_once(patched_tree, fake, monkeypatch):
    alloc, _ = patched_alloc(patched_tree, fake, monkeypatch)
    addrs, data = loaded(fake, alloc)
    pool = alloc.backup_pool
    returned = []
    give_back = type(pool.regions[0]).give_back

    def recording(region, off, n):
        returned.append((off, n))
        give_back(region, off, n)

    monkeypatch.setattr(type(pool.regions[0]), "give_back", recording)
    copy = fake.cudaMemcpy

    calls = []

    def fails_at_the_third(dst, src, count):
        calls.append(src)
        if len(calls) == 3:
            raise RuntimeError("CUDART error: an illegal memory access was encountered")
        copy(dst, src, count)

    monkeypatch.setattr(fake, "cudaMemcpy", fails_at_the_third)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        alloc.sleep(offload_tags=("weights",))
    import gc

    gc.collect()  # the traceback's frames held the last backup
    assert pool.in_use() == 0
    # sleep() takes every backup's span before its first copy: all four, each given back once
    assert len(returned) == len(set(returned)) == 4
    monkeypatch.setattr(fake, "cudaMemcpy", copy)
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)


def test_failed_wake_keeps_every_backup(patched_tree, fake, monkeypatch):
    alloc, _ = patched_alloc(patched_tree, fake, monkeypatch)
    addrs, data = loaded(fake, alloc)
    alloc.sleep(offload_tags=("weights",))
    fake.fail_map_at = fake.map_calls + 3
    with pytest.raises(RuntimeError):
        alloc.wake_up()
    fake.fail_map_at = None
    assert alloc.backup_pool.in_use() == WEIGHTS
    assert all(alloc.pointer_to_data[a].cpu_backup_tensor is not None
               for (t, _), a in zip(LAYOUT, addrs) if t == "weights")
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)
    assert alloc.backup_pool.in_use() == 0


def test_level_2_sleep_holds_no_pinned_memory(patched_tree, fake, monkeypatch):
    alloc, pin = patched_alloc(patched_tree, fake, monkeypatch)
    loaded(fake, alloc)
    alloc.sleep(offload_tags=())  # what sleep(level=2) asks
    assert alloc.backup_pool.capacity() == 0 and len(pin.unregistered) == 1


class EmptyCalls:
    """The ``torch`` cumem.py sees, recording every CPU ``empty`` (a backup)."""

    def __init__(self) -> None:
        self.calls = []

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        if kwargs.get("device") == "cpu":
            self.calls.append((args, kwargs))
        return torch.empty(*args, **kwargs)


def test_switched_off_the_backups_are_0_21_0s(patched_tree, pinned_tree, fake, monkeypatch):
    monkeypatch.setenv("VLLM_SM12X_BACKUP_POOL", "0")
    alloc, pin = patched_alloc(patched_tree, fake, monkeypatch)
    assert alloc.backup_pool is None
    addrs, data = loaded(fake, alloc)
    patched = EmptyCalls()
    monkeypatch.setattr(sys.modules[type(alloc).__module__], "torch", patched)
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)

    old_fake = FakeCuda()
    old = load_cumem(pinned_tree, old_fake, monkeypatch, "_cumem_under_test_0210").CuMemAllocator()
    loaded(old_fake, old)
    pristine = EmptyCalls()
    monkeypatch.setattr(sys.modules[type(old).__module__], "torch", pristine)
    old.sleep(offload_tags=("weights",))
    assert patched.calls == pristine.calls and len(pristine.calls) == 4
    assert pin.registered == []


# --- the selftest's sizes (engines.py) ------------------------------------------------------------


def test_selftest_sizes_are_whole_pieces_in_the_seeds_proportions():
    from sm12x_bundle.selftest import engines

    assert engines.weight_piece(512 * MiB) == 384 * MiB  # not a power of two: rounding shows
    weights, kv, piece = engines.rotation_sizes(24.0, 512 * MiB)
    assert weights % piece == 0 and kv % piece == 0 and piece % (2 * MiB) == 0
    assert weights + kv >= 24 << 30
    assert abs(weights / (weights + kv) - 2 / 3) < 0.02


class CaptureModes:
    """The driver's per-thread stream-capture mode (cuThreadExchangeStreamCaptureMode) and
    the runtime's cudaHostRegister, which records the mode it was called in."""

    GLOBAL, RELAXED = 0, 2

    def __init__(self) -> None:
        self.mode = self.GLOBAL
        self.registered_in: list[int] = []
        self.cuThreadExchangeStreamCaptureMode = self.Function(self._exchange)  # noqa: N815 (the driver's name)

    class Function:
        """A ctypes foreign function: callable, and takes argtypes."""

        def __init__(self, call) -> None:
            self.call, self.argtypes = call, None

        def __call__(self, *args):
            return self.call(*args)

    def _exchange(self, ref) -> int:
        new = ref._obj.value
        ref._obj.value, self.mode = self.mode, new
        return 0

    def cudaHostRegister(self, addr, nbytes, flags):  # noqa: N802
        self.registered_in.append(self.mode)
        return 0


def test_pinning_runs_in_the_relaxed_capture_mode(pool_mod, monkeypatch):
    """The engine captures CUDA graphs (global capture mode) while the pool pins in its own
    thread: there cudaHostRegister is refused and breaks the capture (vLLM 0.33.0's
    test_cudagraph_pool_sleep failed on an H100 until the pinning thread took the relaxed
    mode: docs/records/upstream-allocator-tests-0.33.0-capture-failure-h100-2026-11-25.log).
    So the call is made in relaxed mode, and the thread's mode is put back after it."""
    driver = CaptureModes()
    real_cdll = pool_mod.ctypes.CDLL
    monkeypatch.setattr(pool_mod.ctypes, "CDLL", lambda name, *a, **k: driver if name == "libcuda.so.1" else real_cdll(name, *a, **k))
    monkeypatch.setattr(pool_mod.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(pool_mod.torch.cuda, "cudart", lambda: driver)
    pool_mod.HostMemory(threads=1).register(0x1000, 4096, 0)
    assert driver.registered_in == [CaptureModes.RELAXED]
    assert driver.mode == CaptureModes.GLOBAL


def test_pinning_without_a_driver_still_registers(pool_mod, monkeypatch):
    """No libcuda (a machine without the driver): no capture can be under way either."""
    driver = CaptureModes()

    def no_driver(name, *a, **k):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(pool_mod.ctypes, "CDLL", no_driver)
    monkeypatch.setattr(pool_mod.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(pool_mod.torch.cuda, "cudart", lambda: driver)
    pool_mod.HostMemory.register(object.__new__(pool_mod.HostMemory), 0x1000, 4096, 0)
    assert driver.registered_in == [CaptureModes.GLOBAL]
