"""One target's plan: its lane, its originals, the patched files and the native builds.

:func:`plan_target` is the one call behind ``overlay``, ``image`` and ``build``'s summary.
It reads the target (the image through the engine, or, for a ``pinned: true`` target with
no daemon, the pinned tree of the lane the target names), chooses the lane by the vLLM
version the image carries (an exact match: patches are checked against the image's own
files), patches the image's own copies at fuzz 0 and plans the native builds. The outputs
render the :class:`TargetPlan` it returns; nothing here writes an output.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..config import Config, TargetConfig
from ..containers import Engine, ImageFile
from ..context import Context
from ..errors import ConfigError, EngineError, SeriesError
from ..progress import Progress
from ..series.lane import Lane
from ..source import cache as cache_mod
from ..source.pin import SourceTree
from .files import (
    InstalledFile,
    SeriesPlan,
    container_path,
    patch_image_files,
    plan_series,
    sha256_of,
    wanted_paths,
)
from .native import DEFAULT_CUDA_HOME, NativePlan, plan_native
from .originals import ImageSide, image_side, pinned_side

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


# --- which targets -------------------------------------------------------------------


def target_options_problem(names: Sequence[str] | None, image: str | None, root: str | None) -> str | None:
    """Why --target, --image and --root do not go together, or None (the command line refuses
    it while parsing, exit 2; select_targets, for a library caller, with ConfigError)."""
    if root and not image:
        return "--root needs --image (a config target says its root in the config)"
    if image and names:
        return "give either --target NAME or --image REF, not both"
    return None


def select_targets(
    config: Config, names: Sequence[str] | None, image: str | None, root: str | None
) -> list[TargetConfig]:
    problem = target_options_problem(names, image, root)
    if problem:
        raise ConfigError(problem)
    if image:
        targets = [TargetConfig(name=target_name_for(image), image=image, root=root)]
    elif names:
        targets = [config.target(n) for n in dict.fromkeys(names)]
    else:
        targets = list(config.targets)
    return checked_targets(config, targets)


def checked_targets(config: Config, targets: Sequence[TargetConfig]) -> list[TargetConfig]:
    if not targets:
        raise ConfigError(f"{config.origin}: no targets: add 'targets:' to the config or give --image REF")
    for t in targets:
        if not _NAME.match(t.name):
            raise ConfigError(f"target name {t.name!r} must be letters, digits, '.', '_' or '-' (it names a folder)")
    return list(targets)


def target_name_for(image: str) -> str:
    """An ad hoc target's name: the image reference made into one path component."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", image).strip("-._") or "image"


def image_cache_dir(ctx: Context) -> Path:
    """Where files read out of images are kept, by image id (beside the sdists)."""
    return (ctx.cache_dir or cache_mod.cache_dir()) / "images"


# --- which lane ----------------------------------------------------------------------


def lane_named(lanes: Sequence[Lane], target: TargetConfig) -> Lane:
    """The lane a target names (``vllm:``), else the first: what a pinned target stands in with."""
    wanted = target.vllm or lanes[0].version
    for lane in lanes:
        if lane.version == wanted:
            return lane
    raise ConfigError(f"target {target.name} names vLLM {wanted}, which is not a lane (lanes: {_versions(lanes)})")


def lane_of_image(lanes: Sequence[Lane], target: TargetConfig, side: ImageSide) -> Lane:
    """The lane of exactly the release the image carries; refused when there is none."""
    version = (side.versions.get("vllm") or "").split("+", 1)[0]
    if not version:
        raise SeriesError(
            f"{side.label} does not say which vLLM it carries (no package metadata, no _version.py), "
            f"so no lane can be chosen for it (lanes: {_versions(lanes)})"
        )
    if target.vllm and target.vllm != version:
        raise ConfigError(
            f"target {target.name} says vllm: {target.vllm!r}, but {side.label} carries vLLM {version}: "
            "fix the target's vllm (or its image)"
        )
    for lane in lanes:
        if lane.version == version:
            return lane
    raise SeriesError(
        f"{side.label} carries vLLM {version}, and no lane is for it (lanes: {_versions(lanes)}): "
        "its files are patched only by a series checked against that release; use an image of a "
        f"lane's release or add a lane for {version}"
    )


def _versions(lanes: Sequence[Lane]) -> str:
    return ", ".join(lane.version for lane in lanes)


def every_wanted_path(lanes: Sequence[Lane]) -> list[str]:
    """What any lane reads from an image, asked in the one probe before the lane is known."""
    return list(dict.fromkeys(p for lane in lanes for p in wanted_paths(plan_series(lane.series))))


# --- the plan ------------------------------------------------------------------------


@dataclass(frozen=True)
class TargetPlan:
    """Everything one target's overlay or bundle installs, decided before anything is built."""

    target: TargetConfig
    lane: Lane
    side: ImageSide  # where the originals came from: the image, or the pinned tree standing in
    files: tuple[InstalledFile, ...]  # by container path; a native artifact's data is None until built
    native: tuple[NativePlan, ...]  # the artifacts to build, and where
    landed: tuple[str, ...]  # patches already in the image's files: not applied
    skipped: tuple[str, ...]  # paths of the series no image holds (tests/, docs/)

    @property
    def pin(self) -> dict[str, str | None]:
        return {"version": self.lane.pin.version, "sha256": self.lane.pin.sha256}

    def with_built(self, artifact: str, data: bytes) -> TargetPlan:
        """The plan with a native artifact's bytes filled in."""
        files = tuple(dataclasses.replace(f, data=data) if f.path == artifact else f for f in self.files)
        return dataclasses.replace(self, files=files)


def plan_target(
    ctx: Context,
    target: TargetConfig,
    engine: Engine | None,
    *,
    need_image: bool = False,
    builder_base: str | None = None,
    setup: str | None = None,
    cuda_home: str | None = None,
) -> TargetPlan:
    """Read the target, choose its lane, patch its files and plan its native builds.

    ``engine`` None: no daemon (a pinned target stands in with its lane's pinned tree).
    ``need_image``: the image must be there even for a pinned target. The native build
    happens in ``builder_base`` (default: the image itself) with ``setup`` and
    ``cuda_home`` (default: the config's image.builder_setup and image.cuda_home)."""
    lanes = tuple(ctx.lanes)
    side = _side(ctx, target, engine, lanes, need_image)
    lane = lane_of_image(lanes, target, side) if side.image_id else lane_named(lanes, target)
    image = ctx.config.image
    return plan_lane(
        target, lane, side, ctx.source, builder_base or side.image_id, setup or image.builder_setup,
        cuda_home or image.cuda_home,
    )


def plan_lane(
    target: TargetConfig,
    lane: Lane,
    side: ImageSide,
    source_of: Callable[[str], SourceTree],
    builder: str | None = None,
    setup: str | None = None,
    cuda_home: str = DEFAULT_CUDA_HOME,
) -> TargetPlan:
    """The plan for a target whose lane and originals are known: the lane's file patches
    applied to the originals (fuzz 0), and its native builds from the lane's pinned sources
    (``source_of(version)``) in ``builder`` (None: on the host)."""
    series_plan = plan_series(lane.series)
    originals = side.read(wanted_paths(series_plan))
    if originals["vllm/__init__.py"] is None:
        raise ConfigError(
            f"{side.label} holds no vLLM at {side.root} ({side.root}/__init__.py is missing): fix the target's root"
        )
    patched, landed = patch_image_files(lane.series, {p: originals[p] for p in series_plan.files}, side.label, side.shown)
    files = [
        InstalledFile(p, container_path(side.root, p), a.data, a.mode, a.patches, _sha(originals[p]))
        for p, a in patched.items()
    ]
    natives = _native_plans(lane, series_plan, source_of, builder, setup, cuda_home)
    for n in natives:
        original = originals[n.artifact]
        mode = original.mode if original else 0o755  # the image's own, else what a built .so has
        files.append(InstalledFile(n.artifact, container_path(side.root, n.artifact), None, mode, n.patches, _sha(original)))
    return TargetPlan(
        target, lane, side, tuple(sorted(files, key=lambda f: f.container_path)), natives, tuple(landed),
        series_plan.skipped,
    )


def _side(ctx: Context, target: TargetConfig, engine: Engine | None, lanes: Sequence[Lane], need_image: bool) -> ImageSide:
    """The image when it is there; the named lane's pinned tree for a pinned target when it is not."""
    if engine is not None:
        try:
            engine.image_id(target.image)
        except EngineError as exc:
            if need_image or not target.pinned:
                raise
            ctx.progress.say(f"overlay {target.name}: {exc}; using the pinned tree it carries")
        else:
            return image_side(engine, target, every_wanted_path(lanes), image_cache_dir(ctx))
    if not target.pinned:
        raise EngineError(f"target {target.name}: reading image {target.image} needs a Docker daemon")
    return pinned_side(target, ctx.source(lane_named(lanes, target).version))


def built_on_host(ctx: Context, targets: Sequence[TargetConfig], engine: Engine | None) -> list[str]:
    """The targets whose native artifacts this machine will build, known before anything is
    fetched: what :func:`_side` decides (a pinned target whose image no daemon holds stands in
    with its pinned tree, built on the host), for a lane that has a native patch."""
    names = []
    for t in targets:
        if not t.pinned or not plan_series(lane_named(ctx.lanes, t).series).native:
            continue
        if engine is None or not _has_image(engine, t.image):
            names.append(t.name)
    return names


def _has_image(engine: Engine, ref: str) -> bool:
    try:
        engine.image_id(ref)
    except EngineError:
        return False
    return True


def _native_plans(
    lane: Lane,
    series_plan: SeriesPlan,
    source_of: Callable[[str], SourceTree],
    builder: str | None,
    setup: str | None,
    cuda_home: str,
) -> tuple[NativePlan, ...]:
    """Each artifact the lane's native patches change, from the lane's pinned sources (the
    image carries that release exactly)."""
    if not series_plan.native:
        return ()
    source = source_of(lane.version)
    plans = (plan_native(lane.series, b, source, builder, setup=setup, cuda_home=cuda_home) for b in series_plan.native)
    return tuple(p for p in plans if p is not None)


def _sha(original: ImageFile | None) -> str | None:
    return sha256_of(None if original is None else original.data)


def say_plan(plan: TargetPlan, progress: Progress, output: str = "overlay") -> None:
    """What the plan decided that an operator should hear before anything is built."""
    progress.say(f"{output} {plan.target.name}: lane {plan.lane.version}, from {plan.side.label}")
    for path in plan.skipped:
        progress.say(f"{output} {plan.target.name}: {path} is in no image: not installed")
    for patch_id in plan.landed:
        progress.say(f"{output} {plan.side.ref}: patch {patch_id} is already in the image's files: not applied")
