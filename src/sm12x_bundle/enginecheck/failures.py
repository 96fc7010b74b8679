"""Scenarios d1 and d2: failures inside the engine, and what the engine is left as.

d1: host memory for the backups runs out half-way through a sleep (inject.py, inside the
engine core). d2: a wake meets GPU memory another process holds (holder.py), which then
lets go. Each failing call must fail with a sentence that names the allocation (its tag
and its size or address); the engine must be left as it was before the call (d1: every
byte still on the GPU and serving, d2: asleep with nothing kept mapped); and a retry must
succeed with identical tokens. vLLM's EngineCore.sleep pauses the scheduler before it
sleeps and does not resume it when the sleep fails, in both lanes' releases: after d1's
failed sleep the check resumes it with ``wake_up(tags=["scheduling"])``, vLLM's own way
out of a pause, and says so. A pristine engine may crash, hang or fail for good: every call
is bounded by a timeout and its end is recorded as data.
"""

from __future__ import annotations

import re

from .bench import RELEASE_SLACK, Bench, Engine, Finding, Stop, recording
from .plan import Tree

# A sentence names the allocation when it gives its tag and its size or address.
_TAG = re.compile(r"tag '[^']+'")
_WHERE = re.compile(r"\b\d+ bytes\b|0x[0-9a-fA-F]{6,}")


def names_allocation(error: str) -> bool:
    return bool(_TAG.search(error) and _WHERE.search(error))


def judge_failed_call(f: Finding, reply: dict, what: str) -> None:
    """The call must have failed as a call (not by a dead or hung engine), naming the allocation."""
    if reply.get("ok"):
        raise Stop("error", f"{what} succeeded: the fault was not reached, nothing was tested")
    if reply.get("timed_out") or reply.get("died"):
        raise Stop("fail", f"{what}: {reply.get('error')}")
    f.figures["error"] = reply["error"]
    f.check("the failure names the allocation", names_allocation(reply["error"]),
            f"{what} failed with: {reply['error'][:240]}")


def survived(f: Finding) -> None:
    f.figures["survived"] = f.stopped is None and all(held for held, _ in f.checks.values())


# --- d1: a sleep that runs out of host memory -----------------------------------------------


def failing_sleep(bench: Bench, tree: Tree) -> Finding:
    f = Finding("d1", tree.label)
    with recording(f), bench.engine(tree, "single", f"{tree.label}-failing-sleep") as e:
        f.figures["engine"] = e.facts()
        ref = e.generate("generate before the failing sleep")
        f.figures["fault"] = e.must("inject", "installing the host-memory fault", at="middle")
        used_before = bench.gpu.used()
        failed = e.call("sleep", level=1)
        f.figures["fault_after"] = e.call("uninject")
        judge_failed_call(f, failed, "sleep(1) with host memory running out")
        as_before_sleep(bench, e, f, used_before)
        resumed = e.call("wake", tags=["scheduling"])
        f.figures["resumed_scheduler"] = {"ok": resumed.get("ok"), "error": resumed.get("error")}
        f.tokens("served after the failed sleep", ref, e.generate("generate after the failed sleep"))
        e.must("sleep", "the retried sleep", level=1)
        e.must("wake", "the wake after the retried sleep")
        f.tokens("after the retried sleep and wake", ref, e.generate("generate after the retried sleep"))
    survived(f)
    return f


def as_before_sleep(bench: Bench, e: Engine, f: Finding, used_before: int) -> None:
    """After the failed sleep: every allocation mapped (the allocator says where it keeps
    the flag) and the GPU memory in use what it was before the call."""
    state = e.state()
    change = bench.gpu.used() - used_before
    flags = [t.get("asleep") for t in state.get("tags", {}).values()]
    asleep = sum(flags) if flags and None not in flags else None  # None: no flag, NVML alone judges
    f.figures.update(state_after=state, used_change_bytes=change, asleep_after=asleep)
    said = "the allocator keeps no asleep flag" if asleep is None else f"{asleep} allocations asleep"
    f.check("every byte still on the GPU", abs(change) <= RELEASE_SLACK and not asleep,
            f"{said}; GPU memory in use changed by {change / (1 << 20):.0f} MiB")


# --- d2: a wake that meets memory another process holds -------------------------------------


def held_wake(bench: Bench, tree: Tree) -> Finding:
    f = Finding("d2", tree.label)
    with recording(f), bench.engine(tree, "single", f"{tree.label}-held-wake") as e:
        f.figures["engine"] = e.facts()
        ref = e.generate("generate before the sleep")
        e.must("sleep", "sleep(1) before the other process takes the memory", level=1)
        asleep_used = bench.gpu.used()
        holder = bench.holder(f"{tree.label}-holder")
        try:
            take_memory(bench, f, holder, e.size.weight_bytes // 2)
            held_used = bench.gpu.used()
            judge_failed_call(f, e.call("wake"), "wake while another process holds the memory")
            still_asleep(bench, e, f, held_used)
        finally:
            holder.ask("exit", 30)
            holder.kill()
        f.figures["after_holder"] = bench.settle(asleep_used)
        e.must("wake", "the retried wake")
        f.tokens("after the retried wake", ref, e.generate("generate after the retried wake"))
    survived(f)
    return f


def take_memory(bench: Bench, f: Finding, holder, leave: int) -> None:
    ready = holder.next_message(120)
    if ready.get("event") != "ready":
        raise Stop("error", f"the other process could not start: {ready.get('error')}")
    took = holder.ask("hold", 120, leave_bytes=leave)
    if not took.get("ok") or not took.get("held_bytes"):
        raise Stop("error", f"the other process did not take the memory: {took.get('error', took)}")
    f.figures.update(held_bytes=took["held_bytes"], left_free_bytes=took["free_bytes"])


def still_asleep(bench: Bench, e: Engine, f: Finding, held_used: int) -> None:
    """After the failed wake: the engine says it sleeps, and kept nothing of the GPU mapped."""
    state = e.state()
    kept = bench.gpu.used() - held_used
    f.figures.update(state_after=state, kept_mapped_bytes=kept)
    f.check("still asleep, nothing kept mapped", bool(state.get("is_sleeping")) and kept <= RELEASE_SLACK,
            f"is_sleeping {state.get('is_sleeping')}; the failed wake kept {kept / (1 << 20):.0f} MiB mapped")
