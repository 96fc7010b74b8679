"""The patched tree: the pristine tree with the series applied, written atomically."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ..checks.check import Outcome, VersionReport, check_tree
from ..errors import ApplyError
from ..fsutil import Destination, check_replaceable, copy_tree, refuse_overlap, replace_dir
from ..series.apply import FileText
from ..series.patch import Series
from ..source import record
from ..source.pin import SourceTree


def tree_folder(out: Path, version: str) -> Path:
    """Where ``build`` writes a lane's patched tree under output.dir."""
    return out / f"vllm-{version}-sm12x"


def destinations(out: Path, versions: list[str]) -> list[Destination]:
    """The folders the lanes' trees replace whole under output.dir."""
    return [Destination(tree_folder(out, v), "replace", "output folder") for v in versions]


def patched_files(series: Series, source: SourceTree, fuzz: int = 0) -> tuple[VersionReport, dict[str, FileText | None]]:
    """Apply the series in memory; raise ApplyError naming the first conflict."""
    report = check_tree(series, source, fuzz)
    for res in report.results:
        if res.outcome is Outcome.CONFLICT:
            c = res.conflict
            assert c is not None
            what = f"patch {res.patch} does not apply to vLLM {source.version} ({source.origin}): {c.path}"
            if len(c.differs) == 1:  # nothing to show but one fact: say it in the sentence
                raise ApplyError(f"{what}: {c.differs[0]}")
            raise ApplyError(f"{what} hunk #{c.hunk} at line {c.hunk_line}:\n  " + "\n  ".join(c.differs))
    assert report.tree is not None
    return report, report.tree.changed()


def _mtime(path: Path) -> float:
    # A patched file gets a fixed mtime that differs from the original's, so reruns
    # give the same tree and no stale bytecode can match it by size and mtime.
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    return float(epoch) if epoch else path.stat().st_mtime + 1


def write_tree(series: Series, source: SourceTree, out: Path, fuzz: int = 0, force: bool = False) -> VersionReport:
    """Write the patched tree to ``out``: all of it, or (on any failure) nothing.

    ``out`` must be absent, empty or a previous output of this tool unless ``force``."""
    refuse_overlap(out, [*source.inputs(), ("series folder", series.file.parent)])
    check_replaceable(out, force)
    report, changes = patched_files(series, source, fuzz)
    with replace_dir(out, force) as staging:
        if source.recorded:  # each file read once and checked, then applied to from the copy
            assert source.cache is not None and source.sha256 is not None
            record.copy_verified(source.root.parent, source.root.name, source.sha256, staging)
            report, changes = patched_files(series, replace(source, root=staging, cache=None), fuzz)
        else:
            copy_tree(source.root, staging)
        _write_changes(staging, changes)
    return report


def _write_changes(staging: Path, changes: dict[str, FileText | None]) -> None:
    """Write the patched files over their copies in ``staging`` (the copy's mtime + 1)."""
    for rel, text in sorted(changes.items()):
        dest = staging / rel
        if text is None:
            dest.unlink()
            continue
        stamp = _mtime(dest) if dest.is_file() else float(os.environ.get("SOURCE_DATE_EPOCH", 0))
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            dest.unlink()  # never write through a hard link into the cache
        dest.write_bytes(text.to_bytes())
        os.chmod(dest, text.mode)
        os.utime(dest, (stamp, stamp))
