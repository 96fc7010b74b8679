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

import contextlib
import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import fsutil
from ..config import Config, TargetConfig
from ..containers import Engine
from ..context import Context
from ..fsutil import replace_dir, write_file
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
    with tempfile.TemporaryDirectory(prefix="sm12x-native-") as tmp:
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


def stage(overlay: Overlay, folder: Path) -> None:
    """Write one overlay's files and manifest into ``folder`` (fixed modes and mtimes)."""
    for f in overlay.files:
        dest = folder / f.source
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.data)
        os.chmod(dest, f.mode)
        mtime = overlay_mtime(f.data)
        os.utime(dest, (mtime, mtime))
    manifest = folder / "manifest.json"
    manifest.write_bytes(overlay.manifest_bytes())
    os.chmod(manifest, 0o644)
    os.utime(manifest, (MTIME_BASE, MTIME_BASE))
    # Every folder 0755, as vLLM's own are in an image; the content folder itself
    # starts as a private (0700) staging folder and must be readable by the container's user.
    for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        os.chmod(sub, 0o755)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def is_written(folder: Path, overlay: Overlay) -> bool:
    """The folder already holds exactly this overlay, modes included (so it is left alone,
    inodes and all; a folder an older version left 0700 is written again)."""
    try:
        if (folder / "manifest.json").read_bytes() != overlay.manifest_bytes() or _mode(folder) != 0o755:
            return False
        return all(
            (folder / f.source).read_bytes() == f.data and _mode(folder / f.source) == f.mode for f in overlay.files
        )
    except OSError:
        return False


Verifier = Callable[[Overlay, Path], None]


def destinations(out: Path, targets: Sequence[TargetConfig]) -> list[fsutil.Destination]:
    """Each target's folder under ``out``, written into (a version folder of its own, and
    current.json): absent, empty or ours (marked, or holding only what this tool wrote before
    it marked its folders), unless --force."""
    return [_target_folder(out, t.name) for t in targets]


def _target_folder(out: Path, target: str) -> fsutil.Destination:
    return fsutil.Destination(out / target, "into", "overlay folder", ("current.json",), _previous_overlays)


def _previous_overlays(folder: Path) -> bool:
    """Only current.json and <content hash>/manifest.json folders: what this tool wrote
    before it marked its folders."""
    entries = list(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else []
    return bool(entries) and all(
        p.name == "current.json" and p.is_file()
        or re.fullmatch(r"[0-9a-f]{16}", p.name) is not None and (p / "manifest.json").is_file()
        for p in entries
    )


def _holds_files(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def check_output(overlays: Sequence[Overlay], out: Path, force: bool = False) -> None:
    """Refuse, before anything is written, any folder the overlays would replace or write into."""
    fsutil.refuse_protected(out, "overlays folder")
    targets = [_target_folder(out, o.target) for o in overlays]
    versions = [fsutil.Destination(overlay_folder(out, o), "replace", "overlay folder")
                for o in overlays if not is_written(overlay_folder(out, o), o)]
    fsutil.check_destinations(targets + versions, force)


def overlays_root(ctx: Context, out: Path | None) -> Path:
    """``--out``, else output.overlays; '' and the like are refused, never taken as '.'."""
    return fsutil.refuse_protected(ctx.config.output.overlays if out is None else out, "overlays folder")


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
    check_output(overlays, out, force)
    # Marked once written: absent, empty or written before folders were marked.
    claimed = [t for t in {out / o.target for o in overlays} if _previous_overlays(t) or not _holds_files(t)]
    folders = []
    with contextlib.ExitStack() as stack:
        for overlay in overlays:
            dest = overlay_folder(out, overlay)
            folder = dest
            if not is_written(dest, overlay):
                folder = stack.enter_context(replace_dir(dest, force, "overlay folder"))
                stage(overlay, folder)
            if verify is not None:
                verify(overlay, folder)
            folders.append(dest)
    for target in claimed:
        fsutil.mark(target)
    for overlay in overlays:
        current = out / overlay.target / "current.json"
        write_file(current, overlay.manifest_bytes())
        os.utime(current, (MTIME_BASE, MTIME_BASE))
    return folders


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
