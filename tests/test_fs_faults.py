"""Outputs against the run's own inputs, --force against what is not the tool's, a cache
others could write, runs killed midway, and the exit code of every input or machine fault.

Each case runs the command line (``cli.main`` in this process, or ``python -m sm12x_bundle``
where a signal or the working directory is part of the case) inside a private world under
tmp_path: HOME, the working directory, a small local vLLM tree and a one-patch series. Every
case records the world (each file's sha256, mode, mtime and inode; hostilekit.record) before
and after: a refusal changes nothing but what the case names.

Killed runs use the test-only pause hook (fsutil.pause): ``SM12X_TEST_PAUSE_AT=<point>`` makes
the run write its pid to ``SM12X_TEST_PAUSE_FILE`` and sleep at that point, where the test
kills it with SIGKILL (or SIGTERM); the next run, without the hook, must clean up.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hostilekit import differences, record
from sm12x_bundle import cli, fsutil
from sm12x_bundle.checks import report
from sm12x_bundle.checks.check import Conflict, Outcome, PatchResult, VersionReport
from sm12x_bundle.errors import sanitize
from sm12x_bundle.source import cache as cache_mod
from tools.patchkit import make_patch

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = os.geteuid() == 0
SMALL = """\
pin:
  version: "0.21.0"
  source: {tree}
series: {series}
"""


def run_main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return int(exc.code)


@pytest.fixture
def world(tmp_path, monkeypatch) -> Path:
    """tmp_path/home (HOME, with .ssh), home/work (cwd, small.yaml), srctree (the lane's local
    source), series/ (its series), cache/ (an empty private cache), tmp/ (TMPDIR)."""
    home, work = tmp_path / "home", tmp_path / "home" / "work"
    for rel, text in {
        "home/.ssh/id_ed25519": "a private key\n",
        "home/work/keep.txt": "keep\n",
        "lane/srctree/PKG-INFO": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.21.0\n",
        "lane/srctree/vllm/__init__.py": '__version__ = "0.21.0"\n',
        "series/series": "0001-probe.patch\n",
        "series/0001-probe.patch": make_patch({"vllm/sm12x_probe.py": (None, "x = 1\n")}),
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "cache").mkdir(mode=0o755)
    (tmp_path / "tmp").mkdir()
    (work / "small.yaml").write_text(SMALL.format(tree=tmp_path / "lane" / "srctree", series=tmp_path / "series" / "series"))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # what this process's gettempdir gives
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    monkeypatch.chdir(work)
    return tmp_path


def judged(capsys, code: int, expected: int, *fragments: str) -> str:
    """One sentence on stderr, no traceback, the expected code, and each fragment in it."""
    err = capsys.readouterr().err
    assert code == expected, (code, err)
    assert "Traceback" not in err and "a bug" not in err and err.count("sm12x-bundle: error:") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


# --- 1. no output inside an input, no input inside an output (exit 11) ------------------------

OVERLAP = [
    ("out-inside-local-source", ["--out", "{W}/lane/srctree/vllm/out"], "is inside the pin source"),
    ("out-inside-series-folder", ["--out", "{W}/series/out"], "is inside the series folder"),
    ("out-inside-cache", ["--out", "{W}/cache/out"], "is inside the cache folder"),
    ("local-source-inside-out", ["--out", "{W}/lane", "--force"], "which this run reads, is inside the output folder"),
    ("series-inside-out", ["--out", "{W}/series", "--force"], "is inside the series folder"),
]


@pytest.mark.parametrize("argv, phrase", [c[1:] for c in OVERLAP], ids=[c[0] for c in OVERLAP])
def test_an_output_inside_an_input_or_holding_one_is_refused_before_anything_is_written(world, capsys, argv, phrase):
    before = record(world)
    code = run_main(["apply", "-q", "--config", "small.yaml", *(a.replace("{W}", str(world)) for a in argv)])
    judged(capsys, code, 11, phrase, "refused")
    assert differences(before, record(world)) == []


def test_the_cache_inside_the_output_is_refused_even_with_force(world, capsys, monkeypatch):
    (world / "out").mkdir()
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(world / "out" / "cache"))
    before = record(world)
    judged(capsys, run_main(["apply", "-q", "--config", "small.yaml", "--out", str(world / "out"), "--force"]), 11,
           f"the cache folder {world / 'out' / 'cache'}, which this run reads, is inside the output folder")
    assert differences(before, record(world)) == []


@pytest.mark.integration
def test_apply_into_the_cached_tree_is_refused_and_the_cache_is_unchanged(pinned_source, capsys, tmp_path, monkeypatch):
    """The hostile pass's case: the staging folder copied into itself until the disk filled."""
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(cache_mod.cache_dir()))
    monkeypatch.chdir(tmp_path)
    entry = pinned_source.root.parent
    before = record(entry)
    judged(capsys, run_main(["apply", "-q", "--out", str(pinned_source.root / "inside")]), 11, "is inside the cache folder")
    assert differences(before, record(entry)) == []


# --- 2. --force never replaces what is not the tool's (exit 11) -----------------------------


@pytest.mark.parametrize("folder", ["/var/lib/dpkg", "/usr/local/lib", "/etc/ssl", "/usr/local/share", "/var/log"])
def test_force_never_replaces_a_folder_inside_a_system_folder(world, capsys, folder):
    if not os.path.isdir(folder):
        pytest.skip(f"{folder} is not on this machine")
    names = sorted(os.listdir(folder))
    code = run_main(["apply", "-q", "--config", "small.yaml", "--out", folder, "--force"])
    judged(capsys, code, 11, "inside the system folder", "even with --force")
    assert sorted(os.listdir(folder)) == names
    assert not [n for n in os.listdir(Path(folder).parent) if n.startswith(f".{Path(folder).name}.")]


@pytest.mark.parametrize("rel, phrase", [(".ssh", "inside the dot folder"), (".config/app", "inside the dot folder")])
def test_force_never_replaces_a_home_dot_folder(world, capsys, rel, phrase):
    (world / "home" / rel).mkdir(parents=True, exist_ok=True)
    (world / "home" / rel / "keep").write_text("keep\n")
    before = record(world)
    code = run_main(["apply", "-q", "--config", "small.yaml", "--out", str(world / "home" / rel), "--force"])
    judged(capsys, code, 11, phrase)
    assert differences(before, record(world)) == []


def test_force_still_replaces_a_folder_of_the_operators_own(world, capsys):
    (world / "mine").mkdir()
    (world / "mine" / "old.txt").write_text("x")
    assert run_main(["apply", "-q", "--config", "small.yaml", "--out", str(world / "mine"), "--force"]) == 0
    assert (world / "mine" / "vllm" / "sm12x_probe.py").read_text() == "x = 1\n"


def test_forced_problem_names_each_protected_place(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert fsutil.forced_problem(Path("/var/lib/docker")) == "inside the system folder /var/lib"
    assert fsutil.forced_problem(Path("/lib64/x")) == "inside the system folder /lib64"
    assert fsutil.forced_problem(tmp_path.resolve()) == "a home folder"
    assert fsutil.forced_problem(tmp_path.resolve() / ".ssh").startswith("inside the dot folder")
    assert fsutil.forced_problem(tmp_path.resolve() / "build") is None
    assert fsutil.forced_problem(Path("/opt/models")) is None and fsutil.forced_problem(Path("/srv/x")) is None


# --- 3. a cache others could write is refused; links in it are never followed (exit 12) ------


def _sha() -> str:
    from sm12x_bundle.source.pin import known_sha256

    sha = known_sha256("0.21.0")
    assert sha is not None
    return sha


def _cache_case(world: Path, case: str) -> Path | None:
    """Set up the cache for one case; return a path that must not come to exist."""
    cache = world / "cache"
    if case == "world-writable":
        cache.chmod(0o777)
    elif case == "group-writable":
        cache.chmod(0o775)
    elif case == "another-owner":
        os.chown(cache, 4242, 4242)
    elif case in ("lock-link", "tree-lock-link"):
        (cache / "locks").mkdir()
        key = _sha() if case == "lock-link" else "tree-" + _sha()
        (cache / "locks" / f"{key}.lock").symlink_to(world / "planted")
        return world / "planted"
    elif case == "locks-link":
        (world / "elsewhere").mkdir()
        (cache / "locks").symlink_to(world / "elsewhere")
    return None


CACHE_CASES = [
    ("world-writable", "writable by other users (mode 777)"),
    ("group-writable", "writable by other users (mode 775)"),
    ("another-owner", "belongs to user 4242"),
    ("lock-link", "is a link, which the cache never holds"),
    ("locks-link", "is a link, which the cache never holds"),
]


@pytest.mark.parametrize("case, phrase", CACHE_CASES, ids=[c[0] for c in CACHE_CASES])
def test_a_cache_others_could_write_is_refused_before_it_is_used(world, capsys, case, phrase):
    if case == "another-owner" and not ROOT:
        pytest.skip("giving a folder to another user needs root")
    planted = _cache_case(world, case)
    offline = world / "home" / "work" / "offline.yaml"
    offline.write_text(f"pin:\n  version: '0.21.0'\n  index_url: {(world / 'no-index').as_uri()}\n")
    skip = ("cache/locks",) if planted else ()  # the tree's lock may be taken before the sdist's is refused
    before = record(world, skip)
    judged(capsys, run_main(["fetch", "-q", "--config", str(offline)]), 12, "cannot use the cache folder", phrase)
    assert planted is None or not os.path.lexists(planted)
    assert differences(before, record(world, skip)) == []


def _private_cache(world: Path, pinned, with_tree: bool) -> Path:
    """The machine's pinned sdist (and its extracted tree) copied into the world's cache."""
    machine, sha, cache = pinned.root.parents[2], _sha(), world / "cache"
    shutil.copytree(machine / "sdists" / sha, cache / "sdists" / sha)
    if with_tree:
        shutil.copytree(machine / "trees" / sha, cache / "trees" / sha, symlinks=True)
    return cache


@pytest.mark.integration
def test_a_tree_file_changed_after_its_check_never_reaches_the_patched_tree(world, capsys, pinned_source, monkeypatch):
    """The file is changed between the tree's check (Context.source) and its copy: the copy
    reads each file once, hashes what it read and writes those bytes, so it sees the change."""
    from sm12x_bundle.context import Context

    cache = _private_cache(world, pinned_source, with_tree=True)
    target = cache / "trees" / _sha() / pinned_source.root.name / "vllm" / "__init__.py"
    checked = Context.source

    def source_then_tamper(self, version=None):
        tree = checked(self, version)
        target.write_bytes(target.read_bytes() + b"\nimport planted\n")
        return tree

    monkeypatch.setattr(Context, "source", source_then_tamper)
    judged(capsys, run_main(["apply", "-q", "--out", str(world / "out")]), 4, "changed since it was checked")
    assert not (world / "out").exists()
    assert [p.name for p in world.iterdir() if p.name.startswith(".out.")] == []


# --- 4. runs killed midway leave nothing the next run does not remove ------------------------


def _env(world: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(SRC), **extra}
    env.pop("SM12X_TEST_PAUSE_AT", None)
    env.update(extra)
    return env


def _paused(world: Path, argv: list[str], point: str, **extra: str) -> subprocess.Popen:
    """A run started with the pause hook, once it is waiting at ``point``."""
    flag = world / "paused"
    flag.unlink(missing_ok=True)
    env = _env(world, SM12X_TEST_PAUSE_AT=point, SM12X_TEST_PAUSE_FILE=str(flag), **extra)
    proc = subprocess.Popen([sys.executable, "-m", "sm12x_bundle", *argv], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert flag.exists(), f"the run never reached {point}: {proc.poll()} {proc.stderr.read() if proc.stderr else ''}"
    return proc


def _again(argv: list[str], world: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sm12x_bundle", *argv], env=_env(world), capture_output=True,
                          text=True, timeout=600)


def test_a_run_killed_while_deleting_the_old_output_leaves_it_marked_and_the_next_run_removes_it(world):
    argv = ["apply", "-q", "--config", "small.yaml", "--out", "out"]
    assert _again(argv, world).returncode == 0
    proc = _paused(world, argv, "leftover-deleting")
    proc.kill()
    proc.wait()
    work = world / "home" / "work"
    left = list(work.glob(".out.old-*"))
    assert len(left) == 1 and fsutil.is_ours(left[0]), left  # the marker goes last
    done = _again(argv, world)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in work.iterdir()) == ["keep.txt", "out", "small.yaml"]


@pytest.mark.integration
def test_a_run_killed_while_extracting_leaves_a_partial_tree_the_next_run_removes(world, pinned_source):
    cache = _private_cache(world, pinned_source, with_tree=False)
    proc = _paused(world, ["fetch", "-q"], "cache-extracting")
    proc.kill()
    proc.wait()
    partial = list((cache / "trees").glob(_sha() + ".*"))
    assert len(partial) == 1, partial
    done = _again(["fetch", "-q"], world)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (cache / "trees").iterdir()) == [_sha()]


@pytest.mark.integration
@pytest.mark.parametrize("how, code", [(signal.SIGTERM, 143), (signal.SIGKILL, -signal.SIGKILL)], ids=["TERM", "KILL"])
def test_a_scratch_folder_is_removed_on_sigterm_and_by_the_next_run_after_sigkill(world, pinned_source, how, code):
    """A scratch folder of overlay's (sm12x-overlay-*, sm12x-native-*) is locked and marked while in use."""
    tmp = world / "tmp"
    cache = str(pinned_source.root.parents[2])
    proc = _paused(world, ["overlay", "-q", "--out", str(world / "ov")], "scratch-folder", SM12X_BUNDLE_CACHE=cache)
    (scratch,) = tmp.iterdir()
    assert scratch.name.startswith(".sm12x-overlay.tmp-") and fsutil.is_ours(scratch)
    proc.send_signal(how)
    assert proc.wait(timeout=60) == code
    if how == signal.SIGTERM:
        assert list(tmp.iterdir()) == [] and "terminated" in (proc.stderr.read() if proc.stderr else "")
        return
    assert list(tmp.iterdir()) == [scratch]
    assert fsutil.remove_dead_temps("sm12x-overlay-") == [scratch] and list(tmp.iterdir()) == []


SCRATCH = {  # the commands that cannot run here (a GPU): their work folders, entered alone
    "engine-check": ("sm12x_bundle.enginecheck.runner", "workdir", ".sm12x-engine-check.tmp-"),
    "selftest": ("sm12x_bundle.selftest", "_workdir", ".sm12x-selftest.tmp-"),
}


@pytest.mark.parametrize("command", sorted(SCRATCH))
def test_a_killed_runs_work_folder_is_removed_by_the_next_run(world, command):
    """engine-check's and selftest's own work folder (no --work): a scratch folder like overlay's."""
    module, function, name = SCRATCH[command]
    flag, tmp = world / "paused", world / "tmp"
    # Killed inside the block: at temp_folder's own point, or at the block's for any other folder.
    code = f"from sm12x_bundle.fsutil import pause\nfrom {module} import {function}\n" \
           f"with {function}(None): pause('scratch-folder')\n"
    env = _env(world, SM12X_TEST_PAUSE_AT="scratch-folder", SM12X_TEST_PAUSE_FILE=str(flag))
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    (dead,) = tmp.iterdir()
    mod = __import__(module, fromlist=[function])
    with getattr(mod, function)(None) as work:
        assert list(tmp.iterdir()) == [Path(work)], f"{dead.name} is left"
    assert list(tmp.iterdir()) == []
    assert dead.name.startswith(name) and Path(work).name.startswith(name)


# --- 5. every input or machine fault has its class's code, never 2 ---------------------------


def _config(world: Path, extra: str) -> str:
    path = world / "home" / "work" / "c.yaml"
    path.write_text(SMALL.format(tree=world / "lane" / "srctree", series=world / "series" / "series") + extra)
    return str(path)


CODES = [
    ("nan-size", lambda w: ["nomad", "--config", _config(w, "jobs:\n  - {name: j, target: t, model: m, gpu_capacity_gib: .nan}\n")], 3, "must be a finite number, not nan"),
    ("inf-size", lambda w: ["nomad", "--config", _config(w, "jobs:\n  - {name: j, target: t, model: m, peer_residue_gib: -.inf}\n")], 3, "must be a finite number, not -inf"),
    ("nul-escape", lambda w: ["series", "--config", _config(w, 'output:\n  dir: "a\\0b"\n')], 3, "holds a NUL character"),
    ("lone-surrogate", lambda w: ["series", "--config", _config(w, 'output:\n  dir: "a\\ud800b"\n')], 3, "lone UTF-16 surrogate"),
    ("deep-manifest", lambda w: ["nomad", "--manifest", str(_write(w / "deep.json", "[" * 200000 + "]" * 200000)), "--out", "n"], 3, "nested too deeply"),
    ("deep-patch-path", lambda w: ["check", "--config", _deep_series(w)], 5, "1002 folders deep"),
    ("symlink-loop", lambda w: ["apply", "--config", _config(w, ""), "--out", str(_loop(w) / "x" / "out")], 11, "loop of symbolic links"),
    ("nomad-no-overlays", lambda w: ["nomad", "--out", "n"], 12, "no overlay manifest for target"),
    ("selftest-no-vllm", lambda w: ["selftest", "--installed"], 12, "no vLLM is installed"),
    ("engine-check-no-vllm", lambda w: ["engine-check", "--installed"], 12, "no vLLM is importable"),
]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _deep_series(world: Path) -> str:
    deep = "vllm/" + "/".join(["d"] * 1000) + "/f.py"
    (world / "deep").mkdir()
    _write(world / "deep" / "series", "0001-deep.patch\n")
    _write(world / "deep" / "0001-deep.patch", make_patch({deep: (None, "x = 1\n")}))
    return _write(world / "deep.yaml", SMALL.format(tree=world / "lane" / "srctree", series=world / "deep" / "series")).as_posix()


def _loop(world: Path) -> Path:
    (world / "loop1").symlink_to("loop2")
    (world / "loop2").symlink_to("loop1")
    return world / "loop1"


@pytest.mark.parametrize("make, code, phrase", [c[1:] for c in CODES], ids=[c[0] for c in CODES])
def test_each_fault_gets_its_classs_code_and_one_sentence(world, capsys, make, code, phrase):
    if "vllm" in phrase.lower() and _has_vllm():
        pytest.skip("vLLM is installed here")
    argv = make(world)
    before = record(world)
    judged(capsys, run_main([argv[0], "-q", *argv[1:]]), code, phrase)
    assert differences(before, record(world)) == []


def _has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def test_a_deleted_working_directory_is_exit_12(world):
    gone = world / "gone"
    gone.mkdir()
    script = f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); from sm12x_bundle import cli; " \
             "sys.exit(cli.main(['series', '-q']))"
    done = subprocess.run([sys.executable, "-c", script], env=_env(world), capture_output=True, text=True, timeout=120)
    assert done.returncode == 12 and "the working directory no longer exists" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("scratch", ["temp_folder", "mkdtemp"])
def test_no_usable_temp_folder_in_a_command_is_exit_12(world, capsys, monkeypatch, scratch):
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setattr(tempfile, "_candidate_tempdir_list", lambda: [str(world / "absent")])

    def series_with_scratch(ctx, args):  # a command that asks for a scratch folder, as overlay does
        if scratch == "mkdtemp":  # as other steps do, through Python's own tempfile
            tempfile.mkdtemp()
        with fsutil.temp_folder("sm12x-native-"):
            return 0

    parser = cli.build_parser()
    monkeypatch.setattr(cli, "build_parser", lambda: _with_run(parser, "series", series_with_scratch))
    judged(capsys, run_main(["series", "-q"]), 12, "no usable temp folder")


def _with_run(parser, name, run):
    sub = parser._subparsers._group_actions[0].choices[name]
    sub.set_defaults(run=run)
    return parser


def test_a_reader_that_leaves_ends_the_run_quietly_with_141(world):
    """``sm12x-bundle series | head -1``: the reader is gone before the table is written."""
    proc = subprocess.Popen([sys.executable, "-m", "sm12x_bundle", "series", "--config", "small.yaml"],
                            env=_env(world), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


# --- smaller: JUnit, terminal escapes, secrets, modes ----------------------------------------


def test_junit_holds_only_characters_xml_allows():
    conflict = Conflict("vllm/x.py", 1, 3, ("- expected\x1b[31m", "+ found\x00\x07\ud800"))
    result = PatchResult("p\x1bq", Outcome.CONFLICT, conflict=conflict)
    text = report.to_junit([VersionReport("0.21.0", "test", None, [result], lane="0.21.0")])
    parsed = ET.fromstring(text.encode("utf-8", "surrogateescape").split(b"\n", 1)[1])
    failure = parsed.find(".//failure")
    assert failure is not None and "\\x1b[31m" in (failure.text or "") and "\\x00\\x07\\ud800" in (failure.text or "")


def test_escape_sequences_from_a_patch_subject_are_shown_not_obeyed(world, capsys):
    _write(world / "series" / "0001-probe.patch",
           make_patch({"vllm/sm12x_probe.py": (None, "x = 1\n")}, subject="evil \x1b]0;owned\x07\x1b[2J title"))
    assert run_main(["series", "--config", "small.yaml"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;owned\\x07" in out


def test_an_error_never_prints_a_raw_escape(world, capsys):
    code = run_main(["series", "-q", "--config", "a\x1b[2Jb.yaml"])
    err = judged(capsys, code, 3, "a\\x1b[2Jb.yaml")
    assert "\x1b" not in err
    assert sanitize("ok\n\ttab") == "ok\n\ttab" and sanitize("\u202e\x9b") == "\\u202e\\x9b"


@pytest.mark.parametrize("content", ["root:$6$SECRETHASH:19000:0:99999:7:::\n", "SECRET_TOKEN=SECRETHASH\n",
                                     "-----BEGIN OPENSSH PRIVATE KEY-----\nSECRETHASH\n"])
def test_a_series_that_is_not_a_series_is_never_echoed(world, capsys, content):
    _write(world / "series" / "series", content)
    err = judged(capsys, run_main(["series", "-q", "--config", "small.yaml"]), 5, "not a series")
    assert "SECRET" not in err and "BEGIN" not in err


def test_overlay_folders_are_readable_whatever_the_umask(tmp_path):
    """Under umask 077 the folders the overlays write through are 0755 (a container's user reads them)."""
    into = [fsutil.Destination(tmp_path / "ov" / "t", "into", "overlay target folder")]
    spec = fsutil.FileSpec("files/a.py", b"x\n", 0o644, 0)
    old = os.umask(0o077)
    try:
        fsutil.write_versions(into, [fsutil.Version(tmp_path / "ov" / "t" / "v1", (spec,))], [])
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in (tmp_path / "ov").rglob("*") if p.is_dir()}
    assert modes == {"ov/t": 0o755, "ov/t/v1": 0o755, "ov/t/v1/files": 0o755}
    assert (tmp_path / "ov").stat().st_mode & 0o777 == 0o755


def test_build_refuses_an_output_folder_inside_the_cache_before_its_first_step(world, capsys):
    """The lane's tree is local, so only build's own check of every output knows the cache."""
    config = _config(world, f"output:\n  dir: {world / 'cache' / 'build'}\n")
    before = record(world)
    judged(capsys, run_main(["build", "-q", "--config", config]), 11, "is inside the cache folder")
    assert differences(before, record(world)) == []


def test_a_folder_replaced_inside_a_locked_scratch_folder_does_not_wait_for_itself(tmp_path):
    """A build context written inside the scratch folder that a run holds (overlay's native
    build) swaps itself in under a lock on that folder: the same process must not wait for
    its own lock (it did, forever, in the daemon tests)."""
    code = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from sm12x_bundle import fsutil\n"
        "with fsutil.temp_folder('sm12x-locktest-') as tmp:\n"
        "    with fsutil.replace_dir(Path(tmp) / 'context', False, 'build context folder') as staging:\n"
        "        (staging / 'Dockerfile').write_text('FROM scratch\\n')\n"
        "    print((Path(tmp) / 'context' / 'Dockerfile').read_text().strip())\n"
    )
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": src}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "FROM scratch"
