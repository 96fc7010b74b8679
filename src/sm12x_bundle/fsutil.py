"""Writing outputs so that a failure leaves nothing half-written, reruns change nothing,
and nothing the tool did not write is ever replaced.

Every folder the tool owns carries :data:`MARKER`. A folder is replaced only when it is
absent, empty or marked (or ``--force`` says so); the working directory, the home
folder, the root and the folders above the working directory or the home folder never are.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .errors import OutputError

MARKER = ".sm12x-bundle-output"
MARKER_TEXT = (
    b"This folder was written by sm12x-bundle: its next run may replace the folder or the files in it.\n"
    b"Delete this file to keep sm12x-bundle from doing so without --force.\n"
)
# A fixed mtime (2000-01-01), so that reruns leave the same bytes and the same mtimes.
MARKER_MTIME = 946684800
_STAGING_KINDS = ("new", "old")


def write_file(path: Path, data: bytes, mode: int = 0o644) -> bool:
    """Write atomically, and only when the content changes (keeps mtimes and caches stable)."""
    if path.is_file() and path.read_bytes() == data:
        if (path.stat().st_mode & 0o777) != mode:
            path.chmod(mode)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


# --- which folders may be written ------------------------------------------------------


def is_ours(folder: Path) -> bool:
    """The folder holds the marker this tool writes into every folder it owns."""
    marker = folder / MARKER
    return marker.is_file() and not marker.is_symlink()


def refuse_protected(path: str | os.PathLike[str], what: str = "output folder") -> Path:
    """Refuse '', the working directory, home, the root and the folders above the
    working directory or home (even with --force); return the path as given."""
    raw = os.fspath(path)
    target = Path(raw).resolve()
    cwd = Path.cwd().resolve()
    if raw.strip() == "":
        where = "an empty path"
    elif target == Path(target.anchor):
        where = "the root folder"
    elif Path.home().resolve() in (target, Path(os.path.expanduser(raw)).resolve()):
        where = "the home folder"
    elif target in Path.home().resolve().parents:
        where = "a folder above the home folder"
    elif target == cwd:
        where = "the working directory"
    elif target in cwd.parents:
        where = "a folder above the working directory"
    else:
        return Path(raw)
    raise OutputError(f"the {what} {raw!r} is {where}: refused, even with --force; name a folder of its own")


def _first_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path != path.parent:
        path = path.parent
    return path


def check_parent(dest: Path, what: str) -> None:
    """Every existing folder on the way to ``dest`` must be a folder (a sentence, not a traceback)."""
    above = _first_existing(dest.absolute().parent)
    if not above.is_dir():
        raise OutputError(f"cannot write the {what} {dest}: {above} is a file, not a folder; choose another path")


def check_replaceable(dest: Path, force: bool = False, what: str = "output folder") -> None:
    """Refuse to replace ``dest`` unless it is absent, empty, a previous output of this tool
    (marked), or ``force``; nothing is written either way."""
    refuse_protected(dest, what)
    check_parent(dest, what)
    if not os.path.lexists(dest) or force:
        return
    if dest.is_symlink() or not dest.is_dir():
        raise OutputError(
            f"the {what} {dest} exists and is not a folder this tool wrote: refused; "
            "remove it, choose another path, or pass --force to replace it"
        )
    if is_ours(dest):
        return
    foreign = sorted(p.name for p in dest.iterdir())
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise OutputError(
            f"the {what} {dest} holds files this tool did not write ({shown}): refused; empty it, "
            "choose another path, or pass --force to replace it"
        )


def check_files(
    folder: Path, files: Mapping[str, bytes | None], force: bool = False, what: str = "output folder"
) -> None:
    """A folder the tool writes single files into (never replaced whole): refuse to
    overwrite a file with other bytes unless the folder is ours or ``force``. New files
    beside someone else's destroy nothing, so they are written. (None: bytes not known
    yet, so any file of that name would be overwritten.)"""
    refuse_protected(folder, what)
    check_parent(folder / "x", what)
    if os.path.lexists(folder) and not folder.is_dir():
        raise OutputError(f"the {what} {folder} is a file, not a folder: refused; choose another path")
    if force or is_ours(folder):
        return
    clobbered = [n for n, data in files.items() if os.path.lexists(folder / n) and not _holds(folder / n, data)]
    if clobbered:
        raise OutputError(
            f"the {what} {folder} is not marked as written by this tool and {', '.join(clobbered)} would be "
            "overwritten with other bytes: refused; move them away, choose another path, or pass --force"
        )


def _holds(path: Path, data: bytes | None) -> bool:
    try:
        return data is not None and path.is_file() and not path.is_symlink() and path.read_bytes() == data
    except OSError:
        return False


def mark(folder: Path) -> None:
    """Write the marker that says ``folder`` is this tool's to replace."""
    write_file(folder / MARKER, MARKER_TEXT)
    os.utime(folder / MARKER, (MARKER_MTIME, MARKER_MTIME))


def claim(folder: Path, what: str = "output folder") -> None:
    """Create ``folder`` if needed and mark it ours when it is empty (a forced write into
    someone else's folder leaves it unmarked)."""
    _mkdir(folder, what)
    if not any(folder.iterdir()):
        mark(folder)


def write_files(folder: Path, files: Mapping[str, bytes], force: bool = False, what: str = "output folder") -> list[tuple[Path, bool]]:
    """Check every file first, then write each atomically; return (path, changed) pairs."""
    check_files(folder, files, force, what)
    claim(folder, what)
    return [(folder / name, write_file(folder / name, data)) for name, data in files.items()]


def _mkdir(folder: Path, what: str) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the {what} {folder}: {exc.strerror}") from None


def add_force_argument(parser: Any, help_text: str) -> None:
    """``--force``, worded the same for every command that writes an output folder."""
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"{help_text}; without it such a folder is refused (exit 11). '', '.', '~', '/' and "
        "the folders above the working directory or home are refused even with it",
    )


# --- replacing a folder whole -----------------------------------------------------------


def _lock(folder: Path) -> int:
    """Hold an exclusive flock on ``folder`` until the fd is closed (or the process dies)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def _new_staging(parent: Path, name: str, kind: str) -> tuple[Path, int]:
    """A staging folder, locked while this run uses it and marked ours (in that order, so
    a cleaner never takes a live one for a leftover)."""
    path = Path(tempfile.mkdtemp(prefix=f".{name}.{kind}-", dir=parent))
    fd = _lock(path)
    mark(path)
    return path, fd


def remove_leftovers(dest: Path) -> list[Path]:
    """Remove staging folders of ``dest`` left by a run that died: ours (marked) and
    locked by no live run. Return what was removed."""
    removed = []
    for kind in _STAGING_KINDS:
        for path in dest.parent.glob(f".{dest.name}.{kind}-*"):
            if path.is_symlink() or not path.is_dir() or not is_ours(path):
                continue
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a concurrent run is using it
            try:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            finally:
                os.close(fd)
    return removed


@contextlib.contextmanager
def replace_dir(dest: Path, force: bool = False, what: str = "output folder") -> Iterator[Path]:
    """Yield a fresh staging folder beside ``dest``; on success it becomes ``dest``.

    ``dest`` must be absent, empty or a previous output (else OutputError, unless
    ``force``). On any error the staging folder is removed and ``dest`` is left as it was.
    The staging folder holds the marker, so ``dest`` ends up marked.
    """
    check_replaceable(dest, force, what)
    dest = dest.absolute()
    _mkdir(dest.parent, what)
    remove_leftovers(dest)
    staging, fd = _new_staging(dest.parent, dest.name, "new")
    try:
        yield staging
        _swap(staging, dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        os.close(fd)


def _swap(staging: Path, dest: Path) -> None:
    """Move ``staging`` into place; concurrent runs take turns (a lock on the parent), so
    that one never finds ``dest`` moved aside by the other."""
    parent = _lock(dest.parent)
    try:
        _swap_locked(staging, dest)
    finally:
        os.close(parent)


def _swap_locked(staging: Path, dest: Path) -> None:
    if not (dest.exists() or dest.is_symlink()):
        os.replace(staging, dest)
        return
    old, fd = _new_staging(dest.parent, dest.name, "old")
    try:
        os.replace(dest, old / "x")
        os.replace(staging, dest)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        os.close(fd)
