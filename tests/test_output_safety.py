"""Outputs never destroy what the tool did not write.

A folder is replaced only when it is absent, empty or marked as a previous output
(fsutil.MARKER); anything else is refused with exit 11 and left byte for byte as it was,
unless --force. '', '.', '~', '/' and '..' are refused even with --force. Staging folders
of a run that died are removed by the next run, a live one of a concurrent run is not.
``-q`` leaves stderr empty.

Every folder these tests point the tool at lies under tmp_path: the working directory is
tmp_path/home/work, HOME is tmp_path/home, so '..' and '~' name folders of the test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sm12x_bundle import fsutil
from sm12x_bundle.cli import main
from sm12x_bundle.source import cache as cache_mod

TARGET = "vllm-openai-v0.21.0"  # the embedded default's target
TREE = "vllm-0.21.0-sm12x"
PROTECTED = [".", "", "~", "/", ".."]


def listing(root: Path) -> list[tuple[str, str, bytes, int]]:
    """Every entry under ``root`` (hidden ones too): path, kind, content, mode."""
    out = []
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out.append((str(p.relative_to(root)), "link", os.readlink(p).encode(), 0))
        elif p.is_dir():
            out.append((str(p.relative_to(root)), "dir", b"", p.stat().st_mode))
        else:
            out.append((str(p.relative_to(root)), "file", p.read_bytes(), p.stat().st_mode))
    return out


def foreign(folder: Path) -> Path:
    """A folder of someone else's: a file, a hidden file, a subfolder."""
    (folder / "sub").mkdir(parents=True)
    (folder / "mine.txt").write_text("keep\n")
    (folder / ".hidden").write_text("keep too\n")
    (folder / "sub" / "notes.md").write_text("notes\n")
    return folder


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """cwd tmp_path/home/work (holding a file), HOME tmp_path/home, no Docker daemon,
    the real sdist cache."""
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(cache_mod.cache_dir()))
    home = tmp_path / "home"
    cwd = home / "work"
    cwd.mkdir(parents=True)
    (cwd / "keep.txt").write_text("keep\n")
    (home / "dotfile").write_text("home\n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    monkeypatch.chdir(cwd)
    return cwd


@pytest.fixture
def offline(work, monkeypatch) -> Path:
    """A config whose pin cannot be fetched: a command that gets as far as fetching exits 4,
    so exit 11 proves the refusal came before any download."""
    cfg = work / "offline.yaml"
    cfg.write_text(f"pin:\n  version: '0.21.0'\n  index_url: {(work / 'no-index').as_uri()}\n")
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(work.parent.parent / "empty-cache"))
    return cfg


def refused(capsys, code: int, path: str) -> str:
    err = capsys.readouterr().err
    assert code == 11, (code, err)
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert path in err, err
    return err


# --- apply ---------------------------------------------------------------------------


def test_apply_refuses_a_foreign_folder_before_any_download_and_leaves_it_untouched(offline, work, capsys):
    before = listing(foreign(work / "d"))
    err = refused(capsys, main(["apply", "-q", "--config", str(offline), "--out", "d"]), "d")
    assert "--force" in err and "mine.txt" in err
    assert listing(work / "d") == before
    assert sorted(p.name for p in work.iterdir()) == ["d", "keep.txt", "offline.yaml"]  # no staging left


@pytest.mark.parametrize("out", PROTECTED)
def test_apply_refuses_protected_folders_even_with_force(offline, work, capsys, out):
    home = work.parent
    before = listing(home)
    refused(capsys, main(["apply", "-q", "--config", str(offline), "--out", out, "--force"]), "even with --force")
    assert listing(home) == before


def test_apply_out_below_a_file_is_a_sentence(offline, work, capsys):
    (work / "afile").write_text("x")
    err = refused(capsys, main(["apply", "-q", "--config", str(offline), "--out", "afile/sub"]), "afile")
    assert "is a file, not a folder" in err


@pytest.mark.integration
def test_apply_uses_an_empty_folder_and_replaces_its_previous_output(work, capsys, pinned_source):
    (work / "out").mkdir()
    assert main(["apply", "-q", "--out", "out"]) == 0
    assert (work / "out" / fsutil.MARKER).read_bytes() == fsutil.MARKER_TEXT
    assert (work / "out" / "vllm" / "device_allocator" / "cumem.py").is_file()
    first = listing(work / "out")
    (work / "out" / "stale.py").write_text("left by hand in a previous output\n")
    assert main(["apply", "-q", "--out", "out"]) == 0
    assert listing(work / "out") == first
    assert capsys.readouterr().err == ""


@pytest.mark.integration
def test_apply_force_replaces_a_foreign_folder(work, capsys, pinned_source):
    foreign(work / "d")
    assert main(["apply", "-q", "--out", "d", "--force"]) == 0
    assert not (work / "d" / "mine.txt").exists() and (work / "d" / fsutil.MARKER).is_file()
    assert sorted(p.name for p in work.iterdir()) == ["d", "keep.txt"]


# --- staging folders left by a run that died -----------------------------------------

HOLD_STAGING = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from sm12x_bundle.fsutil import replace_dir
    with replace_dir(Path(sys.argv[1])) as staging:
        print(staging, flush=True)
        time.sleep(120)
    """
)


@pytest.mark.integration
def test_leftover_staging_is_removed_but_not_a_live_or_foreign_one(work, capsys, pinned_source):
    dead = work / ".out.new-dead1234"
    dead.mkdir()
    fsutil.mark(dead)
    (dead / "half-written.py").write_text("x")
    dead_old = work / ".out.old-dead5678"
    (dead_old / "x").mkdir(parents=True)
    fsutil.mark(dead_old)
    theirs = foreign(work / ".out.new-notours")  # matches the pattern, but carries no marker
    live = subprocess.Popen([sys.executable, "-c", HOLD_STAGING, str(work / "out")], stdout=subprocess.PIPE, text=True)
    try:
        live_staging = Path(live.stdout.readline().strip())
        assert live_staging.parent == work and live_staging.name.startswith(".out.new-")
        assert main(["apply", "-q", "--out", "out"]) == 0
        assert not dead.exists() and not dead_old.exists()
        assert live_staging.is_dir() and (live_staging / fsutil.MARKER).is_file()  # the concurrent run's
        assert theirs.is_dir() and (theirs / "mine.txt").read_text() == "keep\n"
    finally:
        live.kill()
        live.wait()
    assert main(["apply", "-q", "--out", "out"]) == 0  # its run died: now a leftover
    assert sorted(p.name for p in work.iterdir()) == [".out.new-notours", "keep.txt", "out"]


@pytest.mark.integration
def test_apply_killed_midway_leaves_staging_that_the_next_run_removes(work, capsys, pinned_source):
    proc = subprocess.Popen([sys.executable, "-m", "sm12x_bundle", "apply", "-q", "--out", "out"])
    staging = None
    deadline = time.monotonic() + 120
    while staging is None and time.monotonic() < deadline and proc.poll() is None:
        found = [p for p in work.glob(".out.new-*") if (p / "vllm").is_dir()]
        staging = found[0] if found else None
        time.sleep(0.01)
    assert staging is not None, "the apply finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert staging.is_dir() and not (work / "out").exists()
    assert main(["apply", "-q", "--out", "out"]) == 0
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt", "out"]


# --- build ---------------------------------------------------------------------------


def write_config(work: Path, key: str, value: str) -> Path:
    """The embedded default with ``output.<key>`` set to ``value``."""
    from sm12x_bundle import config as config_mod

    text = config_mod.default_text()
    line = f"\n  {key}: {'build' if key == 'dir' else 'overlays'}\n"
    assert line in text
    cfg = work / "cfg.yaml"
    cfg.write_text(text.replace(line, f"\n  {key}: {value!r}\n"))
    return cfg


def test_build_refuses_a_foreign_tree_folder(work, capsys):
    before = listing(foreign(work / "build" / TREE))
    err = refused(capsys, main(["build", "-q"]), TREE)
    assert "--force" in err
    assert listing(work / "build" / TREE) == before
    assert not (work / "overlays").exists()


def test_build_refuses_a_foreign_overlay_folder_before_writing_the_tree(work, capsys):
    before = listing(foreign(work / "overlays" / TARGET))
    refused(capsys, main(["build", "-q"]), TARGET)
    assert listing(work / "overlays" / TARGET) == before
    assert not (work / "build").exists()  # refused before the first step wrote anything


@pytest.mark.parametrize("key", ["dir", "overlays"])
@pytest.mark.parametrize("value", [".", "~", "/", ".."])
def test_build_refuses_protected_output_folders_even_with_force(work, capsys, key, value):
    home = work.parent
    cfg = write_config(work, key, value)
    before = listing(home)
    refused(capsys, main(["build", "-q", "--config", str(cfg), "--force"]), "even with --force")
    assert listing(home) == before


@pytest.mark.integration
@pytest.mark.native
def test_build_quiet_replaces_its_previous_output_and_force_a_foreign_one(work, capsys, pinned_source):
    """One real build (host compile of the cumem extension): -q leaves stderr empty;
    its outputs are marked and the next build replaces them; --force takes a foreign folder."""
    assert main(["build", "-q"]) == 0
    assert capsys.readouterr().err == ""
    tree, target = work / "build" / TREE, work / "overlays" / TARGET
    assert (tree / fsutil.MARKER).is_file() and (target / fsutil.MARKER).is_file()
    assert (work / "build" / "nomad" / fsutil.MARKER).is_file()
    first = listing(work / "build") + listing(work / "overlays")
    (tree / "stale.py").write_text("x")
    (target / "stale.txt").write_text("x")
    assert main(["build", "-q"]) == 0
    assert not (tree / "stale.py").exists()
    (target / "stale.txt").unlink()  # the overlays folder is written into, not replaced
    assert listing(work / "build") + listing(work / "overlays") == first
    (tree / fsutil.MARKER).unlink()  # no longer recognisably ours
    assert main(["build", "-q"]) == 11
    assert main(["build", "-q", "--force"]) == 0
    assert capsys.readouterr().err.count("\n") == 1


# --- overlay -------------------------------------------------------------------------


def test_overlay_refuses_a_foreign_target_folder(work, capsys):
    before = listing(foreign(work / "ov" / TARGET))
    err = refused(capsys, main(["overlay", "-q", "--out", "ov"]), TARGET)
    assert "--force" in err
    assert listing(work / "ov" / TARGET) == before


@pytest.mark.parametrize("out", PROTECTED)
def test_overlay_refuses_protected_folders_even_with_force(work, capsys, out):
    home = work.parent
    before = listing(home)
    refused(capsys, main(["overlay", "-q", "--out", out, "--force"]), "even with --force")
    assert listing(home) == before


@pytest.mark.integration
@pytest.mark.native
def test_overlay_writes_beside_foreign_files_replaces_its_own_and_forces(work, capsys, pinned_source):
    (work / "ov").mkdir()
    (work / "ov" / "README.md").write_text("the operator's\n")  # beside the target folders: kept
    (work / "ov" / TARGET).mkdir()  # empty: used
    assert main(["overlay", "-q", "--out", "ov"]) == 0
    assert (work / "ov" / "README.md").read_text() == "the operator's\n"
    assert (work / "ov" / TARGET / fsutil.MARKER).is_file()
    first = listing(work / "ov")
    assert main(["overlay", "-q", "--out", "ov"]) == 0
    assert listing(work / "ov") == first
    foreign(work / "forced" / TARGET)
    assert main(["overlay", "-q", "--out", "forced"]) == 11
    assert main(["overlay", "-q", "--out", "forced", "--force"]) == 0
    assert (work / "forced" / TARGET / "mine.txt").read_text() == "keep\n"  # written into, not replaced
    assert (work / "forced" / TARGET / "current.json").is_file()
    capsys.readouterr()


# --- -q ------------------------------------------------------------------------------


def test_quiet_hides_the_command_line_but_a_failure_still_shows_its_output(capsys):
    from sm12x_bundle import cmd
    from sm12x_bundle.errors import CommandError

    with cmd.echo_commands(False):
        cmd.run([sys.executable, "-c", "print('fine')"])
        with pytest.raises(CommandError) as exc:
            cmd.run([sys.executable, "-c", "import sys; sys.exit('the compiler says no')"])
    assert capsys.readouterr().err == ""
    assert "the compiler says no" in str(exc.value) and "exit code 1" in str(exc.value)
    cmd.run([sys.executable, "-c", "pass"])
    assert capsys.readouterr().err.startswith("+ ")


# --- nomad and image -------------------------------------------------------------------

EXAMPLE_MANIFEST = Path(__file__).resolve().parents[1] / "nomad" / "example-manifest.json"


def test_nomad_writes_beside_foreign_files_but_never_over_them(work, capsys):
    spec = ["nomad", "-q", "--manifest", str(EXAMPLE_MANIFEST), "--out", "specs"]
    (work / "specs").mkdir()
    (work / "specs" / "README.md").write_text("the operator's\n")
    assert main(spec) == 0  # new files beside the operator's: nothing is destroyed
    written = sorted(p.name for p in (work / "specs").iterdir())
    assert "README.md" in written and fsutil.MARKER not in written  # not ours to mark
    assert main(spec) == 0  # the same bytes again: nothing is overwritten
    hcl = next((work / "specs").glob("*.nomad.hcl"))
    hcl.write_text("job written by hand\n")
    before = listing(work / "specs")
    refused(capsys, main(spec), hcl.name)
    assert listing(work / "specs") == before
    assert main([*spec, "--force"]) == 0 and hcl.read_text() != "job written by hand\n"
    assert main([*spec[:-1], "fresh"]) == 0 and (work / "fresh" / fsutil.MARKER).is_file()


def test_image_refuses_a_foreign_build_context_folder_before_asking_a_daemon(work, capsys):
    before = listing(foreign(work / "ctx" / "bundle"))
    refused(capsys, main(["image", "-q", "--out", "ctx"]), "bundle")
    assert listing(work / "ctx" / "bundle") == before


@pytest.mark.integration
@pytest.mark.native
def test_overlay_takes_a_target_folder_written_before_markers_existed(work, capsys, pinned_source):
    assert main(["overlay", "-q", "--out", "ov"]) == 0
    target = work / "ov" / TARGET
    (target / fsutil.MARKER).unlink()
    [old] = [p for p in target.iterdir() if p.is_dir()]
    (old / fsutil.MARKER).unlink()
    old.rename(target / "0123456789abcdef")  # an older overlay version, still mounted somewhere
    assert main(["overlay", "-q", "--out", "ov"]) == 0
    assert (target / fsutil.MARKER).is_file() and (target / "0123456789abcdef" / "manifest.json").is_file()
    (target / fsutil.MARKER).unlink()
    (target / "notes.txt").write_text("the operator's\n")  # no longer only overlays: not ours
    assert main(["overlay", "-q", "--out", "ov"]) == 11


def test_build_refuses_a_foreign_nomad_spec_before_writing_the_tree(work, capsys):
    (work / "build" / "nomad").mkdir(parents=True)
    (work / "build" / "nomad" / "dsv4-flash.nomad.hcl").write_text("job written by hand\n")
    before = listing(work / "build")
    refused(capsys, main(["build", "-q"]), "dsv4-flash.nomad.hcl")
    assert listing(work / "build") == before and not (work / "overlays").exists()


def test_a_folder_above_home_is_refused_even_with_force(tmp_path, monkeypatch, capsys):
    # The working directory outside home, so only the home rule can refuse it.
    (tmp_path / "users" / "me").mkdir(parents=True)
    (tmp_path / "users" / "other.txt").write_text("someone else's\n")
    (tmp_path / "work").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "users" / "me"))
    monkeypatch.chdir(tmp_path / "work")
    before = listing(tmp_path / "users")
    code = main(["apply", "-q", "--out", str(tmp_path / "users"), "--force"])
    assert code == 11
    assert "a folder above the home folder: refused, even with --force" in capsys.readouterr().err
    assert listing(tmp_path / "users") == before
