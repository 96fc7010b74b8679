"""One engine check from start to end: everything refusable is refused first, then the
trees, the model folders and the ceilings, then the scenarios, and always the cleanup.

Before any engine starts (each a sentence and an exit code): the vLLM under test and its
lane, the GPU (NVML), the sizes against its free memory and the host's, the compiler and
CUDA headers for the patched copy's extension. Whatever ends the run (success, a failure,
a timeout, Ctrl-C), every process group the check started is ended and the GPU memory in
use is read again (NVML), to show that nothing the check started still holds any.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from .. import native
from ..context import Context
from ..fsutil import check_replaceable, claim, temp_folder
from ..series.lane import Lane
from ..source.pin import resolve_source
from . import ceilings as ceilings_mod
from . import changed, copies, failures, gpu, plan, procs, releases, rotation, scenarios
from .bench import Bench, child_env, settle
from .install import Install, find_install, lane_for
from .model import prompts, write_model
from .report import Report, ScenarioResult

RUNNERS = {"a": scenarios.cycles, "b": scenarios.level2, "c": rotation.rotation,
           "d1": failures.failing_sleep, "d2": failures.held_wake, "e": scenarios.cross_image,
           "f": failures.killed_worker, "g": changed.weight_changed}


@dataclass(frozen=True)
class Options:
    compare: bool
    vllm_path: Path | None
    lane: str | None
    sdist: Path | None
    scenarios: tuple[plan.Scenario, ...]
    quick: bool = False
    model_gib: float | None = None
    swaps: int = 6
    call_timeout: float = 300.0
    start_timeout: float = 600.0
    work: Path | None = None
    parallel: plan.Parallel = plan.Parallel()


@dataclass(frozen=True)
class Preflight:
    install: Install
    lane: Lane
    nvml: gpu.Gpus
    card: gpu.Card
    sizes: plan.Sizes


def preflight(ctx: Context, opts: Options) -> Preflight:
    """Everything that can be refused, before anything is written or started."""
    install = find_install(opts.vllm_path)
    lane = lane_for(ctx.lanes, install, opts.lane)
    nvml = gpu.Gpus(opts.parallel.gpus)
    card = nvml.card()
    sizes = plan.plan_sizes(opts.scenarios, card.free_bytes, card.total_bytes, plan.host_available(),
                            model_gib=opts.model_gib, quick=opts.quick, swaps=opts.swaps, gpus=opts.parallel.gpus)
    if opts.compare:
        need_compiler()
    return Preflight(install, lane, nvml, card, sizes)


def need_compiler() -> None:
    """The patched copy's extension is built here: g++, binutils, the CUDA and Python headers."""
    native.check_host_toolchain("engine-check --compare builds the lane's extension for the patched copy")


@contextmanager
def workdir(keep: Path | None) -> Iterator[Path]:
    """The work folder: --work DIR (absent, empty or one this tool wrote; kept), else a
    scratch folder (locked and marked, so one a killed run left is removed by the next)."""
    if keep is not None:
        check_replaceable(keep, what="work folder")
        claim(keep, "work folder")
        yield keep.resolve()
        return
    with temp_folder("sm12x-engine-check-") as tmp:
        yield Path(tmp)


def run_check(ctx: Context, opts: Options) -> Report:
    pre = preflight(ctx, opts)
    baseline = pre.card.used_bytes
    with workdir(opts.work) as work, procs.groups() as groups:
        try:
            report = execute(ctx, opts, pre, work, groups)
        finally:
            groups.end_all()
            cleanup = {**settle(pre.nvml, baseline), "process_groups_started": groups.started}
            ctx.progress.say(cleanup_words(cleanup))
    report.cleanup = cleanup
    return report


def cleanup_words(c: dict) -> str:
    state = "back to" if c["released"] else "NOT back to"
    return (f"engine-check: every process the check started is ended; GPU memory in use {c['used_after_bytes'] / (1 << 30):.2f} "
            f"GiB, {state} the {c['used_before_bytes'] / (1 << 30):.2f} GiB in use before the check")


def prepare_trees(ctx: Context, opts: Options, pre: Preflight, work: Path) -> tuple[list[plan.Tree], dict | None]:
    """The install as it is; with --compare, the patched copy beside it."""
    install = pre.install
    as_is = plan.Tree("pristine" if opts.compare else "installed", install.root, (install.root,))
    if not opts.compare:
        return [as_is], None
    facts, natives = copies.prepare_patched(install, pre.lane, _source_of(ctx, opts, pre.lane), work, ctx.progress)
    patched = plan.Tree("patched", facts.root, (facts.root, install.root))
    return [as_is, patched], {**facts.to_dict(), "native": natives}


def _source_of(ctx: Context, opts: Options, lane: Lane):
    """The lane's pinned sources: --sdist FILE (checked against the pin), else the cache or PyPI."""
    if opts.sdist is None:
        return ctx.source
    return lambda version: resolve_source(lane.pin, local=opts.sdist, cache_dir=ctx.cache_dir, progress=ctx.progress)


def execute(ctx: Context, opts: Options, pre: Preflight, work: Path, groups: procs.Groups) -> Report:
    trees, copy = prepare_trees(ctx, opts, pre, work)
    sizes = pre.sizes
    models = {key: write_model(work / f"model-{key}", size.shape)
              for key, size in (("single", sizes.single), ("pair", sizes.pair)) if size is not None}
    ceilings = None if sizes.ceiling_bytes is None else ceilings_mod.measure(
        sizes.ceiling_bytes, child_env([pre.install.root], work))
    bench = Bench(groups, pre.nvml, sizes, models, ceilings, trees[0], work,
                  prompts(sizes.prompts, sizes.prompt_len), opts.call_timeout, opts.start_timeout, ctx.progress,
                  opts.parallel)
    results = [run_one(bench, scenario, tree, pre.card.used_bytes) for scenario, tree in plan.runs(trees, opts.scenarios)]
    return Report(
        mode="compare" if opts.compare else "installed", quick=opts.quick, lane=pre.lane.version,
        install={"root": str(pre.install.root), "version": pre.install.version, "version_from": pre.install.version_from,
                 "release_api": asdict(releases.api_for(pre.install.version))},
        card=pre.card.to_dict(), cards=pre.nvml.cards(),
        engine_settings={**opts.parallel.to_dict(), "allocator_switches": plan.allocator_switches()}, date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        trees=[{"label": t.label, "root": str(t.root), "path": [str(p) for p in t.path]} for t in trees],
        sizes=sizes.to_dict(), ceilings=ceilings.to_dict() if ceilings else None, results=results, copy=copy,
        versions=engine_versions(results),
    )


def engine_versions(results: list[ScenarioResult]) -> dict:
    """What each tree's first engine imported (vllm and torch as they said it)."""
    out: dict = {}
    for r in results:
        if r.figures.get("engine") and r.tree not in out:
            out[r.tree] = r.figures["engine"]
    return out


def run_one(bench: Bench, scenario: plan.Scenario, tree: plan.Tree, baseline: int) -> ScenarioResult:
    bench.progress.say(f"engine-check: {scenario.key} {scenario.title} on {tree.label}: {scenario.what}")
    start = time.monotonic()
    finding = RUNNERS[scenario.key](bench, tree)
    bench.groups.end_all()  # whatever the scenario left running
    finding.figures["gpu_after"] = bench.settle(baseline)
    result = ScenarioResult.of(finding, time.monotonic() - start)
    bench.progress.say(f"engine-check: {scenario.key} on {tree.label}: {result.outcome.upper()}: {result.reason}")
    return result
