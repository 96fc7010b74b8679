import hashlib
import io
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from sm12x_bundle.errors import FetchError
from sm12x_bundle.progress import Progress
from sm12x_bundle.source import fetch
from sm12x_bundle.source.index import find_sdist
from sm12x_bundle.source.pin import Pin, resolve_source


def make_sdist(path: Path, version: str = "9.0.0", extra=()) -> str:
    top = f"vllm-{version}"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in [(f"{top}/PKG-INFO", f"Version: {version}\n".encode()), (f"{top}/vllm/__init__.py", b"x = 1\n")]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"") if info.isfile() else None)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_index(root: Path, version: str = "9.0.0", listed_sha: str | None = None, extra=()) -> tuple[str, str]:
    files = root / "files"
    files.mkdir(parents=True, exist_ok=True)
    sha = make_sdist(files / f"vllm-{version}.tar.gz", version, extra)
    page = root / "simple" / "vllm"
    page.mkdir(parents=True, exist_ok=True)
    (page / "index.html").write_text(
        f'<html><body><a href="../../files/vllm-{version}.tar.gz#sha256={listed_sha or sha}">vllm-{version}.tar.gz</a></body></html>'
    )
    return (root / "simple").as_uri(), sha


def leftovers(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if ".tmp" in p.name or p.name.startswith("tmp") and p.is_file())


def test_download_verify_extract_and_reuse(tmp_path):
    index, sha = make_index(tmp_path / "idx")
    cache = tmp_path / "cache"
    src = resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    assert src.version == "9.0.0" and src.sha256 == sha
    assert (src.root / "vllm" / "__init__.py").read_text() == "x = 1\n"
    (tmp_path / "idx" / "files" / "vllm-9.0.0.tar.gz").unlink()  # cached: no second download
    assert resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache).root == src.root


def test_index_lookup_reads_html_links(tmp_path):
    index, sha = make_index(tmp_path / "idx")
    url, listed = find_sdist(index, "vllm-9.0.0.tar.gz")
    assert listed == sha and url.endswith("/files/vllm-9.0.0.tar.gz")
    with pytest.raises(FetchError, match="vllm-9.9.9.tar.gz is not listed"):
        find_sdist(index, "vllm-9.9.9.tar.gz")


def test_tampered_download_leaves_nothing(tmp_path):
    index, sha = make_index(tmp_path / "idx")
    tampered = tmp_path / "idx" / "files" / "vllm-9.0.0.tar.gz"
    tampered.write_bytes(tampered.read_bytes() + b"\0")
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match=f"sha256 mismatch for vllm-9.0.0.tar.gz.*expected {sha}"):
        resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    assert not (cache / "sdists").exists() or not any((cache / "sdists").rglob("*.tar.gz"))
    assert not (cache / "trees").exists()
    assert list((cache / "tmp").iterdir()) == []


def test_index_hash_disagreeing_with_pin_is_refused_before_download(tmp_path):
    index, sha = make_index(tmp_path / "idx", listed_sha="0" * 64)
    with pytest.raises(FetchError, match="the index lists sha256 0{64}.*refusing to download"):
        resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "sdists").exists()


def test_unknown_release_uses_index_hash(tmp_path):
    index, sha = make_index(tmp_path / "idx")
    src = resolve_source(Pin("9.0.0", None), index_url=index, cache_dir=tmp_path / "cache")
    assert src.sha256 == sha


def _member(name, kind=tarfile.REGTYPE, link=""):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info


@pytest.mark.parametrize(
    "member, reason",
    [
        (_member("/etc/evil"), "absolute path"),
        (_member("vllm-9.0.0/../evil"), "'..' component"),
        (_member("vllm-9.0.0/link", tarfile.SYMTYPE, "../../etc/passwd"), "links outside the tree"),
        (_member("vllm-9.0.0/abs", tarfile.SYMTYPE, "/etc/passwd"), "absolute path /etc/passwd"),
        (_member("vllm-9.0.0/hard", tarfile.LNKTYPE, "../x"), "links outside the tree"),
        (_member("vllm-9.0.0/dev", tarfile.CHRTYPE), "not a regular file"),
    ],
)
def test_hostile_sdist_members_are_refused(tmp_path, member, reason):
    index, sha = make_index(tmp_path / "idx", extra=[member])
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match=reason):
        resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    assert not any((cache / "trees").iterdir())


def test_concurrent_runs_share_one_download(tmp_path, monkeypatch):
    index, sha = make_index(tmp_path / "idx")
    cache = tmp_path / "cache"
    calls = []
    real = fetch._stream
    monkeypatch.setattr(fetch, "_stream", lambda *a, **k: calls.append(1) or real(*a, **k))
    roots, errors = [], []

    def worker():
        try:
            roots.append(resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache).root)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(roots)) == 1 and len(calls) == 1
    assert len(list((cache / "trees").iterdir())) == 1


def test_local_sdist_is_verified_against_the_pin(tmp_path):
    sdist = tmp_path / "vllm-9.0.0.tar.gz"
    sha = make_sdist(sdist)
    src = resolve_source(Pin("9.0.0", sha), local=sdist, cache_dir=tmp_path / "cache")
    assert src.version == "9.0.0" and (src.root / "vllm").is_dir()
    with pytest.raises(FetchError, match="sha256 mismatch"):
        resolve_source(Pin("9.0.0", "1" * 64), local=sdist, cache_dir=tmp_path / "cache2")


SRC = Path(__file__).resolve().parents[1] / "src"
FETCH = "import sys; from pathlib import Path; from sm12x_bundle.source.pin import Pin, resolve_source; " \
        "a = sys.argv[1:]; resolve_source(Pin('9.0.0', a[0]), index_url=a[1] or None, " \
        "local=Path(a[2]) if a[2] else None, cache_dir=Path(a[3]))"


def _fetch(args: list[str], **pause: str) -> subprocess.Popen:
    """resolve_source in a child process (the pause hook, fsutil.pause, needs one to kill)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SM12X_TEST_PAUSE")}
    env.update(PYTHONPATH=str(SRC), **pause)
    return subprocess.Popen([sys.executable, "-c", FETCH, *args], env=env, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("point", ["cache-downloading", "cache-storing"])
def test_a_fetch_killed_midway_leaves_a_partial_file_the_next_fetch_removes(tmp_path, point):
    index, sha = make_index(tmp_path / "idx")
    sdist, cache, flag = tmp_path / "idx" / "files" / "vllm-9.0.0.tar.gz", tmp_path / "cache", tmp_path / "paused"
    args = [sha, index, "", str(cache)] if point == "cache-downloading" else [sha, "", str(sdist), str(cache)]
    proc = _fetch(args, SM12X_TEST_PAUSE_AT=point, SM12X_TEST_PAUSE_FILE=str(flag))
    deadline = time.monotonic() + 60
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert flag.exists(), proc.stderr.read() if proc.stderr else ""
    proc.kill()
    proc.wait()
    partial = [p for p in cache.rglob("*") if p.is_file() and p.parent.name != "locks"]
    assert len(partial) == 1 and partial[0].name.startswith(sha + ".") != partial[0].name.endswith(".tmp"), partial
    others = ["keep.txt", "f" * 64 + ".vllm-9.0.0.tar.gz.abcd1234"]  # not ours, or another entry's (its lock)
    for name in others:
        (cache / "tmp").mkdir(exist_ok=True)
        (cache / "tmp" / name).write_text("x\n")
    done = _fetch([sha, index, "", str(cache)])  # from the index either way (a new store would overwrite its .tmp)
    assert done.wait(timeout=120) == 0, done.stderr.read() if done.stderr else ""
    assert sorted(p.name for p in (cache / "tmp").iterdir()) == sorted(others)
    assert [p.name for p in (cache / "sdists" / sha).iterdir()] == ["vllm-9.0.0.tar.gz"]


def test_local_tree_must_be_vllm(tmp_path):
    with pytest.raises(FetchError, match="has no vllm/__init__.py"):
        resolve_source(Pin("9.0.0"), local=tmp_path, cache_dir=tmp_path / "c")
    with pytest.raises(FetchError, match="does not exist"):
        resolve_source(Pin("9.0.0"), local=tmp_path / "nope", cache_dir=tmp_path / "c")


def test_bad_pins_are_refused():
    with pytest.raises(FetchError, match="not a vLLM version"):
        Pin("latest")
    with pytest.raises(FetchError, match="not 64 hex digits"):
        Pin("0.21.0", "abc")


def test_progress_reports_in_tenths(tmp_path):
    buf = io.StringIO()
    task = Progress(buf).task("downloading x", 1000)
    for _ in range(10):
        task.advance(100)
    task.done()
    lines = buf.getvalue().splitlines()
    assert lines[0] == "downloading x: 10% (100 of 1000)" and lines[-1] == "downloading x: done (1000 of 1000)"
    assert len(lines) == 11
