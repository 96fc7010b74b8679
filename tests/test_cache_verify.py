"""The cache is verified on every use, not trusted: the sdist by its sha256, the extracted
tree by the record made at extraction. A damaged copy is named on stderr, discarded and
made again from verified bytes; an unverified archive is never extracted."""

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from test_fetch import make_index

from sm12x_bundle import pipeline
from sm12x_bundle.context import Context
from sm12x_bundle.errors import FetchError
from sm12x_bundle.progress import Progress
from sm12x_bundle.source import extract, record
from sm12x_bundle.source.cache import cache_dir
from sm12x_bundle.source.pin import Pin, resolve_source


def _sdist_path(cache: Path, sha: str, version: str = "9.0.0") -> Path:
    return cache / "sdists" / sha / f"vllm-{version}.tar.gz"


def _flip_byte(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 1
    path.write_bytes(bytes(data))


def _tree(cache: Path, sha: str) -> Path:
    return cache / "trees" / sha


@pytest.fixture
def fetched(tmp_path):
    """A file:// index with a small synthetic sdist, fetched once into a fresh cache."""
    index, sha = make_index(tmp_path / "idx")
    cache = tmp_path / "cache"
    src = resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    return index, sha, cache, src


# --- the sdist ---------------------------------------------------------------------


def test_flipped_byte_in_cached_sdist_is_named_discarded_and_fetched_again(fetched, capfd):
    index, sha, cache, _ = fetched
    sdist = _sdist_path(cache, sha)
    _flip_byte(sdist)
    capfd.readouterr()
    resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    err = capfd.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith("sm12x-bundle: the cached vllm-9.0.0.tar.gz has sha256 ")
    assert f"not {sha}: discarded" in err[0]
    assert hashlib.sha256(sdist.read_bytes()).hexdigest() == sha


def test_flipped_byte_without_an_index_is_a_fetch_error_and_nothing_is_extracted(fetched, capfd):
    _, sha, cache, _ = fetched
    _flip_byte(_sdist_path(cache, sha))
    shutil.rmtree(_tree(cache, sha))
    with pytest.raises(FetchError, match="cannot read the package index") as info:
        resolve_source(Pin("9.0.0", sha), index_url=(cache / "no-index").as_uri(), cache_dir=cache)
    assert info.value.exit_code == 4
    assert "discarded" in capfd.readouterr().err
    assert not _sdist_path(cache, sha).exists()
    assert list((cache / "trees").iterdir()) == []


def test_tampered_sdist_with_its_tree_deleted_is_never_extracted(fetched, tmp_path):
    """The reported case: another archive under the real hash, the tree gone."""
    index, sha, cache, _ = fetched
    make_index(tmp_path / "evil", extra=[tarfile.TarInfo("vllm-9.0.0/evil.py")])
    shutil.copyfile(tmp_path / "evil" / "files" / "vllm-9.0.0.tar.gz", _sdist_path(cache, sha))
    shutil.rmtree(_tree(cache, sha))
    src = resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    assert not (src.root / "evil.py").exists()
    assert sorted(p.name for p in src.root.rglob("*")) == ["PKG-INFO", "__init__.py", "vllm"]


def test_extraction_refuses_bytes_that_do_not_match_the_sha256(fetched):
    """The last guard: extraction hashes the bytes it unpacks, whoever calls it."""
    _, sha, cache, _ = fetched
    _flip_byte(_sdist_path(cache, sha))
    shutil.rmtree(_tree(cache, sha))
    with pytest.raises(FetchError, match=f"no longer matches sha256 {sha}: refusing to extract"):
        extract.cached_tree(_sdist_path(cache, sha), cache)
    assert list((cache / "trees").iterdir()) == []


def test_damaged_cached_copy_of_a_local_sdist_is_replaced(tmp_path, capfd):
    sdist = tmp_path / "vllm-9.0.0.tar.gz"
    _, sha = make_index(tmp_path / "idx")
    shutil.copyfile(tmp_path / "idx" / "files" / "vllm-9.0.0.tar.gz", sdist)
    cache = tmp_path / "cache"
    resolve_source(Pin("9.0.0", sha), local=sdist, cache_dir=cache)
    _flip_byte(_sdist_path(cache, sha))
    shutil.rmtree(_tree(cache, sha))
    src = resolve_source(Pin("9.0.0", sha), local=sdist, cache_dir=cache)
    assert "discarded" in capfd.readouterr().err
    assert hashlib.sha256(_sdist_path(cache, sha).read_bytes()).hexdigest() == sha
    assert (src.root / "vllm" / "__init__.py").read_text() == "x = 1\n"


# --- the extracted tree ------------------------------------------------------------


def _append(root: Path) -> str:
    with open(root / "vllm" / "__init__.py", "a") as fh:
        fh.write("y = 2\n")
    return "vllm-9.0.0/vllm/__init__.py changed"


def _same_size_same_mtime(root: Path) -> str:
    path = root / "vllm" / "__init__.py"
    before = path.stat()
    path.write_bytes(b"x = 2\n")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    return "vllm-9.0.0/vllm/__init__.py changed"


def _add(root: Path) -> str:
    (root / "vllm" / "extra.py").write_text("")
    return "vllm-9.0.0/vllm/extra.py added"


def _remove(root: Path) -> str:
    (root / "PKG-INFO").unlink()
    return "vllm-9.0.0/PKG-INFO removed"


def _chmod(root: Path) -> str:
    (root / "vllm" / "__init__.py").chmod(0o777)
    return "vllm-9.0.0/vllm/__init__.py changed"


def _symlink(root: Path) -> str:
    (root / "vllm" / "__init__.py").unlink()
    (root / "vllm" / "__init__.py").symlink_to("../PKG-INFO")
    return "vllm-9.0.0/vllm/__init__.py changed"


EDITS = [_append, _same_size_same_mtime, _add, _remove, _chmod, _symlink]


@pytest.mark.parametrize("edit", EDITS, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("settled", [False, True], ids=["young", "settled"])
def test_edited_tree_is_named_and_extracted_again(fetched, capfd, monkeypatch, edit, settled):
    """``settled``: the tree's files are older than the record's racy window, so the
    check trusts unchanged fingerprints and only the stat (ctime) shows the edit."""
    index, sha, cache, src = fetched
    if settled:
        monkeypatch.setattr(record, "RACY_NS", 0)
        assert record.check(_tree(cache, sha), sha) == record.Verdict([], 0)  # trusted by stat alone
    what = edit(src.root)
    capfd.readouterr()
    again = resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    err = capfd.readouterr().err.splitlines()
    differs = f"differs from its record ({what})"
    assert err == [f"sm12x-bundle: the cached tree of vllm-9.0.0.tar.gz {differs}: extracting it again"]
    assert again.root == src.root
    assert (src.root / "vllm" / "__init__.py").read_text() == "x = 1\n"
    assert not (src.root / "vllm" / "__init__.py").is_symlink()
    assert sorted(p.name for p in src.root.rglob("*")) == ["PKG-INFO", "__init__.py", "vllm"]
    assert record.check(_tree(cache, sha), sha).differences == []
    assert sorted(p.name for p in (cache / "trees").iterdir()) == [sha]  # nothing set aside left


def test_tree_without_a_record_is_extracted_again(fetched, capfd):
    """A tree cached by an older version of the tool (or a lost record) is not trusted."""
    index, sha, cache, _ = fetched
    (_tree(cache, sha) / record.NAME).unlink()
    resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    assert f"({record.NAME} missing or unreadable)" in capfd.readouterr().err
    assert record.check(_tree(cache, sha), sha).differences == []


def test_young_files_are_hashed_until_they_settle(fetched, monkeypatch):
    """Right after extraction every file may share its ctime with a later edit, so each
    check hashes it; once old, it is recorded again and trusted by its fingerprint."""
    _, sha, cache, _ = fetched
    tree = _tree(cache, sha)
    files = sum(1 for p in tree.rglob("*") if p.is_file() and p.name != record.NAME)
    assert record.check(tree, sha).hashed == files
    assert record.check(tree, sha).hashed == files
    monkeypatch.setattr(record, "RACY_NS", 0)  # as if the window had passed
    assert record.check(tree, sha).hashed == 0
    assert record._load(tree, sha)[0]["settled"]  # the next check may take the fast path


def test_a_copied_cache_is_hashed_once_then_trusted(fetched, tmp_path, monkeypatch):
    """New inodes and ctimes (cp -r) are not differences: the bytes are hashed and match."""
    _, sha, cache, _ = fetched
    monkeypatch.setattr(record, "RACY_NS", 0)
    copy = tmp_path / "copy"
    shutil.copytree(cache, copy)
    assert record.check(_tree(copy, sha), sha) == record.Verdict([], 2)
    assert record.check(_tree(copy, sha), sha) == record.Verdict([], 0)


# --- two runs at once ---------------------------------------------------------------

_RACE = """
import sys, time
from pathlib import Path
from sm12x_bundle.source.pin import Pin, resolve_source
go = Path(sys.argv[3])
while not go.exists():
    time.sleep(0.001)
print(resolve_source(Pin("9.0.0", sys.argv[2]), index_url=sys.argv[1], cache_dir=Path(sys.argv[4])).root)
"""


def _big_sdist_index(root: Path, files: int = 1500) -> tuple[str, str]:
    members = []
    for i in range(files):
        info = tarfile.TarInfo(f"vllm-9.0.0/vllm/m{i // 100}/f{i}.py")
        info.size = 0
        members.append(info)
    return make_index(root, extra=members)


def test_two_processes_repairing_one_entry_leave_one_whole_entry(tmp_path):
    index, sha = _big_sdist_index(tmp_path / "idx")
    cache = tmp_path / "cache"
    src = resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    _append(src.root)
    (src.root / "vllm" / "m3" / "f300.py").unlink()
    _flip_byte(_sdist_path(cache, sha))
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RACE, index, sha, str(go), str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    time.sleep(1.0)  # both started and waiting
    go.touch()
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [code for code, _, _ in results] == [0, 0], results
    assert {out.strip() for _, out, _ in results} == {str(src.root)}
    notices = "".join(err for _, _, err in results).splitlines()
    assert sum("the cached vllm-9.0.0.tar.gz has sha256" in line for line in notices) == 1, notices
    assert sum("the cached tree of vllm-9.0.0.tar.gz differs" in line for line in notices) == 1, notices
    assert hashlib.sha256(_sdist_path(cache, sha).read_bytes()).hexdigest() == sha
    assert record.check(_tree(cache, sha), sha).differences == []
    assert (src.root / "vllm" / "__init__.py").read_text() == "x = 1\n"
    assert sorted(p.name for p in (cache / "trees").iterdir()) == [sha]
    assert list((cache / "tmp").iterdir()) == []


# --- the real pinned sdist ------------------------------------------------------------

PIN_SHA = "05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058"


def _cli(cache: Path, index: str, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    no_daemon = "unix:///nonexistent.sock"
    env = dict(os.environ, SM12X_BUNDLE_CACHE=str(cache), PIP_INDEX_URL=index, DOCKER_HOST=no_daemon)
    argv = [sys.executable, "-m", "sm12x_bundle", *argv]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.integration
def test_real_sdist_damage_is_repaired_before_apply_writes_and_verified_means_verified(
    tmp_path, request, monkeypatch, default_context
):
    """The reported steps on vLLM 0.21.0, in a copy of the cache (the shared one is never touched)."""
    real = _sdist_path(cache_dir(), PIN_SHA, "0.21.0")
    if not real.is_file():
        request.getfixturevalue("pinned_source")  # fetches it into the shared cache once
    pristine = tmp_path / "idx" / "files" / real.name
    pristine.parent.mkdir(parents=True)
    shutil.copyfile(real, pristine)
    (tmp_path / "idx" / "simple" / "vllm").mkdir(parents=True)
    page = tmp_path / "idx" / "simple" / "vllm" / "index.html"
    page.write_text(f'<a href="../../files/{real.name}">{real.name}</a>')
    index, cache = (tmp_path / "idx" / "simple").as_uri(), tmp_path / "cache"
    _sdist_path(cache, PIN_SHA, "0.21.0").parent.mkdir(parents=True)
    shutil.copyfile(real, _sdist_path(cache, PIN_SHA, "0.21.0"))
    with tarfile.open(real) as tar:
        members = {m.name for m in tar.getmembers()}
        version_py = tar.extractfile("vllm-0.21.0/vllm/version.py").read()

    fetched = _cli(cache, index, tmp_path, "fetch", "-q")
    assert fetched.returncode == 0, fetched.stderr
    root = Path(fetched.stdout.strip())
    with open(root / "vllm" / "version.py", "ab") as fh:  # echo x >> .../vllm/version.py
        fh.write(b"x\n")
    applied = _cli(cache, index, tmp_path, "apply", "--out", str(tmp_path / "out"))
    assert applied.returncode == 0, applied.stderr
    differs = "the cached tree of vllm-0.21.0.tar.gz differs from its record (vllm-0.21.0/vllm/version.py changed)"
    assert differs in applied.stderr
    assert (tmp_path / "out" / "vllm" / "version.py").read_bytes() == version_py

    _flip_byte(_sdist_path(cache, PIN_SHA, "0.21.0"), at=1_000_000)  # the tree is whole
    offline = _cli(cache, (tmp_path / "no-index").as_uri(), tmp_path, "build")
    assert offline.returncode == 4, offline.stdout + offline.stderr
    assert "sha256" in offline.stderr and "discarded" in offline.stderr
    assert "verified" not in offline.stdout + offline.stderr
    assert not (tmp_path / "build").exists()

    shutil.rmtree(_tree(cache, PIN_SHA))
    monkeypatch.setenv("PIP_INDEX_URL", index)
    one_lane = dataclasses.replace(default_context.config, lanes=default_context.config.lanes[:1])  # the index has 0.21.0
    run = pipeline.Run(Context(one_lane, Progress.quiet(), cache), tmp_path / "b", None)
    assert pipeline._pin(run).endswith(f"sha256 {PIN_SHA} verified")  # the line build prints
    assert hashlib.sha256(_sdist_path(cache, PIN_SHA, "0.21.0").read_bytes()).hexdigest() == PIN_SHA
    assert set(_record_paths(_tree(cache, PIN_SHA))) == members  # all 5,464, as in the sdist


def _record_paths(tree: Path) -> list[str]:
    return list(json.loads((tree / record.NAME).read_text().partition("\n")[2]))


@pytest.mark.parametrize(
    "damage",
    ["", "not json\n{}", '{"schema": 2, "sdist_sha256": "SHA", "walk_ns": "x", "settled": 1, "stamps": ""}\n{}'],
    ids=["empty", "garbage", "wrong-types"],
)
def test_damaged_record_means_extract_again_not_a_traceback(fetched, capfd, damage):
    index, sha, cache, _ = fetched
    (_tree(cache, sha) / record.NAME).write_text(damage.replace("SHA", sha))
    resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    assert f"({record.NAME} missing or unreadable)" in capfd.readouterr().err
    assert record.check(_tree(cache, sha), sha).differences == []


def test_garbled_entries_under_a_good_header_mean_extract_again(fetched, capfd):
    index, sha, cache, _ = fetched
    path = _tree(cache, sha) / record.NAME
    header = json.loads(path.read_text().partition("\n")[0])
    path.write_text(json.dumps(dict(header, settled=False)) + "\n[1, 2]")
    resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache)
    assert f"({record.NAME} unreadable)" in capfd.readouterr().err
    assert record.check(_tree(cache, sha), sha).differences == []


def test_quiet_runs_repair_without_a_word(fetched, capfd):
    """-q means nothing on stderr but errors; a repaired cache is not an error."""
    index, sha, cache, src = fetched
    _flip_byte(_sdist_path(cache, sha))
    _append(src.root)
    resolve_source(Pin("9.0.0", sha), index_url=index, cache_dir=cache, progress=Progress.quiet())
    assert capfd.readouterr().err == ""
    assert record.check(_tree(cache, sha), sha).differences == []
    assert hashlib.sha256(_sdist_path(cache, sha).read_bytes()).hexdigest() == sha
