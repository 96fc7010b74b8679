"""The manifest: what an overlay or the bundle image put into a vLLM image, as one document.

Both outputs describe what they install with this one schema (docs/design.md): the
content hash, the document and its bytes (:func:`manifest`, :func:`manifest_bytes`), and
reading one back (:func:`load_manifest`). What goes into it is the plan's
(plan/files.py :class:`~sm12x_bundle.plan.files.InstalledFile`); checking it inside an
image is verify.py's.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import inputs
from ..errors import VerifyError
from ..plan.files import InstalledFile

SCHEMA = 1


def content_hash(files: Iterable[InstalledFile]) -> str:
    """First 16 hex digits of sha256 over the sorted ``container_path \\0 sha256 \\0 mode``
    lines, joined by newlines."""
    lines = sorted(f"{f.container_path}\0{f.sha256}\0{f.mode:04o}" for f in files)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def manifest(
    *,
    target: str,
    image: str,
    image_id: str | None,
    vllm_root: str,
    versions: Mapping[str, str | None],
    pin: Mapping[str, str | None],
    series_sha256: str,
    files: Sequence[InstalledFile],
    native: Mapping[str, dict[str, Any]],
) -> dict[str, Any]:
    """The manifest of docs/design.md (``native``: container path -> how it was built)."""
    return {
        "schema": SCHEMA,
        "target": target,
        "image": image,
        "image_id": image_id,
        "vllm_root": vllm_root,
        "versions": dict(versions),
        "pin": dict(pin),
        "series_sha256": series_sha256,
        "content_hash": content_hash(files),
        "files": [f.entry() for f in sorted(files, key=lambda f: f.container_path)],
        "native": dict(native),
    }


def manifest_bytes(document: dict[str, Any]) -> bytes:
    """Sorted keys, indent 2: the same inputs give the same bytes."""
    return (json.dumps(document, sort_keys=True, indent=2) + "\n").encode()


def load_manifest(path: Path) -> tuple[Path, dict[str, Any]]:
    """The overlay folder and its manifest, from the folder, its manifest.json or current.json."""
    path = path / "manifest.json" if path.is_dir() else path
    manifest = inputs.read_json(path, 64 * inputs.MIB, VerifyError, "the overlay manifest")
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise VerifyError(f"{path} is not an overlay manifest of schema {SCHEMA}")
    folder = path.parent if path.name == "manifest.json" else path.parent / manifest["content_hash"]
    return folder, manifest
