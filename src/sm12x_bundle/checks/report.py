"""Render check results: a table for people, JSON for tools, JUnit XML for CI systems."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

from collections.abc import Sequence

from ..errors import sanitize
from ..series.lane import Lane
from ..series.patch import Patch
from ..series.status import applied
from .check import Outcome, VersionReport


def _status(p: Patch) -> str:
    """Where the fix stands upstream: its dated status (``partly: landed in 0.26.0 (checked
    2026-11-27)``), else what Applied-Upstream says (``landed in 0.26.0``, ``not merged``)."""
    if p.upstream is not None:
        return p.upstream.cell()
    found = applied(p.headers["Applied-Upstream"], str(p.file))
    if found.release is None:
        return "not merged"
    return f"landed in {found.release}" + (", partly" if found.partly else "")


def series_table(lanes: Sequence[Lane]) -> str:
    lines = []
    for lane in lanes:
        series = lane.series
        lines.append(f"lane {lane.version}: series {series.file} (sha256 {series.sha256[:16]})")
        for n, p in enumerate(series.patches, 1):
            lines.append(f"{n}. {p.id} [{p.kind}] {p.subject}")
            lines.append(f"   upstream: {p.origin} ({_status(p)})")
            lines.extend(f"     {ref} {state}" for ref, state in (p.upstream.refs if p.upstream else ()))
            lines.append(f"   files: {', '.join(p.paths)}" + (f"; rebuilds {p.builds}" if p.builds else ""))
    return sanitize("\n".join(lines)) + "\n"  # a subject's escape sequences are shown, never obeyed


def series_markdown(lanes: Sequence[Lane]) -> str:
    """The README's patch table, one row per fix and one column per lane: generated from the
    patch headers, the one place they live. A lane's cell is the patch's number in its series;
    "-" where the lane does not carry the fix (``check`` says why)."""
    first: dict[str, Patch] = {}
    numbers: dict[tuple[str, str], int] = {}
    for lane in lanes:
        for n, p in enumerate(lane.series.patches, 1):
            first.setdefault(p.id, p)
            numbers[(lane.version, p.id)] = n
    versions = [lane.version for lane in lanes]
    rows = ["| patch | kind | upstream | status | " + " | ".join(versions) + " |",
            "|---|---|---|---|" + "---|" * len(versions)]
    for fix, p in first.items():
        cells = [f"{numbers[(v, fix)]:04d}" if (v, fix) in numbers else "-" for v in versions]
        rows.append(f"| `{fix}`: {p.subject} | {p.kind} | {_origin_cell(p.origin)} | "
                    f"{_status(p)} | " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def _origin_cell(origin: str) -> str:
    """A link named by the PR or issue number, or the text of an Origin that is no URL
    (``none``: a fix of our own with no upstream counterpart)."""
    if not origin.startswith(("https://", "http://")):
        return origin
    return f"[#{origin.rstrip('/').rsplit('/', 1)[-1]}]({origin})"


def table(reports: list[VersionReport]) -> str:
    rows = [("lane", "vLLM", "patch", "result")]
    details: list[str] = []
    for r in reports:
        lane = r.lane or "-"
        if r.error:
            rows.append((lane, r.version, "-", f"could not run: {r.error}"))
            continue
        for res in r.results:
            rows.append((lane, r.version, res.patch, res.summary()))
            if res.conflict:
                details.append(f"lane {lane}, vLLM {r.version}, {res.patch}: {res.summary()}")
                details.extend("    " + line for line in res.conflict.differs)
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in rows]
    lines.insert(1, "-" * min(100, max(len(x) for x in lines)))
    if details:
        lines += ["", "Conflicts:"] + details
    return sanitize("\n".join(lines)) + "\n"  # the tree's text may hold escape sequences


def to_json(reports: list[VersionReport]) -> str:
    out = []
    for r in reports:
        entry = {"lane": r.lane, "version": r.version, "source": r.origin, "sha256": r.sha256, "result": r.worst}
        if r.error:
            entry["error"] = r.error
        entry["patches"] = [
            {
                "patch": res.patch,
                "carried": res.outcome is not Outcome.NOT_CARRIED,
                "outcome": res.outcome.value,
                "offsets": [{"path": p, "hunk": h, "offset": o} for p, h, o in res.offsets],
                "landed_by": res.landed_by,
                "probes": [{"probe": name, "matches": m} for name, m in res.probes],
                "partly_landed": {"landed": res.probes_where(True), "not_landed": res.probes_where(False)}
                if res.partly_landed
                else None,
                "conflict": None
                if res.conflict is None
                else {
                    "path": res.conflict.path,
                    "hunk": res.conflict.hunk,
                    "line": res.conflict.hunk_line,
                    "differs": list(res.conflict.differs),
                },
            }
            for res in r.results
        ]
        out.append(entry)
    return json.dumps(out, indent=2, sort_keys=True) + "\n"


def to_junit(reports: list[VersionReport]) -> str:
    """One testsuite per (lane, vLLM version), named ``lane-<lane>.vllm-<version>``, one
    testcase per patch.

    A conflict, or a fix the lane lacks, is a failure; a landed patch, carried or not, is
    'skipped' with the reason, so CI shows it without failing the build; a version that
    could not run is an error. A fix partly landed upstream says so in its failure's
    message, or in the system-out of a patch that applies.
    """
    suites = ET.Element("testsuites", name="sm12x-bundle check")
    for r in reports:
        name = (f"lane-{r.lane}." if r.lane else "") + f"vllm-{r.version}"
        suite = ET.SubElement(suites, "testsuite", name=name)
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if r.error:
            case = ET.SubElement(suite, "testcase", classname=name, name="fetch")
            ET.SubElement(case, "error", message=r.error)
            counts["tests"] += 1
            counts["errors"] += 1
        for res in r.results:
            case = ET.SubElement(suite, "testcase", classname=name, name=res.patch)
            counts["tests"] += 1
            if res.missing:
                ET.SubElement(case, "failure", message=res.summary())
                counts["failures"] += 1
            elif res.outcome is Outcome.CONFLICT:
                assert res.conflict is not None
                failure = ET.SubElement(case, "failure", message=res.summary())
                failure.text = "\n".join(res.conflict.differs)
                counts["failures"] += 1
            elif res.outcome in (Outcome.LANDED, Outcome.NOT_CARRIED):
                ET.SubElement(case, "skipped", message=res.summary())
                counts["skipped"] += 1
            elif res.partly_landed:  # a patch that applies has no message of its own
                ET.SubElement(case, "system-out").text = res.summary()
        for key, value in counts.items():
            suite.set(key, str(value))
    _xml_safe(suites)
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


# Characters XML 1.0 cannot hold at all, not even escaped (a conflict's text from the tree
# may carry them): each is written as its Python escape instead.
_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def _xml_text(text: str) -> str:
    return _NOT_XML.sub(lambda m: repr(m.group())[1:-1] if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


def _xml_safe(root: ET.Element) -> None:
    """Every text and attribute under ``root`` made writable as XML 1.0."""
    for element in root.iter():
        if element.text:
            element.text = _xml_text(element.text)
        for key, value in element.attrib.items():
            element.set(key, _xml_text(value))
