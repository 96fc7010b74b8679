"""``selftest``: prove the cumem fixes on this node's GPU.

For each vLLM to test (a source tree, pristine or patched, or the vLLM installed in
this Python): build the tree's cumem extension alone (native.py), load the tree's own
``vllm/device_allocator/cumem.py`` against it in a fresh process (loader.py), and run
each scenario in a process of its own (scenarios.py). plan.py decides what runs and
how big; report.py turns the results into the table, the JSON and the exit code.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..context import Context
from ..errors import ConfigError
from ..fsutil import temp_folder
from . import plan, report, runner
from .plan import Target

@dataclass(frozen=True)
class Options:
    """What one selftest run does (the command line's options, typed)."""

    installed: bool = False
    tree: Path | None = None
    compare: list[Path] | None = None  # [] : the lane's pinned tree and the same tree patched
    lane: str | None = None
    scenarios: tuple[plan.Scenario, ...] = plan.SCENARIOS
    size_gib: float | None = None
    speed_gib: float | None = None
    stress_mib: float | None = None
    cycles: int = 1000
    fault_cycles: int = 10_000
    seed: int = 1
    speed_target: float = 0.9
    wake_after: float = 0.0
    timeout: float = 1800
    python_include: Path | None = None
    work: Path | None = None


def run_selftest(ctx: Context, opts: Options) -> report.Report:
    """Every planned scenario on every target, each in its own process; the report."""
    with _workdir(opts.work) as work:
        return execute(ctx, opts, opts.scenarios, work)


def resolve_targets(ctx: Context, args: Options, work: Path) -> list[Target]:
    if args.installed:
        return [Target("installed", None)]
    if args.tree is not None:
        return [Target("tree", args.tree.resolve())]
    trees = args.compare
    if len(trees) == 2:
        return [Target("pristine", Path(trees[0]).resolve()), Target("patched", Path(trees[1]).resolve())]
    if trees:
        raise ConfigError(f"--compare takes two trees (PRISTINE PATCHED) or none, not {len(trees)}")
    from ..outputs.tree import write_tree

    lane = ctx.named_lane(args.lane)
    source = ctx.source(lane.version)
    patched = work / "patched-tree"
    ctx.progress.say(f"applying the {lane.version} lane's series to vLLM {source.version} in {patched}")
    write_tree(lane.series, source, patched, ctx.config.check.fuzz)
    return [Target("pristine", source.root), Target("patched", patched)]


@contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep.resolve()
        return
    with temp_folder("sm12x-selftest-") as tmp:  # locked and marked: a killed run's is removed by the next
        yield Path(tmp)


def execute(ctx: Context, args: Options, scenarios: tuple[plan.Scenario, ...], work: Path) -> report.Report:
    targets = resolve_targets(ctx, args, work)
    staged = [runner.stage(t, work, python_include=args.python_include) for t in targets]
    probes = []
    for s in staged:
        ctx.progress.say(f"{s.target.label}: loading {s.target.tree or 'the installed vLLM'}")
        probes.append(runner.probe(s, work))
    sizes = plan.plan_sizes(min(p["free_bytes"] for p in probes), size_gib=args.size_gib,
                            speed_gib=args.speed_gib, stress_mib=args.stress_mib, cycles=args.cycles,
                            fault_cycles=args.fault_cycles)
    params = runner.scenario_params(sizes, args.speed_target, args.seed, args.wake_after)
    by_label = {s.target.label: s for s in staged}
    results = []
    for target, scenario in plan.runs(targets, scenarios):
        ctx.progress.say(f"{target.label}: {scenario.number} {scenario.title}: {scenario.what}")
        r = runner.run_scenario(by_label[target.label], scenario, params, work, timeout=args.timeout)
        ctx.progress.say(f"{target.label}: {scenario.number} {scenario.title}: {r.outcome.upper()}: {r.reason}")
        results.append(r)
    return report.Report(
        mode="compare" if args.compare is not None else "single",
        targets=[_target_info(s, p) for s, p in zip(staged, probes)],
        environment=_environment(probes[0]),
        sizes=sizes.to_dict(),
        results=results,
    )


def _target_info(staged: runner.Staged, probe: dict) -> report.TargetInfo:
    return report.TargetInfo(
        label=staged.target.label,
        tree=str(staged.target.tree) if staged.target.tree else None,
        cumem_py=probe.get("cumem_py", str(staged.cumem_py)),
        extension=probe.get("extension", str(staged.extension)),
        build=staged.build,
        placeholders=list(probe.get("placeholders", [])),
        platform=probe.get("platform"),
        version=probe.get("vllm_version"),
    )


def _environment(probe: dict) -> dict:
    keys = ("gpu", "capability", "driver", "torch", "cuda", "python", "free_bytes", "total_bytes", "pin_memory")
    env = {k: probe.get(k) for k in keys}
    env["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return env


__all__ = ["Options", "run_selftest", "resolve_targets"]
