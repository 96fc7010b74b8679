"""Download an sdist (or a wheel) into the cache; its sha256 is verified on the way in and on every use."""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from ..errors import FetchError
from ..fsutil import pause
from ..progress import Progress
from .cache import locked, notice, writing

_CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def _entry(cache: Path, sha256: str, filename: str, folder: str = "sdists") -> Path:
    return cache / folder / sha256 / filename


def cached_sdist(cache: Path, pin, progress: Progress | None = None) -> Path | None:
    """The cached sdist for a pin with a known sha256, hashed now and found whole."""
    if pin.sha256 is None:
        return None
    return cached_file(cache, pin.sha256, pin.filename, progress=progress)


def cached_file(
    cache: Path, sha256: str, filename: str, *, folder: str = "sdists", progress: Progress | None = None
) -> Path | None:
    """``<cache>/<folder>/<sha256>/<filename>``, hashed now and found whole; else None
    (a damaged copy is discarded, with a notice)."""
    path = _entry(cache, sha256, filename, folder)
    with locked(cache, sha256):
        remove_partial(cache, path)
        return path if _whole_or_discarded(path, sha256, progress) else None


def remove_partial(cache: Path, dest: Path) -> list[Path]:
    """Remove what a run killed while downloading or storing the entry ``dest`` left
    (``tmp/<sha256>.<file>.XXXX``, ``sdists/<sha256>/<file>.tmp``). Called with the entry's lock
    held, so no live run is writing any of them: the name and the lock mark them."""
    sha256 = dest.parent.name
    found = [*(cache / "tmp").glob(glob.escape(sha256 + ".") + "*"),
             dest.with_name(dest.name + ".tmp")]
    removed = []
    for path in found:
        if path.is_file() and not path.is_symlink():
            with writing(cache):
                path.unlink()
            removed.append(path)
    return removed


def _whole_or_discarded(path: Path, sha256: str, progress: Progress | None) -> bool:
    """Whether the cached file ``path`` is there and matches; a damaged one is removed."""
    if not path.is_file():
        return False
    digest = sha256_of(path)
    if digest == sha256:
        return True
    notice(progress, f"the cached {path.name} has sha256 {digest}, not {sha256}: discarded; getting a fresh copy")
    path.unlink()
    return False


def download(
    url: str, sha256: str, cache: Path, filename: str, *, progress: Progress | None = None, folder: str = "sdists"
) -> Path:
    """Fetch ``url`` into the cache (``<cache>/<folder>/<sha256>/<filename>``); a hash
    mismatch leaves nothing behind."""
    dest = _entry(cache, sha256, filename, folder)
    with locked(cache, sha256):
        remove_partial(cache, dest)
        if _whole_or_discarded(dest, sha256, progress):  # another run fetched it while we waited
            return dest
        staging = cache / "tmp"
        with writing(cache):
            staging.mkdir(parents=True, exist_ok=True)
            # Named by the sha256, so the next run holding this entry's lock knows it for its own.
            fd, tmp_name = tempfile.mkstemp(prefix=f"{sha256}.{filename}.", dir=staging)
        tmp = Path(tmp_name)
        try:
            with writing(cache), os.fdopen(fd, "wb") as out:  # the last bytes are written as it closes
                digest = _stream(url, out, filename, progress, cache)
            if digest != sha256:
                raise FetchError(
                    f"sha256 mismatch for {filename} from {url}: expected {sha256}, "
                    f"got {digest}; the download was discarded"
                )
            with writing(cache):
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
    return dest


def _stream(url: str, out, filename: str, progress: Progress | None, cache: Path) -> str:
    h = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=120) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            task = (progress or Progress.quiet()).task(f"downloading {filename}", total)
            for block in iter(lambda: response.read(_CHUNK), b""):
                h.update(block)
                _write(out, block, cache)
                task.advance(len(block))
                pause("cache-downloading")
            task.done()
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise FetchError(f"download of {url} failed: {reason}") from None
    return h.hexdigest()


def _write(out, block: bytes, cache: Path) -> None:
    """A write the disk refuses (full, read-only) is the machine's, not the download's."""
    with writing(cache):
        out.write(block)


def store(local: Path, sha256: str, cache: Path, filename: str, progress: Progress | None = None) -> Path:
    """Copy a local sdist, hashed by the caller, into the cache (atomically)."""
    dest = _entry(cache, sha256, filename)
    with locked(cache, sha256):
        remove_partial(cache, dest)
        if not _whole_or_discarded(dest, sha256, progress):
            tmp = dest.with_name(dest.name + ".tmp")
            try:
                with writing(cache):
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(local, tmp)
                pause("cache-storing")
            except BaseException:
                tmp.unlink(missing_ok=True)  # a full disk leaves no partial copy
                raise
            if sha256_of(tmp) != sha256:  # changed under us between hash and copy
                tmp.unlink()
                raise FetchError(f"{local} changed while it was being copied")
            os.replace(tmp, dest)
    return dest
