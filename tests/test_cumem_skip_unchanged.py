"""cumem-skip-unchanged through each lane's patched cumem.py: sleep copies only what changed.

The patched tree's own cumem.py runs against test_cumem_patches' FakeCuda (the C
extension and libcudart), with the fix's checksum module imported as vLLM would import
it; the checksum reads the fake's device memory through its ``view`` hook, in pure torch
(its Triton kernel is checked against the same reference in test_cumem_checksum.py).
"""

from __future__ import annotations

import ast
import gc
from pathlib import Path

import needs
import pytest

torch = needs.module("torch")

from lanekit import LANES, lane_tree  # noqa: E402, F401
from test_backup_pool import load_pool_module  # noqa: E402
from test_cumem_patches import DEVICE_BASE, LAYOUT, FakeCuda, load_cumem  # noqa: E402

pytestmark = pytest.mark.integration

WEIGHTS = sum(n for t, n in LAYOUT if t == "weights")


@pytest.fixture(autouse=True)
def switched_on(monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_SKIP_UNCHANGED", "1")  # the default, whatever the environment says


@pytest.fixture(params=LANES)
def lane(request) -> str:
    return request.param


@pytest.fixture
def fake(monkeypatch) -> FakeCuda:
    fake = FakeCuda()
    fake.copied = []  # device addresses copied to the host (sleep's copies)
    copy = fake.cudaMemcpy

    def recording(dst, src, count):
        if src >= DEVICE_BASE:
            fake.copied.append(src)
        copy(dst, src, count)

    monkeypatch.setattr(fake, "cudaMemcpy", recording)
    return fake


def make_alloc(lane_tree, lane, fake, monkeypatch, pool: bool = False):
    tree = lane_tree(lane, "patched")
    if pool:
        mod = load_pool_module(tree / "vllm/device_allocator/cumem_backup_pool.py",
                      "vllm.device_allocator.cumem_backup_pool", monkeypatch)
        monkeypatch.setattr(mod.HostMemory, "register", lambda self, addr, n, dev: None)
        monkeypatch.setattr(mod.HostMemory, "unregister", lambda self, addr: None)
    # the checksum reads the fake's memory (load_cumem); the switch as the test sets it
    return load_cumem(tree, fake, monkeypatch, f"_cumem_skip_{lane}", skip_unchanged=None).CuMemAllocator()


def loaded(fake, alloc) -> list[int]:
    """LAYOUT, each tag in its own memory pool as vLLM's worker does."""
    addrs = {}
    for tag in ("weights", "kv_cache"):
        with alloc.use_memory_pool(tag):
            for i, (t, size) in enumerate(LAYOUT):
                if t == tag:
                    addrs[i] = fake.my_malloc(alloc, size, tag)
    if getattr(alloc, "backup_pool", None) is not None:
        alloc.backup_pool.wait()
    return [addrs[i] for i in range(len(LAYOUT))]


def weights(addrs: list[int]) -> list[int]:
    return [a for (t, _), a in zip(LAYOUT, addrs) if t == "weights"]


def snapshot(fake, addrs) -> dict[int, bytes]:
    return {a: bytes(fake.memory[a]) for a in addrs}


def cycle(alloc, fake) -> list[int]:
    """sleep(level 1) then wake_up; what the sleep copied."""
    del fake.copied[:]
    alloc.sleep(offload_tags=("weights",))
    copied = list(fake.copied)
    alloc.wake_up()
    return copied


def test_an_unchanged_allocation_is_not_copied_again(lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    data = snapshot(fake, weights(addrs))
    assert cycle(alloc, fake) == weights(addrs)  # the first sleep copies every weight
    assert (alloc.last_sleep_copied_bytes, alloc.last_sleep_skipped_bytes) == (WEIGHTS, 0)
    for _ in range(2):
        assert cycle(alloc, fake) == []  # serving wrote nothing: nothing copied
        assert (alloc.last_sleep_copied_bytes, alloc.last_sleep_skipped_bytes) == (0, WEIGHTS)
        assert alloc.last_sleep_checksum_s > 0
        assert snapshot(fake, weights(addrs)) == data  # and the wake restored every byte


def test_an_allocation_changed_in_place_is_copied_and_restored(lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    cycle(alloc, fake)
    changed = weights(addrs)[1]
    fake.memory[changed][100] ^= 0x01  # a weight updated in place while awake
    data = snapshot(fake, weights(addrs))
    assert cycle(alloc, fake) == [changed]
    assert alloc.last_sleep_copied_bytes == LAYOUT[1][1]  # that allocation alone
    assert snapshot(fake, weights(addrs)) == data  # the changed bytes came back, not the old
    assert cycle(alloc, fake) == []


def test_switched_off_every_sleep_copies_everything(lane_tree, lane, fake, monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_SKIP_UNCHANGED", "0")
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    assert alloc.skip_unchanged is None
    addrs = loaded(fake, alloc)
    for _ in range(2):
        assert cycle(alloc, fake) == weights(addrs)
        assert (alloc.last_sleep_copied_bytes, alloc.last_sleep_skipped_bytes) == (WEIGHTS, 0)
        assert all(d.cpu_backup_tensor is None for d in alloc.pointer_to_data.values())


def test_level_2_drops_the_kept_backups_and_their_sums(lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    cycle(alloc, fake)
    assert set(alloc.skip_unchanged.stored) == set(weights(addrs))
    alloc.sleep(offload_tags=())  # level 2: the weights are discarded
    assert alloc.skip_unchanged.stored == {}
    assert all(d.cpu_backup_tensor is None for d in alloc.pointer_to_data.values())
    alloc.wake_up()
    for a in weights(addrs):  # fresh memory: the kept backup was not restored
        assert bytes(fake.memory[a]) == b"\xa5" * len(fake.memory[a])
    assert cycle(alloc, fake) == weights(addrs)  # and the next sleep copies them all


def test_a_failed_sleep_drops_the_sums(lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    cycle(alloc, fake)
    fake.memory[weights(addrs)[2]][0] ^= 0xFF
    data = snapshot(fake, weights(addrs))
    fake.fail_unmap_at = fake.unmap_calls + 3
    with pytest.raises(RuntimeError, match="sleep failed"):
        alloc.sleep(offload_tags=("weights",))
    fake.fail_unmap_at = None
    gc.collect()
    assert alloc.skip_unchanged.stored == {}
    assert snapshot(fake, weights(addrs)) == data  # rolled back: mapped with their bytes
    assert cycle(alloc, fake) == weights(addrs)  # nothing is trusted: every weight copied
    assert snapshot(fake, weights(addrs)) == data


def test_a_freed_allocation_loses_its_sum_and_a_new_one_at_its_address_is_copied(
        lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    cycle(alloc, fake)
    gone = weights(addrs)[0]
    size = len(fake.memory[gone])
    fake.my_free(alloc, gone)
    assert gone not in alloc.skip_unchanged.stored
    alloc.current_tag = "weights"  # PyTorch hands the same address out again
    alloc.python_malloc_callback((0, size, gone, gone + 1))
    alloc.current_tag = "default"
    fake._map(gone, size)
    assert cycle(alloc, fake) == [gone]


def test_the_transactions_across_ranks_skip_too(lane_tree, lane, fake, monkeypatch):
    """prepare_sleep/commit_sleep (the cross-rank sleep) skip what is unchanged, and an
    aborted sleep drops the sums of the backups it lets go."""
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    cycle(alloc, fake)
    del fake.copied[:]
    prepared = alloc.prepare_sleep(("weights",))
    assert fake.copied == [] and alloc.last_sleep_skipped_bytes == WEIGHTS
    alloc.abort_sleep(prepared)
    assert alloc.skip_unchanged.stored == {}
    prepared = alloc.prepare_sleep(("weights",))
    assert fake.copied == weights(addrs)
    alloc.commit_sleep(prepared)
    alloc.wake_up()
    del fake.copied[:]
    alloc.commit_sleep(alloc.prepare_sleep(("weights",)))
    assert fake.copied == []


def test_a_failed_wake_keeps_the_sums(lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    data = snapshot(fake, weights(addrs))
    alloc.sleep(offload_tags=("weights",))
    fake.fail_map_at = fake.map_calls + 2
    with pytest.raises(RuntimeError):
        alloc.wake_up()
    fake.fail_map_at = None
    alloc.wake_up()  # the retry restores from the backups the sums describe
    assert snapshot(fake, weights(addrs)) == data
    assert cycle(alloc, fake) == []


def test_with_the_backup_pool_the_spans_stay_with_their_allocations(lane_tree, lane, fake, monkeypatch):
    monkeypatch.delenv("VLLM_SM12X_BACKUP_POOL", raising=False)
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch, pool=True)
    addrs = loaded(fake, alloc)
    pool = alloc.backup_pool
    held = pool.capacity()  # pinned once the model is loaded, the skip on or off
    data = snapshot(fake, weights(addrs))
    assert cycle(alloc, fake) == weights(addrs)
    assert pool.in_use() == WEIGHTS and pool.fallback_bytes == 0  # kept through the wake
    assert pool.capacity() == held  # keeping them took no more host memory
    assert cycle(alloc, fake) == [] and pool.in_use() == WEIGHTS
    assert snapshot(fake, weights(addrs)) == data
    alloc.sleep(offload_tags=())  # level 2: the kept spans go back, the pool is released
    gc.collect()
    assert pool.in_use() == 0 and pool.capacity() == 0


@pytest.mark.parametrize("lane", ["0.33.0"])
def test_discard_drops_the_kept_backup(lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    cycle(alloc, fake)
    alloc.discard(("weights",))
    assert alloc.skip_unchanged.stored == {}
    assert all(alloc.pointer_to_data[a].cpu_backup_tensor is None for a in weights(addrs))
    alloc.wake_up()
    assert all(bytes(fake.memory[a]) == b"\xa5" * len(fake.memory[a]) for a in weights(addrs))


# --- 0.21.0: no fixed cost per rank -------------------------------------------------------


def calls_in(tree: Path, qualname: str) -> list[str]:
    """The names called in a function of vllm/v1/worker/gpu_worker.py, in order."""
    module = ast.parse((tree / "vllm/v1/worker/gpu_worker.py").read_text())
    cls, func = qualname.split(".")
    body = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls)
    fn = next(n for n in body.body if isinstance(n, ast.FunctionDef) and n.name == func)
    return [n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]


def test_the_0_21_0_worker_freezes_its_heap_as_0_33_0s_does(lane_tree):
    """CuMemAllocator.sleep ends with gc.collect(): 0.44-0.47 s in each TP >= 2 worker
    of 0.21.0, whose heap nothing froze (docs/results.md). 0.33.0's worker freezes it
    after warm-up; the patched 0.21.0 worker does the same, the pristine one does not."""
    assert "freeze_gc_heap" in calls_in(lane_tree("0.33.0", "pinned"), "Worker._compile_or_warm_up_model")
    where = "Worker.compile_or_warm_up_model"
    assert "freeze_gc_heap" not in calls_in(lane_tree("0.21.0", "pinned"), where)
    assert "freeze_gc_heap" in calls_in(lane_tree("0.21.0", "patched"), where)


def test_the_wake_takes_no_checksum_and_one_synchronize_at_its_end(lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    loaded(fake, alloc)
    cycle(alloc, fake)
    alloc.sleep(offload_tags=("weights",))
    monkeypatch.setattr(alloc.skip_unchanged, "unchanged", lambda *a: pytest.fail("a checksum at wake"))
    del fake.events[:]
    alloc.wake_up()
    assert fake.syncs() == [0] and fake.events[-1] == ("sync", 0)  # for its queued copies


@pytest.mark.parametrize("skip", ["1", "0"])
def test_a_wake_records_each_stage_and_the_bytes_it_copied_back(lane_tree, lane, fake, monkeypatch, skip):
    monkeypatch.setenv("VLLM_CUMEM_SKIP_UNCHANGED", skip)  # recorded with the skip on or off
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    loaded(fake, alloc)
    assert alloc.last_wake_up_stages == {}  # no wake yet
    slow = {"map": 0.0, "copy": 0.0}  # seconds added to each call of that stage

    def timed(name, fn):  # each stage's calls take a known extra time, so the split can be checked
        def call(*args, **kwargs):
            import time
            time.sleep(slow[name])
            return fn(*args, **kwargs)
        return call

    module = __import__("sys").modules[type(alloc).__module__]
    monkeypatch.setattr(module, "create_and_map", timed("map", module.create_and_map))
    copy = fake.cudaMemcpy
    monkeypatch.setattr(fake, "cudaMemcpy", timed("copy", copy))
    alloc.sleep(offload_tags=("weights",))
    slow.update(copy=0.02, map=0.004)
    alloc.wake_up()
    stages = alloc.last_wake_up_stages
    assert stages["copied_bytes"] == WEIGHTS
    restored = sum(1 for t, _ in LAYOUT if t == "weights")
    assert stages["copy_s"] >= 0.02 * restored
    assert stages["map_restored_s"] < stages["copy_s"] and stages["map_emptied_s"] < stages["copy_s"]
    assert set(stages) >= {"map_restored_s", "copy_s", "map_emptied_s", "copied_bytes"}
    for stage in ("map_restored", "map_emptied"):  # each map's spread: 10th, 50th, 90th percentile, max
        spread = stages[f"{stage}_us"]
        assert len(spread) == 4 and spread == sorted(spread) and spread[0] >= 4000
        assert spread[-1] <= stages[f"{stage}_s"] * 1e6 + 1
    assert (stages["restored"], stages["emptied"]) == (restored, len(LAYOUT) - restored)


@pytest.mark.parametrize("path", ["sleep", "prepare and commit"])
def test_a_sleep_records_its_unmaps_and_what_it_ends_with(lane_tree, lane, fake, monkeypatch, path):
    """last_sleep_stages: the checksum's seconds, the unmaps' (each made slower by a known
    time here, so the split can be checked) with how many, and the collection and cache
    release, on the one-rank sleep and on the cross-rank one."""
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    loaded(fake, alloc)
    assert alloc.last_sleep_stages == {}  # no sleep yet
    module = __import__("sys").modules[type(alloc).__module__]
    real = module.unmap_and_release

    calls = []

    def slow_unmap(handle):  # the first unmap takes 0.05 s more, the others 0.01 s
        import time
        time.sleep(0.05 if not calls else 0.01)
        calls.append(handle)
        return real(handle)

    monkeypatch.setattr(module, "unmap_and_release", slow_unmap)
    from types import SimpleNamespace
    monkeypatch.setattr(module, "gc", SimpleNamespace(collect=lambda: __import__("time").sleep(0.03)))
    if path == "sleep":
        alloc.sleep(offload_tags=("weights",))
    else:
        alloc.commit_sleep(alloc.prepare_sleep(("weights",)))
    stages = alloc.last_sleep_stages
    assert stages["unmapped"] == len(LAYOUT) and stages["unmap_s"] >= 0.01 * len(LAYOUT)
    assert stages["checksum_s"] == alloc.last_sleep_checksum_s
    assert 0.03 <= stages["gc_and_empty_cache_s"] < stages["unmap_s"]  # the collection is timed
    p10, p50, p90, most = stages["unmap_us"]  # the one slow unmap is told from the rest
    assert 10_000 <= p10 <= p50 < 50_000 <= most and p90 <= most


# --- the background fill before the first sleep -------------------------------------------


def fill_module(alloc):
    return __import__("sys").modules[type(alloc.skip_unchanged).__module__]


def filled(alloc, monkeypatch, chunk: int = 1024):
    """The fill started as the worker starts it, in CHUNK-byte copies (set before its thread
    starts, so that every allocation is copied in pieces)."""
    monkeypatch.setattr(fill_module(alloc), "FILL_CHUNK", chunk)
    alloc.start_background_fill()
    assert alloc.background_fill.chunk == chunk
    return alloc.background_fill


def test_the_background_fill_spares_the_first_sleep_every_copy(lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    data = snapshot(fake, weights(addrs))
    fill = filled(alloc, monkeypatch)
    fill.thread.join()
    assert fill.figures()["state"] == "done" and fill.figures()["filled_bytes"] == WEIGHTS
    assert cycle(alloc, fake) == []  # the first sleep: nothing left to copy
    assert (alloc.last_sleep_copied_bytes, alloc.last_sleep_skipped_bytes) == (0, WEIGHTS)
    assert snapshot(fake, weights(addrs)) == data  # the wake restored the fill's backups
    fake.memory[weights(addrs)[2]][7] ^= 0x80  # and a later change is still seen
    assert cycle(alloc, fake) == [weights(addrs)[2]]


def test_a_done_fill_lays_out_the_first_sleeps_checksum_and_that_sleep_uses_it(lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    module = fill_module(alloc)
    built = []
    real = module._descriptors
    monkeypatch.setattr(module, "_descriptors", lambda spans, b: built.append(len(spans)) or real(spans, b))
    fill = filled(alloc, monkeypatch)
    fill.thread.join()
    assert fill.figures()["state"] == "done"
    sleeps = [(p, alloc.pointer_to_data[p].handle[1]) for p in weights(addrs)]  # as sleep() passes them
    assert alloc.skip_unchanged.checksum._layout[0] == (tuple(sleeps), module._device(0))
    assert built == [len(sleeps)]  # laid out once, for all of them together
    assert alloc.skip_unchanged.checksum.lay_out(sleeps, module._device(0)) is alloc.skip_unchanged.checksum._layout[1]
    assert built == [len(sleeps)]  # what the first sleep asks for is there


# What a level-1 sleep offloads in each lane, and the source lines that say so: the fill
# takes the same allocations, so that the first sleep finds its checksum laid out.
LEVEL1 = {
    "0.21.0": (("weights",), "vllm/v1/worker/gpu_worker.py",
               ['sleep_across_ranks(allocator, ("weights",) if level == 1 else tuple())']),
    "0.33.0": (("weights", "runtime", "cudagraph"), "vllm/device_allocator/sleep_mode_backend.py",
               ['offload_tags: tuple[str, ...] = ("runtime", "cudagraph")', "if level == 1:",
                'offload_tags = ("weights", *offload_tags)']),
}


def test_the_fill_takes_what_a_level_1_sleep_offloads_so_that_sleep_copies_and_lays_out_nothing(
        lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    loaded(fake, alloc)
    with alloc.use_memory_pool("runtime"):  # 0.33.0's KV-init state: offloaded at level 1
        fake.my_malloc(alloc, 4096, "runtime")
    module = fill_module(alloc)
    built, real = [], module._descriptors
    monkeypatch.setattr(module, "_descriptors", lambda spans, b: built.append(len(spans)) or real(spans, b))
    fill = filled(alloc, monkeypatch)
    fill.thread.join()
    tags = LEVEL1[lane][0]
    offloaded = [p for p, d in alloc.pointer_to_data.items() if d.tag in tags]
    del fake.copied[:]
    alloc.sleep(offload_tags=tags)
    assert fake.copied == [] and alloc.last_sleep_copied_bytes == 0
    assert built == [len(offloaded)]  # laid out once, by the fill, for the sleep's allocations
    alloc.wake_up()


def test_the_fills_tags_are_what_each_lanes_level_1_sleep_offloads(lane_tree, lane):
    import ast

    tags, path, lines = LEVEL1[lane]
    tree = lane_tree(lane, "patched")
    source = (tree / path).read_text()
    assert all(line in source for line in lines), f"{lane}: {path} no longer says what level 1 offloads"
    cumem = ast.parse((tree / "vllm/device_allocator/cumem.py").read_text())
    fill = next(n for n in ast.walk(cumem) if isinstance(n, ast.FunctionDef) and n.name == "start_background_fill"
                and n.args.args and n.args.args[0].arg == "self")
    assert ast.literal_eval(fill.args.defaults[0]) == tags


def test_a_weight_written_while_it_is_filled_is_dropped_and_copied_by_the_sleep(
        lane_tree, lane, fake, monkeypatch):
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    written = weights(addrs)[1]
    module = fill_module(alloc)
    rest, summed, seen = module.time.sleep, module.BackgroundFill._sum, {"on": None, "wrote": False}

    def noted(self, ptr, nbytes, device):  # which allocation the fill is on
        seen["on"] = ptr
        return summed(self, ptr, nbytes, device)

    def write_during_the_copy(seconds):  # a rest between its pieces: serving writes it, once
        if seen["on"] == written and not seen["wrote"]:
            fake.memory[written][0] ^= 0xFF
            seen["wrote"] = True
        rest(seconds)

    monkeypatch.setattr(module.BackgroundFill, "_sum", noted)
    monkeypatch.setattr(module.time, "sleep", write_during_the_copy)
    fill = filled(alloc, monkeypatch)
    fill.thread.join()
    monkeypatch.setattr(module.time, "sleep", rest)
    assert fill.dropped == 1 and fill.filled_bytes == WEIGHTS - LAYOUT[1][1]
    data = snapshot(fake, weights(addrs))
    assert cycle(alloc, fake) == [written]  # the one the fill dropped
    assert snapshot(fake, weights(addrs)) == data  # with the bytes written, not the old ones


def test_a_sleep_stops_the_fill_and_copies_what_it_did_not_finish(lane_tree, lane, fake, monkeypatch):
    import threading

    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    data = snapshot(fake, weights(addrs))
    module = fill_module(alloc)
    resting = threading.Event()

    def held(seconds):  # the fill rests after its first piece until the sleep stops it
        resting.set()
        while not alloc.background_fill.stopping.is_set():
            threading.Event().wait(0.001)

    monkeypatch.setattr(module.time, "sleep", held)
    fill = filled(alloc, monkeypatch)
    assert resting.wait(10)
    threading.Event().wait(0.02)
    running = fill.figures()
    assert running["state"] == "running" and running["seconds"] >= 0.02  # so far, while it runs
    assert cycle(alloc, fake) == weights(addrs)  # everything: the fill finished none
    assert fill.figures()["state"] == "stopped" and fill.filled_bytes == 0
    assert not fill.thread.is_alive()
    assert snapshot(fake, weights(addrs)) == data


def test_an_allocation_freed_before_its_turn_is_not_read(lane_tree, lane, fake, monkeypatch):
    import threading

    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    gone = weights(addrs)[-1]
    module = fill_module(alloc)
    resting, freed = threading.Event(), threading.Event()

    def held(seconds):  # after the first piece, wait until the last weight is freed
        resting.set()
        freed.wait(10)

    monkeypatch.setattr(module.time, "sleep", held)
    fill = filled(alloc, monkeypatch)
    assert resting.wait(10)
    fake.my_free(alloc, gone)  # the free callback takes the fill's lock
    freed.set()
    fill.thread.join()
    assert fill.figures()["state"] == "done"
    assert fill.filled_bytes == WEIGHTS - LAYOUT[-1][1]  # read no byte of it


def test_switched_off_the_fill_makes_no_backup(lane_tree, lane, fake, monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_BACKGROUND_FILL", "0")
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    addrs = loaded(fake, alloc)
    alloc.start_background_fill()
    assert alloc.background_fill is None
    assert cycle(alloc, fake) == weights(addrs)


def test_without_the_skip_there_is_no_fill(lane_tree, lane, fake, monkeypatch):
    monkeypatch.setenv("VLLM_CUMEM_SKIP_UNCHANGED", "0")
    alloc = make_alloc(lane_tree, lane, fake, monkeypatch)
    loaded(fake, alloc)
    alloc.start_background_fill()
    assert alloc.background_fill is None


def test_each_lanes_worker_starts_the_fill_once_warm_up_is_done(lane_tree, lane):
    worker = lane_tree(lane, "patched") / "vllm/v1/worker/gpu_worker.py"
    method = "Worker._compile_or_warm_up_model" if lane == "0.33.0" else "Worker.compile_or_warm_up_model"
    calls = calls_in(lane_tree(lane, "patched"), method)
    assert "start_background_fill" in calls
    assert calls.index("freeze_gc_heap") < calls.index("start_background_fill")
    assert "start_background_fill" not in calls_in(lane_tree(lane, "pinned"), method)
    assert worker.is_file()
