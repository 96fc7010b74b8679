"""``build``: the whole pipeline for a config, planned first, then run step by step.

each lane's pin -> check each lane's series -> one patched tree per lane -> overlays (verified in the target images when
a Docker daemon answers) -> Nomad specs (when the config has jobs) -> bundle image (when
asked). The plan is a list of steps computed from the config alone; ``preflight`` refuses,
before the first step, what a later step would refuse about this machine (output folders,
a Docker daemon), and ``--dry-run`` runs the same checks, then shows what would be built
and where, without fetching or writing anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import containers, fsutil
from .checks.check import Outcome, VersionReport, check_tree
from .context import Context
from .errors import ApplyError, EngineError
from .outputs import image, native_build, nomad, overlay, tree
from .outputs.tree import tree_folder, write_tree
from .plan.originals import connect, pinned_root
from .progress import Progress
from .series.lane import Lane
from .source.pin import SourceTree


@dataclass
class Run:
    """What the steps hand to each other, and the summary they leave."""

    ctx: Context
    out: Path
    verify: bool | None
    force: bool = False
    sources: dict[str, SourceTree] = field(default_factory=dict)  # by lane
    reports: dict[str, VersionReport] = field(default_factory=dict)  # by lane
    summary: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Step:
    name: str
    destination: str
    run: Callable[[Run], str]
    details: tuple[str, ...] = ()  # what --dry-run prints under the step, one line each
    destinations: tuple[fsutil.Destination, ...] = ()  # what it writes, refused before the first step if it may not
    lane: str | None = None  # the lane a per-lane step works on

    @property
    def label(self) -> str:
        """How the progress lines and the dry run name the step: ``tree 0.21.0``, where a
        step runs once per lane, so that two lines never read the same."""
        return f"{self.name} {self.lane}" if self.lane else self.name


def _pin(run: Run) -> str:
    said = []
    for lane in run.ctx.lanes:
        src = run.sources[lane.version] = run.ctx.source(lane.version)
        said.append(f"vLLM {src.version} from {src.origin}" + (f", sha256 {src.sha256} verified" if src.sha256 else ""))
    return "; ".join(said)


def _check(run: Run) -> str:
    fuzz = run.ctx.config.check.fuzz
    for lane in run.ctx.lanes:
        report = run.reports[lane.version] = check_tree(lane.series, run.sources[lane.version], fuzz)
        bad = [r for r in report.results if r.outcome is not Outcome.APPLIES]
        if bad:
            raise ApplyError(
                f"lane {lane.version}: the series does not apply cleanly to its pin: "
                + "; ".join(f"{r.patch}: {r.summary()}" for r in bad)
                + " (run 'sm12x-bundle check' for details)"
            )
    return "; ".join(
        f"lane {lane.version}: {len(lane.series.patches)} patches apply at fuzz {fuzz}, series sha256 {lane.series.sha256[:16]}"
        for lane in run.ctx.lanes
    )


def _tree(lane: Lane) -> Callable[[Run], str]:
    def write(run: Run) -> str:
        dest = tree_folder(run.out, lane.version)
        write_tree(lane.series, run.sources[lane.version], dest, run.ctx.config.check.fuzz, run.force)
        return f"patched tree in {dest} ({len(lane.series.paths)} files changed or added)"

    return write


def _overlays(run: Run) -> str:
    written = overlay.make_and_write(run.ctx, verify=run.verify, force=run.force)
    lines = [f"{ov.target}: {folder} ({len(ov.files)} files, lane {ov.pin['version']})" for ov, folder in written]
    checked = "verified in the target images" if any(ov.image_id for ov, _ in written) else (
        "from the pinned tree (no Docker daemon: not verified in an image)"
    )
    return f"overlays {checked}: " + "; ".join(lines)


def _nomad(run: Run) -> str:
    config = run.ctx.config
    files = nomad.render_jobs(config, nomad.find_manifests(config))
    dest = run.out / "nomad"
    nomad.write_jobs(files, dest, run.force)
    return f"Nomad specs in {dest}: {len(config.jobs)} jobs, HCL and JSON read back as the same job, memory budgets fit"


def _image(run: Run) -> str:
    engine = containers.docker_engine()  # looked up at call time: tests put a fake engine there
    engine.ping()
    cfg = run.ctx.config.image
    result = image.build_bundle(run.ctx, cfg, engine, run.out / "image", push=cfg.push, force=run.force)
    return f"image {result.tag} ({result.image_id[:19]}): {result.checked} files match the manifest"


def plan(ctx: Context, build_image: bool = False) -> list[Step]:
    """The steps ``build`` will run for this config, in order, each with what it writes
    (reads only the series files)."""
    config = ctx.config
    out = Path(config.output.dir)
    steps = [Step("pin", "the cache", _pin), Step("check", "-", _check)]
    for lane in ctx.lanes:
        [dest] = tree.destinations(out, [lane.version])
        steps.append(Step("tree", str(dest.path), _tree(lane), destinations=(dest,), lane=lane.version))
    if config.targets:
        where = Path(config.output.overlays)
        steps.append(Step("overlays", f"{where}/", _overlays, tuple(overlay.planned_overlays(config)),
                          tuple(overlay.destinations(where, config.targets))))
    if config.jobs:
        steps.append(Step("nomad", f"{out}/nomad/", _nomad, destinations=tuple(nomad.destinations(out / "nomad", config.jobs))))
    if build_image or config.image.build:
        steps.append(Step("image", config.image.tag, _image, destinations=tuple(image.destinations(out / "image"))))
    return steps


def check_outputs(ctx: Context, steps: list[Step], force: bool = False) -> Path:
    """Refuse, before the pin is fetched, every output the steps would replace or write into
    that this tool did not write (OutputError): each step says what it writes; return output.dir."""
    out = fsutil.refuse_protected(ctx.config.output.dir, "output.dir folder")
    if any(s.name == "overlays" for s in steps):
        fsutil.refuse_protected(ctx.config.output.overlays, "overlays folder")
    for destination in (d for s in steps for d in s.destinations):
        fsutil.refuse_overlap(destination.path, ctx.inputs(), destination.what)
    fsutil.check_destinations((d for s in steps for d in s.destinations), force)
    return out


def check_daemon(ctx: Context, steps: list[Step]) -> None:
    """Refuse, as the step itself would and in its words, a build whose overlays or image
    need a Docker daemon that does not answer or an image it does not hold (EngineError),
    and a pinned target without root whose pinned tree must stand in (ConfigError)."""
    names = {s.name for s in steps}
    targets = ctx.config.targets if "overlays" in names else ()
    if "image" not in names and all(t.pinned and t.root for t in targets):
        return  # no daemon needed, and every pinned tree can stand in: nothing to ask
    engine = connect("image" in names or any(not t.pinned for t in targets), Progress.quiet())
    for t in targets:
        if engine is not None:
            try:
                engine.image_id(t.image)
                continue
            except EngineError:
                if not t.pinned:
                    raise
        pinned_root(t)


def preflight(ctx: Context, steps: list[Step], force: bool = False) -> Path:
    """Everything ``build`` checks before its first step, which ``--dry-run`` runs too, so a
    dry run that passes is not refused by build for any of it: every lane's series parsed
    (``plan`` read them: exit 5), the output folders (exit 11) and the Docker daemon and
    images the steps need (exit 8). Returns output.dir. Not checked here: the pins' fetch
    and the series applying to them (the pin and check steps, before anything is written)."""
    out = check_outputs(ctx, steps, force)
    check_daemon(ctx, steps)
    native_build.preflight(ctx)  # g++ and cuda.h, when this machine builds the extension (exit 12)
    return out


def run_steps(ctx: Context, steps: list[Step], out: Path, verify: bool | None, force: bool) -> list[str]:
    """Run the planned steps in order, saying each on stderr; return one summary line a step."""
    run = Run(ctx, out, verify, force)
    for n, step in enumerate(steps, 1):
        ctx.progress.say(f"== [{n}/{len(steps)}] {step.label}")
        run.summary.append(f"{step.name:<9} {step.run(run)}")
    return run.summary
