"""The lanes' source trees for a GPU machine without network: pristine and patched.

A GPU machine that cannot reach PyPI cannot fetch a lane's sdist. For each lane this packs
``<lane>/pristine`` (the pinned sdist's tree, verified as every command verifies it) and
``<lane>/patched`` (the same with the lane's series applied in memory, as ``apply``
writes it), each cut down to what the checks there read: the whole ``vllm/`` package
(vLLM's own allocator tests import the real package around the allocator), the cumem
extension's two sources (native.py builds it from them), ``PKG-INFO`` (the version), and
the test file upstream.py plans from, with its packages' ``__init__.py``. The archive is
packed, split and unpacked exactly as the payload is (payload.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..context import Context
from ..outputs.tree import patched_files
from ..progress import Progress
from ..source.pin import SourceTree
from . import payload, upstream

CSRC = ("csrc/cumem_allocator.cpp", "csrc/cumem_allocator_compat.h")
TOP = "trees"


def wanted(rel: str, tests: Sequence[str]) -> bool:
    """Whether a path of a tree goes to the GPU machine."""
    return rel.startswith("vllm/") or rel in CSRC or rel == "PKG-INFO" or rel in tests


def test_paths(version: str, root: Path) -> list[str]:
    """The upstream test file of a tree and its packages' __init__.py files."""
    the_plan = upstream.plan(version, root)
    return [f"{p}/__init__.py" for p in the_plan.packages] + [the_plan.test_file]


def _on_disk(root: Path, rel: str, path: str) -> payload.Entry:
    st = (root / rel).stat()
    return payload.Entry(path, st.st_size, bool(st.st_mode & 0o111), root / rel)


def lane_entries(version: str, source: SourceTree, series) -> tuple[list[payload.Entry], list[str]]:
    """The entries of ``<version>/pristine`` and ``<version>/patched``, and the paths the series changes."""
    tests = test_paths(version, source.root)
    found = sorted(
        p.relative_to(source.root).as_posix()
        for p in source.root.rglob("*")
        if p.is_file() and not p.is_symlink() and wanted(p.relative_to(source.root).as_posix(), tests)
    )
    _report, changes = patched_files(series, source)
    changed = sorted(rel for rel in changes if wanted(rel, tests))
    entries = [_on_disk(source.root, rel, f"{version}/pristine/{rel}") for rel in found]
    for rel in sorted(set(found) | set(changed)):
        text = changes.get(rel, "same")
        if text == "same":
            entries.append(_on_disk(source.root, rel, f"{version}/patched/{rel}"))
        elif text is not None:  # None: the series deletes the file
            data = text.to_bytes()
            entries.append(payload.Entry(f"{version}/patched/{rel}", len(data), bool(text.mode & 0o111), data=data))
    return entries, changed


def build_trees(ctx: Context, versions: Sequence[str], out: Path, *, part_mib: int = payload.PART_MIB,
                progress: Progress | None = None, force: bool = False) -> dict:
    """Pack each lane's pristine and patched trees into ``out`` (replaced whole); the manifest."""
    progress = progress or Progress.stderr()
    entries: list[payload.Entry] = []
    about = []
    for version in versions:
        lane = ctx.named_lane(version)
        source = ctx.source(version)
        lane_files, changed = lane_entries(version, source, lane.series)
        entries += lane_files
        about.append({"lane": version, "sdist_sha256": source.sha256, "origin": source.origin, "changed": changed})
    name = "vllm-trees-" + "-".join(versions)
    return payload.write_parts(out, name, TOP, entries, part_mib, progress, {"trees": about}, force)


def tree_root(dest: Path, version: str, label: str) -> Path:
    """Where an unpacked trees archive holds one lane's tree (label: pristine or patched)."""
    return dest / version / label

