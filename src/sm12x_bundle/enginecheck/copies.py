"""The patched copy of an installed vLLM: the install's own files, the lane's series applied.

The plan is the project's own (plan/target.py ``plan_lane``): the series applied to the
install's own copies of the files it touches, at fuzz 0 (a conflict names the file and the
hunk), and the cumem extension rebuilt from the lane's pinned sources on this host
(outputs/native_build.py). The copy costs next to nothing: every file of ``vllm/`` and of
its dist-info is hard-linked (copied where the work folder is on another file system), then
exactly the patched files are replaced: unlinked, then written, so the install's own files
are never written through a link. ``__pycache__`` folders are not carried: the engines keep
their bytecode under the work folder (PYTHONPYCACHEPREFIX), never in either tree.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import TargetConfig
from ..containers import ImageFile
from ..fsutil import replace_dir
from ..outputs.native_build import build_native
from ..plan.files import VERSION_KEYS
from ..plan.originals import ImageSide
from ..plan.target import TargetPlan, plan_lane
from ..progress import Progress
from ..series.lane import Lane
from ..source.pin import SourceTree
from .install import Install

# Where the file system refuses a hard link, a copy stands in.
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES}


class InstallSide(ImageSide):
    """The originals read from an installed vLLM's folder (ImageSide's interface)."""

    @property
    def label(self) -> str:
        return f"the vLLM installed at {self.root}"


def install_side(install: Install) -> InstallSide:
    def read(paths: list[str]) -> dict[str, ImageFile | None]:
        return {p: _file_or_none(install.root / p) for p in paths}

    versions = dict.fromkeys(VERSION_KEYS) | {"vllm": install.version, "torch": torch_version()}
    return InstallSide(str(install.package), None, str(install.package), versions, read)


def _file_or_none(path: Path) -> ImageFile | None:
    if not path.is_file() or path.is_symlink():
        return None
    return ImageFile(path.read_bytes(), path.stat().st_mode & 0o777)


def torch_version() -> str | None:
    """The torch this Python would import, from its metadata (torch is not imported)."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def plan_patched(install: Install, lane: Lane, source_of: Callable[[str], SourceTree]) -> TargetPlan:
    """The lane's files for this install, its native build planned on this host."""
    target = TargetConfig(name="engine-check", image=str(install.package), root=str(install.package))
    return plan_lane(target, lane, install_side(install), source_of)


@dataclass(frozen=True)
class CopyFacts:
    root: Path
    linked: int
    copied: int
    replaced: tuple[dict, ...]  # path, patches, sha256 before and after

    def to_dict(self) -> dict:
        return {"root": str(self.root), "linked": self.linked, "copied": self.copied, "replaced": list(self.replaced)}


def make_copy(install: Install, files: dict[str, tuple[bytes, int]], dest: Path) -> tuple[int, int]:
    """Link the install's ``vllm/`` and dist-info into ``dest`` (replaced whole, atomically),
    then replace ``files`` (tree path -> bytes and mode). Returns (files linked and kept, copied)."""
    linked = copied = 0
    with replace_dir(dest, what="patched copy") as staging:
        for folder in [install.package, *sorted(install.root.glob("vllm-*.dist-info"))]:
            n_linked, n_copied = link_tree(folder, staging / folder.name)
            linked, copied = linked + n_linked, copied + n_copied
        for path, (data, mode) in files.items():
            linked -= os.path.lexists(staging / path)  # linked above, replaced now
            replace_file(staging / path, data, mode)
    return linked, copied


def link_tree(src: Path, dest: Path) -> tuple[int, int]:
    """Hard-link every file under ``src`` into ``dest`` (links kept as links); (linked, copied)."""
    linked = copied = 0
    for folder, dirs, names in os.walk(src):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        out = dest / Path(folder).relative_to(src)
        out.mkdir(parents=True, exist_ok=True)
        for name in names:
            if _link_one(Path(folder) / name, out / name):
                linked += 1
            else:
                copied += 1
    return linked, copied


def _link_one(src: Path, dest: Path) -> bool:
    if src.is_symlink():
        os.symlink(os.readlink(src), dest)
        return False
    try:
        os.link(src, dest)
        return True
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
    shutil.copy2(src, dest)
    return False


def replace_file(path: Path, data: bytes, mode: int) -> None:
    """Unlink, then write anew: a hard link to the install is never written through."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.chmod(path, mode)


def sha256_of(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def prepare_patched(
    install: Install, lane: Lane, source_of: Callable[[str], SourceTree], work: Path, progress: Progress
) -> tuple[CopyFacts, list[dict]]:
    """Plan, build the extension, make the copy under ``work/patched``; say what it holds."""
    plan = plan_patched(install, lane, source_of)
    for patch_id in plan.landed:
        progress.say(f"engine-check: patch {patch_id} is already in {install.package}: not applied")
    files = {f.path: (f.data, f.mode) for f in plan.files if f.data is not None}
    natives = []
    for native_plan in plan.native:
        progress.say(f"engine-check: building {native_plan.artifact} from the lane's pinned sources")
        built = build_native(native_plan, None, plan.side.versions, plan.side.label,
                             work / "build" / Path(native_plan.artifact).name.split(".")[0], progress)
        mode = next(f.mode for f in plan.files if f.path == native_plan.artifact)
        files[native_plan.artifact] = (built.data, mode)
        natives.append({"artifact": native_plan.artifact, **built.record})
    dest = work / "patched"
    linked, copied = make_copy(install, files, dest)
    by_path = {f.path: f for f in plan.files}
    replaced = tuple(
        {"path": p, "patches": list(by_path[p].patches), "pre_image_sha256": by_path[p].pre_image_sha256,
         "sha256": sha256_of(data)}
        for p, (data, _) in sorted(files.items())
    )
    progress.say(f"engine-check: patched copy at {dest}: {len(replaced)} files replaced, {linked} linked, "
                 f"{copied} copied")
    return CopyFacts(dest, linked, copied, replaced), natives
