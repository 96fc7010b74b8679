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
import time
from pathlib import Path

from .bench import RELEASE_SLACK, Bench, Engine, Finding, Stop, recording
from .plan import Tree

# A sentence names the allocation when it gives its tag and its size or address.
_TAG = re.compile(r"tag '[^']+'")
_WHERE = re.compile(r"\b\d+ bytes\b|0x[0-9a-fA-F]{6,}")


_RANK = re.compile(r"\brank \d+")


def names_allocation(error: str) -> bool:
    return bool(_TAG.search(error) and _WHERE.search(error))


def last_rank(bench: Bench) -> int:
    """The rank a one-rank fault goes to: the last (rank 0 when the engine has one GPU)."""
    return bench.parallel.gpus - 1


def ranks_of(state: dict) -> list[dict]:
    """Every rank's allocator state (one rank: the state itself)."""
    ranks = [r for r in state.get("ranks") or [] if isinstance(r, dict)]
    return ranks or [state]


def asleep_count(state: dict) -> int | None:
    """Allocations asleep over every rank; None when an allocator keeps no flag."""
    flags = [t.get("asleep") for r in ranks_of(state) for t in (r.get("tags") or {}).values()]
    return sum(flags) if flags and None not in flags else None


def judge_failed_call(f: Finding, reply: dict, what: str) -> None:
    """The call must have failed as a call (not by a dead or hung engine), naming the allocation."""
    if reply.get("ok"):
        raise Stop("error", f"{what} succeeded: the fault was not reached, nothing was tested")
    if reply.get("timed_out") or reply.get("died"):
        raise Stop("fail", f"{what}: {reply.get('error')}")
    f.figures["error"] = reply["error"]
    f.check("the failure names the allocation", names_allocation(reply["error"]),
            f"{what} failed with: {reply['error'][:240]}")
    if f.figures.get("gpus", 1) > 1:
        f.check("the failure names the rank", bool(_RANK.search(reply["error"])),
                "the error names a rank" if _RANK.search(reply["error"]) else "the error names no rank")


def survived(f: Finding) -> None:
    f.figures["survived"] = f.stopped is None and all(held for held, _ in f.checks.values())


# --- d1: a sleep that runs out of host memory -----------------------------------------------


def failing_sleep(bench: Bench, tree: Tree) -> Finding:
    f = Finding("d1", tree.label)
    with recording(f), bench.engine(tree, "single", f"{tree.label}-failing-sleep") as e:
        f.figures.update(engine=e.facts(), gpus=bench.parallel.gpus, fault_rank=last_rank(bench))
        ref = e.generate("generate before the failing sleep")
        f.figures["fault"] = e.must("inject", "installing the host-memory fault", at="middle", rank=last_rank(bench))
        used_before = bench.gpu.used()
        failed = e.call("sleep", level=1)
        f.figures["fault_after"] = e.call("uninject")
        judge_failed_call(f, failed, "sleep(1) with host memory running out")
        as_before_sleep(bench, e, f, used_before)
        resumed = e.call("wake", tags=["scheduling"])
        f.figures["resumed_scheduler"] = {"ok": resumed.get("ok"), "error": resumed.get("error")}
        says_awake(e, f)
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
    asleep = asleep_count(state)  # None: no flag, NVML alone judges
    f.figures.update(state_after=state, used_change_bytes=change, asleep_after=asleep,
                     is_sleeping_after=state.get("is_sleeping"))
    said = "the allocator keeps no asleep flag" if asleep is None else f"{asleep} allocations asleep"
    f.check("every byte still on the GPU", abs(change) <= RELEASE_SLACK and not asleep,
            f"{said} over {len(ranks_of(state))} rank(s); GPU memory in use changed by {change / (1 << 20):.0f} MiB")



def says_awake(e: Engine, f: Finding) -> None:
    """Once the scheduler is resumed the engine must say it is awake. (vLLM counts a paused
    scheduler as asleep, EngineCore.is_sleeping in 0.21.0's v1/engine/core.py, so before the
    resume True is the truth.)"""
    state = e.state()
    if "is_sleeping" in state:
        f.figures["is_sleeping_after_resume"] = state["is_sleeping"]
        f.check("is_sleeping tells the truth", state["is_sleeping"] is False,
                f"is_sleeping says {state['is_sleeping']} after the failed sleep and the scheduler's resume")


# --- d2: a wake that meets memory another process holds -------------------------------------


def held_wake(bench: Bench, tree: Tree) -> Finding:
    f = Finding("d2", tree.label)
    with recording(f), bench.engine(tree, "single", f"{tree.label}-held-wake") as e:
        f.figures.update(engine=e.facts(), gpus=bench.parallel.gpus, held_rank=last_rank(bench))
        ref = e.generate("generate before the sleep")
        e.must("sleep", "sleep(1) before the other process takes the memory", level=1)
        asleep_used = bench.gpu.used()
        holder = bench.holder(f"{tree.label}-holder", rank=last_rank(bench))
        try:
            take_memory(bench, f, holder, e.size.weight_bytes // (2 * bench.parallel.gpus))
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
    asleep = asleep_count(state)
    f.figures.update(state_after=state, kept_mapped_bytes=kept, kept_mapped_each=bench.gpu.used_each())
    f.check("still asleep, nothing kept mapped", bool(state.get("is_sleeping")) and kept <= RELEASE_SLACK,
            f"is_sleeping {state.get('is_sleeping')}; the failed wake kept {kept / (1 << 20):.0f} MiB mapped "
            f"over {len(ranks_of(state))} rank(s)" + ("" if asleep is None else f" ({asleep} allocations asleep)"))


# --- f: a worker killed while the engine sleeps --------------------------------------------


def killed_worker(bench: Bench, tree: Tree) -> Finding:
    """The engine must say that a worker died (health fails, calls fail) within the call
    timeout; a call that hangs until the timeout fails the scenario. Nothing is retried."""
    f = Finding("f", tree.label)
    with recording(f), bench.engine(tree, "single", f"{tree.label}-killed-worker") as e:
        f.figures.update(engine=e.facts(), gpus=bench.parallel.gpus, killed_rank=last_rank(bench))
        e.generate("generate before the sleep")
        e.must("sleep", "sleep(1) before the worker is killed", level=1)
        f.figures["kill"] = e.must("kill_rank", "killing the worker", rank=last_rank(bench))
        f.figures["worker_gone"] = dead(f.figures["kill"]["killed_pid"], within=10.0)
        start = time.monotonic()
        calls = {name: e.call(name, **args) for name, args in
                 (("wake", {}), ("generate", {"prompts": bench.prompts[:1], "max_tokens": 4}), ("state", {}))}
        f.figures["said_within_s"] = time.monotonic() - start
        judge_dead_worker(bench, f, calls)
    return f


def dead(pid: int, within: float) -> bool:
    """Wait until the killed process is gone or a zombie (SIGKILL is delivered, not awaited):
    the scenario judges the engine after its worker died, not while it dies."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def judge_dead_worker(bench: Bench, f: Finding, calls: dict[str, dict]) -> None:
    f.figures["after_kill"] = {k: {x: v.get(x) for x in ("ok", "error", "timed_out", "died", "healthy", "seconds")}
                               for k, v in calls.items()}
    hung = [k for k, v in calls.items() if v.get("timed_out")]
    f.check("no call hung", not hung, "every call answered" if not hung else
            f"{', '.join(hung)} hung until the {bench.call_timeout:.0f} s timeout")
    served = [k for k in ("wake", "generate") if calls[k].get("ok")]
    f.check("calls fail", not served, "wake and generate failed" if not served else
            f"{', '.join(served)} succeeded with a worker dead")
    last = calls["state"]
    if "healthy" in last or "healthy" in calls["generate"]:
        unhealthy = not last.get("healthy", True) or not calls["generate"].get("healthy", True)
        f.check("health fails", unhealthy, "/health fails" if unhealthy else "/health still says healthy")
