"""Which native artifacts a target needs rebuilt, from which patched sources, and where.

The cumem extension is built alone from its patched sources (native.py's compiler line);
:func:`plan_native` decides where, and nothing else does: in a builder container started
from the real image whenever there is one (its own Python and CUDA headers), on the host
only for a target made from the pinned tree without an image. outputs/native_build.py
carries the plan out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..series.apply import VirtualTree
from ..series.patch import Series
from ..source.pin import SourceTree
from .files import NativeBuild, apply_subseries

DEFAULT_CUDA_HOME = "/usr/local/cuda"


@dataclass(frozen=True)
class BuilderPlan:
    """Dockerfile.builder's inputs: where the extension is built, and from what."""

    base: str  # the image it is built in (by id where it was checked)
    sources: dict[str, bytes]  # csrc/... -> bytes: the patched source and its headers
    setup: str | None = None  # shell line run before compiling
    cuda_home: str = DEFAULT_CUDA_HOME


@dataclass(frozen=True)
class NativePlan:
    """One artifact to build: the patched inputs, and where (``builder`` None: the host)."""

    artifact: str  # tree path, e.g. vllm/cumem_allocator.abi3.so
    sources: dict[str, bytes]
    patches: tuple[str, ...]
    built_from: dict[str, Any]
    builder: BuilderPlan | None


def plan_native(
    series: Series,
    build: NativeBuild,
    source: SourceTree,
    image: str | None,
    *,
    setup: str | None = None,
    cuda_home: str = DEFAULT_CUDA_HOME,
) -> NativePlan | None:
    """Patch ``build``'s inputs in ``source``; None when the series changes nothing there.

    ``image`` is the real image the artifact is for (by id), or None for the pinned tree
    without one: the only case that builds on the host.
    """
    tree = VirtualTree(source.root)
    where = f"vLLM {source.version} source ({source.origin})"
    applied, _landed = apply_subseries(series, tree, set(build.inputs), where)
    if not applied:
        return None
    sources = {}
    for rel in build.inputs:
        text = tree.read(rel)
        if text is not None:
            sources[rel] = text.to_bytes()
    patches = tuple(dict.fromkeys(i for ids in applied.values() for i in ids))
    built_from = {
        "vllm": source.version,
        "sdist_sha256": source.sha256,
        "files": sorted(sources),
        "patches": list(patches),
    }
    builder = BuilderPlan(image, dict(sorted(sources.items())), setup, cuda_home) if image else None
    return NativePlan(build.artifact, dict(sorted(sources.items())), patches, built_from, builder)
