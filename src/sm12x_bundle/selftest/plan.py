"""What a selftest run does, decided before anything touches the GPU.

The scenarios, which of them run on which tree, and how big each one is: pure
functions over the command's options and the GPU's free memory (read by the probe),
tested without a GPU.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import ConfigError
from ..series.lane import version_key

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
# The driver's minimum granularity for cuMemCreate on NVIDIA GPUs: every cumem
# allocation is a multiple of it, and so is any leak the scenarios can see.
GRANULARITY = 2 * MiB


@dataclass(frozen=True)
class Scenario:
    number: int
    name: str
    title: str
    bug: bool  # proves a fix: must fail on the pristine tree, pass on the patched one
    what: str
    guard: bool = False  # a regression guard: runs on pristine too, which may pass it
    # The first release whose own code fixes this scenario's bug (read in its sdist): on a
    # tree of that release or later the scenario guards against regression, it proves nothing.
    upstream_from: str | None = None

    def proves(self, version: str | None) -> bool:
        """Whether this scenario proves a fix on a pristine tree of ``version``."""
        return self.bug and not self.fixed_upstream(version)

    def guards(self, version: str | None) -> bool:
        return self.guard or (self.bug and self.fixed_upstream(version))

    def fixed_upstream(self, version: str | None) -> bool:
        if self.upstream_from is None or version is None:
            return False
        try:
            return version_key(version) >= version_key(self.upstream_from)
        except ValueError:  # a tree that names no release number: judge it as unfixed
            return False


SCENARIOS: tuple[Scenario, ...] = (
    # Not fixed upstream by 0.33.0: its free callback synchronizes (so the sweep is safe), its
    # sleep() does not (an illegal memory access on the H200, docs/results.md).
    Scenario(1, "inflight-free", "in-flight free", True,
             "a pool tensor is freed (context-exit sweep, then sleep()) while a write into it is queued"),
    Scenario(2, "stale-error", "stale error", True,
             "a free fails on the PyTorch path (pool dropped while asleep), then a healthy wake_up"),
    Scenario(3, "partial-wake", "partial wake", True,
             "wake_up fails part-way for lack of memory; memory is given back; wake_up retried"),
    Scenario(4, "stress", "stress", False,
             "many sleep/wake cycles with work in flight, offloaded and discarded tags, varied sizes"),
    Scenario(5, "speed", "speed", False,
             "sleep and wake throughput against the pinned-copy ceiling; the first sleep's cost"),
    Scenario(6, "double-wake", "double wake", False,
             "wake_up on an allocator already awake (and a map of a mapped allocation), then sleep and wake",
             guard=True),
    Scenario(7, "failing-sleep", "sleep fails part-way", True,
             "sleep() fails at the k-th pinned backup (host memory runs out); the tensors are used; sleep retried"),
    Scenario(8, "moe-churn", "MoE weight-load churn", True,
             "varied 1-3 GiB transient buffers in the weights pool under a memory budget, max_split_size_mb:20"),
    # 0.33.0's wake_up maps only what is asleep (vllm#52514), so the retry resumes; 0.26.0's does not.
    Scenario(9, "foreign-process", "another process", True,
             "asleep; another process takes the memory; wake_up fails; it exits; wake_up retried",
             upstream_from="0.33.0"),
    Scenario(10, "fault-stress", "fault stress", False,
             "sleep/wake cycles with failures injected at random points (host allocation, map, double wake)"),
    Scenario(11, "first-sleep", "first sleep", True,
             "the first sleep of a process against the D2H ceiling; host RAM its backups take (speed.py)"),
    Scenario(12, "rotation", "rotation", True,
             "two engines of 24 GiB on one GPU swapped in turn: the first swap against the steady ones"),
    Scenario(13, "ranks", "ranks", True,
             "sleep and wake across ranks (one per GPU, or 4 on one): one rank fails; all or none (ranks.py)"),
)
BY_NAME = {s.name: s for s in SCENARIOS}


def select(names: Sequence[str] | None) -> tuple[Scenario, ...]:
    """The scenarios named (by name or number), in their fixed order; all when none."""
    if not names:
        return SCENARIOS
    chosen = set()
    for raw in names:
        for name in filter(None, (n.strip() for n in raw.split(","))):
            chosen.add(_lookup(name).number)
    return tuple(s for s in SCENARIOS if s.number in chosen)


def _lookup(name: str) -> Scenario:
    if name.isdigit():
        for s in SCENARIOS:
            if s.number == int(name):
                return s
    elif name in BY_NAME:
        return BY_NAME[name]
    close = difflib.get_close_matches(name, list(BY_NAME), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    choices = ", ".join(f"{s.number} {s.name}" for s in SCENARIOS)
    raise ConfigError(f"unknown scenario '{name}'{hint}: choose from {choices}")


@dataclass(frozen=True)
class Target:
    """A vLLM to test: a source tree (pristine or patched), or the installed one."""

    label: str  # "pristine", "patched", "tree" or "installed"
    tree: Path | None  # None: the vLLM installed in this Python


def runs(targets: Sequence[Target], scenarios: Sequence[Scenario]) -> list[tuple[Target, Scenario]]:
    """Which scenario runs on which target, in order.

    Comparing, the pristine tree runs only the scenarios that prove a fix and the
    regression guards (its stress and speed figures prove nothing about the patches);
    every other target runs all.
    """
    plan = []
    for target in targets:
        for scenario in scenarios:
            if target.label == "pristine" and not (scenario.bug or scenario.guard):
                continue
            plan.append((target, scenario))
    return plan


@dataclass(frozen=True)
class Sizes:
    """How big each scenario is, in bytes (all multiples of GRANULARITY)."""

    inflight_bytes: int
    stale_bytes: int
    partial_count: int
    partial_each: int
    stress_bytes: int
    stress_cycles: int
    speed_bytes: int
    speed_chunk: int
    spin_ms: float
    guard_bytes: int = 64 * MiB
    sleep_count: int = 8
    sleep_each: int = 256 * MiB
    sleep_fail_at: int = 4  # the 4th of 8 backups fails, as in the H200 runs of the sleep transactions
    churn_min: int = 1 * GiB
    churn_max: int = 3 * GiB
    churn_buffers: int = 16
    churn_shard: int = 16 * MiB
    churn_budget: int = 6 * GiB + 512 * MiB
    foreign_count: int = 8
    foreign_each: int = 1 * GiB
    fault_bytes: int = 32 * MiB
    fault_cycles: int = 10_000
    fault_sweeps: int = 200  # in-flight sweeps in fault stress, one every 10 cycles from the first

    def to_dict(self) -> dict:
        return asdict(self)


def _round_down(n: int, unit: int = GRANULARITY) -> int:
    return n // unit * unit


def plan_sizes(
    free_bytes: int,
    *,
    size_gib: float | None = None,
    speed_gib: float | None = None,
    stress_mib: float | None = None,
    cycles: int = 1000,
    fault_cycles: int = 10_000,
    spin_ms: float = 200.0,
) -> Sizes:
    """Sizes from the GPU's free memory, unless the operator gave them.

    Partial wake defaults to 8 GiB or a quarter of the free memory, whichever is
    less; speed to 32 GiB or a quarter (sleep() has a fixed cost, so its throughput
    is meant for model-sized sleeps, and the first sleep pins that much host memory);
    stress to 512 MiB or a twentieth. ``size_gib`` sets both partial wake and speed,
    ``speed_gib`` speed alone. Partial wake needs its bytes free twice over at one
    point (the allocations asleep, then the memory that blocks their wake), so it may
    take at most 60% of what is free; speed must fit in half.
    """
    _check_counts(free_bytes, cycles, fault_cycles)
    count = 8
    partial = _given("--size-gib", size_gib, GiB, free_bytes, 0.6) or min(8 * GiB, free_bytes // 4)
    each = _round_down(partial // count)
    if each < 4 * GRANULARITY:
        raise ConfigError(f"--size-gib {size_gib:g} is too small: at least {count * 4 * GRANULARITY / MiB:.0f} MiB")
    speed = (_given("--speed-gib", speed_gib, GiB, free_bytes, 0.5)
             or _given("--size-gib", size_gib, GiB, free_bytes, 0.5)
             or min(32 * GiB, free_bytes // 4))
    chunk = min(512 * MiB, _round_down(speed // 4))
    if chunk < GRANULARITY:
        raise ConfigError("the speed scenario needs at least 8 MiB")
    stress = _given("--stress-mib", stress_mib, MiB, free_bytes, 0.5) or min(512 * MiB, free_bytes // 20)
    return Sizes(
        inflight_bytes=64 * MiB,
        stale_bytes=64 * MiB,
        partial_count=count,
        partial_each=each,
        stress_bytes=max(_round_down(stress), 16 * MiB),
        stress_cycles=cycles,
        speed_bytes=_round_down(speed, chunk),
        speed_chunk=chunk,
        spin_ms=spin_ms,
        fault_cycles=fault_cycles,
        **_transaction_sizes(free_bytes),
    )


def _check_counts(free_bytes: int, cycles: int, fault_cycles: int) -> None:
    if cycles < 1:
        raise ConfigError(f"--cycles must be at least 1, not {cycles}")
    if fault_cycles < 1:
        raise ConfigError(f"--fault-cycles must be at least 1, not {fault_cycles}")
    if free_bytes < 512 * MiB:
        raise ConfigError(f"the GPU has only {free_bytes / MiB:.0f} MiB free: the selftest needs at least 512 MiB")


def _transaction_sizes(free_bytes: int) -> dict:
    """Scenarios 7-9, from the free memory: failing sleep 8 x (256 MiB or a 64th);
    the churn's buffers up to 3 GiB or a 16th, from a third of that, in a budget of
    twice the largest plus the kept shards (PyTorch gives a pool's cached segments back,
    largest first, only when they cover the request: with less, a fixed allocator fails
    too); another process, 8 x (1 GiB or a 32nd)."""
    biggest = max(_round_down(min(3 * GiB, free_bytes // 16)), 3 * GRANULARITY)
    buffers, shard = 16, max(_round_down(biggest // 192), GRANULARITY)
    return {
        "sleep_each": max(_round_down(min(256 * MiB, free_bytes // 64)), GRANULARITY),
        "churn_min": max(_round_down(biggest // 3), GRANULARITY),
        "churn_max": biggest,
        "churn_buffers": buffers,
        "churn_shard": shard,
        "churn_budget": 2 * biggest + buffers * shard + _round_down(biggest // 12),
        "foreign_each": max(_round_down(min(1 * GiB, free_bytes // 32)), GRANULARITY),
    }


def _given(option: str, value: float | None, unit: int, free_bytes: int, share: float) -> int | None:
    if value is None:
        return None
    n = int(value * unit)
    if n <= 0:
        raise ConfigError(f"{option} must be positive, not {value:g}")
    if n > free_bytes * share:
        raise ConfigError(
            f"{option} {value:g} does not fit: the GPU has {free_bytes / GiB:.1f} GiB free, "
            f"and this scenario may take at most {share:.0%} of it"
        )
    return n
