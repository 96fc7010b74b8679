"""The machine, not the input and not the tool: every case gets one sentence and its own
exit code, and nothing of the machine's is touched.

* A file the tool writes (``check --junit``, ``selftest --json-out``, a Nomad spec,
  ``current.json``) goes only to a new path or over a regular file: a device (/dev/null,
  /dev/full), a FIFO, a socket, a folder, or a link to one, is refused (exit 2 for an option,
  while parsing; 11 otherwise) and left as it was, even as root.
* ``--force`` never moves a mount point, a folder that holds one, ``/`` or a system folder
  (exit 11); a replace the file system refuses puts the old folder back and leaves no
  ``.<name>.old-*`` or ``.<name>.new-*``.
* A path this machine will not let the tool write (read-only, full, /proc, /sys, a cache that
  is a file) and a missing compiler or header are exit 12, one sentence naming the path (or
  the tool) and the system's own words, before anything is fetched or written where that
  can be known first.

Real parts: FIFOs from os.mkfifo, sockets bound on an AF_UNIX path, the machine's own
/dev/null and /dev/full, tmpfs and read-only bind mounts (as root; skipped otherwise). No
test writes into /proc or /sys or replaces a device: the point is the refusal.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import shutil
import socket
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from sm12x_bundle import cli, fsutil, native
from sm12x_bundle.checks import report as checks_report
from sm12x_bundle.errors import EnvironmentProblem, OutputError, environment_problem
from sm12x_bundle.outputs import native_build

ROOT = os.geteuid() == 0
# The embedded default's first target and the machine's own devices.
TARGET = "vllm-openai-v0.21.0"
DEVICES = ("/dev/null", "/dev/full")
MANIFEST = Path(__file__).resolve().parents[1] / "nomad" / "example-manifest.json"


def run_main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors, as a console script sees them
        return int(exc.code)


def one_sentence(capsys, code: int, expected: int, *fragments: str) -> str:
    err = capsys.readouterr().err
    assert code == expected, (code, err)
    assert "Traceback" not in err and "a bug" not in err, err
    lines = [line for line in err.splitlines() if not line.startswith(("usage:", " "))]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    return err


def identity(path: str | Path) -> tuple[int, int, int, int]:
    """What a node is (kind and permissions, device number, inode, size), without opening it."""
    st = os.lstat(path)
    return st.st_mode, st.st_rdev, st.st_ino, st.st_size


def entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    """An empty working folder, a home and an empty cache of the test's own, no Docker daemon."""
    cwd = tmp_path / "work"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-daemon.sock")
    return cwd


OFFLINE = """\
pin:
  version: '0.21.0'
  index_url: {index}
targets:
  - name: vllm-openai-v0.21.0
    image: vllm/vllm-openai:v0.21.0
    root: /usr/local/lib/python3.12/dist-packages/vllm
    pinned: true
"""


@pytest.fixture
def offline(work) -> Path:
    """The default's first lane and target, with a pin that cannot be fetched: getting as far
    as a download exits 4, so any other code proves the refusal came first."""
    cfg = work / "offline.yaml"
    cfg.write_text(OFFLINE.format(index=(work / "no-index").as_uri()))
    return cfg


# --- real special files ----------------------------------------------------------------


@pytest.fixture
def specials(tmp_path) -> dict[str, Path]:
    """A FIFO, a bound socket, and links to them and to /dev/null."""
    folder = tmp_path / "specials"
    folder.mkdir()
    os.mkfifo(folder / "fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "sock"))
    (folder / "to-null").symlink_to("/dev/null")
    (folder / "to-fifo").symlink_to(folder / "fifo")
    yield {p.name: p for p in folder.iterdir()}
    sock.close()


REPORT_OPTIONS = [["check", "--junit"], ["selftest", "--installed", "--json-out"]]


@pytest.mark.parametrize("option", REPORT_OPTIONS, ids=["check-junit", "selftest-json-out"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_report_option_never_names_a_device(work, offline, capsys, option, device):
    before = identity(device)
    code = run_main([option[0], "-q", "--config", str(offline), *option[1:], device])
    one_sentence(capsys, code, 2, f"'{device}' is a character device, not a regular file")
    assert identity(device) == before


@pytest.mark.parametrize("option", REPORT_OPTIONS, ids=["check-junit", "selftest-json-out"])
@pytest.mark.parametrize("name, kind", [("fifo", "is a FIFO"), ("sock", "is a socket"),
                                        ("to-null", "is a link to a character device (/dev/null)"),
                                        ("to-fifo", "is a link to a FIFO")])
def test_a_report_option_never_names_a_fifo_a_socket_or_a_link_to_one(work, offline, capsys, specials, option, name, kind):
    before = {n: identity(p) for n, p in specials.items()}
    code = run_main([option[0], "-q", "--config", str(offline), *option[1:], str(specials[name])])
    one_sentence(capsys, code, 2, kind, "not a regular file")
    assert {n: identity(p) for n, p in specials.items()} == before


@pytest.mark.parametrize("name", ["fifo", "sock", "to-null", "to-fifo"])
def test_write_file_refuses_what_is_not_a_regular_file(specials, name):
    """The library's own check, for callers that never went through argparse."""
    before = identity(specials[name])
    with pytest.raises(OutputError, match="not a regular file: refused"):
        fsutil.write_file(specials[name], b"report\n")
    assert identity(specials[name]) == before and stat.S_ISLNK(before[0]) == name.startswith("to-")


@pytest.mark.parametrize("device", DEVICES)
def test_write_file_never_replaces_a_device_even_as_root(device):
    before = identity(device)
    with pytest.raises(OutputError, match=f"the file {device} is a character device"):
        fsutil.write_file(Path(device), b"report\n")
    assert identity(device) == before


def test_write_file_still_writes_a_new_file_and_over_a_regular_one(tmp_path):
    path = tmp_path / "r.xml"
    assert fsutil.write_file(path, b"one\n") and path.read_bytes() == b"one\n"
    assert fsutil.write_file(path, b"two\n") and path.read_bytes() == b"two\n"


def test_nomad_never_writes_over_a_fifo_even_with_force(work, capsys):
    spec = ["nomad", "-q", "--manifest", str(MANIFEST), "--out", "specs"]
    assert run_main(spec) == 0
    hcl = next((work / "specs").glob("*.nomad.hcl"))
    hcl.unlink()
    os.mkfifo(hcl)
    before = identity(hcl)
    one_sentence(capsys, run_main([*spec, "--force"]), 11, f"{hcl.name} is a FIFO", "refused")
    assert identity(hcl) == before


def test_overlay_never_writes_current_json_over_a_fifo_even_with_force(work, offline, capsys):
    """Refused before anything is fetched (the offline pin would exit 4)."""
    (work / "ov" / TARGET).mkdir(parents=True)
    os.mkfifo(work / "ov" / TARGET / "current.json")
    before = identity(work / "ov" / TARGET / "current.json")
    code = run_main(["overlay", "-q", "--config", str(offline), "--out", "ov", "--force"])
    one_sentence(capsys, code, 11, "current.json is a FIFO")
    assert identity(work / "ov" / TARGET / "current.json") == before
    assert entries(work / "ov" / TARGET) == ["current.json"]


# --- /, system folders and mount points, even with --force -----------------------------

SYSTEM = ["/etc", "/usr", "/usr/lib", "/usr/local", "/var", "/boot", "/proc", "/sys", "/dev", "/bin", "/sbin",
          "/lib", "/lib64", "/opt", "/srv", "/home", "/root", "/run", "/tmp", "/mnt", "/media"]


@pytest.mark.parametrize("folder", SYSTEM)
def test_force_never_replaces_a_system_folder(work, offline, capsys, folder):
    top = entries(Path("/"))
    code = run_main(["apply", "-q", "--config", str(offline), "--out", folder, "--force"])
    one_sentence(capsys, code, 11, f"'{folder}' is ", "refused, even with --force")
    assert entries(Path("/")) == top  # no /.proc.old-* or the like


@pytest.mark.parametrize("argv", [["overlay", "--out", "/etc", "--force"], ["nomad", "--manifest", str(MANIFEST),
                                  "--out", "/etc", "--force"], ["build", "--force"]], ids=["overlay", "nomad", "build"])
def test_every_output_refuses_a_system_folder(work, offline, capsys, argv):
    offline.write_text(offline.read_text() + "output:\n  dir: /etc\n")  # what build writes into
    config = [] if argv[0] == "nomad" else ["--config", str(offline)]  # nomad: the default's jobs
    one_sentence(capsys, run_main([argv[0], "-q", *config, *argv[1:]]), 11, "'/etc' is a system folder")


def _mount(*argv: str) -> None:
    if not ROOT:
        pytest.skip("mounting needs root")
    proc = subprocess.run(["mount", *argv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount here: {proc.stderr.strip()}")


@contextlib.contextmanager
def mounted(target: Path, *argv: str) -> Iterator[Path]:
    """``mount ARGV TARGET`` for the duration of the block (root only; skipped otherwise)."""
    target.mkdir(parents=True, exist_ok=True)
    _mount(*argv, str(target))
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=False)
        if os.path.ismount(target):
            subprocess.run(["umount", "-l", str(target)], check=False)


def tmpfs(target: Path, size: str = "64k") -> contextlib.AbstractContextManager[Path]:
    return mounted(target, "-t", "tmpfs", "-o", f"size={size}", "tmpfs")


def read_only(source: Path, target: Path) -> contextlib.AbstractContextManager[Path]:
    """``source`` seen read-only at ``target`` (a bind mount: the same device as its parent)."""
    source.mkdir(parents=True, exist_ok=True)
    return mounted(target, "--bind", "-o", "ro", str(source))


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["plain", "force"])
def test_a_mount_point_is_never_moved(work, offline, capsys, force):
    with tmpfs(work / "m") as m:
        (m / fsutil.MARKER).write_bytes(fsutil.MARKER_TEXT)  # even one marked as ours
        code = run_main(["apply", "-q", "--config", str(offline), "--out", "m", *force])
        one_sentence(capsys, code, 11, "m is a mount point", "even with --force")
        assert os.path.ismount(m) and entries(m) == [fsutil.MARKER]
        assert entries(work) == ["m", "offline.yaml"]  # no .m.old-* or .m.new-*


def test_a_bind_mount_on_the_same_device_is_a_mount_point_too(work, offline, capsys):
    """os.path.ismount cannot see it (same st_dev as its parent); the mount table does."""
    (work / "src").mkdir()
    with mounted(work / "b", "--bind", str(work / "src")) as b:
        assert not os.path.ismount(b) and fsutil.is_mount_point(b)
        code = run_main(["apply", "-q", "--config", str(offline), "--out", "b", "--force"])
        one_sentence(capsys, code, 11, "b is a mount point")


def test_force_never_moves_a_folder_that_holds_a_mount_point(work, offline, capsys):
    with tmpfs(work / "outer" / "data") as data:
        (data / "models.bin").write_bytes(b"weights")
        code = run_main(["apply", "-q", "--config", str(offline), "--out", "outer", "--force"])
        one_sentence(capsys, code, 11, "outer holds a mount point", str(data))
        assert (data / "models.bin").read_bytes() == b"weights"
        assert entries(work) == ["offline.yaml", "outer"]


def test_a_busy_rename_leaves_nothing_behind(tmp_path):
    """A real EBUSY (renaming a mount point), straight at the swap: no .<name>.old-* stays."""
    staging = tmp_path / "staging"
    staging.mkdir()
    with tmpfs(tmp_path / "busy") as busy:
        with pytest.raises(OSError) as caught:
            fsutil._swap_locked(staging, busy)
        assert caught.value.errno == errno.EBUSY
        assert os.path.ismount(busy) and entries(tmp_path) == ["busy", "staging"]


def test_a_failed_second_rename_puts_the_old_folder_back(tmp_path, monkeypatch):
    """The second rename cannot be made to fail for real once the first worked, so it fails
    here by hand (EXDEV): the previous content must be back, and no staging folder left."""
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "previous.txt").write_text("previous\n")
    fsutil.mark(dest)
    real_replace = os.replace

    def replace(a, b):
        if Path(b) == dest and ".out.new-" in str(a):  # the staging folder taking dest's place
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(a), None, str(b))
        real_replace(a, b)

    monkeypatch.setattr(fsutil.os, "replace", replace)
    refused = pytest.raises(EnvironmentProblem, match="cannot write the output folder .*out.*: Invalid cross-device link")
    with refused, fsutil.replace_dir(dest) as staging:
        (staging / "new.txt").write_text("new\n")
    assert (dest / "previous.txt").read_text() == "previous\n" and not (dest / "new.txt").exists()
    assert entries(tmp_path) == ["out"]


# --- read-only, full and kernel file systems: exit 12 ---------------------------------


@pytest.fixture
def real_cache(monkeypatch, pinned_source) -> Path:
    """The machine's sdist cache (the pinned 0.21.0 tree is in it)."""
    cache = pinned_source.root.parents[2]
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(cache))
    return cache


@pytest.mark.integration
def test_apply_into_a_read_only_folder_is_exit_12_and_leaves_the_tree_as_it_was(work, real_cache, capsys):
    (work / "src" / "tree").mkdir(parents=True)
    fsutil.mark(work / "src" / "tree")  # a previous output of ours, that this run may replace
    (work / "src" / "tree" / "old.txt").write_text("old\n")
    with read_only(work / "src", work / "ro") as ro:
        for out in ("ro/tree", "ro/new/tree"):
            code = run_main(["apply", "-q", "--out", out])
            one_sentence(capsys, code, 12, "Read-only file system", f"the output folder {out}")
        assert entries(ro) == ["tree"] and entries(ro / "tree") == [fsutil.MARKER, "old.txt"]


@pytest.mark.integration
def test_apply_onto_a_full_disk_is_one_sentence_and_leaves_nothing(work, real_cache, capsys):
    with tmpfs(work / "full", "1m") as full:
        code = run_main(["apply", "-q", "--out", "full/tree"])
        err = one_sentence(capsys, code, 12, "cannot write the output folder full/tree", "No space left on device")
        assert "full/tree/" in err and ".tree.new-" not in err  # named where it would be, not where it was staged
        assert entries(full) == []


def test_a_full_copy_of_many_files_is_one_sentence_with_a_count(tmp_path):
    """shutil.copytree reports every file that failed (thousands on a full disk): the
    sentence names the first and counts the rest."""
    src = tmp_path / "src"
    src.mkdir()
    for n in range(40):
        (src / f"f{n:02}.bin").write_bytes(os.urandom(16 * 1024))
    with tmpfs(tmp_path / "full", "128k") as full:
        with pytest.raises(shutil.Error) as caught:
            shutil.copytree(src, full / "copy")
        text = str(environment_problem(caught.value, "write the copy"))
    assert text.startswith("cannot write the copy: No space left on device (at ") and "more)" in text
    assert len(text) < 300 and "\n" not in text


@pytest.mark.parametrize("out", ["/proc/sm12x-bundle-test", "/sys/kernel/sm12x-bundle-test"])
def test_an_output_folder_under_proc_or_sys_is_exit_12(work, offline, capsys, out):
    code = run_main(["apply", "-q", "--config", str(offline), "--out", out, "--force"])
    one_sentence(capsys, code, 12, f"cannot write the output folder {out}", "file system")
    assert not os.path.lexists(out)


@pytest.mark.parametrize("report", ["/proc/version", "/proc/sm12x-bundle.xml", "/sys/kernel/sm12x-bundle.xml"])
def test_a_report_under_proc_or_sys_is_exit_12_before_anything_runs(work, offline, capsys, report):
    before = Path("/proc/version").read_bytes()
    code = run_main(["check", "-q", "--config", str(offline), "--junit", report])
    one_sentence(capsys, code, 12, f"cannot write the report {report}", "kernel's")
    assert Path("/proc/version").read_bytes() == before
    assert report == "/proc/version" or not os.path.lexists(report)


def test_a_report_in_a_read_only_folder_is_exit_12_before_anything_runs(work, offline, capsys):
    with read_only(work / "src", work / "ro"):
        code = run_main(["check", "-q", "--config", str(offline), "--junit", "ro/check.xml"])
        one_sentence(capsys, code, 12, "cannot write the report ro/check.xml", "read-only file system")


# --- the cache ---------------------------------------------------------------------------


def test_a_cache_path_that_is_a_file_is_exit_12(work, offline, capsys, monkeypatch):
    (work / "cache-file").write_text("not a folder\n")
    for cache in ("cache-file", "cache-file/sub"):
        monkeypatch.setenv("SM12X_BUNDLE_CACHE", cache)
        code = run_main(["fetch", "-q", "--config", str(offline)])
        one_sentence(capsys, code, 12, f"cannot use the cache folder {cache}", "is a file, not a folder",
                     "SM12X_BUNDLE_CACHE")
    assert (work / "cache-file").read_text() == "not a folder\n"


def test_a_read_only_cache_is_exit_12(work, offline, capsys, monkeypatch):
    with read_only(work / "src", work / "ro"):
        monkeypatch.setenv("SM12X_BUNDLE_CACHE", "ro/cache")
        code = run_main(["fetch", "-q", "--config", str(offline)])
        one_sentence(capsys, code, 12, "cannot write the cache folder ro/cache", "Read-only file system")


def test_a_cache_under_proc_is_exit_12(work, offline, capsys, monkeypatch):
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", "/proc/sm12x-bundle-cache")
    code = run_main(["fetch", "-q", "--config", str(offline)])
    one_sentence(capsys, code, 12, "cannot use the cache folder /proc/sm12x-bundle-cache", "kernel's proc")


def test_a_read_only_image_cache_is_exit_12(tmp_path):
    """What is read out of images is kept beside the sdists (plan/target.image_cache_dir)."""
    from sm12x_bundle.plan.originals import ImageCache

    with read_only(tmp_path / "src", tmp_path / "ro") as ro:
        store = ImageCache(ro / "images" / "sha256-0")
        with pytest.raises(EnvironmentProblem, match=r"cannot write the image cache file .*: Read-only file system"):
            store.save_facts(None, ["vllm/__init__.py"], {"root": "/x"})


def local_index(root: Path, payload: bytes) -> tuple[str, str]:
    """A file:// index holding one sdist whose one big member is ``payload``."""
    import hashlib

    files = root / "files"
    files.mkdir(parents=True)
    sdist = files / "vllm-9.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for name, data in [("vllm-9.0.0/PKG-INFO", b"Version: 9.0.0\n"), ("vllm-9.0.0/big.bin", payload)]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
    (root / "simple" / "vllm").mkdir(parents=True)
    (root / "simple" / "vllm" / "index.html").write_text(
        f'<a href="../../files/vllm-9.0.0.tar.gz#sha256={sha}">vllm-9.0.0.tar.gz</a>'
    )
    return (root / "simple").as_uri(), sha


@pytest.mark.parametrize("where", ["download", "extraction"])
def test_a_full_cache_is_exit_12_not_a_bad_download_or_sdist(work, capsys, monkeypatch, tmp_path, where):
    """Random bytes do not compress (the download fills the disk); zeros do (the sdist fits
    and its extraction fills it). Either way the cache is named, not the sdist."""
    payload = os.urandom(2 << 20) if where == "download" else bytes(4 << 20)
    index, sha = local_index(tmp_path / "idx", payload)
    (work / "cfg.yaml").write_text(f"pin:\n  version: '0.21.0'\n  sha256: {sha}\n  index_url: {index}\n")
    with tmpfs(work / "full", "1m"):
        monkeypatch.setenv("SM12X_BUNDLE_CACHE", "full/cache")
        code = run_main(["fetch", "-q", "--config", "cfg.yaml", "--vllm", "9.0.0"])
        one_sentence(capsys, code, 12, "cannot write the cache folder full/cache", "No space left on device")
        cache = work / "full" / "cache"
        partial = [p for p in cache.rglob("*") if p.is_file() and p.parts[len(cache.parts)] in ("tmp", "trees")]
        assert partial == [], (where, partial)  # a verified sdist may stay; no partial download or tree


# --- the compiler and the headers ------------------------------------------------------


@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry-run", "build"])
def test_build_without_cuda_h_is_exit_12_before_anything_is_fetched(work, capsys, monkeypatch, tmp_path, dry_run):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    code = run_main(["build", "-q", *dry_run])
    one_sentence(capsys, code, 12, f"there is no {tmp_path / 'no-cuda' / 'include' / 'cuda.h'}", "CUDA_HOME",
                 "no Docker daemon answers")
    assert entries(work) == [] and not (tmp_path / "cache").exists()  # nothing fetched, nothing written


def test_build_without_a_compiler_is_exit_12_naming_it(work, capsys, monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    code = run_main(["build", "-q", "--dry-run"])
    one_sentence(capsys, code, 12, "needs g++, readelf and nm on PATH", "apt-get install g++ binutils")


def test_overlay_without_cuda_h_is_exit_12_before_anything_is_fetched(work, offline, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    code = run_main(["overlay", "-q", "--config", str(offline)])
    one_sentence(capsys, code, 12, "building the cumem extension on this machine", "cuda.h")
    assert entries(work) == ["offline.yaml"]


def test_a_target_built_in_its_image_needs_no_host_toolchain(default_context, monkeypatch, tmp_path):
    """With the image in a daemon, the extension is built in a builder container from it."""

    class Daemon:
        def image_id(self, ref: str) -> str:
            return "sha256:" + "0" * 64

    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    native_build.preflight(default_context, engine=Daemon())  # nothing raised
    with pytest.raises(EnvironmentProblem, match="no Docker daemon answers"):
        native_build.preflight(default_context, engine=None)


def test_the_host_toolchain_check_names_each_missing_part(tmp_path):
    with pytest.raises(EnvironmentProblem) as caught:
        native.check_host_toolchain("a test", {"PATH": str(tmp_path), "CUDA_HOME": str(tmp_path)})
    text = str(caught.value)
    assert text.startswith("building the cumem extension on this machine (a test) needs g++, readelf and nm on PATH")
    assert f"there is no {tmp_path}/include/cuda.h" in text


# --- the last line of defence in cli.main -------------------------------------------------


@pytest.mark.parametrize("error, code, fragment", [
    (PermissionError(errno.EACCES, "Permission denied", "/some/path"), 12, "cannot use /some/path: Permission denied"),
    (OSError(errno.ENOSPC, "No space left on device"), 12, "cannot go on: No space left on device"),
    (OSError(errno.EINVAL, "Invalid argument"), 2, "a bug in sm12x-bundle: OSError"),
    (TypeError("unsupported operand"), 2, "a bug in sm12x-bundle: TypeError"),
], ids=["with-a-path", "disk-full-without-a-path", "oserror-bug", "typeerror-bug"])
def test_a_stray_oserror_is_the_machines_but_a_bug_stays_a_bug(capsys, monkeypatch, tmp_path, error, code, fragment):
    def failing(lanes):
        raise error

    monkeypatch.setattr(checks_report, "series_table", failing)  # what `series` calls
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where a bug's trace goes
    assert cli.main(["series", "-q"]) == code
    err = capsys.readouterr().err
    assert fragment in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_every_help_lists_exit_12():
    assert 12 in cli.COMMON_CODES
    for name, sub in cli.build_parser()._subparsers._group_actions[0].choices.items():
        assert "\n  12  this machine stands in the way" in sub.format_help(), name
