"""The cache: sdists and their extracted trees, keyed by sha256.

Layout: ``<cache>/sdists/<sha256>/<file>`` and ``<cache>/trees/<sha256>/<top dir>``.
Entries appear by atomic rename only, under a per-entry lock, so concurrent runs
either see a whole entry or none, and never download or extract the same one twice.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """SM12X_BUNDLE_CACHE, else $XDG_CACHE_HOME/sm12x-bundle, else ~/.cache/sm12x-bundle."""
    explicit = os.environ.get("SM12X_BUNDLE_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "sm12x-bundle"


@contextlib.contextmanager
def locked(cache: Path, key: str) -> Iterator[None]:
    """Hold an exclusive lock on one cache entry for the duration of the block."""
    lock_dir = cache / "locks"
    lock_dir.mkdir(parents=True, exist_ok=True)
    with open(lock_dir / f"{key}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
