"""The fingerprint of this sm12x-bundle: its version and a sha256 over its package's files and
the series it ships, so that a job's rollout gate runs the tool that rendered the job.

The gate runs sm12x-bundle from a checkout mounted on the client (jobs.GATE_TOOL_MOUNT). A
checkout of another version may hold other scenarios, another series or other options; the
gate's command therefore carries the renderer's fingerprint (``--require-tool``) and the CLI
refuses to run when its own differs (errors.ToolMismatch). The same files give the same
fingerprint, wherever they lie: a checkout (src/ and patches/) or an installed wheel (the
series packaged as sm12x_bundle/_patches).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator
from pathlib import Path

from . import __version__
from .series.lane import shipped_lanes, shipped_patches

PACKAGE = Path(__file__).resolve().parent
# Not the package's sources: bytecode, and what a wheel packages beside them (the series are
# counted from wherever shipped_patches finds them, so a checkout and a wheel agree).
_SKIPPED = frozenset({"__pycache__", "_patches", "_docker"})


def _package_files() -> Iterator[tuple[str, Path]]:
    for path in PACKAGE.rglob("*"):
        rel = path.relative_to(PACKAGE)
        if _SKIPPED.intersection(rel.parts) or _stray(rel) or not path.is_file():
            continue
        yield f"sm12x_bundle/{rel.as_posix()}", path


def _stray(rel: Path) -> bool:
    """Bytecode, hidden files and editor backups: not part of any release."""
    return rel.suffix in (".pyc", ".pyo") or any(p.startswith(".") or p.endswith("~") for p in rel.parts)


def _series_files() -> Iterator[tuple[str, Path]]:
    """Each shipped lane's series and patches: what the gate's embedded default applies."""
    root = shipped_patches()
    if root is None:
        return
    for version in shipped_lanes():
        for path in (root / version).rglob("*"):
            rel = path.relative_to(root)
            if path.is_file() and not _stray(rel):
                yield f"patches/{rel.as_posix()}", path


@functools.lru_cache(maxsize=1)
def tool_fingerprint() -> str:
    """``<version>/sha256:<hex>``: the hex is sha256 over ``name NUL sha256(bytes) LF`` of
    every file, sorted by name (file modes and times do not count)."""
    digest = hashlib.sha256()
    for name, path in sorted([*_package_files(), *_series_files()]):
        digest.update(f"{name}\0{hashlib.sha256(path.read_bytes()).hexdigest()}\n".encode())
    return f"{__version__}/sha256:{digest.hexdigest()}"
