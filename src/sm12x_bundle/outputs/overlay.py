"""Per-file overlays: the patched copies of exactly the files a lane's series changes, ready
to bind-mount read-only over the same files inside a running vLLM container.

The overlay renders a target's plan (plan/target.py, :func:`plan_target`): the lane chosen
by the image's vLLM version, the image's own files patched at fuzz 0, and the native
builds, which are carried out here (native_build.py: in a builder container from the
target image when the overlay is read from an image, on the host only for a target made
from the pinned tree without one). Then:

* **write**: ``<out>/<target>/<content hash>/{manifest.json, files/...}`` staged and renamed
  into place, plus ``<out>/<target>/current.json``. Same inputs give the same bytes and the
  same mtimes; a new version is a new path.
* **verify** (verify.py): the overlay mounted read-only in the target image (no network):
  hashes, compile, import where the image can import vLLM, the native extension loads, the
  image's own bytecode cannot shadow an overlaid file, and the image's originals are the
  recorded pre-images (otherwise refused).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import fsutil
from ..config import Config, TargetConfig
from ..containers import Engine
from ..context import Context
from ..plan.files import InstalledFile
from ..plan.originals import connect
from ..plan.target import (
    TargetPlan,
    checked_targets,
    plan_target,
    say_plan,
)
from ..progress import Progress
from . import native_build
from .manifest import content_hash, manifest_bytes
from .manifest import manifest as manifest_document
from .verify import Verified, verify_overlay

# Overlaid files get mtimes in the first 194 days of 2000 (before vLLM existed), derived
# from their content: never the image original's mtime, and never the mtime of another
# version of the same overlay (a persistent PYTHONPYCACHEPREFIX keeps bytecode keyed on
# mtime and size, so two versions of one size must differ in mtime).
MTIME_BASE = 946684800


# --- one overlay ---------------------------------------------------------------------


def overlay_mtime(data: bytes) -> int:
    return MTIME_BASE + int.from_bytes(hashlib.sha256(data).digest()[:3], "big")


@dataclass(frozen=True)
class Overlay:
    target: str
    image: str
    image_id: str | None
    vllm_root: str
    versions: dict[str, str | None]
    pin: dict[str, str | None]
    series_sha256: str
    files: tuple[InstalledFile, ...]
    native: dict[str, dict[str, Any]] = field(default_factory=dict)  # container path -> build record

    @property
    def content_hash(self) -> str:
        return content_hash(self.files)

    def manifest(self) -> dict[str, Any]:
        return manifest_document(
            target=self.target,
            image=self.image,
            image_id=self.image_id,
            vllm_root=self.vllm_root,
            versions=self.versions,
            pin=self.pin,
            series_sha256=self.series_sha256,
            files=self.files,
            native=self.native,
        )

    def manifest_bytes(self) -> bytes:
        return manifest_bytes(self.manifest())


def make_overlay(plan: TargetPlan, progress: Progress) -> Overlay:
    """Everything one target's overlay holds, in memory (nothing is written): the plan
    rendered, with its native artifacts built."""
    say_plan(plan, progress)
    records: dict[str, dict[str, Any]] = {}
    with fsutil.temp_folder("sm12x-native-") as tmp:
        for n, todo in enumerate(plan.native):
            art = native_build.build_native(
                todo, plan.side.engine, plan.side.versions, plan.side.label, Path(tmp) / str(n), progress
            )
            plan = plan.with_built(art.artifact, art.data)
            path = next(f.container_path for f in plan.files if f.path == art.artifact)
            records[path] = art.record
    side = plan.side
    return Overlay(
        plan.target.name, side.ref, side.image_id, side.root, side.versions, plan.pin, plan.lane.series.sha256,
        plan.files, records,
    )


# --- writing, atomically -------------------------------------------------------------


def overlay_folder(out: Path, overlay: Overlay) -> Path:
    return out / overlay.target / overlay.content_hash


def version_files(overlay: Overlay) -> tuple[fsutil.FileSpec, ...]:
    """One overlay's files and manifest as they are written (fixed modes and mtimes)."""
    files = [fsutil.FileSpec(f.source, f.data, f.mode, overlay_mtime(f.data)) for f in overlay.files]
    return (*files, fsutil.FileSpec("manifest.json", overlay.manifest_bytes(), 0o644, MTIME_BASE))


def is_written(folder: Path, overlay: Overlay) -> bool:
    """The folder already holds exactly this overlay, modes included."""
    return fsutil.holds(folder, version_files(overlay))


Verifier = Callable[[Overlay, Path], None]

# What this tool wrote in a target's folder before it marked its folders: current.json and
# <content hash>/manifest.json folders.
EARLIER = fsutil.Earlier(files=("current.json",), folders=r"[0-9a-f]{16}", holding="manifest.json")


def destinations(out: Path, targets: Sequence[TargetConfig]) -> list[fsutil.Destination]:
    """The overlays folder (never the root, home or a system folder), and each target's folder
    under it, written into (a version folder of its own, and current.json): absent, empty or
    ours (marked, or holding only what this tool wrote before it marked its folders), unless
    --force."""
    return [fsutil.Destination(out, "within", "overlays folder"), *(_target_folder(out, t.name) for t in targets)]


def _target_folder(out: Path, target: str) -> fsutil.Destination:
    return fsutil.Destination(out / target, "into", "overlay folder", ("current.json",), EARLIER)


def overlays_root(ctx: Context, out: Path | None) -> Path:
    """``--out``, else output.overlays ('' and the like are refused by destinations(), never
    taken as '.')."""
    return Path(ctx.config.output.overlays if out is None else out)


def planned_overlays(config: Config) -> list[str]:
    """Where each target's overlay goes and which lane makes it, from the config alone
    (``build --dry-run``: no daemon is asked, nothing is read)."""
    lanes = [lane.version for lane in config.lanes]
    lines = []
    for t in config.targets:
        folder = f"{config.output.overlays}/{t.name}/"
        if t.pinned:
            named = t.vllm or lanes[0]
            how = f"lane {named}: image {t.image} (its vLLM must be {named}); no daemon: the pinned {named} tree"
        else:
            how = f"image {t.image}: the lane of its vLLM version ({', '.join(lanes)}); needs a daemon"
        lines.append(f"{folder}  {how}")
    return lines


def write_overlays(
    overlays: Sequence[Overlay], out: Path, verify: Verifier | None = None, force: bool = False
) -> list[Path]:
    """Stage every overlay, verify each if asked, then move them all into place.

    On any error nothing is written: staging folders are removed and current.json files
    keep pointing at what they pointed at. Folders this tool did not write are refused
    (OutputError) unless ``force``.
    """
    targets = list(dict.fromkeys(o.target for o in overlays))
    into = [fsutil.Destination(out, "within", "overlays folder"), *(_target_folder(out, t) for t in targets)]
    versions = [fsutil.Version(overlay_folder(out, o), version_files(o)) for o in overlays]
    pointers = [(out / o.target / "current.json", fsutil.FileSpec("current.json", o.manifest_bytes(), 0o644, MTIME_BASE))
                for o in overlays]
    check = None if verify is None else (lambda i, folder: verify(overlays[i], folder))
    fsutil.write_versions(into, versions, pointers, force, check, "overlay folder")
    return [v.folder for v in versions]


# --- make and write: what `overlay` and `build` both run ----------------------------------


def make_overlays(ctx: Context, targets: Sequence[TargetConfig], engine: Engine | None, need_image: bool) -> list[Overlay]:
    """Every target's overlay, in memory: any error here leaves nothing written."""
    return [make_overlay(plan_target(ctx, t, engine, need_image=need_image), ctx.progress) for t in targets]


def make_and_write(
    ctx: Context,
    targets: list[TargetConfig] | None = None,
    *,
    verify: bool | None = None,
    out: Path | None = None,
    force: bool = False,
) -> list[tuple[Overlay, Path]]:
    """Make every target's overlay and write them under ``out`` (default: output.overlays,
    relative to the working directory); what ``overlay`` and ``build`` both run.

    ``targets`` None: the config's. ``verify`` None: check each overlay read from an image in
    that image when a daemon answers (a pinned target made from the pinned tree is not);
    True: a daemon and every target's image are required. A target that is not pinned
    needs a daemon either way (EngineError). Nothing is written when anything fails.
    """
    written, reports = make_and_write_reports(ctx, targets, verify, out, force)
    for report in reports:
        say_verified(ctx.progress, report)
    return written


def make_and_write_reports(
    ctx: Context, targets: Sequence[TargetConfig] | None, verify: bool | None, out: Path | None, force: bool = False
) -> tuple[list[tuple[Overlay, Path]], list[Verified]]:
    targets = checked_targets(ctx.config, list(ctx.config.targets) if targets is None else targets)
    out = overlays_root(ctx, out)
    fsutil.check_destinations(destinations(out, targets), force)  # before any image is read or anything built
    engine = connect(bool(verify) or any(not t.pinned for t in targets), ctx.progress)
    native_build.preflight(ctx, targets, engine)  # before anything is fetched
    overlays = make_overlays(ctx, targets, engine, bool(verify))
    reports: list[Verified] = []

    def check(overlay: Overlay, folder: Path) -> None:
        if overlay.image_id is not None or verify:
            reports.append(verify_overlay(engine, folder))

    checking = verify or (verify is None and engine is not None)
    folders = write_overlays(overlays, out, check if checking else None, force)
    return list(zip(overlays, folders)), reports


def say_verified(progress: Progress, report: Verified) -> None:
    for line in report.ok:
        progress.say(f"verify {report.image}: ok: {line}")
    for note in report.notes:
        progress.say(f"verify {report.image}: note: {note}")
