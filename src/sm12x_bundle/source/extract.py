"""Extract an sdist safely, once, into the cache.

Members with absolute paths, ``..`` components, links that point outside the tree,
or device/fifo entries are refused before anything is written.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tarfile
import tempfile
from pathlib import Path

from ..errors import FetchError
from ..progress import Progress
from .cache import locked


def _unsafe(member: tarfile.TarInfo) -> str | None:
    """Why a member must not be extracted, or None when it is safe."""
    name = member.name
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "has an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "has a '..' component"
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        return "is not a regular file, directory or link"
    if member.issym() or member.islnk():
        target = member.linkname
        if target.startswith("/"):
            return f"links to the absolute path {target}"
        base = posixpath.dirname(name) if member.issym() else ""
        resolved = posixpath.normpath(posixpath.join(base, target))
        if resolved == ".." or resolved.startswith("../"):
            return f"links outside the tree ({target})"
    return None


def check_members(tar: tarfile.TarFile, origin: str) -> list[tarfile.TarInfo]:
    members = tar.getmembers()
    for member in members:
        reason = _unsafe(member)
        if reason:
            raise FetchError(f"{origin}: member {member.name!r} {reason}: refusing to extract")
    tops = {m.name.split("/", 1)[0] for m in members}
    if len(tops) != 1:
        raise FetchError(f"{origin}: expected one top-level directory, found {len(tops)}")
    return members


def cached_tree(sdist: Path, cache: Path, *, progress: Progress | None = None) -> Path:
    """Extract ``sdist`` (whose cache folder is named by its sha256) once; return the root."""
    sha = sdist.parent.name
    dest = cache / "trees" / sha
    with locked(cache, "tree-" + sha):
        if not dest.is_dir():
            _extract_to(sdist, dest, progress)
    (top,) = [p for p in dest.iterdir() if p.is_dir()]
    return top


def _extract_to(sdist: Path, dest: Path, progress: Progress | None) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        try:
            with tarfile.open(sdist, "r:*") as tar:
                members = check_members(tar, sdist.name)
                task = (progress or Progress.quiet()).task(f"extracting {sdist.name}", len(members))
                for member in members:
                    _extract_one(tar, member, tmp)
                    task.advance(1)
                task.done()
        except (tarfile.TarError, EOFError, OSError) as exc:
            raise FetchError(f"{sdist.name} is not a readable sdist: {exc}") from None
        os.replace(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _extract_one(tar: tarfile.TarFile, member: tarfile.TarInfo, root: Path) -> None:
    # The 'data' filter re-checks what check_members checked and drops modes we do
    # not want (setuid, device files) where this Python has it.
    if hasattr(tarfile, "data_filter"):
        tar.extract(member, root, filter="data")
    else:  # pragma: no cover - Python < 3.11.4
        tar.extract(member, root)
