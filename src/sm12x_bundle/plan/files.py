"""Which files a series installs into a vLLM image, and the image's own copies patched.

Pure but for a temporary folder: :func:`plan_series` says which tree paths a lane's series
installs (``vllm/`` files in place, ``csrc/`` through the artifact built from it),
:func:`patch_image_files` applies the file patches to an image's own copies at fuzz 0
(a conflict names the image, the file and the hunk: an output never swaps in a whole file
from another vLLM version), and :class:`InstalledFile` is one file an output puts into an
image, with its pre-image.
"""

from __future__ import annotations

import dataclasses
import hashlib
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import fsutil, native
from ..checks.check import Conflict, Outcome, classify
from ..containers import VERSION_KEYS as _PROBED
from ..containers import ImageFile
from ..errors import ApplyError, ConfigError, SeriesError
from ..series.apply import VirtualTree
from ..series.patch import Series

# The versions a manifest records, in the words the probe answers in.
VERSION_KEYS = tuple(_PROBED.values())


def sha256_of(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def read_or_none(path: Path) -> bytes | None:
    """A regular file's bytes (None: absent, or a link)."""
    return path.read_bytes() if path.is_file() and not path.is_symlink() else None


# What each native artifact is built from, alone (tree paths; missing inputs are skipped).
NATIVE_RECIPES = {
    f"vllm/{native.ARTIFACT}": (str(native.SOURCE), "csrc/cumem_allocator_compat.h"),
}


@dataclass(frozen=True)
class NativeBuild:
    artifact: str  # tree path of the built file, e.g. vllm/cumem_allocator.abi3.so
    inputs: tuple[str, ...]  # tree paths it is built from
    patches: tuple[str, ...]  # the native patches that change it


@dataclass(frozen=True)
class SeriesPlan:
    files: tuple[str, ...]  # vllm/ paths patched in place, in first-touched order
    native: tuple[NativeBuild, ...]
    skipped: tuple[str, ...]  # paths no image holds (tests/, docs/): not installed


def plan_series(series: Series) -> SeriesPlan:
    """Which files the series installs: vllm/ files in place, csrc/ through their artifact."""
    files: dict[str, None] = {}
    skipped: dict[str, None] = {}
    builds: dict[str, list[str]] = {}
    for patch in series.patches:
        if patch.kind == "native":
            builds.setdefault(_recipe_of(patch.builds, patch.file), []).append(patch.id)
        inputs = NATIVE_RECIPES.get(patch.builds or "", ())
        for fp in patch.files:
            if fp.path.startswith("vllm/"):
                if fp.deleted:
                    raise SeriesError(
                        f"{patch.file}: deletes {fp.path}: an overlay or bundle image cannot delete a file"
                    )
                files.setdefault(fp.path)
            elif patch.kind == "native" and fp.path not in inputs:
                raise SeriesError(f"{patch.file}: changes {fp.path}, which {patch.builds} is not built from")
            elif patch.kind != "native":
                skipped.setdefault(fp.path)
    native_builds = tuple(NativeBuild(a, NATIVE_RECIPES[a], tuple(ids)) for a, ids in builds.items())
    return SeriesPlan(tuple(files), native_builds, tuple(skipped))


def _recipe_of(artifact: str | None, where: Path) -> str:
    if artifact not in NATIVE_RECIPES:
        known = ", ".join(NATIVE_RECIPES)
        raise SeriesError(
            f"{where}: Sm12x-Builds {artifact!r} cannot be built alone: only {known} can be rebuilt alone "
            "(see native.py)"
        )
    return artifact


def installed_paths(series: Series) -> dict[str, tuple[str, ...]]:
    """Every file an output installs (``vllm/...``) -> the ids of the patches behind it."""
    plan = plan_series(series)
    out = {path: tuple(p.id for p in series.patches if path in p.paths) for path in plan.files}
    out.update({b.artifact: b.patches for b in plan.native})
    return out


def apply_subseries(
    series: Series, tree: VirtualTree, paths: set[str], where: str, shown: Callable[[str], str] = str
) -> tuple[dict[str, list[str]], list[str]]:
    """Apply, in series order, only the file patches touching ``paths`` (fuzz 0).

    Uses the same classification as ``check``: a patch already in the file is skipped,
    one that conflicts raises ApplyError naming ``where``, the file and the hunk.
    Returns {path: patch ids applied} and the ids found already there.
    """
    applied: dict[str, list[str]] = {}
    landed: list[str] = []
    for patch in series.patches:
        files = tuple(fp for fp in patch.files if fp.path in paths)
        if not files:
            continue
        result = classify(tree, dataclasses.replace(patch, files=files), 0)
        if result.outcome is Outcome.CONFLICT:
            assert result.conflict is not None
            raise _conflict(where, patch.id, result.conflict, shown)
        if result.outcome is Outcome.LANDED:
            landed.append(patch.id)
            continue
        for fp in files:
            applied.setdefault(fp.path, []).append(patch.id)
    return applied, landed


def _conflict(where: str, patch_id: str, c: Conflict, shown: Callable[[str], str]) -> ApplyError:
    what = f"{where}: patch {patch_id} does not apply to {shown(c.path)}"
    if len(c.differs) == 1:  # nothing to show but one fact (a file missing, or one in the way)
        return ApplyError(f"{what}: {c.differs[0]}")
    return ApplyError(
        f"{what}: hunk #{c.hunk} (line {c.hunk_line}) differs (fuzz 0; an overlay never swaps in a whole file "
        "from another vLLM version):\n  " + "\n  ".join(c.differs)
    )


# --- paths ---------------------------------------------------------------------------


def container_path(root: str, tree_path: str) -> str:
    """``vllm/x/y.py`` -> ``<root>/x/y.py``: the root is the image's ``vllm`` package folder."""
    assert tree_path.startswith("vllm/"), tree_path
    return posixpath.join(root, tree_path[len("vllm/") :])


def normal_root(root: str, where: str) -> str:
    norm = posixpath.normpath(root)
    if not norm.startswith("/") or norm == "/":
        raise ConfigError(f"{where}: root {root!r} must be an absolute path to the vllm package folder")
    return norm


def module_name(root: str, path: str) -> str:
    """``<root>/device_allocator/cumem.py`` -> ``vllm.device_allocator.cumem``; an extension
    (``<root>/cumem_allocator.abi3.so``) -> ``vllm.cumem_allocator``."""
    rel = posixpath.relpath(path, root)
    stem = rel.split(".", 1)[0]
    parts = ["vllm", *stem.split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def wanted_paths(plan: SeriesPlan) -> list[str]:
    """Every tree path an overlay reads from the image: the package marker and the originals."""
    return list(dict.fromkeys(["vllm/__init__.py", *plan.files, *(b.artifact for b in plan.native)]))


@dataclass(frozen=True)
class Applied:
    data: bytes
    mode: int
    patches: tuple[str, ...]


def patch_image_files(
    series: Series, originals: dict[str, ImageFile | None], where: str, shown: Callable[[str], str] = str
) -> tuple[dict[str, Applied], list[str]]:
    """Patch the image's own copies (tree path -> bytes and mode, None: absent) surgically.

    A patched file keeps the mode the image gives it (the tree reads it back from disk);
    a file the series creates takes the mode its patch names."""
    with fsutil.temp_folder("sm12x-overlay-") as tmp:
        for path, original in originals.items():
            if original is not None:
                dest = Path(tmp) / path
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(original.data)
                dest.chmod(original.mode)
        tree = VirtualTree(Path(tmp))
        applied, landed = apply_subseries(series, tree, set(originals), where, shown)
        out = {}
        for path, ids in applied.items():
            text = tree.edits[path]
            assert text is not None  # deletions are refused by plan_series
            out[path] = Applied(text.to_bytes(), text.mode, tuple(ids))
    return out, landed


@dataclass(frozen=True)
class InstalledFile:
    """One file an output puts into an image."""

    path: str  # vllm/... in the tree
    container_path: str
    data: bytes | None = field(repr=False)  # None: not built yet
    mode: int
    patches: tuple[str, ...]
    pre_image_sha256: str | None  # None: the image has no such file

    @property
    def sha256(self) -> str | None:
        return sha256_of(self.data)

    @property
    def source(self) -> str:
        """Where the file lies under the overlay folder or the build context."""
        return "files/" + self.container_path.lstrip("/")

    def entry(self) -> dict[str, Any]:
        return {
            "container_path": self.container_path,
            "source": self.source,
            "pre_image_sha256": self.pre_image_sha256,
            "sha256": self.sha256,
            "patches": list(self.patches),
            "mode": f"{self.mode:04o}",
        }
