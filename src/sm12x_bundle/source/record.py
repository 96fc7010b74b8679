"""The digest record of an extracted tree: what every file held when it was extracted.

The record lists each path under ``trees/<sha256>/`` with its kind, mode, size and the
sha256 of its bytes (a link: its target), plus a stat fingerprint (mtime, ctime, inode).
A check walks the tree once and stats every file. When the walk's fingerprints are the
recorded ones (one digest over all of them, kept in the record's first line) and all
are old, the tree is whole; otherwise the full record is read, a path added, removed or
of another kind is a difference, and every file whose fingerprint is new or young is
hashed and compared.

This rests on ctime: the kernel sets it on every write, chmod, rename and utime, and no
system call sets it back, so an edit that restores the size and mtime still changes the
fingerprint. What it does not catch: bytes changed below the file system (a disk fault,
a write to the raw device), a same-size edit made while the system clock is set back, and
a forged record. A fingerprint younger than RACY_NS at the walk that recorded it may share
its ctime with a later edit (coarse clocks, 1 s file systems), so such files are hashed
on every check until a check finds them old and records them again.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import FetchError

NAME = ".sm12x-tree-record.json"
SCHEMA = 2
RACY_NS = 2_000_000_000  # longer than any file system's timestamp granularity we meet

# path -> stamp: "dir", or "<st_mode> <size> <mtime_ns> <ctime_ns> <inode>" from lstat
# for anything else (a string, so the fast path compares it without parsing it).
Stamps = dict[str, str]
# path -> [stamp, content]; content: a file's sha256, a link's target, "" otherwise.
Entries = dict[str, list[str]]


@dataclass(frozen=True)
class Verdict:
    differences: list[str]  # "<path> changed|added|removed", sorted; empty: the tree is whole
    hashed: int  # files whose bytes were read and hashed by this check


def write(root: Path, sdist_sha256: str) -> None:
    """Record every path under ``root`` (a tree extracted a moment ago)."""
    walk_ns = time.time_ns()
    stamps = _walk(root)
    _save(root, sdist_sha256, walk_ns, {rel: [st, _content(root, rel, st)] for rel, st in stamps.items()})


def check(root: Path, sdist_sha256: str) -> Verdict:
    """Compare the tree under ``root`` with its record; call with the entry's lock held.

    A missing or unreadable record is one difference. Files that had to be hashed and
    still match are recorded again, so the next check can trust their fingerprint.
    """
    header, lines = _load(root, sdist_sha256)
    if header is None:
        return Verdict([f"{NAME} missing or unreadable"], 0)
    walk_ns = time.time_ns()
    stamps = _walk(root)
    if header["settled"] and _digest(stamps) == header["stamps"]:
        return Verdict([], 0)
    entries = _entries(lines)
    if entries is None:
        return Verdict([f"{NAME} unreadable"], 0)
    differences, fresh, hashed = [], {}, 0
    for rel, stamp in stamps.items():
        want = entries.pop(rel, None)
        if want is None:
            differences.append(f"{rel} added")
            continue
        if stamp != want[0] or not _old(stamp, header["walk_ns"]):
            got = [stamp, _content(root, rel, stamp)]
            hashed += _kind(stamp) == stat.S_IFREG
            if _identity(got) != _identity(want):
                differences.append(f"{rel} changed")
            want = got
        fresh[rel] = want
    differences += [f"{rel} removed" for rel in entries]
    if not differences:
        _save(root, sdist_sha256, walk_ns, fresh)
    return Verdict(sorted(differences), hashed)


def _walk(root: Path) -> Stamps:
    """Every path under ``root`` but the record, with its stamp: one stat per file."""
    stamps: Stamps = {}
    stack = [(str(root), "")]
    while stack:
        folder, prefix = stack.pop()
        with os.scandir(folder) as it:
            for e in it:
                rel = prefix + e.name
                if e.is_dir(follow_symlinks=False):
                    stamps[rel] = "dir"
                    stack.append((e.path, rel + "/"))
                elif prefix or not rel.startswith(NAME):  # not the record, nor one being written
                    st = e.stat(follow_symlinks=False)
                    stamps[rel] = f"{st.st_mode} {st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"
    return stamps


def _digest(stamps: Stamps) -> str:
    # A path holds no NUL and a stamp no newline, so the joined text reads back one way.
    text = "\n".join(map("\0".join, sorted(stamps.items())))
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _kind(stamp: str) -> int:
    return stat.S_IFDIR if stamp == "dir" else stat.S_IFMT(int(stamp.split(" ", 1)[0]))


def _old(stamp: str, walk_ns: int) -> bool:
    """Whether a path last changed well before the walk that recorded it (see RACY_NS)."""
    return stamp == "dir" or int(stamp.split(" ")[3]) < walk_ns - RACY_NS


def _content(root: Path, rel: str, stamp: str) -> str:
    kind = _kind(stamp)
    if kind == stat.S_IFLNK:
        return os.readlink(root / rel)
    return _sha256(root / rel) if kind == stat.S_IFREG else ""


def _identity(entry: list[str]) -> tuple[str, str]:
    """What must not change: kind, mode and size, and content (not mtime, ctime, inode)."""
    stamp, content = entry
    return " ".join(stamp.split(" ")[:2]), content


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _save(root: Path, sdist_sha256: str, walk_ns: int, entries: Entries) -> None:
    stamps = {rel: entry[0] for rel, entry in entries.items()}
    header = {
        "schema": SCHEMA,
        "sdist_sha256": sdist_sha256,
        "walk_ns": walk_ns,
        "settled": all(_old(s, walk_ns) for s in stamps.values()),
        "stamps": _digest(stamps),
    }
    fd, tmp = tempfile.mkstemp(prefix=NAME + ".", dir=root)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="surrogateescape") as fh:
            fh.write(json.dumps(header, sort_keys=True) + "\n")
            json.dump(entries, fh, sort_keys=True, separators=(",", ":"))
        os.replace(tmp, root / NAME)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load(root: Path, sdist_sha256: str) -> tuple[dict | None, str]:
    """The record's header (None when missing, unreadable or not this sdist's) and the
    text of its entries, parsed only when the fast path fails."""
    try:
        first, _, rest = (root / NAME).read_text("utf-8", "surrogateescape").partition("\n")
        header = json.loads(first)
    except (OSError, ValueError):
        return None, ""
    types = {"schema": int, "sdist_sha256": str, "walk_ns": int, "settled": bool, "stamps": str}
    if not isinstance(header, dict) or set(header) != set(types) or header["schema"] != SCHEMA:
        return None, ""
    if not all(isinstance(header[k], t) for k, t in types.items()):
        return None, ""
    return (header, rest) if header["sdist_sha256"] == sdist_sha256 else (None, "")


def _entries(text: str) -> Entries | None:
    try:
        entries = json.loads(text)
    except ValueError:
        return None
    ok = isinstance(entries, dict) and all(
        isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v) for v in entries.values()
    )
    return entries if ok else None


def copy_verified(entry: Path, top: str, sdist_sha256: str, dest: Path) -> None:
    """Copy the folder ``top`` of the cached tree ``entry`` (trees/<sha256>) into ``dest``
    from its record: each file is opened without following a link, read once, its sha256
    compared with the record's, and those very bytes written, so a file changed after the
    tree was checked never reaches ``dest`` (FetchError naming it). What the record does not
    list is not copied."""
    header, lines = _load(entry, sdist_sha256)
    entries = _entries(lines) if header is not None else None
    if entries is None:
        raise FetchError(f"the cached tree {entry} has no readable record: refusing to copy it (run again to re-extract)")
    prefix = top + "/"
    for rel in sorted(entries):  # a folder sorts before what it holds
        if rel.startswith(prefix):
            stamp, content = entries[rel]
            _copy_entry(entry / rel, dest / rel[len(prefix):], stamp, content)


def _copy_entry(src: Path, dst: Path, stamp: str, content: str) -> None:
    kind = _kind(stamp)
    if kind == stat.S_IFDIR:
        dst.mkdir(parents=True, exist_ok=True)
        os.chmod(dst, 0o755)  # explicit: a umask of 077 must not make the tree unreadable in a container
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    if kind == stat.S_IFLNK:
        target = _read_link(src)
        if target != content:
            raise FetchError(f"the cached tree's link {src} changed since it was checked: refusing to copy it")
        os.symlink(target, dst)
        return
    data, st = _read_once(src)
    if hashlib.sha256(data).hexdigest() != content:
        raise FetchError(f"the cached tree's file {src} changed since it was checked: refusing to copy it "
                         "(run again to check and re-extract the tree)")
    try:
        with open(dst, "xb") as fh:
            fh.write(data)
    except OSError as exc:  # named by the file that could not be written (a full disk)
        raise OSError(exc.errno, exc.strerror, os.fspath(dst)) from None
    os.chmod(dst, int(stamp.split(" ", 1)[0]) & 0o777)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns))


def _read_link(src: Path) -> str:
    try:
        return os.readlink(src)
    except OSError as exc:
        raise FetchError(f"the cached tree's link {src} cannot be read: {exc.strerror}") from None


def _read_once(src: Path) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file ``src``, read through one descriptor opened without
    following a link (a link planted where the file was is refused, never followed)."""
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise FetchError(f"the cached tree's file {src} cannot be opened as a file: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise FetchError(f"the cached tree's file {src} is no longer a regular file: refusing to copy it")
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(), st
    finally:
        os.close(fd)
