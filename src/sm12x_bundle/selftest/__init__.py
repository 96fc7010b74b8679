"""``selftest``: prove the cumem fixes on this node's GPU.

For each vLLM to test (a source tree, pristine or patched, or the vLLM installed in
this Python): build the tree's cumem extension alone (native.py), load the tree's own
``vllm/device_allocator/cumem.py`` against it in a fresh process (loader.py), and run
each scenario in a process of its own (scenarios.py). plan.py decides what runs and
how big; report.py turns the results into the table, the JSON and the exit code.
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from ..context import Context
from ..errors import BundleError, ConfigError
from ..fsutil import write_file
from . import plan, report, runner
from .plan import Target

HELP = "prove the cumem fixes on this node's GPU, scenario by scenario"
EPILOG = """\
scenarios (each in its own process; --scenario NAME or NUMBER, repeatable):
  1 inflight-free  a pool tensor is freed while a write into it is still queued
  2 stale-error    a free fails on the PyTorch path, then a healthy wake_up
  3 partial-wake   wake_up fails part-way for lack of memory, then is retried
  4 stress         sleep/wake cycles with work in flight, several tags, varied sizes
  5 speed          sleep/wake GB/s against the pinned-copy ceiling; first-sleep cost

examples:
  sm12x-bundle selftest --installed                 # the vLLM of this Python (bundle image)
  sm12x-bundle selftest --compare                   # the pinned tree, then the same tree patched
  sm12x-bundle selftest --compare PRISTINE PATCHED --json-out selftest.json
  sm12x-bundle selftest --tree build/vllm-patched --scenario stress --cycles 5000

selftest: exit 0 when every scenario passes (--compare: the pristine tree fails
scenarios 1-3 and the patched tree passes every scenario), 9 when not; 2 when it
could not run (no GPU, cumem unavailable), 7 when the extension did not build."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tree", type=Path, metavar="DIR", help="a vLLM source tree (its csrc/ and vllm/)")
    which.add_argument("--installed", action="store_true", help="the vLLM installed in this Python, as it is")
    which.add_argument("--compare", nargs="*", metavar="TREE",
                       help="PRISTINE PATCHED: show that scenarios 1-3 fail on the first and pass on the second "
                            "(no trees: the pinned tree and the same tree with the series applied)")
    p.add_argument("--scenario", action="append", metavar="NAME", help="run only this scenario (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--json-out", type=Path, metavar="FILE", help="also write the JSON report to FILE")
    p.add_argument("--size-gib", type=float, metavar="GIB",
                   help="bytes asleep in partial-wake and speed (default: partial-wake 8 GiB, speed 32 GiB, "
                        "each at most a quarter of the free memory)")
    p.add_argument("--speed-gib", type=float, metavar="GIB", help="bytes asleep in speed alone")
    p.add_argument("--stress-mib", type=float, metavar="MIB",
                   help="bytes in the stress pools (default: 512 MiB or a twentieth of the free memory)")
    p.add_argument("--cycles", type=int, default=1000, metavar="N", help="stress sleep/wake cycles (default 1000)")
    p.add_argument("--speed-target", type=float, default=0.9, metavar="FRACTION",
                   help="sleep and wake must reach this fraction of the pinned-copy ceiling (default 0.9)")
    p.add_argument("--timeout", type=float, default=1800, metavar="SECONDS",
                   help="limit for each scenario's process (default 1800)")
    p.add_argument("--python-include", type=Path, metavar="DIR",
                   help="the folder holding Python.h, for building the extension (default: this Python's)")
    p.add_argument("--work", type=Path, metavar="DIR",
                   help="keep the builds and each scenario's JSON here (default: a temporary folder)")


def resolve_targets(ctx: Context, args: argparse.Namespace, work: Path) -> list[Target]:
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

    source = ctx.source()
    patched = work / "patched-tree"
    ctx.progress.say(f"applying the series to vLLM {source.version} in {patched}")
    write_tree(ctx.series, source, patched, ctx.config.check.fuzz)
    return [Target("pristine", source.root), Target("patched", patched)]


@contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep.resolve()
        return
    with tempfile.TemporaryDirectory(prefix="sm12x-selftest-") as tmp:
        yield Path(tmp)


def execute(ctx: Context, args: argparse.Namespace, scenarios: tuple[plan.Scenario, ...], work: Path) -> report.Report:
    targets = resolve_targets(ctx, args, work)
    staged = [runner.stage(t, work, python_include=args.python_include) for t in targets]
    probes = []
    for s in staged:
        ctx.progress.say(f"{s.target.label}: loading {s.target.tree or 'the installed vLLM'}")
        probes.append(runner.probe(s, work))
    sizes = plan.plan_sizes(min(p["free_bytes"] for p in probes), size_gib=args.size_gib,
                            speed_gib=args.speed_gib, stress_mib=args.stress_mib, cycles=args.cycles)
    params = runner.scenario_params(sizes, args.speed_target)
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
    )


def _environment(probe: dict) -> dict:
    keys = ("gpu", "capability", "driver", "torch", "cuda", "python", "free_bytes", "total_bytes", "pin_memory")
    env = {k: probe.get(k) for k in keys}
    env["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return env


def run(ctx: Context, args: argparse.Namespace) -> int:
    scenarios = plan.select(args.scenario)  # a typo fails before anything is built
    if not 0 < args.speed_target <= 1:
        raise ConfigError(f"--speed-target must be in (0, 1], not {args.speed_target}")
    with _workdir(args.work) as work:
        rep = execute(ctx, args, scenarios, work)
    if args.json_out:
        write_file(args.json_out, report.to_json(rep).encode())
    print(report.to_json(rep) if args.json else report.table(rep), end="")
    return report.exit_code(rep)


COMMANDS = {"selftest": (HELP, EPILOG, add_arguments, run)}

__all__ = ["COMMANDS", "BundleError"]
