"""Where a target's originals come from: the image itself, or the pinned tree standing in for it.

:func:`image_side` asks the image once (one container: its vLLM root, versions, whether
vLLM imports there, the files asked for and their bytecode) and keeps the answers by image
id (:class:`ImageCache`); :func:`pinned_side` reads the lane's pinned tree for a
``pinned: true`` target when no daemon answers. Either way the result is an
:class:`ImageSide`, which the plan reads the originals through.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import containers as engines
from ..config import TargetConfig
from ..containers import Engine, ImageFile, probe_vllm
from ..errors import ConfigError, EngineError
from ..fsutil import write_file
from ..progress import Progress
from ..source.pin import SourceTree
from .files import VERSION_KEYS, container_path, normal_root, read_or_none


@dataclass(frozen=True)
class ImageSide:
    """The originals of one target: read out of the image, or from the pinned tree standing in for it."""

    ref: str
    image_id: str | None  # None: the pinned tree
    root: str
    versions: dict[str, str | None]
    read: Callable[[list[str]], dict[str, ImageFile | None]] = field(repr=False)
    engine: Engine | None = field(default=None, repr=False)  # what it was read through (None: the pinned tree)
    import_error: str | None = "not asked (the pinned tree)"  # None: `import vllm` works in the image
    bytecode: dict[str, list[str]] | None = None  # vllm/... path -> the image's .pyc of it; None: not asked

    @property
    def label(self) -> str:
        return f"image {self.ref}" if self.image_id else f"the pinned tree standing in for image {self.ref}"

    def shown(self, tree_path: str) -> str:
        return container_path(self.root, tree_path) if tree_path.startswith("vllm/") else tree_path


def image_side(
    engine: Engine, target: TargetConfig, paths: Sequence[str] = (), cache: Path | None = None
) -> ImageSide:
    """Ask the image: its id, its vLLM root (unless the target says), versions, and the
    files at ``paths`` (tree paths), all in one container.

    With ``cache``, answers and files are kept by image id: an id names the image's
    content, so what was read from it once never goes stale.
    """
    image_id = engine.image_id(target.image)
    given = normal_root(target.root, f"target {target.name}") if target.root else None
    store = ImageCache(cache / image_id.replace(":", "-")) if cache else None
    facts = store.facts(given, paths) if store else None
    known: dict[str, ImageFile | None] = {}  # tree path -> what the probe read
    if facts is None:
        probe = probe_vllm(engine, target.image, given, list(paths))
        facts = {"root": probe.root, "versions": probe.versions, "import_error": probe.import_error,
                 "bytecode": probe.bytecode}
        known = {p: None if b is None else ImageFile(b, probe.modes[p]) for p, b in probe.files.items()}
        if store:
            found = normal_root(probe.root, f"image {target.image}")
            store.save_files({container_path(found, p): data for p, data in known.items()})
            store.save_facts(given, paths, facts)
    root = normal_root(facts["root"], f"image {target.image}")
    versions = dict.fromkeys(VERSION_KEYS) | facts["versions"]

    def read(wanted: list[str]) -> dict[str, ImageFile | None]:
        rest = [container_path(root, p) for p in wanted if p not in known]
        got = _read_image(engine, target.image, rest, store)
        return {p: known[p] if p in known else got[container_path(root, p)] for p in wanted}

    return ImageSide(
        target.image, image_id, root, versions, read, engine, facts["import_error"], facts["bytecode"]
    )


def _read_image(engine: Engine, ref: str, paths: list[str], store: ImageCache | None) -> dict[str, ImageFile | None]:
    if not paths:
        return {}
    return store.read(engine, ref, paths) if store else engine.read_entries(ref, paths)


_CACHED = "image cache file"  # a write the machine refuses names it so (EnvironmentProblem)


@dataclass(frozen=True)
class ImageCache:
    """What was read out of one image (by id): the probe's answers, file contents and modes.

    A kept file carries the image's mode on disk. (Files kept before modes were kept,
    under ``files/``, all read 0644, so this cache keeps its files under ``entries/``.)"""

    folder: Path

    def _facts_file(self, root: str | None, paths: Sequence[str]) -> Path:
        # By the paths asked too: the bytecode listed is only theirs, and a new series asks others.
        key = "\0".join([root or "", *sorted(paths)])
        return self.folder / f"probe-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"

    def facts(self, root: str | None, paths: Sequence[str]) -> dict[str, Any] | None:
        try:
            return json.loads(self._facts_file(root, paths).read_text("utf-8"))
        except (OSError, ValueError):
            return None

    def save_facts(self, root: str | None, paths: Sequence[str], facts: dict[str, Any]) -> None:
        write_file(self._facts_file(root, paths), json.dumps(facts, sort_keys=True).encode(), what=_CACHED)

    def save_files(self, files: dict[str, ImageFile | None]) -> None:
        for path, f in files.items():
            if f is None:
                write_file(self.folder / "absent" / path.lstrip("/"), b"", what=_CACHED)
            else:
                write_file(self.folder / "entries" / path.lstrip("/"), f.data, f.mode, what=_CACHED)

    def read(self, engine: Engine, ref: str, paths: list[str]) -> dict[str, ImageFile | None]:
        known: dict[str, ImageFile | None] = {}
        for path in paths:
            blob, absent = self.folder / "entries" / path.lstrip("/"), self.folder / "absent" / path.lstrip("/")
            if blob.is_file():
                known[path] = ImageFile(blob.read_bytes(), blob.stat().st_mode & 0o777)
            elif absent.is_file():
                known[path] = None
        missing = [p for p in paths if p not in known]
        if missing:
            got = engine.read_entries(ref, missing)
            self.save_files(got)
            known.update(got)
        return known


def pinned_root(target: TargetConfig) -> str:
    """Where vLLM sits in a pinned target's image, which the pinned tree standing in for it
    cannot tell: the target must say (ConfigError)."""
    if not target.root:
        raise ConfigError(f"target {target.name} is pinned but has no root: without Docker it must say where vLLM is")
    return normal_root(target.root, f"target {target.name}")


def pinned_side(target: TargetConfig, source: SourceTree) -> ImageSide:
    """The pinned tree as the image's stand-in: the target says it carries that release unchanged."""
    root = pinned_root(target)

    def read(paths: list[str]) -> dict[str, ImageFile | None]:
        return {p: _entry_or_none(source.root / p) for p in paths}

    versions = dict.fromkeys(VERSION_KEYS) | {"vllm": source.version}
    return ImageSide(target.image, None, root, versions, read)


def _entry_or_none(path: Path) -> ImageFile | None:
    """A file of the pinned tree with its mode on disk (the sdist's, kept by extraction)."""
    data = read_or_none(path)
    return None if data is None else ImageFile(data, path.stat().st_mode & 0o777)


def connect(need: bool, progress: Progress) -> Engine | None:
    """The Docker engine, or None when no daemon answers and none is needed."""
    engine = engines.docker_engine()  # looked up at call time: tests put a fake engine there
    try:
        engine.ping()
    except EngineError:
        if need:
            raise
        progress.say(f"overlay: no Docker daemon answers at {engines.daemon_address()}: pinned targets use the pinned tree")
        return None
    return engine
