"""Overlays without a daemon: the plan, patching an image's own files, the manifest, atomic
writes and the in-image check, against a fake engine (images are dicts of files).

The fake engine answers the same questions a real image would (containers.py's root and
version probes, read_files) and runs the verify script on this machine's Python with
each mount's source in place of the container path, so the script itself is exercised.
The integration tests build the default target's overlay from the real vLLM 0.21.0 tree,
with no daemon, as a fresh machine does.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from tools.patchkit import make_patch, write_series

from sm12x_bundle import containers as engine_mod
from sm12x_bundle.cli import main
from sm12x_bundle.config import TargetConfig, parse
from sm12x_bundle.containers import ImageFile
from sm12x_bundle.errors import (
    ApplyError,
    ConfigError,
    EngineError,
    SeriesError,
    VerifyError,
)
from sm12x_bundle.outputs import manifest, native_build, overlay, verify
from sm12x_bundle.plan import files as plan_files
from sm12x_bundle.plan import originals as plan_originals
from sm12x_bundle.plan import target as plan_target
from sm12x_bundle.progress import Progress
from sm12x_bundle.series.lane import Lane
from sm12x_bundle.series.patch import load_series
from sm12x_bundle.source.pin import Pin
from lanekit import native_fixes  # noqa: E402

ROOT = "/usr/local/lib/python3.12/dist-packages/vllm"
OPT = "/opt/vllm/vllm"
BODY = "".join(f"value_{i} = {i}\n" for i in range(1, 41))
PIN = {"version": "0.21.0", "sha256": "0" * 64}


# --- a fake engine -------------------------------------------------------------------


@dataclass
class FakeImage:
    files: dict[str, bytes]
    python_root: str | None = None  # what the image's python3 says; None: it finds nothing
    dists: dict[str, str] = field(default_factory=dict)  # installed distributions
    modes: dict[str, int] = field(default_factory=dict)  # path -> mode (default 0644)

    def entry(self, path: str) -> ImageFile | None:
        data = self.files.get(path)
        return None if data is None else ImageFile(data, self.modes.get(path, 0o644))

    @property
    def id(self) -> str:
        """Content-addressed, as a real image id is."""
        content = [sorted((k, v.hex()) for k, v in self.files.items()), self.python_root, self.dists]
        h = hashlib.sha256(json.dumps(content).encode())
        return "sha256:" + h.hexdigest()


class FakeEngine:
    def __init__(self, images: dict[str, FakeImage], reachable: bool = True):
        self.images, self.reachable = images, reachable
        self.runs: list[list[str]] = []
        self.reads: list[list[str]] = []

    def ping(self) -> None:
        if not self.reachable:
            raise EngineError("the Docker daemon at unix:///nowhere does not answer")

    def _image(self, ref: str) -> FakeImage:
        self.ping()
        if ref not in self.images:
            raise EngineError(f"image {ref} not found in the daemon")
        return self.images[ref]

    def image_id(self, ref: str) -> str:
        return self._image(ref).id

    def image_labels(self, ref: str) -> dict[str, str]:
        return {}

    def read_files(self, ref: str, paths: list[str]) -> dict[str, bytes | None]:
        image = self._image(ref)
        self.reads.append(list(paths))
        return {p: image.files.get(p) for p in paths}

    def read_entries(self, ref: str, paths: list[str]) -> dict[str, ImageFile | None]:
        image = self._image(ref)
        self.reads.append(list(paths))
        return {p: image.entry(p) for p in paths}

    def run(self, ref, argv, *, mounts=(), env=None, network=False, timeout=600):
        image = self._image(ref)
        self.runs.append(list(argv))
        assert network is False
        if argv[:2] == ["python3", "-c"] and argv[2] == engine_mod._PROBE:
            return 0, "SM12X-PROBE " + json.dumps(self._probe(image, argv[3], json.loads(argv[4]))) + "\n"
        if argv[:2] == ["python3", "-c"] and argv[2] == verify.VERIFY_SCRIPT:
            return self._verify_here(argv[3], mounts, env)
        raise AssertionError(f"unexpected command {argv}")

    def _probe(self, image: FakeImage, root: str, wanted: list[str]) -> dict:
        """What containers.py's probe prints, from the fake image's files."""
        found = sorted(p[: -len("/__init__.py")] for p in image.files if p.endswith("/vllm/__init__.py"))
        root = root or image.python_root or (found[0] if len(found) == 1 else "")
        versions = {d: image.dists.get(d) for d in engine_mod.VERSION_KEYS}
        own = image.files.get(f"{root}/_version.py", b"").decode()
        if versions["vllm"] is None and "'" in own:
            versions["vllm"] = own.split("'")[1]
        error = None if "torch" in image.dists else "ModuleNotFoundError: No module named 'torch'"
        entries = {p: image.entry(root + p[len("vllm") :]) for p in wanted} if root else {}
        files = {p: None if e is None else base64.b64encode(e.data).decode() for p, e in entries.items()}
        modes = {p: e.mode for p, e in entries.items() if e is not None}
        return {
            "root": root, "found": found, "versions": versions, "import_error": error, "files": files,
            "modes": modes, "bytecode": {},
        }

    def _verify_here(self, spec_json: str, mounts, env):
        """Run the verify script on this machine, each mount's source standing in for its target."""
        where = {m.target: str(m.source) for m in mounts}
        assert all(m.read_only for m in mounts)
        spec = json.loads(spec_json)
        for f in spec["files"] + spec["native"]:
            f["path"] = where[f["path"]]
        spec["libdir"] = where.get(spec["libdir"], spec["libdir"])
        proc = subprocess.run(
            [sys.executable, "-c", verify.VERIFY_SCRIPT, json.dumps(spec)],
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
        )
        return proc.returncode, proc.stdout + proc.stderr


def image_with(root: str = ROOT, files: dict[str, str] | None = None, version: str = "0.21.0", **kw) -> FakeImage:
    content = {f"{root}/__init__.py": b"", f"{root}/_version.py": f"__version__ = version = '{version}'\n".encode()}
    for rel, text in (files if files is not None else {"a.py": BODY}).items():
        content[f"{root}/{rel}"] = text.encode()
    return FakeImage(content, **kw)


def series_of(tmp_path: Path, patches: dict[str, str]):
    return load_series(write_series(tmp_path / "patches", patches))


def change(old: str, new: str, path: str = "vllm/a.py", **headers) -> str:
    return make_patch({path: (BODY, BODY.replace(old, new))}, **headers)


def no_sources(version):
    raise AssertionError("no native build expected")


def lane_of(series) -> Lane:
    return Lane(PIN["version"], Pin(PIN["version"], PIN["sha256"]), series)


def build(engine, series, target: TargetConfig) -> overlay.Overlay:
    side = plan_originals.image_side(engine, target)
    plan = plan_target.plan_lane(target, lane_of(series), side, no_sources, side.image_id)
    return overlay.make_overlay(plan, Progress.quiet())


def target(image: str = "img", root: str | None = None, name: str = "t", pinned: bool = False) -> TargetConfig:
    return TargetConfig(name=name, image=image, root=root, pinned=pinned)


# --- the plan ------------------------------------------------------------------------


def test_plan_overlays_vllm_files_and_skips_the_rest(tmp_path):
    series = series_of(
        tmp_path,
        {
            "0001-a.patch": make_patch(
                {"vllm/a.py": (BODY, BODY + "x = 1\n"), "tests/test_a.py": ("", "assert True\n")}
            ),
            "0002-b.patch": make_patch({"vllm/new.py": (None, "y = 2\n")}),
        },
    )
    plan = plan_files.plan_series(series)
    assert plan.files == ("vllm/a.py", "vllm/new.py")
    assert plan.skipped == ("tests/test_a.py",)
    assert plan.native == ()


def test_plan_maps_a_native_patch_to_its_artifact(tmp_path):
    native_patch = make_patch(
        {"csrc/cumem_allocator.cpp": ("int x;\n", "int y;\n")},
        Sm12x_Kind="native",
        Sm12x_Builds="vllm/cumem_allocator.abi3.so",
    )
    plan = plan_files.plan_series(series_of(tmp_path, {"0001-n.patch": native_patch}))
    assert plan.files == ()
    [nb] = plan.native
    assert nb.artifact == "vllm/cumem_allocator.abi3.so"
    assert nb.inputs == ("csrc/cumem_allocator.cpp", "csrc/cumem_allocator_compat.h")
    assert nb.patches == ("n",)


@pytest.mark.parametrize(
    "changes, builds, message",
    [
        ({"vllm/a.py": (BODY, None)}, None, "cannot delete"),
        ({"csrc/other.cu": ("a\n", "b\n")}, "vllm/cumem_allocator.abi3.so", "is not built from"),
        ({"csrc/x.cu": ("a\n", "b\n")}, "vllm/_C.abi3.so", "cannot be built alone"),
    ],
)
def test_plan_refuses_what_an_overlay_cannot_carry(tmp_path, changes, builds, message):
    headers = {"Sm12x_Kind": "native", "Sm12x_Builds": builds} if builds else {}
    series = series_of(tmp_path, {"0001-x.patch": make_patch(changes, **headers)})
    with pytest.raises(SeriesError, match=message):
        plan_files.plan_series(series)


def test_container_paths_and_module_names():
    assert plan_files.container_path(OPT, "vllm/device_allocator/cumem.py") == f"{OPT}/device_allocator/cumem.py"
    assert plan_files.module_name(OPT, f"{OPT}/device_allocator/cumem.py") == "vllm.device_allocator.cumem"
    assert plan_files.module_name(OPT, f"{OPT}/x/__init__.py") == "vllm.x"
    assert plan_files.module_name(OPT, f"{OPT}/cumem_allocator.abi3.so") == "vllm.cumem_allocator"
    assert plan_files.normal_root("/opt/vllm/vllm/", "t") == OPT
    for bad in ("opt/vllm", "/", "/../"):
        with pytest.raises(ConfigError, match="absolute"):
            plan_files.normal_root(bad, "t")


# --- where vLLM is, and what the image carries ----------------------------------------


def test_root_from_the_target_asks_no_python(tmp_path):
    engine = FakeEngine({"img": image_with(OPT)})
    side = plan_originals.image_side(engine, target(root=OPT + "/"))
    assert side.root == OPT
    [probe] = engine.runs
    assert probe[3] == OPT  # the search is skipped


def test_root_from_the_images_python(tmp_path):
    engine = FakeEngine({"img": image_with(OPT, python_root=OPT)})
    assert plan_originals.image_side(engine, target()).root == OPT


def test_root_falls_back_to_searching_for_the_package(tmp_path):
    engine = FakeEngine({"img": image_with(ROOT, python_root=None)})
    assert plan_originals.image_side(engine, target()).root == ROOT


def test_several_vllm_packages_and_no_answer_need_a_root(tmp_path):
    image = image_with(ROOT)
    image.files.update(image_with(OPT).files)
    with pytest.raises(EngineError, match="several vLLM packages"):
        plan_originals.image_side(FakeEngine({"img": image}), target())


def test_no_vllm_in_the_image_is_a_clear_error(tmp_path):
    engine = FakeEngine({"img": FakeImage({"/usr/bin/python3": b""})})
    with pytest.raises(EngineError, match="holds no vLLM"):
        plan_originals.image_side(engine, target())


def test_a_wrong_root_is_a_clear_error(tmp_path):
    engine = FakeEngine({"img": image_with(ROOT)})
    series = series_of(tmp_path, {"0001-a.patch": change("value_3 = 3\n", "value_3 = 33\n")})
    with pytest.raises(ConfigError, match=f"no vLLM at {OPT}"):
        build(engine, series, target(root=OPT))


def test_versions_from_metadata_else_the_trees_version_file():
    dists = {"vllm": "0.21.0", "torch": "2.9.0+cu130", "flashinfer-python": "0.5.2"}
    side = plan_originals.image_side(FakeEngine({"img": image_with(python_root=ROOT, dists=dists)}), target())
    assert side.versions == {
        "vllm": "0.21.0", "torch": "2.9.0+cu130", "triton": None, "flashinfer": "0.5.2", "deep_gemm": None,
    }
    side = plan_originals.image_side(FakeEngine({"img": image_with(python_root=ROOT)}), target())
    assert side.versions["vllm"] == "0.21.0"  # from <root>/_version.py


# --- patching the image's own copy ---------------------------------------------------


def test_pre_image_is_the_images_own_file(tmp_path):
    own = BODY.replace("value_1 = 1\n", "value_1 = 'image build'\n")
    engine = FakeEngine({"img": image_with(OPT, {"a.py": own}, python_root=OPT)})
    series = series_of(tmp_path, {"0001-a.patch": change("value_20 = 20\n", "value_20 = 'patched'\n")})
    ov = build(engine, series, target())
    [f] = ov.files
    assert f.container_path == f"{OPT}/a.py"
    assert f.pre_image_sha256 == hashlib.sha256(own.encode()).hexdigest()
    # surgical: the image's own line 1 survives, the patch's line 20 lands
    assert f.data == own.replace("value_20 = 20\n", "value_20 = 'patched'\n").encode()
    assert f.patches == ("a",)
    assert ov.image_id == engine.images["img"].id


def test_skew_is_an_apply_error_naming_image_file_and_hunk(tmp_path):
    skewed = BODY.replace("value_19 = 19\n", "value_19 = 'another release'\n")
    engine = FakeEngine({"vllm:0.26": image_with(OPT, {"a.py": skewed}, python_root=OPT)})
    series = series_of(tmp_path, {"0001-a.patch": change("value_20 = 20\n", "value_20 = 'patched'\n")})
    with pytest.raises(ApplyError) as exc:
        build(engine, series, target("vllm:0.26"))
    text = str(exc.value)
    assert "image vllm:0.26" in text and f"{OPT}/a.py" in text and "hunk #1" in text
    assert "value_19 = 'another release'" in text


def test_a_patch_already_in_the_image_is_not_applied_twice(tmp_path):
    patched = BODY.replace("value_20 = 20\n", "value_20 = 'patched'\n")
    engine = FakeEngine({"img": image_with(files={"a.py": patched}, python_root=ROOT)})
    series = series_of(tmp_path, {"0001-a.patch": change("value_20 = 20\n", "value_20 = 'patched'\n")})
    assert build(engine, series, target()).files == ()


def test_new_files_have_no_pre_image_but_may_not_replace_another_file(tmp_path):
    series = series_of(tmp_path, {"0001-n.patch": make_patch({"vllm/new.py": (None, "y = 2\n")})})
    [f] = build(FakeEngine({"img": image_with(python_root=ROOT)}), series, target()).files
    assert (f.container_path, f.pre_image_sha256, f.data) == (f"{ROOT}/new.py", None, b"y = 2\n")
    clash = FakeEngine({"img": image_with(files={"new.py": "y = 'theirs'\n"}, python_root=ROOT)})
    with pytest.raises(ApplyError, match=f"{ROOT}/new.py"):
        build(clash, series, target())


def test_a_missing_file_is_an_apply_error(tmp_path):
    engine = FakeEngine({"img": image_with(files={}, python_root=ROOT)})
    series = series_of(tmp_path, {"0001-a.patch": change("value_20 = 20\n", "x\n")})
    with pytest.raises(ApplyError, match="file missing"):
        build(engine, series, target())


# --- the manifest and the content hash -----------------------------------------------


def test_manifest_follows_the_schema(tmp_path):
    series = series_of(tmp_path, {"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")})
    ov = build(FakeEngine({"img": image_with(python_root=ROOT)}), series, target())
    m = json.loads(ov.manifest_bytes())
    assert set(m) == {
        "schema", "target", "image", "image_id", "vllm_root", "versions", "pin", "series_sha256",
        "content_hash", "files", "native",
    }
    assert m["schema"] == 1 and m["vllm_root"] == ROOT and m["series_sha256"] == series.sha256
    [entry] = m["files"]
    assert entry["source"] == "files" + ROOT + "/a.py" and entry["mode"] == "0644"
    line = f"{ROOT}/a.py\0{entry['sha256']}\x000644".encode()
    assert m["content_hash"] == hashlib.sha256(line).hexdigest()[:16]


def test_modes_come_from_the_image_and_every_folder_is_0755(tmp_path):
    """An executable file stays executable (vLLM's envs.py is 0755); the folders all read 0755."""
    img = image_with(python_root=ROOT, files={"a.py": BODY, "b.py": BODY})
    img.modes[f"{ROOT}/a.py"] = 0o755
    both = {"vllm/a.py": (BODY, BODY + "x = 1\n"), "vllm/b.py": (BODY, BODY + "y = 2\n")}
    patches = {"0001-a.patch": make_patch(both)}
    ov = build(FakeEngine({"img": img}), series_of(tmp_path, patches), target())
    entries = {e["container_path"]: e["mode"] for e in json.loads(ov.manifest_bytes())["files"]}
    assert entries == {f"{ROOT}/a.py": "0755", f"{ROOT}/b.py": "0644"}
    [folder] = overlay.write_overlays([ov], tmp_path / "out")
    assert (folder / "files" / ROOT.lstrip("/") / "a.py").stat().st_mode & 0o777 == 0o755
    assert (folder / "files" / ROOT.lstrip("/") / "b.py").stat().st_mode & 0o777 == 0o644
    folders = [folder, *(p for p in folder.rglob("*") if p.is_dir())]
    assert {f"{p.stat().st_mode & 0o777:04o}" for p in folders} == {"0755"}
    # a folder an older version left 0700 is not taken as already written
    folder.chmod(0o700)
    assert not overlay.is_written(folder, ov)
    overlay.write_overlays([ov], tmp_path / "out")
    assert folder.stat().st_mode & 0o777 == 0o755


def test_the_image_cache_keeps_modes(tmp_path):
    """Read once through the engine, then from the cache: the mode survives both ways."""
    img = image_with(python_root=ROOT)
    img.modes[f"{ROOT}/a.py"] = 0o755
    engine = FakeEngine({"img": img})
    store = plan_originals.ImageCache(tmp_path / "cache")
    first = store.read(engine, "img", [f"{ROOT}/a.py", f"{ROOT}/missing.py"])
    again = store.read(engine, "img", [f"{ROOT}/a.py", f"{ROOT}/missing.py"])
    assert first == again == {f"{ROOT}/a.py": ImageFile(BODY.encode(), 0o755), f"{ROOT}/missing.py": None}
    assert len(engine.reads) == 1


def test_same_inputs_give_the_same_bytes_and_mtimes(tmp_path):
    series = series_of(tmp_path, {"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")})
    engine = FakeEngine({"img": image_with(python_root=ROOT)})
    outs = []
    for n in range(2):
        out = tmp_path / f"out{n}"
        overlay.write_overlays([build(engine, series, target())], out)
        files = [p for p in out.rglob("*") if p.is_file()]
        outs.append({p.relative_to(out): (p.read_bytes(), p.stat().st_mtime, p.stat().st_mode) for p in files})
    assert outs[0] == outs[1]
    assert len(outs[0]) == 5  # current.json, manifest.json, one file, the target's and the overlay's markers


def test_content_hash_changes_when_a_patch_changes(tmp_path):
    engine = FakeEngine({"img": image_with(python_root=ROOT)})
    one = build(engine, series_of(tmp_path / "1", {"0001-a.patch": change("value_20 = 20\n", "v = 0\n")}), target())
    two = build(engine, series_of(tmp_path / "2", {"0001-a.patch": change("value_20 = 20\n", "v = 1\n")}), target())
    assert one.content_hash != two.content_hash
    out = tmp_path / "out"
    paths = overlay.write_overlays([one], out) + overlay.write_overlays([two], out)
    assert paths[0] != paths[1] and paths[0].is_dir()  # the old version stays for running jobs
    assert json.loads((out / "t" / "current.json").read_text())["content_hash"] == two.content_hash


def test_overlaid_python_gets_a_fixed_mtime_unlike_the_original(tmp_path):
    series = series_of(tmp_path, {"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")})
    ov = build(FakeEngine({"img": image_with(python_root=ROOT)}), series, target())
    [folder] = overlay.write_overlays([ov], tmp_path / "out")
    [f] = ov.files
    st = (folder / f.source).stat()
    assert st.st_mtime == overlay.overlay_mtime(f.data)
    assert overlay.MTIME_BASE <= st.st_mtime < overlay.MTIME_BASE + (1 << 24)  # early 2000, before vLLM
    other = overlay.overlay_mtime(f.data + b"# another version of the same file\n")
    assert other != st.st_mtime


def test_an_identical_overlay_is_left_alone(tmp_path):
    series = series_of(tmp_path, {"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")})
    ov = build(FakeEngine({"img": image_with(python_root=ROOT)}), series, target())
    [folder] = overlay.write_overlays([ov], tmp_path / "out")
    inode = (folder / ov.files[0].source).stat().st_ino
    overlay.write_overlays([ov], tmp_path / "out")
    assert (folder / ov.files[0].source).stat().st_ino == inode  # a running bind mount keeps its file


def test_nothing_is_written_when_any_target_fails(tmp_path):
    series = series_of(tmp_path, {"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")})
    engine = FakeEngine({"good": image_with(python_root=ROOT)})
    good = build(engine, series, target("good", name="good"))
    out = tmp_path / "out"

    def fails(ov, folder):
        raise VerifyError("no")

    with pytest.raises(VerifyError):
        overlay.write_overlays([good], out, verify=fails)
    assert [p for p in out.rglob("*") if p.is_file()] == []


# --- the command ---------------------------------------------------------------------


def in_fake_docker(tmp_path, monkeypatch) -> FakeEngine:
    """Work in tmp_path, with a fake daemon (no images yet) and the image cache inside."""
    monkeypatch.chdir(tmp_path)
    engine = FakeEngine({})
    monkeypatch.setattr(engine_mod, "docker_engine", lambda: engine)
    monkeypatch.setattr(plan_target, "image_cache_dir", lambda ctx: tmp_path / "cache" / "images")
    return engine


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A working directory with a config whose targets are fake images."""
    engine = in_fake_docker(tmp_path, monkeypatch)

    def configure(patches: dict[str, str], targets: str) -> FakeEngine:
        write_series(tmp_path / "patches", patches)
        (tmp_path / "sm12x-bundle.yaml").write_text(f"series: patches/series\ntargets:\n{targets}")
        return engine

    return configure


TWO_TARGETS = "  - {name: a, image: 'img:a'}\n  - {name: b, image: 'img:b', root: /opt/vllm/vllm}\n"


def test_cli_writes_every_target(project, tmp_path, capsys):
    engine = project({"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")}, TWO_TARGETS)
    engine.images |= {"img:a": image_with(python_root=ROOT), "img:b": image_with(OPT)}
    assert main(["overlay", "-q"]) == 0
    out = capsys.readouterr().out
    assert "a: overlays/a/" in out and "b: overlays/b/" in out
    assert json.loads((tmp_path / "overlays/b/current.json").read_text())["files"][0]["container_path"] == f"{OPT}/a.py"


def test_cli_skew_in_one_target_writes_nothing(project, tmp_path, capsys):
    engine = project({"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")}, TWO_TARGETS)
    skewed = image_with(OPT, {"a.py": BODY.replace("value_20 = 20", "v")})
    engine.images |= {"img:a": image_with(python_root=ROOT), "img:b": skewed}
    assert main(["overlay", "-q"]) == ApplyError.exit_code
    assert "image img:b" in capsys.readouterr().err
    assert not (tmp_path / "overlays").exists()


@pytest.mark.parametrize(
    "argv, code, message",
    [
        (["--root", OPT], 2, "--root needs --image"),  # the command line: argparse's exit 2
        (["--image", "x", "--target", "a"], 2, "not both"),
        (["--target", "c"], ConfigError.exit_code, "no target named 'c'"),
        (["--manifest", "m.json"], 2, "argument --manifest: 'm.json' does not exist"),
        (["--image", "missing:1"], EngineError.exit_code, "missing:1 not found"),
    ],
)
def test_cli_bad_input_is_one_sentence_and_writes_nothing(project, tmp_path, capsys, argv, code, message):
    engine = project({"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")}, TWO_TARGETS)
    engine.images |= {"img:a": image_with(python_root=ROOT)}
    try:
        assert main(["overlay", "-q", *argv]) == code
    except SystemExit as exc:
        assert exc.code == code
    assert message in capsys.readouterr().err
    assert not (tmp_path / "overlays").exists()


def test_cli_unreachable_daemon_refuses_an_image_target(project, tmp_path, capsys):
    engine = project({"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")}, TWO_TARGETS)
    engine.reachable = False
    assert main(["overlay", "-q"]) == EngineError.exit_code
    assert "does not answer" in capsys.readouterr().err
    assert not (tmp_path / "overlays").exists()


def test_cli_reads_an_image_once_by_id(project, tmp_path):
    engine = project({"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")}, TWO_TARGETS)
    engine.images |= {"img:a": image_with(python_root=ROOT), "img:b": image_with(OPT)}
    assert main(["overlay", "-q", "--target", "a"]) == 0
    runs, reads = len(engine.runs), len(engine.reads)
    assert main(["overlay", "-q", "--target", "a", "--out", "again"]) == 0
    assert (len(engine.runs), len(engine.reads)) == (runs, reads)  # the same id: nothing read again
    assert (tmp_path / "again/a/current.json").read_bytes() == (tmp_path / "overlays/a/current.json").read_bytes()
    engine.images["img:a"].files[f"{ROOT}/a.py"] += b"# rebuilt\n"  # a new image: a new id
    assert main(["overlay", "-q", "--target", "a", "--out", "third"]) == 0
    assert (len(engine.runs), len(engine.reads)) == (runs + 1, reads)  # one probe reads the files too


def test_a_series_that_asks_other_files_asks_the_image_again(project, tmp_path):
    """The probe's answers (bytecode included) are kept for the paths it was asked about."""
    engine = project({"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")}, TWO_TARGETS)
    engine.images |= {"img:a": image_with(python_root=ROOT, files={"a.py": BODY, "b.py": BODY})}
    assert main(["overlay", "-q", "--target", "a"]) == 0
    runs = len(engine.runs)
    write_series(tmp_path / "patches", {
        "0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n"),
        "0002-b.patch": change("value_30 = 30\n", "value_30 = 0\n", path="vllm/b.py"),
    })
    assert main(["overlay", "-q", "--target", "a", "--out", "again"]) == 0
    assert len(engine.runs) == runs + 1  # one new probe: it reads b.py and lists its bytecode
    assert len(json.loads((tmp_path / "again/a/current.json").read_text())["files"]) == 2


def test_cli_ad_hoc_image_gets_a_folder_named_after_it(project, tmp_path, capsys):
    engine = project({"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")}, TWO_TARGETS)
    engine.images["glm/vllm:nvfp4"] = image_with(OPT)
    assert main(["overlay", "-q", "--image", "glm/vllm:nvfp4", "--root", OPT, "--out", "ov"]) == 0
    assert (tmp_path / "ov" / "glm-vllm-nvfp4" / "current.json").is_file()


# --- lanes: the image's vLLM version selects the series -------------------------------


@pytest.fixture
def two_lanes(tmp_path, monkeypatch):
    """Lanes 0.21.0 and 0.33.0 (small local trees), each with its own series for vllm/a.py."""
    engine = in_fake_docker(tmp_path, monkeypatch)
    lanes = ""
    for version, line in (("0.21.0", "value_20 = 20\n"), ("0.33.0", "value_30 = 30\n")):
        write_series(tmp_path / f"p{version}", {"0001-a.patch": change(line, line.replace(" = ", " = 1"))})
        tree = tmp_path / f"src-{version}"
        for rel, text in {"PKG-INFO": f"Name: vllm\nVersion: {version}\n", "vllm/__init__.py": "", "vllm/a.py": BODY}.items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            (tree / rel).write_text(text)
        lanes += f"  - {{version: '{version}', series: p{version}/series, source: src-{version}}}\n"

    def configure(targets: str) -> FakeEngine:
        (tmp_path / "sm12x-bundle.yaml").write_text(f"lanes:\n{lanes}targets:\n{targets}")
        return engine

    return configure


def written_a(tmp_path: Path, target: str) -> tuple[dict, str]:
    m = json.loads((tmp_path / "overlays" / target / "current.json").read_text())
    folder = tmp_path / "overlays" / target / m["content_hash"]
    return m, (folder / m["files"][0]["source"]).read_text()


def test_the_images_vllm_version_selects_its_lane(two_lanes, tmp_path, capsys):
    engine = two_lanes("  - {name: old, image: 'img:21'}\n  - {name: new, image: 'img:33'}\n")
    engine.images |= {"img:21": image_with(python_root=ROOT), "img:33": image_with(python_root=ROOT, version="0.33.0")}
    assert main(["overlay", "-q"]) == 0
    old, old_a = written_a(tmp_path, "old")
    new, new_a = written_a(tmp_path, "new")
    assert old["pin"]["version"] == "0.21.0" and "value_20 = 120\n" in old_a and "value_30 = 30\n" in old_a
    assert new["pin"]["version"] == "0.33.0" and "value_30 = 130\n" in new_a and "value_20 = 20\n" in new_a
    assert old["series_sha256"] != new["series_sha256"]


def test_a_lane_with_an_empty_series_gives_an_empty_overlay(two_lanes, tmp_path):
    """A lane being written: no patch yet, nothing to overlay, and nothing else refused."""
    engine = two_lanes("  - {name: new, image: 'img:33'}\n")
    (tmp_path / "p0.33.0" / "series").write_text("# nothing yet\n")
    engine.images["img:33"] = image_with(python_root=ROOT, version="0.33.0")
    assert main(["overlay", "-q"]) == 0
    m = json.loads((tmp_path / "overlays/new/current.json").read_text())
    assert m["files"] == [] and m["native"] == {} and m["pin"]["version"] == "0.33.0"


def test_an_image_whose_release_has_no_lane_is_refused_and_nothing_is_written(two_lanes, tmp_path, capsys):
    engine = two_lanes("  - {name: old, image: 'img:21'}\n  - {name: mid, image: 'img:26'}\n")
    engine.images |= {"img:21": image_with(python_root=ROOT), "img:26": image_with(python_root=ROOT, version="0.26.0")}
    assert main(["overlay", "-q"]) == SeriesError.exit_code
    err = capsys.readouterr().err
    assert "image img:26 carries vLLM 0.26.0, and no lane is for it (lanes: 0.21.0, 0.33.0)" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "overlays").exists()


def test_a_target_whose_image_carries_another_release_than_it_says_is_refused(two_lanes, tmp_path, capsys):
    engine = two_lanes("  - {name: new, image: 'img:33', vllm: '0.21.0'}\n")
    engine.images["img:33"] = image_with(python_root=ROOT, version="0.33.0")
    assert main(["overlay", "-q"]) == ConfigError.exit_code
    assert "target new says vllm: '0.21.0', but image img:33 carries vLLM 0.33.0" in capsys.readouterr().err
    assert not (tmp_path / "overlays").exists()


def test_pinned_targets_without_a_daemon_stand_in_with_the_lane_they_name(two_lanes, tmp_path, capsys):
    engine = two_lanes(
        f"  - {{name: first, image: 'img:21', root: {ROOT}, pinned: true}}\n"
        f"  - {{name: new, image: 'img:33', root: {ROOT}, pinned: true, vllm: '0.33.0'}}\n"
    )
    engine.reachable = False
    assert main(["overlay", "-q"]) == 0
    first, first_a = written_a(tmp_path, "first")  # no vllm: the first lane
    new, new_a = written_a(tmp_path, "new")
    assert first["pin"]["version"] == first["versions"]["vllm"] == "0.21.0" and "value_20 = 120\n" in first_a
    assert new["pin"]["version"] == new["versions"]["vllm"] == "0.33.0" and "value_30 = 130\n" in new_a
    assert first["image_id"] is None and new["image_id"] is None


def test_a_target_naming_a_release_without_a_lane_is_refused_at_load(two_lanes, tmp_path, capsys):
    two_lanes("  - {name: mid, image: 'img:26', vllm: '0.26.0'}\n")
    assert main(["overlay", "-q"]) == ConfigError.exit_code
    err = capsys.readouterr().err
    assert "sm12x-bundle.yaml:5: targets[0].vllm: target 'mid' names vLLM '0.26.0', which is not a lane" in err
    assert "(lanes: 0.21.0, 0.33.0)" in err


def test_build_dry_run_names_each_targets_lane(two_lanes, tmp_path, capsys):
    engine = two_lanes("  - {name: new, image: 'img:33', root: /r/vllm, pinned: true, vllm: '0.33.0'}\n"
                       "  - {name: any, image: 'img:x'}\n")
    assert main(["build", "-q", "--dry-run"]) == 8  # as build would: img:x is not in the daemon
    assert capsys.readouterr().err == "sm12x-bundle: error: image img:x not found in the daemon\n"
    engine.images["img:x"] = image_with(python_root=ROOT)
    assert main(["build", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "overlays/new/  lane 0.33.0: image img:33 (its vLLM must be 0.33.0); no daemon: the pinned 0.33.0 tree" in out
    assert "overlays/any/  image img:x: the lane of its vLLM version (0.21.0, 0.33.0); needs a daemon" in out
    assert not (tmp_path / "overlays").exists() and not (tmp_path / "build").exists()


def test_target_names_must_be_one_folder():
    with pytest.raises(ConfigError, match=r"t.yaml:2: targets\[0\].name: .*names a folder"):  # refused at load
        parse("targets:\n  - {name: ../x, image: i}\n", "t.yaml", Path("."))


# --- verify --------------------------------------------------------------------------


def verified_setup(tmp_path, image: FakeImage, new_text: str = "value_20 = 0\n"):
    series = series_of(tmp_path, {"0001-a.patch": change("value_20 = 20\n", new_text)})
    engine = FakeEngine({"img": image})
    [folder] = overlay.write_overlays([build(engine, series, target())], tmp_path / "out")
    return engine, folder


def test_verify_checks_hashes_and_compiles_in_the_image(tmp_path):
    engine, folder = verified_setup(tmp_path, image_with(python_root=ROOT))
    report = verify.verify_overlay(engine, folder)
    assert any("sha256" in line for line in report.ok) and any("compiles" in line for line in report.ok)
    assert any("imports not checked" in n for n in report.notes)


def test_verify_refuses_an_image_whose_original_differs(tmp_path):
    engine, folder = verified_setup(tmp_path, image_with(python_root=ROOT))
    other = BODY.replace("value_1 = 1\n", "value_1 = 'rebuilt'\n").encode()
    engine.images["img"].files[f"{ROOT}/a.py"] = other
    with pytest.raises(VerifyError) as exc:
        verify.verify_overlay(engine, folder)
    text = str(exc.value)
    assert f"{ROOT}/a.py" in text and "refused" in text
    assert hashlib.sha256(BODY.encode()).hexdigest() in text and hashlib.sha256(other).hexdigest() in text
    assert not any(verify.VERIFY_SCRIPT in r for r in engine.runs)  # refused before anything runs


def test_verify_refuses_a_file_that_does_not_compile(tmp_path):
    engine, folder = verified_setup(tmp_path, image_with(python_root=ROOT), "value_20 = (\n")
    with pytest.raises(VerifyError, match="does not compile"):
        verify.verify_overlay(engine, folder)


def test_verify_refuses_a_tampered_overlay(tmp_path):
    engine, folder = verified_setup(tmp_path, image_with(python_root=ROOT))
    [f] = json.loads((folder / "manifest.json").read_text())["files"]
    os.chmod(folder / f["source"], 0o644)
    (folder / f["source"]).write_text("print('not the patch')\n")
    with pytest.raises(VerifyError, match="differs from its manifest"):
        verify.verify_overlay(engine, folder)


def test_verify_finds_current_json_and_reports_a_missing_image(tmp_path):
    engine, folder = verified_setup(tmp_path, image_with(python_root=ROOT))
    assert manifest.load_manifest(folder.parent / "current.json")[0] == folder
    with pytest.raises(EngineError, match="not found"):
        verify.verify_overlay(engine, folder, image="nope")


def _pyc_for(path: Path, mtime: int, size: int, flags: int = 0) -> None:
    cache = path.parent / "__pycache__"
    cache.mkdir(exist_ok=True)
    head = importlib.util.MAGIC_NUMBER + flags.to_bytes(4, "little")
    head += mtime.to_bytes(4, "little") + size.to_bytes(4, "little")
    (cache / f"{path.stem}.{sys.implementation.cache_tag}.pyc").write_bytes(head + b"\0" * 16)


def run_script(spec: dict) -> str:
    argv = [sys.executable, "-c", verify.VERIFY_SCRIPT, json.dumps(spec)]
    proc = subprocess.run(argv, capture_output=True, text=True)
    return proc.stdout


def test_verify_script_catches_stale_bytecode(tmp_path):
    py = tmp_path / "vllm" / "m.py"
    py.parent.mkdir()
    py.write_text("x = 1\n")
    os.utime(py, (overlay.MTIME_BASE, overlay.MTIME_BASE))
    spec = {"root": str(py.parent), "files": [{"path": str(py), "sha256": hashlib.sha256(b"x = 1\n").hexdigest()}],
            "native": [], "modules": [], "libdir": "/nonexistent"}
    _pyc_for(py, overlay.MTIME_BASE, 6)  # the trap: the image's .pyc matches size and mtime
    assert "Python would run the old code" in run_script(spec)
    _pyc_for(py, overlay.MTIME_BASE + 1, 6)
    assert "stale by mtime/size" in run_script(spec)
    _pyc_for(py, 0, 0, flags=1)  # unchecked hash-based
    assert "PYTHONPYCACHEPREFIX" in run_script(spec)


def test_image_cuda_must_match_the_headers():
    side = plan_originals.ImageSide("img", "id", ROOT, {"torch": "2.9.0+cu129"}, lambda p: {})
    assert native_build.image_cuda(side.versions) == "12.9"
    native_build.check_cuda_match(side.versions, "12.8", side.label)
    with pytest.raises(ConfigError, match="image img runs CUDA 12.9"):
        native_build.check_cuda_match(side.versions, "13.0", side.label)
    native_build.check_cuda_match({"torch": "2.9.0"}, "13.0", side.label)


# --- the real pinned tree, no daemon -------------------------------------------------


@pytest.mark.integration
@pytest.mark.native
def test_default_target_without_docker_from_the_pinned_tree(
    tmp_path, monkeypatch, capsys, series, pinned_tree, patched_tree
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(engine_mod, "docker_engine", lambda: FakeEngine({}, reachable=False))
    assert main(["overlay"]) == 0
    captured = capsys.readouterr()
    assert "no Docker daemon" in captured.err
    current = tmp_path / "overlays" / "vllm-openai-v0.21.0" / "current.json"
    m = json.loads(current.read_text())
    folder = current.parent / m["content_hash"]
    assert (folder / "manifest.json").read_bytes() == current.read_bytes()
    assert m["image_id"] is None and m["versions"]["vllm"] == "0.21.0" and m["series_sha256"] == series.sha256
    files = {f["container_path"]: f for f in m["files"]}
    assert files[f"{ROOT}/envs.py"]["mode"] == "0755"  # as in the sdist, not 0644 by kind
    assert (folder / files[f"{ROOT}/envs.py"]["source"]).stat().st_mode & 0o777 == 0o755
    assert folder.stat().st_mode & 0o777 == 0o755
    cumem = files[f"{ROOT}/device_allocator/cumem.py"]
    assert cumem["patches"] == list(plan_files.installed_paths(series)["vllm/device_allocator/cumem.py"])
    assert cumem["patches"][:2] == ["cumem-stream-aware-free", "cumem-wake-up-rollback"]
    original = (pinned_tree / "vllm/device_allocator/cumem.py").read_bytes()
    assert cumem["pre_image_sha256"] == hashlib.sha256(original).hexdigest()
    written = folder / cumem["source"]
    assert written.read_bytes() == (patched_tree / "vllm/device_allocator/cumem.py").read_bytes()
    assert written.stat().st_mtime != (pinned_tree / "vllm/device_allocator/cumem.py").stat().st_mtime
    so = files[f"{ROOT}/cumem_allocator.abi3.so"]
    assert so["patches"] == native_fixes("0.21.0") and so["mode"] == "0755"
    assert so["pre_image_sha256"] is None  # not in the sdist: recorded only when read from an image
    record = m["native"][so["container_path"]]
    assert "libcuda.so.1" in record["links"] and record["built_from"]["vllm"] == "0.21.0"
    # same bytes again, from a second run
    first = {p: p.read_bytes() for p in (tmp_path / "overlays").rglob("*") if p.is_file()}
    assert main(["overlay", "-q"]) == 0
    assert {p: p.read_bytes() for p in (tmp_path / "overlays").rglob("*") if p.is_file()} == first


@pytest.mark.integration
@pytest.mark.native
def test_pinned_overlay_passes_the_in_image_checks_here(tmp_path, series, pinned_source):
    """The verify script on this machine's Python: hashes, compile, and the rebuilt extension loads."""
    t = TargetConfig(name="t", image="img", root=ROOT, pinned=True)
    side = plan_originals.pinned_side(t, pinned_source)
    plan = plan_files.plan_series(series)
    ov = overlay.make_overlay(plan_target.plan_lane(t, lane_of(series), side, lambda v: pinned_source), Progress.quiet())
    [folder] = overlay.write_overlays([ov], tmp_path / "out")
    originals = {
        plan_files.container_path(ROOT, p): (pinned_source.root / p).read_bytes()
        for p in plan_files.wanted_paths(plan)
        if (pinned_source.root / p).is_file()
    }
    engine = FakeEngine({"img": FakeImage(originals)})
    with pytest.raises(VerifyError, match="made from the pinned tree"):
        engine.images["img"].files[f"{ROOT}/cumem_allocator.abi3.so"] = b"the image's own build"
        verify.verify_overlay(engine, folder)
    del engine.images["img"].files[f"{ROOT}/cumem_allocator.abi3.so"]
    report = verify.verify_overlay(engine, folder)
    assert any("loads as vllm.cumem_allocator" in line for line in report.ok), report
    assert any("cumem.py: compiles" in line for line in report.ok)


@pytest.mark.integration
def test_overlaid_files_keep_the_pinned_trees_modes(series, pinned_source):
    """vLLM 0.21.0's envs.py is 0755 in the sdist; the overlay's copy must not become 0644."""
    side = plan_originals.pinned_side(TargetConfig(name="t", image="img", root=ROOT, pinned=True), pinned_source)
    originals = side.read(list(plan_files.plan_series(series).files))
    assert originals["vllm/envs.py"].mode == 0o755
    patched, _ = plan_files.patch_image_files(series, originals, side.label)
    assert patched["vllm/envs.py"].mode == 0o755
    assert patched["vllm/device_allocator/cumem.py"].mode == 0o644
    assert patched["vllm/v1/attention/ops/sm12x_sparse_mla/__init__.py"].mode == 0o644  # new: the patch's mode


@pytest.mark.integration
def test_pinned_target_needs_a_root_without_docker(pinned_source):
    with pytest.raises(ConfigError, match="no root"):
        plan_originals.pinned_side(TargetConfig(name="t", image="i", pinned=True), pinned_source)


def test_make_and_write_verifies_what_it_read_from_images(project, tmp_path):
    """What `build` calls: all config targets, verified in their images when a daemon answers."""
    from sm12x_bundle.config import load
    from sm12x_bundle.context import Context

    engine = project({"0001-a.patch": change("value_20 = 20\n", "value_20 = 0\n")}, TWO_TARGETS)
    engine.images |= {"img:a": image_with(python_root=ROOT), "img:b": image_with(OPT)}
    ctx = Context(load(tmp_path / "sm12x-bundle.yaml"), Progress.quiet())
    written = overlay.make_and_write(ctx)
    assert [(ov.target, folder.parent) for ov, folder in written] == [("a", Path("overlays/a")), ("b", Path("overlays/b"))]
    assert sum(r[2] == verify.VERIFY_SCRIPT for r in engine.runs) == 2
    again = overlay.make_and_write(ctx, [ctx.config.target("a")], verify=False, out=tmp_path / "elsewhere")
    assert again[0][1] == tmp_path / "elsewhere" / "a" / written[0][0].content_hash
    assert sum(r[2] == verify.VERIFY_SCRIPT for r in engine.runs) == 2  # verify=False: not checked
    engine.reachable = False
    with pytest.raises(EngineError, match="does not answer"):
        overlay.make_and_write(ctx)  # targets that are not pinned need the daemon
