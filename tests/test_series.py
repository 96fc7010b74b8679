import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tools.patchkit import make_patch, write_series
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


# --- what a patch may create, and what a series may name ---------------------------------


@pytest.mark.parametrize("mode, words", [("120000", "a symbolic link"), ("160000", "a submodule (gitlink)"),
                                         ("100600", "not a regular file's mode"), ("040000", "a folder")])
def test_a_patch_may_create_only_regular_files(tmp_path, mode, words):
    """A symlink's 120000 was accepted ("applies") and written as a regular file of mode 0000."""
    text = make_patch({"vllm/link.py": (None, "../../etc/passwd\n")}).replace("new file mode 100644", f"new file mode {mode}")
    line = text.splitlines().index(f"new file mode {mode}") + 1
    series = write_series(tmp_path, {"0001-link.patch": text})
    with pytest.raises(SeriesError) as exc:
        load_series(series)
    assert str(exc.value) == (f"{tmp_path / '0001-link.patch'}:{line}: mode {mode} ({words}) is refused: a patch may "
                              "only add or change regular files (100644, 100755)")


@pytest.mark.parametrize("line", ["deleted file mode 120000", "index 1234567..89abcde 120000", "old mode 120000"])
def test_a_patch_may_not_touch_a_symlink_either(line):
    text = make_patch({"a.py": ("x\n", "y\n")}).replace("--- a/a.py", f"{line}\n--- a/a.py")
    with pytest.raises(SeriesError, match=r"p.patch:\d+: mode 120000 \(a symbolic link\) is refused"):
        parse_patch(text, Path("p.patch"))


def test_a_mode_change_is_refused_not_ignored():
    text = make_patch({"a.py": ("x\n", "y\n")}).replace("--- a/a.py", "old mode 100644\nnew mode 100755\n--- a/a.py")
    with pytest.raises(SeriesError, match=r"p.patch:\d+: mode changes \(old mode/new mode\) are not supported"):
        parse_patch(text, Path("p.patch"))


def test_regular_modes_are_kept():
    text = make_patch({"run.sh": (None, "echo\n")}).replace("new file mode 100644", "new file mode 100755")
    assert parse_patch(text, Path("p.patch")).files[0].mode == 0o100755


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _refusal(series: Path, odd: Path) -> str:
    """load_series's SeriesError, from a thread: one still reading ``odd`` after 10 s (a FIFO
    nobody writes) is let go by opening the FIFO's other end, and the test fails."""
    got: list[BaseException] = []

    def load() -> None:
        try:
            load_series(series)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            got.append(exc)

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():
        os.close(os.open(odd, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(10)
        pytest.fail(f"load_series({series}) blocked reading {odd}")
    assert got and isinstance(got[0], SeriesError), got
    return str(got[0])


@pytest.mark.parametrize("make, what", [(_fifo, "a FIFO (named pipe)"), (Path.mkdir, "a folder")], ids=["fifo", "folder"])
def test_a_series_or_patch_that_is_not_a_regular_file_is_named_not_read(tmp_path, make, what):
    """Never opened for reading: a FIFO without a writer would block forever."""
    odd = tmp_path / "odd"
    make(odd)
    assert _refusal(odd, odd) == f"cannot read series {odd}: it is {what}, not a regular file"
    (tmp_path / "series").write_text("# first\nodd\n")
    assert _refusal(tmp_path / "series", odd) == (
        f"{tmp_path / 'series'}:2: cannot read patch {odd}: it is {what}, not a regular file")


def test_a_device_as_the_series_is_named():
    """In a child process with 1 GiB of address space: reading /dev/zero never ends."""
    program = ("import sys; from pathlib import Path; from sm12x_bundle.series.patch import load_series\n"
               "try:\n    load_series(Path('/dev/zero'))\nexcept Exception as exc:\n    sys.exit(str(exc))\n")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, preexec_fn=limit)
    assert proc.stderr == "cannot read series /dev/zero: it is a character device, not a regular file\n"


def test_a_series_is_read_up_to_its_bound_only(tmp_path, monkeypatch):
    from sm12x_bundle.series import patch as patch_mod

    monkeypatch.setattr(patch_mod, "MAX_PATCH_BYTES", 100)
    series = write_series(tmp_path, {"0001-a.patch": make_patch({"a.py": ("x\n", "y\n")})})
    with pytest.raises(SeriesError, match=r"series:1: patch .*0001-a.patch is larger than 100 bytes: refused$"):
        load_series(series)
