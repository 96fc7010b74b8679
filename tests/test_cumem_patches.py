"""What patches 0001 (stream-aware free) and 0002 (wake_up rollback) change in cumem.py.

Each tree's own ``vllm/device_allocator/cumem.py`` runs with real (CPU) torch. Its CUDA
side is a fake: the C extension and libcudart become :class:`FakeCuda`, which keeps
the contents of every mapped allocation, fails the k-th ``create_and_map`` when told
to, and records maps, unmaps and device synchronizes in order. GPU work still queued
is modelled explicitly (``launch``): unmapping an address that queued work touches,
with no synchronize of its device in between, is recorded as a violation, which is
what faults with CUDA_ERROR_ILLEGAL_ADDRESS on a real GPU.

Every behaviour test runs on both trees and asserts that the bug shows on the pinned
tree and is gone on the patched one.
"""

from __future__ import annotations

import ctypes
import gc
import importlib.util
import logging
import os
import sys
import types
import weakref
from contextlib import contextmanager
from pathlib import Path

import needs
import pytest

torch = needs.module("torch")

from lanekit import LANES, lane_tree  # noqa: E402, F401
from sm12x_bundle.series.apply import VirtualTree  # noqa: E402
from sm12x_bundle.series.probes import probe_matches  # noqa: E402

pytestmark = pytest.mark.integration

CUMEM = Path("vllm/device_allocator/cumem.py")
# Fake device addresses sit above every user-space CPU address (x86-64 and aarch64
# Linux stop at 2**48), so a pointer tells by its value which side it is on.
DEVICE_BASE = 0x7E00_0000_0000_0000


class FakePool:
    """torch.cuda.MemPool as the context-exit sweep sees it: its segments and how
    many bytes of each are in use (0: freed by its tensors, cached by PyTorch)."""

    def __init__(self) -> None:
        self.in_use: dict[int, int] = {}

    def snapshot(self) -> list[dict]:
        return [{"address": a, "allocated_size": n} for a, n in self.in_use.items()]


class FakeAsyncCopy:
    """cudaMemcpyAsync as a ctypes function: argtypes and restype can be set; the copy
    is done at once, through the fake's cudaMemcpy (so its failures and a test's wrapper
    apply), and the fake's queue notes the address as touched until a synchronize."""

    def __init__(self, fake: "FakeCuda") -> None:
        self.fake, self.argtypes, self.restype = fake, None, None

    def __call__(self, dst: int, src: int, count: int, kind: int, stream) -> int:
        self.fake.cudaMemcpy(dst, src, count)
        self.fake.events.append(("copy async", dst))
        return 0


class FakeLib:
    def __init__(self, fake: "FakeCuda") -> None:
        self.cudaMemcpyAsync = FakeAsyncCopy(fake)


class FakeCuda:
    """The cumem C extension and libcudart as cumem.py sees them, and the device."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int | None]] = []
        self.memory: dict[int, bytearray] = {}  # mapped address -> its bytes
        self.queued: dict[int, set[int]] = {}  # device -> addresses queued work touches
        self.violations: list[int] = []  # addresses unmapped under queued work
        self.fail_map_at: int | None = None  # the k-th create_and_map from cumem.py fails
        self.fail_copy_to: int | None = None  # a copy back into this address fails
        self.fail_unmap_at: int | None = None  # the k-th unmap_and_release fails
        self.map_calls = 0
        self.unmap_calls = 0
        self.pool: FakePool | None = None
        self._next = DEVICE_BASE

    # -- vllm.cumem_allocator ------------------------------------------------
    def init_module(self, malloc_callback, free_callback) -> None:
        pass

    def python_create_and_map(self, device: int, size: int, d_mem: int, p_handle: int) -> None:
        self.map_calls += 1
        if self.map_calls == self.fail_map_at:
            raise RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:137")
        self._map(d_mem, size)

    def python_unmap_and_release(self, device: int, size: int, d_mem: int, p_handle: int) -> None:
        self.unmap_calls += 1
        if self.unmap_calls == self.fail_unmap_at:  # cuMemUnmap failed: still mapped
            raise RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp:240")
        if d_mem not in self.memory:
            raise RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp:207")
        if d_mem in self.queued.get(device, ()):
            self.violations.append(d_mem)
        del self.memory[d_mem]
        self.events.append(("unmap", d_mem))

    def _map(self, d_mem: int, size: int) -> None:
        if d_mem in self.memory:  # what cuMemMap says to an address still mapped
            raise RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp:145")
        self.memory[d_mem] = bytearray(b"\xa5" * size)  # fresh memory, not the data
        self.events.append(("map", d_mem))

    # -- CudaRTLibrary ---------------------------------------------------------
    @property
    def lib(self) -> "FakeLib":
        """The loaded library (the patched wake calls cudaMemcpyAsync through it)."""
        return FakeLib(self)

    def CUDART_CHECK(self, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"CUDART error: {result}")

    def cudaMemcpy(self, dst: int, src: int, count: int) -> None:
        if dst >= DEVICE_BASE:
            if dst == self.fail_copy_to:
                raise RuntimeError("CUDART error: out of memory")
            self._mapped(dst)[:count] = ctypes.string_at(src, count)
        else:
            ctypes.memmove(dst, bytes(self._mapped(src)[:count]), count)

    def view(self, addr: int, nbytes: int, device) -> "torch.Tensor":
        """A mapped allocation's bytes as a tensor (cumem-skip-unchanged's checksum reads it)."""
        return torch.frombuffer(self._mapped(addr), dtype=torch.uint8)[:nbytes]

    def _mapped(self, addr: int) -> bytearray:
        if addr not in self.memory:
            raise RuntimeError("CUDART error: an illegal memory access was encountered")
        return self.memory[addr]

    # -- torch.cuda.synchronize ------------------------------------------------
    def synchronize(self, device: int | None = None) -> None:
        self.events.append(("sync", device))
        if device is None:
            self.queued.clear()
        else:
            self.queued.pop(device, None)

    def syncs(self) -> list[int | None]:
        return [d for kind, d in self.events if kind == "sync"]

    # -- the test's side: kernels, and PyTorch calling my_malloc / my_free ---------
    def launch(self, device: int, *addrs: int) -> None:
        """Queue work on ``device`` that touches ``addrs`` and has not run yet."""
        self.queued.setdefault(device, set()).update(addrs)

    def my_malloc(self, alloc, size: int, tag: str | None = None, device: int = 0) -> int:
        d_mem, self._next = self._next, self._next + size + (1 << 21)
        old_tag = alloc.current_tag
        alloc.current_tag = tag or old_tag
        try:
            alloc.python_malloc_callback((device, size, d_mem, d_mem + 1))
        finally:
            alloc.current_tag = old_tag
        self._map(d_mem, size)
        self.memory[d_mem][:] = os.urandom(size)
        if self.pool is not None:
            self.pool.in_use[d_mem] = size
        return d_mem

    def my_free(self, alloc, ptr: int) -> None:
        handle = alloc.python_free_callback(ptr)
        self.python_unmap_and_release(*handle)

    @contextmanager
    def memory_pool(self, malloc_callback, free_callback):
        """Stands in for use_memory_pool_with_allocator (a CUDA pluggable allocator)."""
        self.pool = FakePool()
        try:
            yield self.pool, None
        finally:
            self.pool = None


class CudaPlatform:
    """vllm.platforms.current_platform as 0.33.0's cumem.py asks it: not ROCm."""

    @staticmethod
    def is_rocm() -> bool:
        return False


def load_tree_module(tree: Path, mod_name: str, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """Run the tree's own file of ``mod_name`` as that module (a plain module: nothing
    below it is importable from the tree, so 0003's backup pool stays out)."""
    path = tree / (mod_name.replace(".", "/") + ".py")
    if not path.is_file():
        path = tree / mod_name.replace(".", "/") / "__init__.py"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, mod_name, mod)
    spec.loader.exec_module(mod)
    return mod


def load_cumem(tree: Path, fake: FakeCuda, monkeypatch: pytest.MonkeyPatch, name: str,
               skip_unchanged: str | None = "0"):
    """Import ``tree``'s cumem.py against ``fake``; only what its imports need is faked.
    The tree's cumem-skip-unchanged checksum reads the fake's memory, in pure torch; it is
    switched off (VLLM_CUMEM_SKIP_UNCHANGED) unless ``skip_unchanged`` says otherwise
    (None: as the environment says), so that the other fixes' tests see sleep and wake
    as their patches make them (tests/test_cumem_skip_unchanged.py has it on)."""

    def module(mod_name: str, **attrs) -> None:
        mod = types.ModuleType(mod_name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, mod_name, mod)

    for pkg in ("vllm", "vllm.utils", "vllm.distributed", "vllm.distributed.device_communicators"):
        module(pkg)
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.utils.platform_utils", is_pin_memory_available=lambda: False)
    # 0.33.0's cumem.py: AllocationData and the tag rule in the package's own
    # __init__.py, the allocator config in alloc_conf.py (both run as they are).
    module("vllm.platforms", current_platform=CudaPlatform())
    module("vllm.utils.torch_utils", PIN_MEMORY=False)
    if (tree / "vllm/device_allocator/alloc_conf.py").is_file():
        load_tree_module(tree, "vllm.device_allocator", monkeypatch)
        load_tree_module(tree, "vllm.device_allocator.alloc_conf", monkeypatch)
    module("vllm.utils.system_utils", find_loaded_library=lambda lib: f"/fake/{lib}.abi3.so")
    module(
        "vllm.cumem_allocator",
        init_module=fake.init_module,
        python_create_and_map=fake.python_create_and_map,
        python_unmap_and_release=fake.python_unmap_and_release,
        # cumem-run-reservations' function, where the fake has it (None: an extension without it)
        python_free_reserved=getattr(fake, "python_free_reserved", None),
    )
    module("vllm.distributed.device_communicators.cuda_wrapper", CudaRTLibrary=lambda: fake)
    if (tree / "vllm/device_allocator/cumem_checksum.py").is_file():
        checksum = load_tree_module(tree, "vllm.device_allocator.cumem_checksum", monkeypatch)
        monkeypatch.setattr(checksum, "device_view", fake.view)
        monkeypatch.setattr(checksum, "triton", None)  # its kernel: test_cumem_checksum.py
        if skip_unchanged is not None:
            monkeypatch.setenv("VLLM_CUMEM_SKIP_UNCHANGED", skip_unchanged)
    spec = importlib.util.spec_from_file_location(name, tree / CUMEM)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)
    spec.loader.exec_module(mod)
    assert mod.cumem_available
    monkeypatch.setattr(mod, "use_memory_pool_with_allocator", fake.memory_pool)
    monkeypatch.setattr(torch.cuda, "synchronize", fake.synchronize)
    if hasattr(torch, "accelerator"):
        monkeypatch.setattr(torch.accelerator, "synchronize", fake.synchronize, raising=False)
        monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None, raising=False)
    return mod


@pytest.fixture(params=["pinned", "patched"])
def variant(request) -> str:
    return request.param


@pytest.fixture(params=LANES)
def lane(request) -> str:
    """The lane whose tree runs; a test of one lane's patch parametrizes it alone."""
    return request.param


ONLY_0_21 = pytest.mark.parametrize("lane", ["0.21.0"])  # 0.33.0 has the fix upstream


@pytest.fixture
def fake() -> FakeCuda:
    return FakeCuda()


@pytest.fixture
def alloc(lane_tree, lane, variant, fake, monkeypatch):
    """A fresh CuMemAllocator from the lane's pinned or patched tree."""
    mod = load_cumem(lane_tree(lane, variant), fake, monkeypatch, f"_cumem_under_test_{variant}")
    return mod.CuMemAllocator()


def is_asleep(data) -> bool:
    """0.33.0 names it is_asleep; 0.21.0 has none, its patch 0002 names it asleep."""
    return getattr(data, "is_asleep", False) or getattr(data, "asleep", False)


# --- 0001: stream-aware free ------------------------------------------------------
# 0.33.0 synchronizes in the free callback (upstream), but its sleep() still unmaps
# with work queued: the 0.33.0 lane's 0001 adds the once-per-device synchronize.


@ONLY_0_21
def test_free_callback_synchronizes_before_unmap(variant, fake, alloc):
    a = fake.my_malloc(alloc, 4096)
    fake.launch(0, a)
    fake.my_free(alloc, a)
    assert a not in fake.memory and a not in alloc.pointer_to_data
    if variant == "pinned":
        assert fake.violations == [a]
        assert fake.syncs() == []
    else:
        assert fake.violations == []
        assert fake.events[-2:] == [("sync", 0), ("unmap", a)]


def test_sleep_synchronizes_each_device_once_before_unmapping(variant, fake, alloc):
    on_0 = [fake.my_malloc(alloc, 4096, "weights"), fake.my_malloc(alloc, 8192, "kv_cache"),
            fake.my_malloc(alloc, 4096, "kv_cache")]
    on_1 = [fake.my_malloc(alloc, 4096, "weights", device=1)]
    fake.launch(0, *on_0)
    fake.launch(1, *on_1)
    fake.events.clear()
    alloc.sleep(offload_tags=("weights",))
    assert fake.memory == {}
    if variant == "pinned":
        assert sorted(fake.violations) == sorted(on_0 + on_1)
    else:
        assert fake.violations == []
        assert fake.syncs() == [0, 1]  # once per device, not once per allocation
        first_unmap = next(i for i, (kind, _) in enumerate(fake.events) if kind == "unmap")
        assert all(kind != "sync" for kind, _ in fake.events[first_unmap:])


@ONLY_0_21
def test_pool_exit_sweep_synchronizes_once_before_unmapping(variant, fake, alloc):
    with alloc.use_memory_pool(tag="weights"):
        kept = fake.my_malloc(alloc, 4096)
        dropped = [fake.my_malloc(alloc, 8192) for _ in range(3)]
        fake.launch(0, kept, *dropped)
        for addr in dropped:  # their tensors died; PyTorch's cache keeps the segments
            fake.pool.in_use[addr] = 0
        fake.events.clear()
    assert set(fake.memory) == {kept} and set(alloc.pointer_to_data) == {kept}
    if variant == "pinned":
        assert fake.violations == dropped
    else:
        assert fake.violations == []
        assert fake.events == [("sync", 0)] + [("unmap", a) for a in dropped]


def test_patched_synchronizes_only_when_something_is_unmapped(fake, request, monkeypatch):
    alloc = load_cumem(request.getfixturevalue("patched_tree"), fake, monkeypatch, "_cumem_cost").CuMemAllocator()
    with alloc.use_memory_pool(tag="weights"):
        addrs = [fake.my_malloc(alloc, 4096) for _ in range(3)]
    assert fake.syncs() == []  # allocating, and a sweep with nothing to free, cost nothing
    alloc.sleep(offload_tags=("weights",))
    fake.events.clear()
    alloc.wake_up()
    # the wake's copies back are queued (cudaMemcpyAsync): one synchronize, at its end
    assert fake.syncs() == [0] and fake.events[-1] == ("sync", 0) and set(fake.memory) == set(addrs)


# --- wake_up rollback (0.21.0's 0002, 0.33.0's 0001) -----------------------------------
# 0.33.0 wakes only what is asleep, so a retry resumes where a failed wake stopped
# (not "invalid argument" forever, as in 0.21.0); but the failed wake still keeps what
# it mapped, and an allocation whose copy back failed counts as awake and never gets
# its bytes back.

LAYOUT = [("weights", 4096), ("weights", 8192), ("kv_cache", 2 * 4096), ("weights", 12288), ("weights", 4096)]
# The patched wake_up maps the offloaded allocations (with a backup) first, the discarded
# kv cache last.
WAKE_ORDER = [e for e in LAYOUT if e[0] == "weights"] + [e for e in LAYOUT if e[0] != "weights"]


def asleep_with_data(fake: FakeCuda, alloc) -> tuple[list[int], dict[int, bytes]]:
    """Allocate LAYOUT, fill it with random bytes, sleep (offloading the weights)."""
    addrs = [fake.my_malloc(alloc, size, tag) for tag, size in LAYOUT]
    data = {a: bytes(fake.memory[a]) for a in addrs}
    alloc.sleep(offload_tags=("weights",))
    assert fake.memory == {}
    return addrs, data


def record_copies(fake: FakeCuda, monkeypatch) -> None:
    """From now on, fake.events holds ("copy", device address) for every cudaMemcpy
    beside the maps and unmaps (and nothing from before)."""
    copy = fake.cudaMemcpy

    def copying(dst, src, count):
        fake.events.append(("copy", dst if dst >= DEVICE_BASE else src))
        copy(dst, src, count)

    monkeypatch.setattr(fake, "cudaMemcpy", copying)
    del fake.events[:]


def state(alloc) -> dict[int, tuple]:
    """What must survive a failed wake_up unchanged: per allocation, its tag, its
    handle and the bytes of its CPU backup (None when it has none)."""
    return {
        ptr: (d.tag, d.handle, None if d.cpu_backup_tensor is None else d.cpu_backup_tensor.numpy().tobytes())
        for ptr, d in alloc.pointer_to_data.items()
    }


def assert_woken_intact(fake: FakeCuda, alloc, addrs: list[int], data: dict[int, bytes]) -> None:
    assert set(fake.memory) == set(addrs)
    for (tag, _), a in zip(LAYOUT, addrs):
        if tag == "weights":
            assert bytes(fake.memory[a]) == data[a], f"weights at {a:#x} not restored"
        assert alloc.pointer_to_data[a].cpu_backup_tensor is None


@pytest.mark.parametrize("k", [2, 3, 5])
def test_wake_up_failing_at_allocation_k_rolls_back(lane, variant, fake, alloc, k):
    addrs, data = asleep_with_data(fake, alloc)
    before = state(alloc)
    fake.fail_map_at = fake.map_calls + k
    with pytest.raises(RuntimeError) as failure:
        alloc.wake_up()
    fake.fail_map_at = None
    if variant == "pinned":
        assert set(fake.memory) == set(addrs[: k - 1])  # left mapped, backups dropped
        assert state(alloc) != before
        if lane == "0.21.0":
            with pytest.raises(RuntimeError, match="invalid argument"):
                alloc.wake_up()  # and every retry fails on the address still mapped
        return
    assert fake.memory == {}
    assert state(alloc) == before
    tag, size = WAKE_ORDER[k - 1]
    assert f"tag {tag!r}, {size} bytes" in str(failure.value)
    assert isinstance(failure.value.__cause__, RuntimeError)
    assert "out of memory" in str(failure.value.__cause__) and "out of memory" in str(failure.value)
    alloc.wake_up()  # memory is back: the retry succeeds
    assert_woken_intact(fake, alloc, addrs, data)


def test_wake_up_queues_each_copy_after_its_map_and_maps_the_discarded_allocations_last(
        lane, variant, fake, alloc, monkeypatch):
    """The driver works on new memory after cuMemCreate returns and copies queued then
    wait for it: a discarded kv cache mapped before the copies made the wake about 3%
    slower on an H200 (docs/results.md). The patched wake maps each offloaded allocation
    and queues its copy at once (the host maps the next while the link copies: in an
    engine the maps took longer than the copies), then maps the discarded ones, then
    waits for the copies."""
    addrs, data = asleep_with_data(fake, alloc)
    record_copies(fake, monkeypatch)
    alloc.wake_up()
    events = [e for e in fake.events if e[0] in ("copy", "map")]
    weights = [a for (tag, _), a in zip(LAYOUT, addrs) if tag == "weights"]
    kv = [a for (tag, _), a in zip(LAYOUT, addrs) if tag != "weights"]
    if variant == "patched":
        expected = [e for a in weights for e in (("map", a), ("copy", a))] + [("map", a) for a in kv]
        assert fake.events[-1] == ("sync", 0)  # after every map: the copies ran meanwhile
    else:  # pristine: map and copy one allocation at a time, in layout order
        expected = [e for a in addrs for e in ((("map", a), ("copy", a)) if a in weights else (("map", a),))]
    assert events == expected
    assert_woken_intact(fake, alloc, addrs, data)


def test_wake_up_failing_in_copy_back_rolls_back(lane, variant, fake, alloc):
    addrs, data = asleep_with_data(fake, alloc)
    before = state(alloc)
    fake.fail_copy_to = addrs[1]
    with pytest.raises(RuntimeError) as failure:
        alloc.wake_up()
    fake.fail_copy_to = None
    if variant == "pinned":
        assert set(fake.memory) == set(addrs[:2])
        assert alloc.pointer_to_data[addrs[0]].cpu_backup_tensor is None  # its data only lives on
        if lane == "0.21.0":
            with pytest.raises(RuntimeError, match="invalid argument"):
                alloc.wake_up()
        else:  # the retry resumes, but counts addrs[1] as awake: its bytes are lost
            alloc.wake_up()
            assert bytes(fake.memory[addrs[1]]) != data[addrs[1]]
        return
    assert fake.memory == {} and state(alloc) == before
    assert "tag 'weights', 8192 bytes" in str(failure.value)
    assert "CUDART error: out of memory" in str(failure.value.__cause__)
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)


def test_failed_wake_up_leaves_what_earlier_calls_woke(lane, variant, fake, alloc):
    addrs, data = asleep_with_data(fake, alloc)
    kv = addrs[2]
    alloc.wake_up(tags=["kv_cache"])
    fake.fail_map_at = fake.map_calls + 2
    with pytest.raises(RuntimeError):
        alloc.wake_up(tags=["weights"])
    fake.fail_map_at = None
    if variant == "pinned":
        assert set(fake.memory) == {kv, addrs[0]}
        if lane == "0.21.0":
            with pytest.raises(RuntimeError, match="invalid argument"):
                alloc.wake_up(tags=["weights"])
        return
    assert set(fake.memory) == {kv}
    alloc.wake_up(tags=["weights"])
    assert_woken_intact(fake, alloc, addrs, data)


# --- wake_up wakes only what is asleep (0.21.0's 0002; upstream in 0.33.0: a guard) ---


def pristine_bug(lane: str, variant: str) -> bool:
    """Whether the pristine tree of the lane has the bug a guard test looks at:
    0.33.0 already wakes only what is asleep and sleeps only what is awake."""
    return variant == "pinned" and lane == "0.21.0"


def test_second_wake_up_wakes_nothing(lane, variant, fake, alloc, caplog):
    addrs, data = asleep_with_data(fake, alloc)
    alloc.wake_up()
    maps = fake.map_calls
    if pristine_bug(lane, variant):
        with pytest.raises(RuntimeError, match="invalid argument"):
            alloc.wake_up()  # maps again an address that is mapped
        return
    with caplog.at_level(logging.INFO):
        alloc.wake_up()
    assert fake.map_calls == maps
    if lane == "0.21.0":
        assert "nothing is asleep" in caplog.text
    assert_woken_intact(fake, alloc, addrs, data)
    alloc.sleep(offload_tags=("weights",))  # and the allocator sleeps and wakes as before
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)


def test_wake_up_by_tag_subsets_in_any_order(lane, variant, fake, alloc):
    addrs, data = asleep_with_data(fake, alloc)
    alloc.wake_up(tags=["weights"])
    alloc.wake_up(tags=["kv_cache"])
    assert set(fake.memory) == set(addrs)
    if pristine_bug(lane, variant):
        with pytest.raises(RuntimeError, match="invalid argument"):
            alloc.wake_up()
        return
    alloc.wake_up()  # everything is awake: nothing to map
    alloc.wake_up(tags=["weights"])
    assert_woken_intact(fake, alloc, addrs, data)


# --- sleep() is all or nothing (0.21.0's 0002, 0.33.0's 0001) ---------------------------


class HostAllocationFails:
    """The ``torch`` that a tree's cumem.py sees, whose k-th CPU ``empty`` (the pinned
    backup of sleep()) fails as pinned host allocation does when host memory runs out.
    Keeps a weak reference to every backup it made, to tell whether it was released."""

    def __init__(self, k: int) -> None:
        self.k, self.calls, self.made = k, 0, []

    def __getattr__(self, name):
        return getattr(torch, name)

    def empty(self, *args, **kwargs):
        if kwargs.get("device") != "cpu":
            return torch.empty(*args, **kwargs)
        self.calls += 1
        if self.calls == self.k:
            raise RuntimeError("CUDA error: out of memory (pinned host allocation)")
        backup = torch.empty(*args, **kwargs)
        self.made.append(weakref.ref(backup))
        return backup

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.made)


def awake_with_data(fake: FakeCuda, alloc) -> tuple[list[int], dict[int, bytes]]:
    addrs = [fake.my_malloc(alloc, size, tag) for tag, size in LAYOUT]
    return addrs, {a: bytes(fake.memory[a]) for a in addrs}


def assert_untouched(fake: FakeCuda, alloc, addrs: list[int], data: dict[int, bytes], tags=("weights", "kv_cache")):
    """Every allocation mapped, not asleep, without a backup; the bytes of ``tags`` as they were."""
    assert set(fake.memory) == set(addrs)
    for (tag, _), a in zip(LAYOUT, addrs):
        if tag in tags:
            assert bytes(fake.memory[a]) == data[a], f"{tag} at {a:#x} lost its bytes"
        d = alloc.pointer_to_data[a]
        assert d.cpu_backup_tensor is None and not is_asleep(d)


@pytest.mark.parametrize("k", [2, 4])  # the k-th of the 4 weights' backups fails
def test_sleep_failing_at_backup_k_leaves_everything_mapped(variant, fake, alloc, monkeypatch, k):
    addrs, data = awake_with_data(fake, alloc)
    host = HostAllocationFails(k)
    monkeypatch.setattr(sys.modules[type(alloc).__module__], "torch", host)
    with pytest.raises(RuntimeError) as failure:
        alloc.sleep(offload_tags=("weights",))
    if variant == "pinned":
        assert set(fake.memory) != set(addrs)  # unmapped under live tensors
        return
    assert_untouched(fake, alloc, addrs, data)
    assert host.alive() == 0  # the k-1 backups made were released
    tag, size = [ts for ts in LAYOUT if ts[0] == "weights"][k - 1]
    assert f"sleep failed to back up the allocation (tag {tag!r}, {size} bytes)" in str(failure.value)
    assert "out of memory" in str(failure.value.__cause__)
    alloc.sleep(offload_tags=("weights",))  # the retry succeeds
    assert fake.memory == {}
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)


def test_sleep_failing_in_the_copy_leaves_everything_mapped(variant, fake, alloc, monkeypatch):
    addrs, data = awake_with_data(fake, alloc)
    copy = fake.cudaMemcpy

    def fails_from_the_third(dst, src, count, calls=[]):
        calls.append(src)
        if len(calls) == 3:
            raise RuntimeError("CUDART error: an illegal memory access was encountered")
        copy(dst, src, count)

    monkeypatch.setattr(fake, "cudaMemcpy", fails_from_the_third)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        alloc.sleep(offload_tags=("weights",))
    if variant == "pinned":
        assert set(fake.memory) != set(addrs)
        return
    assert_untouched(fake, alloc, addrs, data)


def test_sleep_releases_each_allocation_right_after_its_copy(lane, variant, fake, alloc, monkeypatch):
    """Released all at once at the end of sleep(), the memory made a wake right after the
    sleep run at 0.80-0.81 of the host-to-device ceiling instead of 0.88-0.89 on an H200
    (docs/results.md): each offloaded allocation is
    released right after its own copy, as pristine does, the discarded ones after them."""
    addrs, _ = awake_with_data(fake, alloc)
    record_copies(fake, monkeypatch)
    alloc.sleep(offload_tags=("weights",))
    events = [e for e in fake.events if e[0] in ("copy", "unmap")]
    weights = {a for (tag, _), a in zip(LAYOUT, addrs) if tag == "weights"}
    if variant == "patched":  # the offloaded ones first, then the discarded kv cache
        order = [a for a in addrs if a in weights] + [a for a in addrs if a not in weights]
    else:  # pristine: layout order
        order = addrs
    expected = [e for a in order for e in ((("copy", a), ("unmap", a)) if a in weights else (("unmap", a),))]
    assert events == expected


def test_sleep_failing_to_unmap_maps_back_what_it_unmapped(variant, fake, alloc):
    addrs, data = awake_with_data(fake, alloc)
    # The 4th unmap: pristine releases in layout order (LAYOUT[3], after a weight, a weight
    # and the kv cache); the patched sleep releases the offloaded allocations first, each
    # right after its copy, so its 4th is LAYOUT[4] and the discarded kv cache is untouched.
    fake.fail_unmap_at = fake.unmap_calls + 4
    with pytest.raises(RuntimeError) as failure:
        alloc.sleep(offload_tags=("weights",))
    fake.fail_unmap_at = None
    if variant == "pinned":
        assert set(fake.memory) == set(addrs[3:])
        return
    # The offloaded bytes come back, and the kv cache was never released.
    assert_untouched(fake, alloc, addrs, data)
    assert "sleep failed to unmap the allocation (tag 'weights', 4096 bytes)" in str(failure.value)
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)


def test_sleep_twice_sleeps_once(lane, variant, fake, alloc):
    addrs, data = asleep_with_data(fake, alloc)
    if pristine_bug(lane, variant):
        with pytest.raises(RuntimeError):
            alloc.sleep(offload_tags=("weights",))  # copies out of unmapped memory
        return
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)


# --- discard() beside the transactions (0.33.0) ---------------------------------------
# 0.33.0's discard(tags) unmaps the awake allocations of its tags without a backup and
# skips the asleep ones. The transactions leave no allocation half-done between calls,
# so discard never sees one mid-transaction; what it discarded wakes (and rolls back)
# like any allocation without a backup, and it keeps the backup of one asleep.

ONLY_0_33 = pytest.mark.parametrize("lane", ["0.33.0"])


@ONLY_0_33
def test_failed_wake_up_rolls_back_a_discarded_allocation(variant, fake, alloc):
    addrs, data = awake_with_data(fake, alloc)
    kv = addrs[2]
    alloc.discard("kv_cache")
    assert set(fake.memory) == set(addrs) - {kv}
    alloc.sleep(offload_tags=("weights",))
    fake.fail_map_at = fake.map_calls + 4  # the 4th map: pristine LAYOUT[3], patched LAYOUT[4]
    with pytest.raises(RuntimeError):
        alloc.wake_up()
    fake.fail_map_at = None
    if variant == "pinned":
        assert set(fake.memory) == set(addrs[:3])  # kept what the failed wake mapped
        return
    assert fake.memory == {}
    data_kv = alloc.pointer_to_data[kv]
    assert is_asleep(data_kv) and data_kv.cpu_backup_tensor is None
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)


@ONLY_0_33
def test_discard_keeps_the_backup_of_an_asleep_allocation(variant, fake, alloc):
    addrs, data = asleep_with_data(fake, alloc)
    maps, unmaps = fake.map_calls, fake.unmap_calls
    alloc.discard("weights")
    assert (fake.map_calls, fake.unmap_calls) == (maps, unmaps)
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)


@ONLY_0_33
def test_discard_after_a_failed_sleep(variant, fake, alloc, monkeypatch):
    addrs, data = awake_with_data(fake, alloc)
    monkeypatch.setattr(sys.modules[type(alloc).__module__], "torch", HostAllocationFails(2))
    with pytest.raises(RuntimeError):
        alloc.sleep(offload_tags=("weights",))
    if variant == "pinned":
        assert set(fake.memory) != set(addrs)  # the first weight unmapped under its tensor
        return
    alloc.discard("kv_cache")
    assert set(fake.memory) == set(addrs) - {addrs[2]}
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up()
    assert_woken_intact(fake, alloc, addrs, data)


# --- what the selftest reads of each lane's allocator ------------------------------------


def test_selftest_finds_the_one_pool_kept_for_a_tag(variant, fake, alloc):
    from sm12x_bundle.selftest.frees import kept_pool

    with alloc.use_memory_pool(tag="selftest-stale-drop"):
        fake.my_malloc(alloc, 4096)
    pool, _allocator = kept_pool(alloc.allocator_and_pools["selftest-stale-drop"])
    assert pool is not None and not isinstance(pool, (list, tuple))


# --- probes -----------------------------------------------------------------------


def _probes(series, patch_id: str):
    return next(p for p in series.patches if p.id == patch_id).probes


def test_stream_aware_free_probe_sees_only_the_fixed_trees(series, pinned_tree, patched_tree):
    probes = _probes(series, "cumem-stream-aware-free")
    assert probes
    assert not any(probe_matches(VirtualTree(pinned_tree), p) for p in probes)
    assert all(probe_matches(VirtualTree(patched_tree), p) for p in probes)


