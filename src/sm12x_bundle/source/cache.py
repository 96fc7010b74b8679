"""The cache: sdists and their extracted trees, keyed by sha256.

Layout: ``<cache>/sdists/<sha256>/<file>`` and ``<cache>/trees/<sha256>/<top dir>``; the test
suite keeps the files it reads from PyPI in ``<cache>/test-inputs/<sha256>/<file>``.
Entries appear by atomic rename only, under a per-entry lock, so concurrent runs
either see a whole entry or none, and never download or extract the same one twice.
An entry found damaged is replaced under the same lock, again by rename. A cache the
machine will not let us write (read-only, full, a file where its folder goes) is
EnvironmentProblem (exit 12), one sentence naming the cache folder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ..errors import EnvironmentProblem, environment_problem
from ..fsutil import pseudo_file_system
from ..progress import Progress

_HINT = "set SM12X_BUNDLE_CACHE to a folder this user can write"


def cache_dir() -> Path:
    """SM12X_BUNDLE_CACHE, else $XDG_CACHE_HOME/sm12x-bundle, else ~/.cache/sm12x-bundle."""
    explicit = os.environ.get("SM12X_BUNDLE_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "sm12x-bundle"


@contextlib.contextmanager
def writing(cache: Path) -> Iterator[None]:
    """Any OSError in the block is the cache's: one sentence naming the cache folder. (Callers
    that read an archive tell its errors from the machine's first: extract.py.)"""
    try:
        yield
    except OSError as exc:
        raise unusable(cache, exc) from None


def unusable(cache: Path, exc: OSError) -> EnvironmentProblem:
    """The sentence for a cache folder this machine will not let us use."""
    above = cache.absolute()
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    if not above.is_dir():
        return EnvironmentProblem(f"cannot use the cache folder {cache}: {above} is a file, not a folder; {_HINT}")
    kernel = pseudo_file_system(above)
    if kernel:
        return EnvironmentProblem(f"cannot use the cache folder {cache}: {above} is on the kernel's {kernel} file system; {_HINT}")
    problem = environment_problem(exc, f"write the cache folder {cache}")
    return EnvironmentProblem(f"{problem}; {_HINT}")


def refuse_untrusted(folder: Path, cache: Path) -> None:
    """The cache decides what is built, so only this user may write it: a cache folder (or
    its locks folder) owned by another user or writable by group or others is refused
    (EnvironmentProblem, exit 12), and so is a link where the locks folder goes."""
    try:
        link = stat.S_ISLNK(os.lstat(folder).st_mode)
        st = os.stat(folder)
    except FileNotFoundError:  # absent (made below), or a link that leads nowhere (writing says so)
        return
    except OSError as exc:
        raise unusable(cache, exc) from None
    if link and folder != cache:
        raise EnvironmentProblem(f"cannot use the cache folder {cache}: {folder} is a link, which the cache never "
                                 f"holds: refused; remove it, or {_HINT}")
    if not stat.S_ISDIR(st.st_mode):
        return  # a file or device where the folder goes: writing(cache) names it
    if st.st_uid != os.geteuid():
        raise EnvironmentProblem(f"cannot use the cache folder {cache}: {folder} belongs to user {st.st_uid}, not to "
                                 f"this user ({os.geteuid()}), who alone may write the cache: refused; {_HINT}")
    if st.st_mode & 0o022:
        raise EnvironmentProblem(f"cannot use the cache folder {cache}: {folder} is writable by other users (mode "
                                 f"{stat.S_IMODE(st.st_mode):o}), who could plant files in it: refused; "
                                 f"chmod go-w {folder}, or {_HINT}")


@contextlib.contextmanager
def locked(cache: Path, key: str) -> Iterator[None]:
    """Hold an exclusive lock on one cache entry for the duration of the block (the cache
    checked first: refuse_untrusted)."""
    lock_dir = cache / "locks"
    refuse_untrusted(cache, cache)
    refuse_untrusted(lock_dir, cache)
    with writing(cache):
        for folder in (cache, lock_dir):
            if not os.path.lexists(folder):  # ours alone, whatever the umask says
                folder.mkdir(parents=True, exist_ok=True)
                os.chmod(folder, 0o755)
        fd = _open_lock(lock_dir / f"{key}.lock", cache)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _open_lock(path: Path, cache: Path) -> int:
    """The lock file, never through a link planted in its place (O_NOFOLLOW), and never a
    FIFO's wait (O_NONBLOCK: a FIFO is an error, not a hang)."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise EnvironmentProblem(f"cannot use the cache folder {cache}: the lock file {path} is a link, which "
                                     f"the cache never holds: refused; remove it, or {_HINT}") from None
        raise


def swap_in(new: Path, dest: Path) -> None:
    """Move the folder ``new`` to ``dest``; an old ``dest`` is set aside first, then removed.

    Two renames, so a run reading paths under ``dest`` finds the old or the new folder,
    apart from the instant between them.
    """
    if dest.is_symlink() or dest.is_file():
        dest.unlink()
    if not dest.exists():
        os.replace(new, dest)
        return
    aside = Path(tempfile.mkdtemp(prefix=dest.name + ".discarded.", dir=dest.parent))
    os.replace(dest, aside)
    os.replace(new, dest)
    shutil.rmtree(aside, ignore_errors=True)


def notice(progress: Progress | None, text: str) -> None:
    """Tell the operator about a repair of the cache: on stderr, unless the run is quiet."""
    (progress or Progress.stderr()).say(f"sm12x-bundle: {text}")
