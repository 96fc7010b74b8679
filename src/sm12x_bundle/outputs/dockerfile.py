"""Dockerfile templates (docker/) and the build contexts rendered from them, in memory.

A context is ``{relative path: (bytes, mode)}`` until :func:`write_context` writes it
atomically with fixed mtimes (COPY keeps mtimes, so the same inputs give the same image
layers). Used by the native builder (native_build.py) and the bundle image (image.py).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

from ..containers import Engine
from ..errors import ConfigError, VerifyError
from ..fsutil import replace_dir

# A build context in memory: relative path -> (bytes, mode). None: made by the builder.
ContextFiles = dict[str, tuple[bytes | None, int]]

# FROM names an image by reference, never by bare id: BuildKit (Docker's default builder
# since 23.0) reads `FROM sha256:<id>` as docker.io/library/sha256:<id> and fails, while
# the classic builder (the Docker SDK's) accepts it. A checked image is pinned instead by a
# local tag named after its id, which both builders resolve in the daemon's own store.
PIN_REPOSITORY = "sm12x-bundle-pin"
_IMAGE_ID = re.compile(r"sha256:([0-9a-f]{64})")


def from_reference(image: str) -> str:
    """What FROM says for ``image``: an id becomes its pin tag; a reference stays as it is."""
    m = _IMAGE_ID.fullmatch(image)
    return f"{PIN_REPOSITORY}:{m.group(1)}" if m else image


def pin_locally(engine: Engine, image: str) -> str:
    """Make :func:`from_reference`'s tag exist in the daemon (for an id); return the reference."""
    ref = from_reference(image)
    if ref != image:
        engine.tag(image, PIN_REPOSITORY, ref.split(":", 1)[1])
    return ref


def template(name: str) -> str:
    """docker/<name>: packaged with the tool (_docker/), or in the checkout."""
    packaged = resources.files("sm12x_bundle").joinpath(f"_docker/{name}")
    if packaged.is_file():
        return packaged.read_text("utf-8")
    checkout = Path(__file__).resolve().parents[3] / "docker" / name
    if checkout.is_file():
        return checkout.read_text("utf-8")
    raise ConfigError(f"docker/{name} not found: the tool is installed without its Dockerfiles")


def fill(text: str, values: Mapping[str, str]) -> str:
    """Replace every field written between @ signs; refuse a field without a value."""
    missing = sorted(set(re.findall(r"@([A-Z_]+)@", text)) - set(values))
    if missing:
        raise ConfigError(f"Dockerfile template field(s) {', '.join(missing)} have no value")
    return re.sub(r"@([A-Z_]+)@", lambda m: values[m.group(1)], text)


def write_context(files: ContextFiles, dest: Path, epoch: int, force: bool = False) -> Path:
    """Write a context atomically, every mtime set to ``epoch`` (COPY keeps mtimes); a
    folder this tool did not write is refused unless ``force``."""
    with replace_dir(dest, force, "build context folder") as staging:
        for rel, (data, mode) in files.items():
            if data is None:
                raise VerifyError(f"{rel} has no content yet: the builder has not made it")
            path = staging / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            path.chmod(mode)
        for path in sorted(staging.rglob("*"), reverse=True):
            if path.is_dir():
                path.chmod(0o755)
            os.utime(path, (epoch, epoch))
        os.utime(staging, (epoch, epoch))
    return dest


def context_digest(files: ContextFiles) -> str:
    h = hashlib.sha256()
    for rel, (data, mode) in sorted(files.items()):
        h.update(f"{rel}\0{mode:o}\0".encode() + (data or b"") + b"\0")
    return h.hexdigest()
