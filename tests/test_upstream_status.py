"""Where each fix stands upstream: Applied-Upstream (DEP-3) and the dated Sm12x-Upstream-Status,
how the patch table renders them, and the refusals when the two disagree (series/status.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sm12x_bundle.checks.report import series_markdown, series_table
from sm12x_bundle.errors import SeriesError
from sm12x_bundle.series import sources
from sm12x_bundle.series.lane import Lane
from sm12x_bundle.series.patch import load_series, parse_patch
from sm12x_bundle.source.pin import Pin
from tools.patchkit import make_patch, write_series

REPO = Path(__file__).resolve().parents[1]
CHECKED = "checked 2026-11-27"


def _patch(applied: str, status: str | None = None) -> str:
    text = make_patch({"a.py": ("x\n", "y\n")}, Applied_Upstream=applied)
    if status is not None:
        text = text.replace(f"Applied-Upstream: {applied}\n", f"Applied-Upstream: {applied}\nSm12x-Upstream-Status: {status}\n")
    return text


def _row(tmp_path: Path, text: str) -> str:
    series = write_series(tmp_path / "s", {"0001-fix.patch": text})
    lane = Lane("0.21.0", Pin("0.21.0"), load_series(series))
    return series_markdown([lane]).splitlines()[2]


def _status_cell(row: str) -> str:
    return row.split(" | ")[3]


def test_a_release_in_applied_upstream_renders_as_landed_in_that_release(tmp_path):
    assert _status_cell(_row(tmp_path, _patch("0.26.0"))) == "landed in 0.26.0"
    assert _status_cell(_row(tmp_path, _patch("no"))) == "not merged"
    partly = _patch("0.26.0, partly: sleep() still unmaps", f"partly, {CHECKED}\n #1 merged, in 0.26.0")
    assert _status_cell(_row(tmp_path, partly)) == f"partly: landed in 0.26.0 ({CHECKED})"
    merged = _patch("0.34.0", f"merged, {CHECKED}\n #1 merged")
    assert _status_cell(_row(tmp_path, merged)) == f"merged: landed in 0.34.0 ({CHECKED})"
    assert _status_cell(_row(tmp_path, _patch("no", f"closed unmerged, {CHECKED}\n #1 closed unmerged"))) == (
        f"closed unmerged ({CHECKED})")


def test_the_plain_listing_gives_every_reference_its_state(tmp_path):
    text = _patch("no", f"open, {CHECKED}\n #1 open, under review")
    series = write_series(tmp_path / "s", {"0001-fix.patch": text})
    listing = series_table([Lane("0.21.0", Pin("0.21.0"), load_series(series))])
    assert f"(open ({CHECKED}))" in listing and "     #1 open, under review" in listing


@pytest.mark.parametrize("applied, status, refused", [
    ("0.26.0", f"open, {CHECKED}\n #1 open", "says 'open' but Applied-Upstream says '0.26.0'"),
    ("no", f"merged, {CHECKED}\n #1 merged", "says 'merged' but Applied-Upstream says 'no'"),
    ("0.26.0", f"partly, {CHECKED}\n #1 merged", "says 'partly' but Applied-Upstream says '0.26.0'"),
    ("0.26.0, partly: x", f"merged, {CHECKED}\n #1 merged", "says 'merged'"),
    ("no", f"open, {CHECKED}", "has no line for #1"),
    ("no", "open", "is not '<merged | partly | open | closed unmerged>, checked YYYY-MM-DD'"),
    ("no", f"open, {CHECKED}\n #1 pending", "line '#1 pending' is not"),
    ("soon", None, "Applied-Upstream 'soon' is neither 'no' nor a vLLM release"),
])
def test_a_status_that_disagrees_is_refused_before_anything_applies(tmp_path, applied, status, refused):
    with pytest.raises(SeriesError, match=re.escape(refused)):
        parse_patch(_patch(applied, status), Path("0001-fix.patch"))  # checked while parsing the series


def test_every_shipped_fix_is_dated_and_names_every_reference():
    for upstream in sorted(REPO.glob("patches/fixes/*/upstream")):
        fields = dict(sources.read_upstream(upstream))  # refuses a status that disagrees
        assert "Sm12x-Upstream-Status" in fields, upstream


def test_the_readme_table_says_each_fix_status_and_date():
    """The README rows are the rendered table (tests/test_generated.py keeps them in step); here,
    what they say: the stream-aware free landed partly in 0.26.0, the others as checked."""
    readme = (REPO / "README.md").read_text()
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `([\w-]+)`:.*? \| .*? \| (?:\[#\d+\]\(\S+\)|none) \| (.*?) \|", readme, re.M)}
    assert rows["cumem-stream-aware-free"] == f"partly: landed in 0.26.0 ({CHECKED})"
    assert rows["cumem-wake-up-rollback"] == f"closed unmerged ({CHECKED})"
    assert rows["cumem-backup-pool"] == f"open ({CHECKED})"
    assert rows["cumem-skip-unchanged"] == f"open ({CHECKED})"  # no upstream change of its own: the cell says none
    assert len(rows) == len(list(REPO.glob("patches/fixes/*/upstream")))
    assert "not merged" not in readme.split("<!-- series-table", 1)[1].split("<!-- /series-table", 1)[0]
