"""The offline payload for the GPU machine (enginecheck/payload.py, scripts/gpu-payload).

Built here from small wheels made by the test, served from a file:// simple index, so that
the packing, the split, the manifest and the refusals of unpack run on CPU in seconds; the
pins themselves are checked against the real wheels' METADATA (integration).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from sm12x_bundle.enginecheck import payload
from sm12x_bundle.errors import FetchError, OutputError, VerifyError
from sm12x_bundle.progress import Progress
from sm12x_bundle.source import cache

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu-payload"
QUIET = Progress.quiet()


def make_wheel(folder: Path, filename: str, files: dict[str, bytes], executable: tuple[str, ...] = ()) -> Path:
    """A wheel (a zip) holding ``files``, with fixed timestamps."""
    path = folder / filename
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o100755 if name in executable else 0o100644) << 16
            zf.writestr(info, data)
    return path


def serve(index: Path, wheels: list[Path]) -> str:
    """A file:// PEP 503 index listing each wheel with its sha256; returns its URL."""
    for wheel in wheels:
        project = payload.project_name(wheel.name.split("-")[0])
        page = index / project
        page.mkdir(parents=True, exist_ok=True)
        sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
        (page / "index.html").write_text(f'<a href="{wheel.as_uri()}#sha256={sha}">{wheel.name}</a>\n')
    return index.as_uri()


VLLM = "vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl"
DEP = "tinydep-1.0-py3-none-any.whl"
NOISE = random.Random(1).randbytes(3 << 20)  # incompressible: three parts of 1 MiB and a bit


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Two small wheels shaped like the real ones, an index serving them, pins naming them."""
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(tmp_path / "cache"))
    (tmp_path / "files").mkdir()
    vllm = make_wheel(tmp_path / "files", VLLM, {
        "vllm/__init__.py": b"__version__ = '0.21.0'\n",
        "vllm/_C.abi3.so": NOISE,
        "vllm/_moe_C.abi3.so": b"moe" * 1000,
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2" * 1000,
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3" * 1000,
        "vllm/third_party/deep_gemm/__init__.py": b"",
        "vllm/third_party/deep_gemm/include/a.h": b"h" * 500,
        "vllm-0.21.0.dist-info/METADATA": b"Name: vllm\nVersion: 0.21.0\nRequires-Dist: tinydep>=1\n",
    }, executable=("vllm/_C.abi3.so",))
    dep = make_wheel(tmp_path / "files", DEP, {
        "tinydep/__init__.py": b"X = 1\n",
        "tinydep-1.0.data/purelib/tinydep_extra.py": b"Y = 2\n",
        "tinydep-1.0.data/scripts/tinydep-cli": b"#!/bin/sh\n",
        "tinydep-1.0.dist-info/METADATA": b"Name: tinydep\nVersion: 1.0\n",
    })
    index = serve(tmp_path / "index", [vllm, dep])
    pins = payload.load_pins(json.dumps(pins_doc(index, vllm, dep)), "<test pins>")
    return pins, tmp_path


def pins_doc(index: str, vllm: Path, dep: Path) -> dict:
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    return {
        "index": index,
        "vllm": {"filename": vllm.name, "sha256": sha(vllm)},
        "dependencies": [{"filename": dep.name, "sha256": sha(dep)}],
        "drop": [{"path": "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "why": "FA3 is enough"},
                 {"path": "vllm/_moe_C.abi3.so", "why": "dense"},
                 {"path": "vllm/third_party/deep_gemm/", "why": "fp8"}],
        "device_packages": ["torch"],
    }


def build(pins, tmp_path: Path, name: str = "out", part_mib: int = 1) -> payload.Built:
    return payload.build(tmp_path / name, cache.cache_dir(), part_mib=part_mib, pins=pins,
                         index=pins.index, progress=QUIET)


def test_build_slims_splits_and_unpacks_what_the_wheels_hold(fake):
    pins, tmp_path = fake
    built = build(pins, tmp_path)
    manifest = built.manifest
    assert [p["name"] for p in manifest["parts"]] == [f"vllm-0.21.0-gpu-payload.tar.xz.0{n}" for n in (1, 2, 3, 4)]
    assert all(p["size"] == 1 << 20 for p in manifest["parts"][:-1])
    assert sum(p["size"] for p in manifest["parts"]) == manifest["archive"]["size"]
    left = {x["path"]: (x["files"], x["bytes"]) for x in manifest["left_out"]}
    assert left == {"vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": (1, 3000), "vllm/_moe_C.abi3.so": (1, 3000),
                    "vllm/third_party/deep_gemm/": (2, 500), "<wheel>.data/{scripts,headers,data}/": (1, 10)}
    dest = tmp_path / "site"
    payload.unpack(built.out, dest, progress=QUIET)
    found = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert found == [".sm12x-bundle-output", "tinydep-1.0.dist-info/METADATA", "tinydep/__init__.py", "tinydep_extra.py",
                     "vllm-0.21.0.dist-info/METADATA", "vllm/_C.abi3.so", "vllm/__init__.py",
                     "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"]
    assert (dest / "vllm" / "_C.abi3.so").read_bytes() == NOISE
    assert os.access(dest / "vllm" / "_C.abi3.so", os.X_OK)
    out = subprocess.run([sys.executable, "-c", "import tinydep, tinydep_extra, vllm; print(vllm.__version__)"],
                         env={**os.environ, "PYTHONPATH": str(dest)}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0.21.0"


def test_the_same_wheels_give_the_same_bytes(fake):
    pins, tmp_path = fake
    first, second = build(pins, tmp_path, "a"), build(pins, tmp_path, "b")
    names = sorted(p.name for p in first.out.iterdir())
    assert names == sorted(p.name for p in second.out.iterdir())
    for name in names:
        assert (first.out / name).read_bytes() == (second.out / name).read_bytes(), name
    with tarfile.open(fileobj=io.BytesIO(b"".join((first.out / p["name"]).read_bytes() for p in first.manifest["parts"])),
                      mode="r:xz") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname) for m in members} == {(946684800, 0, 0, "", "")}


def test_a_part_that_differs_is_refused_and_nothing_is_unpacked(fake):
    pins, tmp_path = fake
    built = build(pins, tmp_path)
    part = built.out / built.manifest["parts"][1]["name"]
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(VerifyError, match=r"part vllm-0.21.0-gpu-payload.tar.xz.02 has .* nothing was unpacked"):
        payload.unpack(built.out, tmp_path / "site", progress=QUIET)
    assert not (tmp_path / "site").exists()


def test_a_missing_part_is_refused_and_nothing_is_unpacked(fake):
    pins, tmp_path = fake
    built = build(pins, tmp_path)
    (built.out / built.manifest["parts"][2]["name"]).unlink()
    with pytest.raises(VerifyError, match=r"part vllm-0.21.0-gpu-payload.tar.xz.03 is missing .*1 of 4 missing"):
        payload.unpack(built.out, tmp_path / "site", progress=QUIET)
    assert not (tmp_path / "site").exists()


def test_a_dest_with_files_of_its_own_is_refused_and_kept(fake):
    pins, tmp_path = fake
    built = build(pins, tmp_path)
    dest = tmp_path / "site"
    dest.mkdir()
    (dest / "mine.txt").write_text("keep")
    with pytest.raises(OutputError, match="holds files this tool did not write"):
        payload.unpack(built.out, dest, progress=QUIET)
    assert [p.name for p in dest.iterdir()] == ["mine.txt"]


def forged_payload(folder: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    """A payload folder whose manifest matches a tar.xz the test wrote (so only the archive's
    content can be wrong)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    blob = buf.getvalue()
    folder.mkdir()
    (folder / "p.tar.xz.01").write_bytes(blob)
    sha = hashlib.sha256(blob).hexdigest()
    manifest = {"format": payload.FORMAT, "name": "p", "top": "site", "archive": {"name": "p.tar.xz", "size": len(blob), "sha256": sha},
                "parts": [{"name": "p.tar.xz.01", "size": len(blob), "sha256": sha}], "content": {"files": 1, "bytes": 1}}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _entry(name: str, kind: bytes = tarfile.REGTYPE, data: bytes | None = b"x", link: str = "") -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if data is not None and kind == tarfile.REGTYPE else 0
    return info, data if kind == tarfile.REGTYPE else None


@pytest.mark.parametrize("members, says", [
    ([_entry("site", tarfile.DIRTYPE), _entry("site/../../evil")], "'..' component"),
    ([_entry("site", tarfile.DIRTYPE), _entry("site/link", tarfile.SYMTYPE, link="../../etc")], "links outside"),
    ([_entry("site", tarfile.DIRTYPE), _entry("site/link", tarfile.SYMTYPE, link="x")], "only files and folders"),
    ([_entry("other", tarfile.DIRTYPE), _entry("other/x")], "only files and folders under site/"),
])
def test_an_unsafe_archive_is_refused_and_nothing_is_unpacked(tmp_path, members, says):
    forged_payload(tmp_path / "parts", members)
    with pytest.raises(VerifyError, match=says):
        payload.unpack(tmp_path / "parts", tmp_path / "site", progress=QUIET)
    assert not (tmp_path / "site").exists()
    assert not (tmp_path / "evil").exists()


def test_a_wheel_whose_bytes_differ_from_the_pin_is_refused(fake):
    pins, tmp_path = fake
    other = make_wheel(tmp_path, DEP, {"tinydep/__init__.py": b"X = 666\n"})
    (tmp_path / "files" / DEP).write_bytes(other.read_bytes())  # the index now serves other bytes
    serve(tmp_path / "index", [tmp_path / "files" / DEP])  # ... and lists their sha256
    with pytest.raises(FetchError, match=f"the index lists sha256 .* for {DEP}, but .* pins"):
        build(pins, tmp_path)
    assert not (tmp_path / "out").exists()


def test_a_drop_that_matches_nothing_is_refused(fake):
    pins, tmp_path = fake
    doc = pins_doc(pins.index, tmp_path / "files" / VLLM, tmp_path / "files" / DEP)
    doc["drop"].append({"path": "vllm/_no_such_C.abi3.so", "why": "typo"})
    with pytest.raises(Exception, match="drop 'vllm/_no_such_C.abi3.so' matches nothing"):
        build(payload.load_pins(json.dumps(doc)), tmp_path)


def run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "-q", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=False)


def test_the_script_says_one_sentence_and_exits_9_on_a_bad_part(fake):
    pins, tmp_path = fake
    built = build(pins, tmp_path)
    (built.out / built.manifest["parts"][0]["name"]).write_bytes(b"garbage")
    proc = run_script("unpack", str(built.out), str(tmp_path / "site"))
    assert proc.returncode == 9
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("gpu-payload: error: part vllm-0.21.0-gpu-payload.tar.xz.01 has 7 bytes")


def test_unpack_imports_nothing_outside_the_standard_library(fake):
    """The GPU machine runs unpack; it must need no package beyond Python itself."""
    pins, tmp_path = fake
    built = build(pins, tmp_path)
    code = (
        "import sys, runpy\n"
        "before = set(sys.modules)\n"
        f"sys.argv = ['gpu-payload', '-q', 'unpack', {str(built.out)!r}, {str(tmp_path / 'site')!r}]\n"
        f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "tops = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "print(sorted(t for t in tops if t not in sys.stdlib_module_names and t != 'sm12x_bundle'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "site" / "vllm" / "__init__.py").is_file()


def test_shipped_pins_name_vllm_0_21_0_and_the_40_wheels_its_engine_and_server_miss():
    pins = payload.load_pins()
    assert pins.vllm.filename == "vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl"
    assert len(pins.dependencies) == 40  # 26 for the offline LLM(...) path, 14 more for `vllm serve`
    assert {w.project for w in pins.dependencies}.isdisjoint(pins.device_packages)
    assert {"torch", "triton", "transformers", "numpy", "psutil"} <= pins.device_packages
    assert [d.path for d in pins.drops] == ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/_moe_C.abi3.so",
                                            "vllm/third_party/deep_gemm/"]


@pytest.mark.integration
def test_every_requirement_of_the_pinned_wheels_is_met_or_has_a_reason():
    """Each Requires-Dist that applies on the GPU machine is a payload wheel, a package the
    machine holds, or a reason in left_out; and every reason there is for a requirement
    that needs one (none is stale)."""
    pins = payload.load_pins()
    wheels = {w.filename: payload.fetch_wheel(cache.cache_dir(), w, pins.index, QUIET) for w in pins.wheels}
    requirements = {name: payload.requires_dist(path) for name, path in wheels.items()}
    assert payload.unmet_requirements(pins, requirements) == []
    bare = payload.Pins(pins.index, pins.vllm, pins.dependencies, pins.drops, pins.device_packages)
    needing = {payload.project_name(Requirement(u.requirement).name) for u in payload.unmet_requirements(bare, requirements)}
    assert needing == set(pins.left_out) | set(pins.overridden)


def test_check_reports_a_requirement_the_machine_does_not_meet(tmp_path):
    site = tmp_path / "site"
    (site / "tinydep-1.0.dist-info").mkdir(parents=True)
    (site / "tinydep-1.0.dist-info" / "METADATA").write_text(
        "Name: tinydep\nVersion: 1.0\nRequires-Dist: pytest>=1\nRequires-Dist: no-such-package-anywhere>=1\n"
        "Requires-Dist: pytest<1; python_version < '3'\n")
    pins = payload.load_pins()
    unmet = payload.unmet_requirements(pins, payload.site_requirements(site), payload.installed_versions(site))
    assert [str(u) for u in unmet] == ["tinydep-1.0.dist-info: no-such-package-anywhere>=1: not installed here"]


# --- the lanes' trees -----------------------------------------------------------------------


@pytest.mark.integration
def test_the_trees_hold_what_apply_writes_cut_to_what_the_checks_read(pinned_source, patched_tree, series):
    from sm12x_bundle.enginecheck import trees

    entries, changed = trees.lane_entries("0.21.0", pinned_source, series)
    by_label: dict[str, dict[str, payload.Entry]] = {"pristine": {}, "patched": {}}
    for entry in entries:
        version, label, rel = entry.path.split("/", 2)
        assert version == "0.21.0"
        by_label[label][rel] = entry
    expected = sorted(p.relative_to(patched_tree).as_posix() for p in patched_tree.rglob("*")
                      if p.is_file() and (p.relative_to(patched_tree).as_posix().startswith("vllm/")))
    assert sorted(r for r in by_label["patched"] if r.startswith("vllm/")) == expected
    assert set(by_label["patched"]) - set(expected) == {
        "PKG-INFO", "csrc/cumem_allocator.cpp", "csrc/cumem_allocator_compat.h", "tests/__init__.py",
        "tests/basic_correctness/__init__.py", "tests/basic_correctness/test_cumem.py"}
    for rel, entry in by_label["patched"].items():
        with entry.open({}) as fh:
            assert fh.read() == (patched_tree / rel).read_bytes(), rel
    for rel, entry in by_label["pristine"].items():
        assert entry.source == pinned_source.root / rel
    assert set(changed) == set(series.paths)  # every file the series touches, csrc/ included
    assert "vllm/device_allocator/cumem.py" in changed and "csrc/cumem_allocator.cpp" in changed
