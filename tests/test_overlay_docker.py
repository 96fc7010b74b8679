"""Overlays against a real Docker daemon and stand-in vLLM images (docker_support.py):
the real vLLM 0.21.0 files at the official root and at /opt/vllm/vllm, 0.33.0's at the
official root (the second lane), 0.26.0's at the official root (a release no lane is for),
and an image without vLLM.

Each container costs seconds on the test daemon's vfs storage, so the module makes each
overlay once and checks several things of it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from docker_support import (  # noqa: F401  (fixtures)
    SKEW_VERSION,
    daemon,
    standin_base,
    standin_lane2,
    standin_novllm,
    standin_official,
    standin_opt,
    standin_skew,
)

from sm12x_bundle.cli import main
from sm12x_bundle.config import TargetConfig
from sm12x_bundle.containers import OFFICIAL_VLLM_ROOT
from sm12x_bundle.errors import EngineError, SeriesError, VerifyError
from sm12x_bundle.outputs import overlay
from sm12x_bundle.plan import originals as plan_originals
from sm12x_bundle.plan import target as plan_target
from sm12x_bundle.progress import Progress
from lanekit import native_fixes  # noqa: E402

pytestmark = pytest.mark.docker

CUMEM = "vllm/device_allocator/cumem.py"
OPT = "/opt/vllm/vllm"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan_target, "image_cache_dir", lambda ctx: tmp_path / "image-cache")
    return tmp_path


def overlay_cli(*argv: str) -> int:
    return main(["overlay", "-q", *argv])


def current(out: Path, name: str) -> tuple[Path, dict]:
    manifest = json.loads((out / name / "current.json").read_text())
    return out / name / manifest["content_hash"], manifest


# --- where vLLM is -------------------------------------------------------------------


def test_install_root_found_at_both_roots(daemon, standin_official, standin_opt):
    official = plan_originals.image_side(daemon, TargetConfig(name="a", image=standin_official.ref))
    assert official.root == OFFICIAL_VLLM_ROOT  # the image's python3 finds it
    assert official.versions["vllm"] == "0.21.0"  # from the dist-info metadata
    opt = plan_originals.image_side(daemon, TargetConfig(name="b", image=standin_opt.ref))
    assert opt.root == OPT  # not on sys.path: found by searching
    assert opt.versions["vllm"] == "0.21.0"  # from the package's _version.py
    assert opt.image_id == daemon.image_id(standin_opt.ref)


# --- made from the image, checked in the image ---------------------------------------


def _verified_overlay(tmp_path_factory, name: str, ref: str):
    """`overlay --image REF --verify` into a fresh folder: (out folder, stdout, stderr)."""
    import contextlib
    import io
    import os

    out = tmp_path_factory.mktemp(name) / "overlays"
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["overlay", "--image", ref, "--verify", "--out", os.fspath(out)])
    assert code == 0, stderr.getvalue()
    return out, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def official_overlay(tmp_path_factory, standin_official, daemon):
    """`overlay --verify` of the official-root stand-in, run once: (out folder, stdout, stderr)."""
    return _verified_overlay(tmp_path_factory, "official", standin_official.ref)


def test_overlay_patches_the_images_own_file(official_overlay, standin_official, daemon, pinned_tree, patched_tree):
    out, stdout, _ = official_overlay
    folder, m = current(out, plan_target.target_name_for(standin_official.ref))
    assert m["image_id"] == daemon.image_id(standin_official.ref)
    assert m["vllm_root"] == OFFICIAL_VLLM_ROOT and m["versions"]["vllm"] == "0.21.0"
    files = {f["container_path"]: f for f in m["files"]}
    cumem = files[f"{OFFICIAL_VLLM_ROOT}/device_allocator/cumem.py"]
    assert cumem["pre_image_sha256"] == sha((pinned_tree / CUMEM).read_bytes())
    assert (folder / cumem["source"]).read_bytes() == (patched_tree / CUMEM).read_bytes()
    assert f"{folder}" in stdout


def test_native_extension_is_rebuilt_and_loads_in_the_image(official_overlay, standin_official, daemon):
    out, _, stderr = official_overlay
    folder, m = current(out, plan_target.target_name_for(standin_official.ref))
    so = next(f for f in m["files"] if f["container_path"].endswith("/cumem_allocator.abi3.so"))
    assert so["pre_image_sha256"] is None  # the stand-in carries vLLM's Python files only
    assert so["patches"] == native_fixes("0.21.0") and so["mode"] == "0755"
    record = m["native"][so["container_path"]]
    # a daemon and a real image: built in a builder container started from the image itself
    assert record["built_on"].startswith("builder image sha256:") and "libcuda.so.1" in record["links"]
    assert record["builder_base"] == daemon.image_id(standin_official.ref)
    assert record["built_from"]["vllm"] == "0.21.0" and record["built_from"]["patches"] == native_fixes("0.21.0")
    assert f"{so['container_path']}: loads as vllm.cumem_allocator" in stderr


def test_verify_checks_hashes_compile_and_bytecode_in_the_image(official_overlay, standin_official):
    _, stdout, stderr = official_overlay
    py = f"{OFFICIAL_VLLM_ROOT}/device_allocator/cumem.py"
    for line in (
        f"{py}: the image's original is the recorded pre-image",
        f"{py}: sha256",
        f"{py}: compiles",
        "imports not checked: the image has no torch",
    ):
        assert line in stderr
    assert f"verified in {standin_official.ref}" in stdout


def test_image_and_pinned_tree_give_the_same_files(official_overlay, standin_official, default_context, pinned_source):
    """The stand-in carries the pinned release unchanged: both paths must agree byte for byte
    on the Python files. The extension is the same build of the same patched source, but
    compiled where each path builds it (the image's builder container; the host for the
    pinned tree), so only its sha256 may differ."""
    out, _, _ = official_overlay
    _, m = current(out, plan_target.target_name_for(standin_official.ref))
    t = TargetConfig(name="p", image="x", root=OFFICIAL_VLLM_ROOT, pinned=True)
    side = plan_originals.pinned_side(t, pinned_source)
    lane = default_context.lane("0.21.0")
    ov = overlay.make_overlay(plan_target.plan_lane(t, lane, side, lambda v: pinned_source), Progress.quiet())
    mine = json.loads(ov.manifest_bytes())
    so = f"{OFFICIAL_VLLM_ROOT}/cumem_allocator.abi3.so"
    assert [f for f in mine["files"] if f["container_path"] != so] == [
        f for f in m["files"] if f["container_path"] != so
    ]
    [a], [b] = ([{k: v for k, v in f.items() if k != "sha256"} for f in d["files"] if f["container_path"] == so]
                for d in (mine, m))
    assert a == b
    assert mine["native"][so]["built_from"] == m["native"][so]["built_from"]
    assert mine["native"][so]["built_on"] == "host"


def test_overlay_at_the_opt_root_verifies(workdir, standin_opt, capsys):
    assert main(["overlay", "--image", standin_opt.ref, "--verify"]) == 0  # not -q: the checks are listed
    folder, m = current(workdir / "overlays", plan_target.target_name_for(standin_opt.ref))
    paths = {f["container_path"] for f in m["files"]}
    assert {f"{OPT}/device_allocator/cumem.py", f"{OPT}/cumem_allocator.abi3.so"} <= paths
    assert all(p.startswith(OPT + "/") for p in paths)
    assert f"{OPT}/cumem_allocator.abi3.so: loads as vllm.cumem_allocator" in capsys.readouterr().err


# --- refusals ------------------------------------------------------------------------


def test_verify_refuses_an_image_whose_original_differs(
    official_overlay, standin_official, standin_skew, default_context, capsys
):
    """The 0.21.0 overlay against 0.26.0's files at the same paths: refused before mounting."""
    out, _, _ = official_overlay
    manifest = out / plan_target.target_name_for(standin_official.ref) / "current.json"
    assert overlay_cli("--verify", "--manifest", str(manifest), "--image", standin_skew.ref) == VerifyError.exit_code
    err = capsys.readouterr().err
    theirs = sha((default_context.source(SKEW_VERSION).root / CUMEM).read_bytes())
    files = json.loads(manifest.read_text())["files"]
    ours = next(f for f in files if f["container_path"].endswith(CUMEM[len("vllm") :]))["pre_image_sha256"]
    assert f"{OFFICIAL_VLLM_ROOT}/device_allocator/cumem.py: expected {ours}, found {theirs}" in err
    assert "refused" in err


def test_an_image_of_a_release_without_a_lane_is_refused_and_nothing_is_written(workdir, standin_skew, capsys):
    """0.26.0 has no lane: refused with a sentence naming the lanes, never patched by the nearest one."""
    assert overlay_cli("--image", standin_skew.ref) == SeriesError.exit_code
    err = capsys.readouterr().err
    assert f"image {standin_skew.ref} carries vLLM {SKEW_VERSION}, and no lane is for it (lanes: 0.21.0, 0.33.0)" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (workdir / "overlays").exists()


@pytest.mark.parametrize(
    "which, message",
    [
        ("missing", "sm12x-standin/no-such-image:1 not found"),
        ("novllm", "holds no vLLM"),
    ],
)
def test_bad_images_are_one_sentence_and_write_nothing(workdir, daemon, standin_novllm, capsys, which, message):
    ref = standin_novllm.ref if which == "novllm" else "sm12x-standin/no-such-image:1"
    assert overlay_cli("--image", ref) == EngineError.exit_code
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not (workdir / "overlays").exists()


def test_unreachable_daemon_is_one_sentence_and_writes_nothing(workdir, monkeypatch, capsys):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    assert overlay_cli("--image", "anything:1") == EngineError.exit_code
    assert "does not answer" in capsys.readouterr().err
    assert overlay_cli("--verify") == EngineError.exit_code  # verify needs the image
    assert not (workdir / "overlays").exists()


def test_pinned_target_absent_from_the_daemon_uses_the_pinned_tree(workdir, daemon, capsys):
    """The default targets' official images are not in the test daemon (no registry): each
    pinned target stands in with the pinned tree of the lane it names."""
    assert overlay_cli() == 0
    out = capsys.readouterr().out
    for version in ("0.21.0", "0.33.0"):
        _, m = current(workdir / "overlays", f"vllm-openai-v{version}")
        assert m["image_id"] is None and m["image"] == f"vllm/vllm-openai:v{version}"
        assert m["pin"]["version"] == m["versions"]["vllm"] == version
        assert f"from the pinned vLLM {version} tree" in out


# --- the second lane -----------------------------------------------------------------


@pytest.fixture(scope="module")
def lane2_overlay(tmp_path_factory, standin_lane2, daemon):
    """`overlay --image <0.33.0 stand-in> --verify`, run once: (out folder, stdout, stderr)."""
    return _verified_overlay(tmp_path_factory, "lane2", standin_lane2.ref)


def test_a_0_33_0_image_gets_the_0_33_0_lane_verified_in_the_image(lane2_overlay, standin_lane2, default_context):
    out, stdout, stderr = lane2_overlay
    folder, m = current(out, plan_target.target_name_for(standin_lane2.ref))
    lane = default_context.lane("0.33.0")
    assert m["versions"]["vllm"] == "0.33.0" and m["pin"] == {"version": "0.33.0", "sha256": lane.pin.sha256}
    assert m["series_sha256"] == lane.series.sha256
    source = default_context.source("0.33.0")
    files = {f["container_path"]: f for f in m["files"]}
    for f in files.values():
        ids = set(f["patches"])
        assert ids <= set(lane.series.ids), f  # only the 0.33.0 lane's patches
    cumem = files.get(f"{OFFICIAL_VLLM_ROOT}/device_allocator/cumem.py")
    if cumem is not None:  # the lane patches cumem.py: its pre-image is 0.33.0's own
        assert cumem["pre_image_sha256"] == sha((source.root / CUMEM).read_bytes())
    for f in m["files"]:  # every file checked in the image it was made for
        assert f"{f['container_path']}: the image's original is the recorded pre-image" in stderr
    assert f"verified in {standin_lane2.ref}" in stdout
