from pathlib import Path

import pytest

from patchkit import make_patch, write_series
from sm12x_bundle.errors import SeriesError
from sm12x_bundle.series.patch import load_series, parse_patch


def test_headers_and_kind_are_parsed():
    text = make_patch({"a.py": ("x\n", "y\n")}, Sm12x_Kind="native", Sm12x_Builds="vllm/x.so", Bug="b1")
    patch = parse_patch(text, Path("0003-thing.patch"))
    assert patch.id == "thing"
    assert patch.kind == "native"
    assert patch.builds == "vllm/x.so"
    assert patch.headers["Bug"] == "b1"
    assert patch.paths == ("a.py",)


def test_missing_required_header_is_refused():
    text = make_patch({"a.py": ("x\n", "y\n")}).replace("Origin: https://github.com/vllm-project/vllm/pull/1\n", "")
    with pytest.raises(SeriesError, match="missing header\\(s\\) Origin"):
        parse_patch(text, Path("p.patch"))


def test_native_patch_must_name_its_artifact():
    text = make_patch({"a.cpp": ("x\n", "y\n")}, Sm12x_Kind="native")
    with pytest.raises(SeriesError, match="needs Sm12x-Builds"):
        parse_patch(text, Path("p.patch"))


@pytest.mark.parametrize(
    "path",
    ["/etc/passwd", "../outside.py", "vllm/../../outside.py", "vllm/./x.py", "a\\b.py"],
)
def test_hostile_paths_are_refused(path):
    text = make_patch({"vllm/x.py": ("x\n", "y\n")}).replace("vllm/x.py", path)
    with pytest.raises(SeriesError, match="refused|expected a path"):
        parse_patch(text, Path("p.patch"))


def test_renames_and_binaries_are_refused():
    text = make_patch({"a.py": ("x\n", "y\n")}).replace("--- a/a.py", "rename from a.py\n--- a/a.py")
    with pytest.raises(SeriesError, match="rename patches are not supported"):
        parse_patch(text, Path("p.patch"))
    text = make_patch({"a.py": ("x\n", "y\n")}).replace("--- a/a.py", "GIT binary patch\n--- a/a.py")
    with pytest.raises(SeriesError, match="GIT patches are not supported"):
        parse_patch(text, Path("p.patch"))


def test_probe_syntax_is_checked():
    good = make_patch({"a.py": ("x\n", "y\n")}, Sm12x_Probe="a.py::f ~ sync\\(\na.cpp ~ reset")
    patch = parse_patch(good, Path("p.patch"))
    assert [(p.path, p.qualname, p.pattern) for p in patch.probes] == [("a.py", "f", "sync\\("), ("a.cpp", None, "reset")]
    with pytest.raises(SeriesError, match="not 'PATH"):
        parse_patch(make_patch({"a.py": ("x\n", "y\n")}, Sm12x_Probe="a.py sync"), Path("p.patch"))
    with pytest.raises(SeriesError, match="would leave the tree"):
        parse_patch(make_patch({"a.py": ("x\n", "y\n")}, Sm12x_Probe="../a.py ~ x"), Path("p.patch"))


def test_series_order_comments_and_digest(tmp_path):
    series = write_series(tmp_path, {"0001-a.patch": make_patch({"a.py": ("x\n", "y\n")}), "0002-b.patch": make_patch({"b.py": ("x\n", "y\n")})})
    series.write_text("# comment\n0001-a.patch\n\n0002-b.patch -p1\n")
    loaded = load_series(series)
    assert loaded.ids == ("a", "b")
    digest = loaded.sha256
    (tmp_path / "0002-b.patch").write_text(make_patch({"b.py": ("x\n", "z\n")}))
    assert load_series(series).sha256 != digest


def test_series_entry_cannot_escape(tmp_path):
    (tmp_path / "series").write_text("../evil.patch\n")
    with pytest.raises(SeriesError, match="would leave the tree"):
        load_series(tmp_path / "series")


def test_empty_or_missing_series(tmp_path):
    # A lane may carry nothing: every fix landed upstream, or its ports are not written yet.
    (tmp_path / "series").write_text("# nothing\n")
    assert load_series(tmp_path / "series").patches == ()
    with pytest.raises(SeriesError, match="cannot read"):
        load_series(tmp_path / "absent")
