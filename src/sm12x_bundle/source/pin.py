"""A pinned vLLM release and the pristine source tree it resolves to."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

from ..errors import FetchError
from . import cache as cache_mod
from . import extract, fetch, index

_VERSION = re.compile(r"^\d+(\.\d+)*([a-z]+\d*)?(\.post\d+)?(\.dev\d+)?$")


@cache
def _releases() -> dict[str, str]:
    text = resources.files("sm12x_bundle").joinpath("data/releases.json").read_text("utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def known_sha256(version: str) -> str | None:
    """The sdist sha256 recorded in data/releases.json, if this release is known."""
    return _releases().get(version)


@dataclass(frozen=True)
class Pin:
    """A vLLM release identified by its PyPI sdist and that file's sha256."""

    version: str
    sha256: str | None = None  # None: use the index's hash (unknown release)

    def __post_init__(self) -> None:
        if not _VERSION.match(self.version):
            raise FetchError(f"{self.version!r} is not a vLLM version number")
        if self.sha256 is not None and not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise FetchError(f"pin sha256 for vLLM {self.version} is not 64 hex digits")

    @classmethod
    def for_version(cls, version: str) -> Pin:
        return cls(version, known_sha256(version))

    @property
    def filename(self) -> str:
        return f"vllm-{self.version}.tar.gz"


@dataclass(frozen=True)
class SourceTree:
    """A pristine vLLM source tree on disk (never modified once made)."""

    root: Path
    version: str
    sha256: str | None  # of the sdist it came from; None for a local tree
    origin: str  # where it came from, for reports
    cache: Path | None = None  # the cache folder the tree lies in (None: a local tree)

    @property
    def recorded(self) -> bool:
        """The tree is a cache entry with a digest record (trees/<sha256>/<top>)."""
        return self.cache is not None and self.sha256 is not None and self.root.parent.name == self.sha256

    def inputs(self) -> list[tuple[str, Path | None]]:
        """The folders a run reads this tree from, each named for a sentence."""
        if self.cache is not None:
            return [("cache folder", self.cache), ("source tree", self.root)]
        return [("local source tree", self.root)]


def tree_version(root: Path) -> str | None:
    """The version a source tree declares in PKG-INFO (sdists carry one)."""
    pkg_info = root / "PKG-INFO"
    if pkg_info.is_file():
        for line in pkg_info.read_text("utf-8", "replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    return None


def resolve_source(
    pin: Pin,
    *,
    index_url: str | None = None,
    local: Path | None = None,
    cache_dir: Path | None = None,
    progress=None,
) -> SourceTree:
    """Give the pristine tree for ``pin``: a local tree, a local sdist, or a download.

    The sdist (cached, downloaded or local) is hashed and compared with the pin's sha256
    in every call, and its tree, extracted once into the cache, is checked against the
    record made at extraction; a damaged copy of either is discarded and made again.
    """
    cache_dir = cache_dir or cache_mod.cache_dir()
    if local is not None:
        return _local(pin, local, cache_dir, progress)
    sdist, root = _from_cache(pin, cache_dir, progress)
    if sdist is None:
        sdist = _download(pin, index_url, cache_dir, progress)
    if root is None:
        root = extract.cached_tree(sdist, cache_dir, progress=progress)
    return SourceTree(root, pin.version, sdist.parent.name, f"PyPI sdist {pin.filename}", cache_dir)


def _from_cache(pin: Pin, cache_dir: Path, progress) -> tuple[Path | None, Path | None]:
    """(the cached sdist, hashed now; its cached tree, checked now): None for each one
    that is missing or damaged."""
    if pin.sha256 is None:
        return None, None
    # Hash the sdist in a thread while this one walks the tree: hashlib lets go of the
    # GIL, so on two cores the sdist's check costs little wall time.
    with ThreadPoolExecutor(max_workers=1) as pool:
        sdist = pool.submit(fetch.cached_sdist, cache_dir, pin, progress)
        root = extract.whole_tree(cache_dir, pin.sha256)
        return sdist.result(), root


def _download(pin: Pin, index_url: str | None, cache_dir: Path, progress) -> Path:
    url, index_sha = index.find_sdist(index.index_url(index_url), pin.filename)
    expected = pin.sha256 or index_sha
    if pin.sha256 and index_sha and index_sha != pin.sha256:
        raise FetchError(
            f"the index lists sha256 {index_sha} for {pin.filename}, "
            f"but the pin says {pin.sha256}: refusing to download"
        )
    if expected is None:
        raise FetchError(f"no sha256 for {pin.filename}: the index gave none and the pin has none")
    return fetch.download(url, expected, cache_dir, pin.filename, progress=progress)


def _local(pin: Pin, local: Path, cache_dir: Path, progress) -> SourceTree:
    if local.is_dir():
        if not (local / "vllm" / "__init__.py").is_file():
            raise FetchError(f"{local} is not a vLLM source tree: it has no vllm/__init__.py")
        version = tree_version(local) or pin.version
        return SourceTree(local.resolve(), version, None, f"local tree {local}")
    if local.is_file():
        digest = fetch.sha256_of(local)
        if pin.sha256 and digest != pin.sha256:
            raise FetchError(
                f"sha256 mismatch for {local}: expected {pin.sha256}, got {digest}"
            )
        sdist = fetch.store(local, digest, cache_dir, local.name, progress)
        root = extract.cached_tree(sdist, cache_dir, progress=progress)
        return SourceTree(root, tree_version(root) or pin.version, digest, f"local sdist {local}", cache_dir)
    raise FetchError(f"{local} does not exist")
