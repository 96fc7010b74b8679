"""Writing outputs so that a failure leaves nothing half-written and reruns change nothing."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


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


@contextlib.contextmanager
def replace_dir(dest: Path) -> Iterator[Path]:
    """Yield a fresh staging folder beside ``dest``; on success it becomes ``dest``.

    On any error the staging folder is removed and ``dest`` is left as it was.
    """
    dest = dest.absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.new-", dir=dest.parent))
    try:
        yield staging
        old = None
        if dest.exists() or dest.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / "x")
        os.replace(staging, dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
