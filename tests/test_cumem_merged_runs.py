"""cumem-merged-runs and cumem-run-reservations through each lane's patched cumem.py.

Unless VLLM_CUMEM_MERGE_RUNS=0 a wake maps each run of back-to-back allocations of one tag
with one physical allocation, and the sleep unmaps it with one call. The tree's own
cumem.py runs against :class:`RunsCuda`, test_cumem_patches' fake extension with what the
real driver answered on an H200 (bench/cumem_shared_handle_bench.py, docs/results.md): one
map may cover ranges reserved back to back; one range inside such a mapping can be neither
unmapped nor freed alone. The extension's own side (ranges carved back to back from one
region, my_free leaving a slot of 0 to the allocator, python_free_reserved) is built and
run against the fake driver in tests/test_cumem_native.py.
"""

from __future__ import annotations

import needs
import pytest

torch = needs.module("torch")

from lanekit import LANES, lane_tree  # noqa: E402, F401
from test_cumem_patches import FakeCuda, is_asleep, load_cumem  # noqa: E402

pytestmark = pytest.mark.integration

# Back to back: four weights, then three of the KV cache, then one more weight.
LAYOUT = [("weights", 4096)] * 4 + [("kv_cache", 8192)] * 3 + [("weights", 4096)]


class RunsCuda(FakeCuda):
    """FakeCuda whose allocations lie back to back (``gap_after``: indexes followed by a
    gap), whose map may cover several reservations in one call, and which refuses to
    unmap or free one range of such a mapping alone, as the driver did."""

    def __init__(self, gap_after: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.gap_after = gap_after
        self.reserved: dict[int, int] = {}  # base -> size, as my_malloc reserved them
        self.spans: dict[int, list[int]] = {}  # a map over several reservations: its bases
        self.freed_ranges: list[int] = []  # address ranges given back
        self.unmaps: list[tuple[int, int]] = []  # (address, size) of each unmap call

    def my_malloc(self, alloc, size: int, tag: str | None = None, device: int = 0) -> int:
        d_mem = self._next
        self.reserved[d_mem] = size
        addr = super().my_malloc(alloc, size, tag, device)
        gap = len(self.reserved) - 1 in self.gap_after
        self._next = d_mem + size + (1 << 21 if gap else 0)  # back to back unless told
        return addr

    def _bases(self, d_mem: int, size: int) -> list[int]:
        bases, at = [], d_mem
        while at < d_mem + size and at in self.reserved:
            bases.append(at)
            at += self.reserved[at]
        if at != d_mem + size:
            raise RuntimeError("CUDA Error: invalid argument (not reserved)")
        return bases

    def python_create_and_map(self, device: int, size: int, d_mem: int, p_handle: int) -> None:
        self.map_calls += 1
        if self.map_calls == self.fail_map_at:
            raise RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:137")
        bases = self._bases(d_mem, size)
        for base in bases:
            self._map(base, self.reserved[base])
        if len(bases) > 1:
            self.spans[d_mem] = bases

    def python_unmap_and_release(self, device: int, size: int, d_mem: int, p_handle: int) -> None:
        self.unmap_calls += 1
        if self.unmap_calls == self.fail_unmap_at:
            raise RuntimeError("CUDA Error: invalid argument at cumem_allocator.cpp:240")
        bases = self.spans.get(d_mem) or [d_mem]
        if any(d_mem in span for b, span in self.spans.items() if b != d_mem) or d_mem not in self.memory:
            raise RuntimeError("CUDA Error: invalid argument (one range of a mapping)")
        if sum(self.reserved[b] for b in bases) != size:
            raise RuntimeError("CUDA Error: invalid argument (not the mapping's size)")
        self.spans.pop(d_mem, None)
        for base in bases:
            if base in self.queued.get(device, ()):
                self.violations.append(base)
            del self.memory[base]
        self.unmaps.append((d_mem, size))
        self.events.append(("unmap", d_mem))

    def python_free_reserved(self, device: int, size: int, d_mem: int, p_handle: int) -> None:
        if d_mem in self.memory:
            raise RuntimeError("CUDA Error: invalid argument (still mapped)")
        assert self.reserved.pop(d_mem) == size
        self.freed_ranges.append(d_mem)

    def my_free(self, alloc, ptr: int) -> None:
        """my_free of the patched extension: a slot of 0 leaves the release to the allocator."""
        handle = alloc.python_free_callback(ptr)
        if handle[3] == 0:
            return
        self.python_unmap_and_release(*handle)
        del self.reserved[ptr]
        self.freed_ranges.append(ptr)


@pytest.fixture(params=LANES)
def lane(request) -> str:
    return request.param


@pytest.fixture(params=["1", "0", None], ids=["merged", "off", "default"])
def merge(request, monkeypatch) -> bool:
    """The switch set to 1, to 0, or unset: on by default."""
    if request.param is None:
        monkeypatch.delenv("VLLM_CUMEM_MERGE_RUNS", raising=False)
    else:
        monkeypatch.setenv("VLLM_CUMEM_MERGE_RUNS", request.param)
    return request.param != "0"


def make(lane_tree, lane, monkeypatch, fake: RunsCuda):
    mod = load_cumem(lane_tree(lane, "patched"), fake, monkeypatch, "_cumem_merged_runs")
    return mod, mod.CuMemAllocator()


def allocated(fake: RunsCuda, alloc) -> tuple[list[int], dict[int, bytes]]:
    addrs = [fake.my_malloc(alloc, size, tag) for tag, size in LAYOUT]
    return addrs, {a: bytes(fake.memory[a]) for a in addrs}


def weights_intact(fake: RunsCuda, addrs, data) -> bool:
    return all(bytes(fake.memory[a]) == data[a] for (tag, _), a in zip(LAYOUT, addrs) if tag == "weights")


def test_a_wake_maps_each_run_once_and_the_next_sleep_unmaps_it_once(lane_tree, lane, monkeypatch, merge):
    fake = RunsCuda()
    _, alloc = make(lane_tree, lane, monkeypatch, fake)
    addrs, data = allocated(fake, alloc)
    alloc.sleep(offload_tags=("weights",))
    assert fake.unmap_calls == len(LAYOUT)  # the first sleep: what was mapped at load, one by one
    fake.map_calls = fake.unmap_calls = 0
    alloc.wake_up()
    assert weights_intact(fake, addrs, data)
    # merged: weights 0-3 as one run, the last weight alone, the KV cache as one run
    assert fake.map_calls == (3 if merge else len(LAYOUT))
    assert alloc.last_wake_up_stages["restored"] == 5 and alloc.last_wake_up_stages["emptied"] == 3
    alloc.sleep(offload_tags=("weights",))
    assert fake.unmap_calls == (3 if merge else len(LAYOUT))
    assert alloc.last_sleep_stages["unmapped"] == fake.unmap_calls
    assert fake.memory == {} and fake.violations == []
    alloc.wake_up()
    assert weights_intact(fake, addrs, data)


def test_a_run_stops_at_a_gap_and_at_the_most_bytes_a_run_maps(lane_tree, lane, monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_MERGE_RUNS", "1")
    fake = RunsCuda(gap_after=(1,))  # a gap after the second weight
    mod, alloc = make(lane_tree, lane, monkeypatch, fake)
    monkeypatch.setattr(mod, "MERGE_BYTES", 2 * 8192)  # two KV allocations at the most
    addrs, data = allocated(fake, alloc)
    alloc.sleep(offload_tags=("weights",))
    fake.map_calls = 0
    alloc.wake_up()
    # weights [0, 1] | [2, 3] | [7]; KV [4, 5] | [6]
    assert fake.map_calls == 5
    assert sorted(len(b) for b in fake.spans.values()) == [2, 2, 2]
    assert weights_intact(fake, addrs, data)


def test_the_switch_does_nothing_without_the_extensions_release(lane_tree, lane, monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_MERGE_RUNS", "1")
    fake = RunsCuda()
    monkeypatch.setattr(RunsCuda, "python_free_reserved", None)  # an extension without the fix
    _, alloc = make(lane_tree, lane, monkeypatch, fake)
    assert alloc.merge_runs is False
    allocated(fake, alloc)
    alloc.sleep(offload_tags=("weights",))
    fake.map_calls = 0
    alloc.wake_up()
    assert fake.map_calls == len(LAYOUT)


def merged_and_awake(lane_tree, lane, monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_MERGE_RUNS", "1")
    fake = RunsCuda()
    _, alloc = make(lane_tree, lane, monkeypatch, fake)
    addrs, data = allocated(fake, alloc)
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up()
    fake.map_calls = fake.unmap_calls = 0
    fake.unmaps.clear()
    return fake, alloc, addrs, data


def test_a_member_freed_while_its_run_is_mapped_goes_with_the_run(lane_tree, lane, monkeypatch):
    fake, alloc, addrs, data = merged_and_awake(lane_tree, lane, monkeypatch)
    run = addrs[:4]
    fake.my_free(alloc, run[1])
    # its range can be neither unmapped nor freed alone: both wait for the run
    assert fake.unmap_calls == 0 and fake.freed_ranges == [] and run[1] in fake.memory
    assert run[1] not in alloc.pointer_to_data
    for a in (run[0], run[2]):
        fake.my_free(alloc, a)
    assert fake.unmap_calls == 0
    fake.my_free(alloc, run[3])  # the last member: the run is unmapped, every range given back
    assert fake.unmaps == [(run[0], 4 * 4096)]
    assert sorted(fake.freed_ranges) == sorted(run)
    assert all(a not in fake.memory for a in run) and fake.violations == []
    assert bytes(fake.memory[addrs[7]]) == data[addrs[7]]  # the weight mapped alone is untouched


def test_a_sleep_after_a_member_was_freed_unmaps_the_run_and_gives_its_range_back(lane_tree, lane, monkeypatch):
    fake, alloc, addrs, data = merged_and_awake(lane_tree, lane, monkeypatch)
    fake.my_free(alloc, addrs[1])
    alloc.sleep(offload_tags=("weights",))
    assert (addrs[0], 4 * 4096) in fake.unmaps  # the run whole, its freed member's range too
    assert fake.freed_ranges == [addrs[1]] and fake.memory == {}
    fake.map_calls = 0
    alloc.wake_up()
    # the freed member is gone: weights [0] | [2, 3] | [7], KV [4, 5, 6]
    assert fake.map_calls == 4 and addrs[1] not in fake.memory
    left = [a for (tag, _), a in zip(LAYOUT, addrs) if tag == "weights" and a != addrs[1]]
    assert all(bytes(fake.memory[a]) == data[a] for a in left)


def test_a_failed_wake_unmaps_the_runs_it_mapped_and_can_be_retried(lane_tree, lane, monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_MERGE_RUNS", "1")
    fake = RunsCuda()
    _, alloc = make(lane_tree, lane, monkeypatch, fake)
    addrs, data = allocated(fake, alloc)
    alloc.sleep(offload_tags=("weights",))
    fake.map_calls, fake.fail_map_at = 0, 2  # the second map: the weight alone
    with pytest.raises(RuntimeError, match=r"wake_up failed to map the allocation \(tag 'weights'"):
        alloc.wake_up()
    assert fake.memory == {} and fake.spans == {}
    assert all(is_asleep(d) and d.run is None for d in alloc.pointer_to_data.values())
    fake.fail_map_at = None
    alloc.wake_up()
    assert weights_intact(fake, addrs, data)


def test_a_sleep_that_fails_to_unmap_a_run_maps_back_what_it_unmapped(lane_tree, lane, monkeypatch):
    fake, alloc, addrs, data = merged_and_awake(lane_tree, lane, monkeypatch)
    fake.fail_unmap_at = 2  # the first run is unmapped, the weight alone is not
    with pytest.raises(RuntimeError, match="sleep failed to unmap"):
        alloc.sleep(offload_tags=("weights",))
    assert not any(is_asleep(d) for d in alloc.pointer_to_data.values())
    assert weights_intact(fake, addrs, data)
    fake.fail_unmap_at = None
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up()
    assert weights_intact(fake, addrs, data)


def test_a_sleep_across_ranks_unmaps_each_run_once(lane_tree, lane, monkeypatch):
    fake, alloc, addrs, data = merged_and_awake(lane_tree, lane, monkeypatch)
    prepared = alloc.prepare_sleep(offload_tags=("weights",))
    assert fake.unmap_calls == 0
    alloc.commit_sleep(prepared)
    assert fake.unmap_calls == 3 and fake.memory == {}
    alloc.wake_up()
    assert weights_intact(fake, addrs, data)


def test_a_run_that_cannot_be_unmapped_in_a_committed_sleep_stays_awake_whole(lane_tree, lane, monkeypatch, caplog):
    fake, alloc, addrs, data = merged_and_awake(lane_tree, lane, monkeypatch)
    prepared = alloc.prepare_sleep(offload_tags=("weights",))
    fake.fail_unmap_at = 1  # the first run
    alloc.commit_sleep(prepared)
    assert "could not unmap the 4 allocations (tag 'weights'" in caplog.text
    assert [is_asleep(alloc.pointer_to_data[a]) for a in addrs[:4]] == [False] * 4
    assert all(bytes(fake.memory[a]) == data[a] for a in addrs[:4])


def test_a_run_that_cannot_be_unmapped_when_its_last_member_goes_is_logged_not_raised(lane_tree, lane, monkeypatch, caplog):
    """The free callback runs inside the extension's free: an error raised there would be lost."""
    fake, alloc, addrs, data = merged_and_awake(lane_tree, lane, monkeypatch)
    for a in addrs[:3]:
        fake.my_free(alloc, a)
    fake.fail_unmap_at = 1
    fake.my_free(alloc, addrs[3])  # the last member: the run's unmap fails
    assert "could not unmap the 4 allocations" in caplog.text
    assert all(a in fake.memory for a in addrs[:4]) and fake.freed_ranges == []


def test_a_discard_unmaps_a_run_whole(lane_tree, monkeypatch):
    """0.33.0's discard(tags): the KV cache's run goes with one unmap, the weights stay."""
    fake, alloc, addrs, data = merged_and_awake(lane_tree, "0.33.0", monkeypatch)
    alloc.discard("kv_cache")
    assert fake.unmaps == [(addrs[4], 3 * 8192)]
    assert all(is_asleep(alloc.pointer_to_data[a]) for a in addrs[4:7])
    assert all(bytes(fake.memory[a]) == data[a] for a in addrs[:4] + addrs[7:])


# --- the runs an engine loads: mapped as one when the pool context ends -----------------

def loaded(lane_tree, lane, monkeypatch, scratch=None):
    """An engine's load: the weights, then the KV cache, each in its pool context (the
    LAYOUT's last weight is left out: it would follow the KV cache). ``scratch``
    replaces the device scratch buffer (default: host memory the fake copies through)."""
    fake = RunsCuda()
    mod, alloc = make(lane_tree, lane, monkeypatch, fake)
    monkeypatch.setattr(mod, "_scratch", scratch or (lambda device, n: torch.empty(n, dtype=torch.uint8)))
    addrs = []
    for tag in ("weights", "kv_cache"):
        with alloc.use_memory_pool(tag=tag):
            addrs += [fake.my_malloc(alloc, size, tag) for t, size in LAYOUT[:7] if t == tag]
    return fake, alloc, addrs


def test_a_pool_context_maps_its_runs_as_one_so_the_first_sleep_unmaps_each_once(lane_tree, lane, monkeypatch, merge):
    fake, alloc, addrs = loaded(lane_tree, lane, monkeypatch)
    data = {a: bytes(fake.memory[a]) for a in addrs}
    fake.map_calls = fake.unmap_calls = 0
    alloc.sleep(offload_tags=("weights",))
    # merged: the four weights' run and the KV cache's, one unmap each
    assert fake.unmap_calls == (2 if merge else 7) and fake.memory == {} and fake.violations == []
    alloc.wake_up()
    assert all(bytes(fake.memory[a]) == data[a] for a in addrs[:4])
    assert fake.map_calls == (2 if merge else 7)


def test_a_run_mapped_as_one_at_load_keeps_every_byte_and_frees_like_a_woken_run(lane_tree, lane, monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_MERGE_RUNS", "1")
    fake, alloc, addrs = loaded(lane_tree, lane, monkeypatch)
    # the fake's memory was written at each my_malloc; the copies kept it through the remap
    assert sorted(len(b) for b in fake.spans.values()) == [3, 4]
    assert all(alloc.pointer_to_data[a].run is not None for a in addrs)
    before = {a: bytes(fake.memory[a]) for a in addrs}
    for a in addrs[:4]:
        fake.my_free(alloc, a)
    assert fake.unmaps[-1] == (addrs[0], 4 * 4096) and sorted(fake.freed_ranges) == sorted(addrs[:4])
    assert all(bytes(fake.memory[a]) == before[a] for a in addrs[4:])


def test_without_a_scratch_buffer_the_runs_stay_as_they_were(lane_tree, lane, monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_MERGE_RUNS", "1")

    asked = []

    def full(device, n):
        asked.append(n)
        raise RuntimeError("CUDA out of memory")

    fake, alloc, addrs = loaded(lane_tree, lane, monkeypatch, scratch=full)
    assert asked == [4 * 4096, 3 * 8192]  # each pool context's run asked for one
    assert fake.spans == {} and all(alloc.pointer_to_data[a].run is None for a in addrs)
    fake.unmap_calls = 0
    alloc.sleep(offload_tags=("weights",))
    assert fake.unmap_calls == 7


def test_a_run_that_cannot_be_mapped_as_one_is_mapped_again_one_by_one_with_its_bytes(lane_tree, lane, monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_MERGE_RUNS", "1")
    fake = RunsCuda()
    mod, alloc = make(lane_tree, lane, monkeypatch, fake)
    monkeypatch.setattr(mod, "_scratch", lambda device, n: torch.empty(n, dtype=torch.uint8))
    with alloc.use_memory_pool(tag="weights"):
        addrs = [fake.my_malloc(alloc, 4096, "weights") for _ in range(4)]
        data = {a: bytes(fake.memory[a]) for a in addrs}
        fake.map_calls, fake.fail_map_at = 0, 1  # the run's own map, after its members went
    assert fake.map_calls == 1 + 4  # the run's map, refused; each member's again
    assert fake.spans == {} and sorted(fake.memory) == sorted(addrs)
    assert all(bytes(fake.memory[a]) == data[a] for a in addrs)
    assert all(alloc.pointer_to_data[a].run is None for a in addrs)
    fake.fail_map_at, fake.unmap_calls = None, 0
    alloc.sleep(offload_tags=("weights",))
    assert fake.unmap_calls == 4
    alloc.wake_up()
    assert all(bytes(fake.memory[a]) == data[a] for a in addrs)


def test_with_the_unchanged_skip_a_member_changed_in_place_is_copied_alone(lane_tree, lane, monkeypatch):
    """The skip's checksum is taken per allocation, merged or not: a member written while
    its run is mapped is copied by the next sleep, the others are not, and the wake after
    brings back the changed bytes."""
    monkeypatch.setenv("VLLM_CUMEM_MERGE_RUNS", "1")
    monkeypatch.setenv("VLLM_CUMEM_SKIP_UNCHANGED", "1")
    fake = RunsCuda()
    mod = load_cumem(lane_tree(lane, "patched"), fake, monkeypatch, "_cumem_merged_skip", skip_unchanged=None)
    alloc = mod.CuMemAllocator()
    monkeypatch.setattr(mod, "_scratch", lambda device, n: torch.empty(n, dtype=torch.uint8))
    with alloc.use_memory_pool(tag="weights"):
        addrs = [fake.my_malloc(alloc, 4096, "weights") for _ in range(4)]
    alloc.sleep(offload_tags=("weights",))
    alloc.wake_up()
    assert len(fake.spans) == 1 and alloc.last_sleep_copied_bytes == 4 * 4096
    fake.memory[addrs[2]][7] ^= 0x10  # a weight updated in place inside the mapped run
    data = {a: bytes(fake.memory[a]) for a in addrs}
    alloc.sleep(offload_tags=("weights",))
    assert (alloc.last_sleep_copied_bytes, alloc.last_sleep_skipped_bytes) == (4096, 3 * 4096)
    alloc.wake_up()
    assert all(bytes(fake.memory[a]) == data[a] for a in addrs)
    alloc.sleep(offload_tags=("weights",))
    assert (alloc.last_sleep_copied_bytes, alloc.last_sleep_skipped_bytes) == (0, 4 * 4096)
