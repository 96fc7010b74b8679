"""Classify each patch of the series against one source tree.

For each patch, in series order, on the tree as the earlier patches left it:
1. it reverse-applies            -> landed upstream (the same change is there);
2. it has probes and all match   -> landed upstream (written differently);
3. it applies (fuzz 0 default)   -> applies (noting any offsets);
4. otherwise                     -> conflict (file, hunk, and the lines that differ).
Only patches that apply change the tree the next patch sees.

A lane is checked the same way, and then every fix the shipped layout knows that the lane
does not carry is looked for in the pristine tree: another lane's patch for it reverse-applies,
or its probes match -> not carried, landed upstream (the lane rightly dropped it); neither
-> not carried, missing (the lane's users lack a fix upstream has not made).

Where a fix that did not land has several probes and some match while others do not, the
result names both ("partly landed upstream: PATH::QUALNAME; not landed: ..."): upstream made
part of the fix (vLLM 0.26.0 synchronizes in the free callback, not in sleep()). The outcome,
and so the exit code, stays what the patch itself did.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..errors import BundleError
from ..series.apply import HunkFailure, HunkResult, VirtualTree, apply_file_patch
from ..series.lane import Fix, Lane
from ..series.patch import Patch, Probe, Series
from ..series.probes import probe_matches
from ..source.pin import SourceTree


class Outcome(str, enum.Enum):
    APPLIES = "applies"
    LANDED = "landed upstream"
    CONFLICT = "conflict"
    NOT_CARRIED = "not carried"


@dataclass(frozen=True)
class Conflict:
    path: str
    hunk: int
    hunk_line: int  # the hunk's old-side start line
    differs: tuple[str, ...]


@dataclass(frozen=True)
class PatchResult:
    patch: str
    outcome: Outcome
    offsets: tuple[tuple[str, int, int], ...] = ()  # (path, hunk, offset) where offset != 0
    landed_by: str | None = None  # "reverse-apply" | "probe"
    conflict: Conflict | None = None
    # Each probe of the fix (PATH::QUALNAME) and whether it matched, when they were asked
    # (every outcome but a reverse-apply landing).
    probes: tuple[tuple[str, bool], ...] = ()

    @property
    def missing(self) -> bool:
        """A fix the lane does not carry and upstream has not made."""
        return self.outcome is Outcome.NOT_CARRIED and self.landed_by is None

    @property
    def partly_landed(self) -> bool:
        """Some of the fix's probes match and some do not: upstream made part of the fix."""
        return self.landed_by is None and {m for _, m in self.probes} == {True, False}

    def probes_where(self, matched: bool) -> list[str]:
        return [name for name, m in self.probes if m is matched]

    def summary(self) -> str:
        if not self.partly_landed:
            return self._outcome()
        return (f"{self._outcome()}; partly landed upstream: {', '.join(self.probes_where(True))}; "
                f"not landed: {', '.join(self.probes_where(False))}")

    def _outcome(self) -> str:
        if self.outcome is Outcome.NOT_CARRIED:
            if self.missing:
                wholly = " wholly" if self.partly_landed else ""
                return f"not carried, and not{wholly} landed upstream: this lane lacks the fix"
            return f"not carried: landed upstream ({self.landed_by})"
        if self.outcome is Outcome.APPLIES:
            if not self.offsets:
                return "applies"
            by_file: dict[str, list[int]] = {}
            for path, _hunk, offset in self.offsets:
                by_file.setdefault(path, []).append(offset)
            parts = [
                f"{path} {min(o):+d}" + (f"..{max(o):+d}" if min(o) != max(o) else "") + f" ({len(o)} hunks)"
                for path, o in by_file.items()
            ]
            return "applies with offsets: " + ", ".join(parts)
        if self.outcome is Outcome.LANDED:
            return f"landed upstream ({self.landed_by})"
        c = self.conflict
        assert c is not None
        return f"conflict: {c.path} hunk #{c.hunk} (line {c.hunk_line})"


@dataclass
class VersionReport:
    version: str
    origin: str
    sha256: str | None
    results: list[PatchResult] = field(default_factory=list)
    error: str | None = None
    error_code: int = 0
    tree: VirtualTree | None = field(default=None, repr=False)
    lane: str | None = None  # the lane whose series was checked; None: a bare series

    @property
    def worst(self) -> str:
        if self.error:
            return "could not run"
        outcomes = {r.outcome for r in self.results}
        if Outcome.CONFLICT in outcomes:
            return Outcome.CONFLICT.value
        if any(r.missing for r in self.results):
            return MISSING
        if Outcome.LANDED in outcomes:
            return Outcome.LANDED.value
        return Outcome.APPLIES.value


EXIT_APPLIES, EXIT_LANDED, EXIT_CONFLICT = 0, 10, 20
MISSING = "missing a fix"


def exit_code(reports: list[VersionReport]) -> int:
    """Worst first: could not run (that error's code) > conflict or a missing fix > landed > applies.

    A fix the lane does not carry because it landed upstream is not 'landed' here: the lane
    already dropped it."""
    for r in reports:
        if r.error:
            return r.error_code or BundleError.exit_code
    worst = {r.worst for r in reports}
    if Outcome.CONFLICT.value in worst or MISSING in worst:
        return EXIT_CONFLICT
    if Outcome.LANDED.value in worst:
        return EXIT_LANDED
    return EXIT_APPLIES


def _try_apply(tree: VirtualTree, patch: Patch, fuzz: int, reverse: bool = False) -> list[tuple[str, HunkResult]]:
    """Apply (or reverse-apply) every file of ``patch`` on ``tree``; raise HunkFailure, tree untouched."""
    scratch = VirtualTree(tree.root, dict(tree.edits))
    results = []
    for fp in patch.files:
        for r in apply_file_patch(scratch, fp.reversed() if reverse else fp, fuzz):
            results.append((fp.path, r))
    tree.edits = scratch.edits
    return results


def probe_name(probe: Probe) -> str:
    """How a report names a probe: ``PATH::QUALNAME`` (``PATH`` for a whole-file probe)."""
    return f"{probe.path}::{probe.qualname}" if probe.qualname else probe.path


def ask_probes(tree: VirtualTree, probes: tuple[Probe, ...]) -> tuple[tuple[str, bool], ...]:
    """Each probe's name and whether it matches ``tree`` as it stands."""
    return tuple((probe_name(p), probe_matches(tree, p)) for p in probes)


def classify(tree: VirtualTree, patch: Patch, fuzz: int = 0) -> PatchResult:
    # Reverse-apply and probes look at the tree as it stands; neither changes it.
    probe_tree = VirtualTree(tree.root, dict(tree.edits))
    try:
        _try_apply(VirtualTree(tree.root, dict(tree.edits)), patch, 0, reverse=True)
        return PatchResult(patch.id, Outcome.LANDED, landed_by="reverse-apply")
    except HunkFailure:
        pass
    probes = ask_probes(probe_tree, patch.probes)
    if probes and all(m for _, m in probes):
        return PatchResult(patch.id, Outcome.LANDED, landed_by="probe", probes=probes)
    try:
        applied = _try_apply(tree, patch, fuzz)
    except HunkFailure as failure:
        conflict = Conflict(failure.path, failure.index, failure.hunk.old_start, tuple(failure.diff_lines()))
        return PatchResult(patch.id, Outcome.CONFLICT, conflict=conflict, probes=probes)
    offsets = tuple((path, r.index, r.offset) for path, r in applied if r.offset)
    return PatchResult(patch.id, Outcome.APPLIES, offsets=offsets, probes=probes)


def not_carried(tree: VirtualTree, fix: Fix) -> PatchResult:
    """How ``tree`` shows a fix it was not patched with: landed by "reverse-apply" (some
    lane's patch for it reverse-applies), by "probe" (every probe of the fix matches), or
    not (missing; the probes say whether part of it landed)."""
    for patch in fix.patches:
        try:
            _try_apply(VirtualTree(tree.root, dict(tree.edits)), patch, 0, reverse=True)
            return PatchResult(fix.id, Outcome.NOT_CARRIED, landed_by="reverse-apply")
        except HunkFailure:
            pass
    probes = ask_probes(tree, fix.probes)
    landed = "probe" if probes and all(m for _, m in probes) else None
    return PatchResult(fix.id, Outcome.NOT_CARRIED, landed_by=landed, probes=probes)


def check_lane(lane: Lane, source: SourceTree, fixes: dict[str, Fix], fuzz: int = 0) -> VersionReport:
    """The lane's series on ``source`` (see check_tree), then one row for each of ``fixes``
    the lane does not carry, looked for in the pristine tree."""
    report = check_tree(lane.series, source, fuzz)
    report.lane = lane.version
    pristine = VirtualTree(source.root)
    for fix in fixes.values():
        if fix.id not in lane.series.ids:
            report.results.append(not_carried(pristine, fix))
    return report


def check_tree(series: Series, source: SourceTree, fuzz: int = 0) -> VersionReport:
    """Classify every patch on a pristine copy of ``source`` (held in memory)."""
    tree = VirtualTree(source.root)
    report = VersionReport(source.version, source.origin, source.sha256, tree=tree)
    for patch in series.patches:
        report.results.append(classify(tree, patch, fuzz))
    return report
