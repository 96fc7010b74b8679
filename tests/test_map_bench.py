"""bench/cumem_map_bench.py and the probe's VMM module without a GPU: the enum reader,
the thread accounting and the bench's --help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sm12x_bundle.enginecheck import vmm

from benchkit import BENCH_DIR, load_bench

BENCH = BENCH_DIR / "cumem_map_bench.py"


def test_the_driver_enums_are_read_from_cuda_h(tmp_path):
    values = {name: i + 1 for i, name in enumerate(vmm.ENUMS)}
    values["CU_MEM_HANDLE_TYPE_FABRIC"] = 0x8
    header = tmp_path / "cuda.h"
    header.write_text("typedef enum {\n" + "".join(
        f"    {name} = {hex(v) if name.endswith('FABRIC') else v},\n" for name, v in values.items()) + "} x;\n")
    assert vmm.cuda_enums(header) == values


def test_a_missing_enum_is_named(tmp_path):
    header = tmp_path / "cuda.h"
    header.write_text("typedef enum { CU_MEM_ALLOCATION_TYPE_PINNED = 1 } x;\n")
    with pytest.raises(vmm.VmmError, match="CU_MEM_LOCATION_TYPE_DEVICE not found"):
        vmm.cuda_enums(header)


def test_the_bench_names_a_missing_enum_without_a_traceback(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda.h").write_text("typedef enum { CU_MEM_ALLOCATION_TYPE_PINNED = 1 } x;\n")
    env = {"CUDA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, str(BENCH), str(tmp_path)], capture_output=True, text=True, env=env)
    assert run.returncode == 1
    assert "cumem_map_bench: CU_MEM_LOCATION_TYPE_DEVICE not found" in run.stderr
    assert "Traceback" not in run.stderr


def test_thread_cpu_names_this_thread_and_busiest_sorts_by_use():
    mine = vmm.thread_cpu()
    assert any(name.split(" ", 1)[0].isdigit() for name in mine)
    before = {"1 a": 1.0, "2 b": 0.0}
    after = {"1 a": 1.5, "2 b": 0.1, "3 c": 0.0}
    assert vmm.busiest_threads(before, after, 1.0) == [["1 a", 0.5], ["2 b", 0.1]]


def test_help_says_what_it_measures():
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, check=True).stdout
    assert "create as the extension does" in out and "--threads" in out


WAKE_BENCH = BENCH.parent / "cumem_wake_maps_bench.py"


def load_wake_bench():
    return load_bench(WAKE_BENCH)


def test_the_wake_bench_reads_an_allocation_layout_and_refuses_a_bad_one():
    import argparse

    mod = load_wake_bench()
    assert mod.layout("500x12") == (500, 12 << 20) and mod.layout("1X1") == (1, 1 << 20)
    for bad in ("500", "0x12", "ax12"):
        with pytest.raises(argparse.ArgumentTypeError, match="COUNTxMIB|at least 1"):
            mod.layout(bad)


def test_the_wake_bench_refuses_an_unknown_other_before_it_builds_anything(tmp_path):
    run = subprocess.run([sys.executable, str(WAKE_BENCH), str(tmp_path), "--other", "none,nobody"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--other 'none,nobody': each must be one of" in run.stderr
    assert "Traceback" not in run.stderr and list(tmp_path.iterdir()) == []


def test_the_wake_bench_help_says_what_happens_between_the_sleep_and_the_wake():
    out = subprocess.run([sys.executable, str(WAKE_BENCH), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "release-hog" in out and "--weights" in out


def test_back_to_back_finds_the_longest_run_of_adjacent_ranges():
    from sm12x_bundle.enginecheck.vmm import back_to_back

    ranges = [(0x10, 0x10), (0x40, 0x10), (0x20, 0x10), (0x50, 0x10), (0x60, 0x10), (0x90, 0x10)]
    assert back_to_back(ranges) == [(0x40, 0x10), (0x50, 0x10), (0x60, 0x10)]
    assert back_to_back([(0x10, 0x10)]) == [(0x10, 0x10)] and back_to_back([]) == []


class _Driver:
    """The calls span_pass makes, over a dict of mappings; ``spans`` says whether one
    set-access or unmap call may cover several mappings (CUresult 1 when not)."""

    def __init__(self, spans: bool) -> None:
        self.spans, self.mapped, self.live, self.calls = spans, {}, set(), []

    def prop(self, *args):
        return None

    def check(self, rc, what):
        assert rc == 0, what

    def create(self, size, prop):
        handle = len(self.calls) + 100
        self.live.add(handle)
        self.calls.append("create")
        return 0, handle

    def map(self, addr, size, handle):
        assert addr not in self.mapped
        self.mapped[addr] = size

    def _covers_one(self, addr, size):
        return self.mapped.get(addr) == size

    def try_set_access(self, addr, size):
        self.calls.append(("access", addr, size))
        return 0 if self.spans or self._covers_one(addr, size) else 1

    def set_access(self, addr, size):
        assert self.try_set_access(addr, size) == 0

    def try_unmap(self, addr, size):
        self.calls.append(("unmap", addr, size))
        if not (self.spans or self._covers_one(addr, size)):
            return 1
        for a in [a for a in self.mapped if addr <= a < addr + size]:
            del self.mapped[a]
        return 0

    def release(self, handle):
        self.live.remove(handle)


@pytest.mark.parametrize("spans", [True, False])
def test_the_span_pass_asks_for_one_call_over_the_run_and_leaves_nothing_mapped(spans):
    from sm12x_bundle.enginecheck.vmm import span_pass

    drv, out = _Driver(spans), {}
    ranges = [(0x1000, 0x100), (0x1100, 0x100), (0x1200, 0x100), (0x9000, 0x100)]
    row = span_pass(drv, ranges, rdma=False, out=out)
    assert out["back_to_back_run"] == 3
    assert out["one_call_over_the_run_cuda_result"] == ({"set access": 0, "unmap": 0} if spans else
                                                        {"set access": 1, "unmap": 1})
    assert ("access", 0x1000, 0x300) in drv.calls and ("unmap", 0x1000, 0x300) in drv.calls
    assert set(row) == {"set access, a call for each back-to-back range", "unmap, a call for each back-to-back range",
                        "set access, one call over the run", "unmap, one call over the run"}
    assert drv.mapped == {} and drv.live == set()  # refused or not, every range is unmapped and released


def test_the_span_pass_skips_ranges_that_are_not_back_to_back():
    from sm12x_bundle.enginecheck.vmm import span_pass

    out = {}
    assert span_pass(_Driver(True), [(0x1000, 0x100), (0x3000, 0x100)], rdma=False, out=out) == {}
    assert out == {"back_to_back_run": 1}


FILL_BENCH = BENCH_DIR / "cumem_fill_cost_bench.py"


def load_fill_bench():
    return load_bench(FILL_BENCH)


def test_the_fill_bench_reads_its_paces_and_refuses_bad_ones(tmp_path):
    import argparse

    mod = load_fill_bench()
    assert mod.shares("0.25,1") == [0.25, 1.0]
    for bad in ("0", "1.5", "a", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            mod.shares(bad)
    run = subprocess.run([sys.executable, str(FILL_BENCH), str(tmp_path), "--rounds", "0"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--rounds and --batch must be at least 1" in run.stderr
    assert "Traceback" not in run.stderr and list(tmp_path.iterdir()) == []


def test_a_fill_round_counts_the_steps_it_slows_as_a_loss():
    """A stand-in fill that runs 0.3 s and makes each step take twice as long while it
    runs: the round reads a loss near one half, and drops the fill after it."""
    import threading
    import time
    from types import SimpleNamespace

    mod = load_fill_bench()

    class Fill:
        def __init__(self):
            self.state = "running"
            self.thread = threading.Timer(0.3, lambda: setattr(self, "state", "done"))
            self.thread.start()

        def figures(self):
            return {"state": self.state, "filled_bytes": 1, "seconds": 0.3}

        def stop(self):
            self.thread.join()

    released = []
    alloc = SimpleNamespace(background_fill=None, pointer_to_data={1: "a", 2: "b"},
                            _release_backup=released.append)
    alloc.start_background_fill = lambda: setattr(alloc, "background_fill", Fill())
    checksum_mod = SimpleNamespace(FILL_SHARE=0.25)

    def step():
        running = alloc.background_fill is not None and alloc.background_fill.state == "running"
        time.sleep(0.004 if running else 0.002)

    r = mod.one_round(alloc, checksum_mod, step, 0.0, 0.5)
    assert checksum_mod.FILL_SHARE == 0.5 and r["share"] == 0.5 and r["fill"]["state"] == "done"
    assert 0.25 < r["loss"] < 0.6 and r["steps_without"] > r["steps_with"] > 0
    assert alloc.background_fill is None and released == ["a", "b"]


def test_the_wake_bench_reads_a_wake_order_and_refuses_a_bad_one():
    import argparse

    mod = load_wake_bench()
    assert [mod.order(x) for x in ("as-is", "maps-first", "group4")] == ["as-is", "maps-first", "group4"]
    for bad in ("group0", "group", "groupx", "first"):
        with pytest.raises(argparse.ArgumentTypeError, match="groupN"):
            mod.order(bad)


@pytest.mark.parametrize("group, events", [
    (2, ["map 1", "map 2", "copy 1", "copy 2", "map 3", "copy 3", "map 9"]),
    (None, ["map 1", "map 2", "map 3", "copy 1", "copy 2", "copy 3", "map 9"]),
])
def test_an_ordered_wake_maps_and_queues_in_groups(monkeypatch, group, events):
    """groupN: N maps, then their N copies; None (maps-first): every map of an allocation
    with a backup, then every copy, then the discarded allocations' maps."""
    import time
    from types import SimpleNamespace

    import torch

    mod = load_wake_bench()
    seen = []

    class CallTimes:
        def __init__(self):
            self.seconds = []

        def since(self, start):
            self.seconds.append(time.perf_counter() - start)

        def record(self, stage):
            return {f"{stage}_s": sum(self.seconds)}

    cumem = SimpleNamespace(CallTimes=CallTimes, create_and_map=lambda handle: seen.append(f"map {handle[2]}"),
                            _queue_copy_back=lambda ptr, data: seen.append(f"copy {ptr}"))

    def wake_step(step, ptr, data, woken, fn):
        fn(ptr, data) if step == "copy" else fn(data.handle)

    alloc = SimpleNamespace(_wake_step=wake_step)
    backed = [(p, SimpleNamespace(handle=(0, 8, p), cpu_backup_tensor=object())) for p in (1, 2, 3)]
    discarded = [(9, SimpleNamespace(handle=(0, 8, 9), cpu_backup_tensor=None))]
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: seen.append(f"sync {device}"))
    stages = mod.ordered_wake(cumem, alloc, backed, discarded, [], group)
    assert seen == events + ["sync 0"] and stages["copied_bytes"] == 24


SHARED_BENCH = BENCH_DIR / "cumem_shared_handle_bench.py"


def load_shared_bench(monkeypatch):
    mod = load_bench(SHARED_BENCH)
    seen = []
    monkeypatch.setattr(mod, "usable", lambda torch, ranges: seen.append(list(ranges)) or True)
    return mod, seen


class _VaDriver(_Driver):
    """_Driver with address ranges: ``honours`` says whether a reservation's hint is taken
    (else each range lands apart from the last), and cuMemMap through ``lib``."""

    def __init__(self, honours: bool) -> None:
        super().__init__(spans=True)
        self.honours, self.reserved, self.next = honours, {}, 0x10_0000

    def reserve(self, size, hint=0, alignment=0):
        addr = hint if self.honours and hint and hint not in self.reserved else self.next
        self.next = max(self.next, addr + size) + (0 if self.honours else 0x1000)
        self.reserved[addr] = size
        return addr

    def free_range(self, addr, size):
        assert self.reserved.pop(addr) == size

    @property
    def lib(self):
        drv = self

        class _Lib:
            @staticmethod
            def cuMemMap(addr, size, offset, handle, flags):
                drv.map(addr.value, size.value, handle.value)
                return 0

            @staticmethod
            def cuMemAddressFree(addr, size):
                return 1  # refused while mapped: the bench frees it after the run's unmap
        return _Lib


def test_one_run_maps_each_chunk_over_its_part_and_calls_access_and_unmap_once(monkeypatch):
    bench, seen = load_shared_bench(monkeypatch)
    drv = _VaDriver(honours=True)
    row = bench.one_run(None, drv, count=5, size=0x200, rdma=False, chunk=0x400)
    assert row["physical allocations"] == 3  # 2 + 2 + 1 ranges
    base = min(a for a, _ in seen[0])
    assert seen[0] == [(base + i * 0x200, 0x200) for i in range(5)]
    assert [c for c in drv.calls if c != "create"] == [("access", base, 0xA00), ("unmap", base, 0xA00)]
    assert drv.mapped == {} and drv.live == set() and drv.reserved == {}


@pytest.mark.parametrize("honours", [True, False])
def test_the_hinted_run_maps_once_only_where_the_ranges_came_back_to_back(monkeypatch, honours):
    bench, seen = load_shared_bench(monkeypatch)
    drv, out = _VaDriver(honours), {}
    row = bench.hinted_run(None, drv, count=4, size=0x200, rdma=False, out=out)
    assert out["hinted_back_to_back"] == (4 if honours else 1)
    if honours:
        assert out["hinted_one_map_cuda_result"] == 0 and row["physical allocations"] == 1
        assert out["free_one_address_range_under_the_run_cuda_result"] == 1
        assert "unmap_one_range_of_the_run_cuda_result" in out
        assert len(seen) == 1 and len(seen[0]) == 4
    else:
        assert row == {} and "hinted_one_map_cuda_result" not in out and seen == []
    assert drv.mapped == {} and drv.live == set() and drv.reserved == {}


def test_the_shared_handle_bench_help_names_its_ways():
    out = subprocess.run([sys.executable, str(SHARED_BENCH), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "hinted run, one handle" in out and "currently must be zero" in out and "--chunk-mib" in out


def test_the_wake_bench_reads_orders_and_pauses_and_refuses_bad_ones():
    import argparse

    mod = load_wake_bench()
    names = "as-is,maps-first,kv-after-copies,group4,kernel30,maps-first-kernel10"
    assert mod.orders(names) == names.split(",")
    for bad in ("kernel0", "kernel101", "maps-first-group4", "group0", "sideways"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected as-is"):
            mod.order(bad)
    assert mod.pauses("0,10,30") == [0.0, 10.0, 30.0]
    for bad in ("-1", "ten"):
        with pytest.raises(argparse.ArgumentTypeError, match="negative|milliseconds"):
            mod.pauses(bad)


class _Cumem:
    """A tree's cumem module as use_order sees it: the allocator's own wake, recorded."""

    class CallTimes:
        pass

    def __init__(self):
        calls = self.calls = []

        class CuMemAllocator:
            def _map_and_copy_back(self, restored, emptied, woken):
                calls.append((list(restored), list(emptied)))
                return {"copy_s": 0.5 if restored else 0.0, "copied_bytes": len(restored),
                        "map_emptied_s": 0.1 * len(emptied), "emptied": len(emptied)}

        self.CuMemAllocator = CuMemAllocator


def test_kv_after_copies_is_the_trees_own_wake_of_the_backups_then_of_the_rest():
    mod = load_wake_bench()
    cumem = _Cumem()
    own = cumem.CuMemAllocator._map_and_copy_back
    mod.use_order(cumem, "kv-after-copies")
    stages = cumem.CuMemAllocator()._map_and_copy_back(["w1", "w2"], ["kv"], [])
    assert cumem.calls == [(["w1", "w2"], []), ([], ["kv"])]
    assert stages["copy_s"] == 0.5 and stages["copied_bytes"] == 2 and stages["map_emptied_s"] == 0.1
    mod.use_order(cumem, "as-is")  # the tree's own wake again, not the bench's
    assert cumem.CuMemAllocator._map_and_copy_back is own
    mod.use_order(cumem, "maps-first")
    assert cumem.CuMemAllocator._map_and_copy_back is not own
    mod.use_order(cumem, "as-is")
    assert cumem.CuMemAllocator._map_and_copy_back is own


def test_the_wake_bench_help_names_the_other_engine_and_the_pauses():
    out = subprocess.run([sys.executable, str(WAKE_BENCH), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "engine" in out and "--pause-ms" in out and "--other-sleep" in out and "kv-after-copies" in out


CHECKSUM_SLEEP_BENCH = BENCH.parent / "cumem_checksum_sleep_bench.py"


def test_the_checksum_sleep_bench_says_what_it_times_and_refuses_a_bad_pause(tmp_path):
    out = subprocess.run([sys.executable, str(CHECKSUM_SLEEP_BENCH), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "after a wake" in out and "--pauses" in out
    run = subprocess.run([sys.executable, str(CHECKSUM_SLEEP_BENCH), str(tmp_path), "--pauses", "0,-1"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "a pause cannot be negative" in run.stderr
    assert "Traceback" not in run.stderr and list(tmp_path.iterdir()) == []
    mod = load_bench(CHECKSUM_SLEEP_BENCH)
    assert mod.ms([0.001, 0.003, 0.002]) == {"median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0,
                                             "all_ms": [1.0, 3.0, 2.0]}
