"""Extract an sdist safely, once, into the cache.

Refused before anything is written: members with absolute paths, ``..`` components or
names that are not plain, links that point outside the tree (also through other links),
loops of links, hard links to no earlier file, sparse members, headers of impossible
size, and device/fifo entries. Only bytes whose sha256 matches the pin are extracted.
Each refusal has a test (tests/test_fuzz.py, tests/test_fetch.py).
"""

from __future__ import annotations

import glob
import hashlib
import io
import posixpath
import shutil
import tarfile
import tempfile
from pathlib import Path

from ..errors import FetchError, is_environment
from ..fsutil import pause
from ..progress import Progress
from . import record
from .cache import locked, notice, swap_in, unusable, writing


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
    if member.issparse():  # its declared size is free to claim: a terabyte costs no data
        return "is a sparse file"
    if member.issym() or member.islnk():
        # tarfile resolves a link from its name as written; the kernel from where the link
        # lands. They differ for 'a/.', 'a/' or 'a//b', so such names are refused.
        plain = name[2:] if name.startswith("./") else name
        if plain != posixpath.normpath(plain):
            return "is a link whose name is not plain (a '.', an empty part or a trailing '/')"
        target = member.linkname
        if target.startswith("/"):
            return f"links to the absolute path {target}"
        base = posixpath.dirname(name) if member.issym() else ""
        resolved = posixpath.normpath(posixpath.join(base, target))
        if resolved == ".." or resolved.startswith("../"):
            return f"links outside the tree ({target})"
    return None


def _through_symlink(path: str, symlinks: dict[str, str]) -> str | None:
    """The first symlink member that ``path`` goes through (one it ends at is not counted)."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    stack: list[str] = []
    for n, part in enumerate(parts):
        if part == "..":
            stack = stack[:-1]
        else:
            stack.append(part)
        if n < len(parts) - 1 and "/".join(stack) in symlinks:
            return "/".join(stack)
    return None


def _in_a_loop(name: str, symlinks: dict[str, str]) -> bool:
    """Whether following symlink members from ``name`` comes back to one already passed."""
    seen = set()
    while name in symlinks and name not in seen:
        seen.add(name)
        name = symlinks[name]
    return name in seen


def _unsafe_among(member: tarfile.TarInfo, symlinks: dict[str, str], files_before: set[str]) -> str | None:
    """Why a member is unsafe given the others, which ``_unsafe`` alone cannot see."""
    # Through a symlink, a path resolves where the link points, not where its text says:
    # links that each stay inside on paper can chain out (a -> b/../../x, then b -> .).
    paths = [member.name]
    if member.issym():
        paths.append(posixpath.join(posixpath.dirname(member.name), member.linkname))
    if member.islnk():
        paths.append(member.linkname)
    for path in paths:
        link = _through_symlink(path, symlinks)
        if link:
            return f"goes through the symlink {link!r}"
    # tarfile resolves a hard link to an earlier member; any other target is an error it
    # does not type (KeyError) or a link to a folder.
    if member.islnk() and posixpath.normpath(member.linkname) not in files_before:
        return f"is a hard link to {member.linkname!r}, which is not an earlier file in the archive"
    # When tarfile cannot make a symlink (a folder is in the way, the name is too long, its
    # parent is a file) it extracts the link's target in its place instead: through a loop
    # of links that recursed until RecursionError.
    if member.issym() and _in_a_loop(posixpath.normpath(member.name), symlinks):
        return "is part of a loop of symlinks"
    return None


def _link_target(symlink: tarfile.TarInfo) -> str:
    return posixpath.normpath(posixpath.join(posixpath.dirname(posixpath.normpath(symlink.name)), symlink.linkname))


def check_members(tar: tarfile.TarFile, origin: str) -> list[tarfile.TarInfo]:
    members = tar.getmembers()
    symlinks = {posixpath.normpath(m.name): _link_target(m) for m in members if m.issym()}
    files_before: set[str] = set()
    for member in members:
        reason = _unsafe(member) or _unsafe_among(member, symlinks, files_before)
        if reason:
            raise FetchError(f"{origin}: member {member.name!r} {reason}: refusing to extract")
        if member.isfile():
            files_before.add(posixpath.normpath(member.name))
    tops = {m.name.split("/", 1)[0] for m in members}
    if len(tops) != 1:
        raise FetchError(f"{origin}: expected one top-level directory, found {len(tops)}")
    (top,) = tops
    for member in members:
        if posixpath.normpath(member.name) == posixpath.normpath(top) and not member.isdir():
            raise FetchError(f"{origin}: the top-level entry {member.name!r} is not a directory: refusing to extract")
    return members


def cached_tree(sdist: Path, cache: Path, *, progress: Progress | None = None) -> Path:
    """The root of ``sdist``'s extracted tree (its cache folder is named by its sha256).

    A cached tree is checked against the record made when it was extracted before it is
    given out; one that differs is extracted again from the sdist, verified once more.
    """
    sha = sdist.parent.name
    dest = cache / "trees" / sha
    with locked(cache, "tree-" + sha):
        if dest.is_dir():
            found = record.check(dest, sha).differences
            if not found:
                return _top(dest)
            more = f", and {len(found) - 1} more" if len(found) > 1 else ""
            differs = f"differs from its record ({found[0]}{more})"
            notice(progress, f"the cached tree of {sdist.name} {differs}: extracting it again")
        _extract_to(sdist, sha, dest, progress)
        return _top(dest)


def whole_tree(cache: Path, sha: str) -> Path | None:
    """The cached tree of the sdist with sha256 ``sha`` if it is there and matches its
    record; None otherwise (``cached_tree`` then says what differs and repairs it)."""
    dest = cache / "trees" / sha
    with locked(cache, "tree-" + sha):
        if dest.is_dir() and not record.check(dest, sha).differences:
            return _top(dest)
    return None


def _top(dest: Path) -> Path:
    tops = [p for p in dest.iterdir() if p.is_dir() and not p.is_symlink()]
    if len(tops) != 1:
        raise FetchError(f"the sdist for {dest.name} holds no single top-level folder")
    return tops[0]


def _extract_to(sdist: Path, sha: str, dest: Path, progress: Progress | None) -> None:
    # Extract from the very bytes that were hashed, so nothing unverified is unpacked.
    try:
        data = sdist.read_bytes()
    except OSError as exc:
        raise FetchError(f"cannot read {sdist}: {exc.strerror}") from None
    if hashlib.sha256(data).hexdigest() != sha:
        raise FetchError(f"{sdist} no longer matches sha256 {sha}: refusing to extract it (run again to fetch it anew)")
    cache = dest.parent.parent
    with writing(cache):
        dest.parent.mkdir(parents=True, exist_ok=True)
        remove_partial(dest)
        tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        _unpack(data, sdist.name, tmp, cache, progress)
        _top(tmp)  # one top-level folder, before the tree takes its place in the cache
        with writing(cache):
            record.write(tmp, sha)
            swap_in(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_partial(dest: Path) -> list[Path]:
    """Remove what a run killed while extracting into, or discarding, ``dest`` left
    (``trees/<sha256>.XXXX``, ``trees/<sha256>.discarded.XXXX``). Called with the entry's
    lock held, so no live run is using any of them: the name and the lock mark them."""
    removed = []
    for path in dest.parent.glob(glob.escape(dest.name) + ".*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _unpack(data: bytes, name: str, tmp: Path, cache: Path, progress: Progress | None) -> None:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
            members = check_members(tar, name)
            task = (progress or Progress.quiet()).task(f"extracting {name}", len(members))
            for member in members:
                extract_member(tar, member, tmp)
                task.advance(1)
                if task.count == 100:
                    pause("cache-extracting")
            task.done()
    except OSError as exc:
        if is_environment(exc):  # a full or read-only cache, not the archive
            raise unusable(cache, exc) from None
        raise FetchError(f"{name} is not a readable sdist: {exc}") from None
    except (tarfile.TarError, EOFError) as exc:
        raise FetchError(f"{name} is not a readable sdist: {exc}") from None
    except MemoryError:
        # tarfile reads an extended header (pax record, GNU long name) whole, at the
        # size its header declares; a hostile header declares terabytes.
        raise FetchError(f"{name}: a member header declares a size too large to read") from None


def extract_member(tar: tarfile.TarFile, member: tarfile.TarInfo, root: Path) -> None:
    # The 'data' filter re-checks what check_members checked and drops modes we do
    # not want (setuid, device files) where this Python has it.
    if hasattr(tarfile, "data_filter"):
        tar.extract(member, root, filter="data")
    else:  # pragma: no cover - Python < 3.11.4
        tar.extract(member, root)
