"""Building the cumem extension alone (native.py), and what the error-code reset changes in it.

The plan tests need nothing. The native tests compile each lane's pinned and patched
``csrc/cumem_allocator.cpp`` (0.21.0's patch 0003, 0.33.0's patch 0002) with native.py
against a fake libcuda
(stubs/fake_libcuda.c: the driver calls the extension makes, with failure injection
and live-object counts) and drive each build in a fresh interpreter
(stubs/cumem_scenarios.py): no GPU or driver needed, only a compiler and CUDA headers.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import sysconfig
from pathlib import Path

import needs
import pytest

from lanekit import LANES, lane_tree  # noqa: F401
from sm12x_bundle import cmd, native
from sm12x_bundle.errors import BundleError, EnvironmentProblem

STUBS = Path(__file__).parent / "stubs"


def fake_toolkit(root: Path, stubs: str | None = "lib64/stubs") -> Path:
    (root / "include").mkdir(parents=True)
    (root / "include" / "cuda.h").write_text("")
    (root / "include" / "cuda_runtime_api.h").write_text("")
    if stubs:
        (root / stubs).mkdir(parents=True)
        (root / stubs / "libcuda.so").write_text("")
    return root


@pytest.fixture
def toolkit(tmp_path) -> Path:
    return fake_toolkit(tmp_path / "cuda")


@pytest.fixture
def py_include(tmp_path) -> Path:
    (tmp_path / "py").mkdir()
    (tmp_path / "py" / "Python.h").write_text("")
    return tmp_path / "py"


# --- the plan -----------------------------------------------------------------------


def test_plan_is_one_compiler_call(tmp_path, toolkit, py_include):
    argv = native.cumem_build_argv(
        tmp_path / "tree", tmp_path / "out", cuda_home=toolkit, python_include=py_include
    )
    assert argv == [
        "g++", "-shared", "-fPIC", "-O2", "-std=c++17", "-DPy_LIMITED_API=0x03080000",
        f"-I{toolkit}/include", f"-I{py_include}",
        f"{tmp_path}/tree/csrc/cumem_allocator.cpp", "-o", f"{tmp_path}/out/cumem_allocator.abi3.so",
        f"-L{toolkit}/lib64/stubs", "-lcuda",
    ]


@pytest.mark.parametrize("stubs", ["lib/stubs", "targets/x86_64-linux/lib/stubs"])
def test_plan_finds_the_stub_libcuda(tmp_path, py_include, stubs):
    cuda = fake_toolkit(tmp_path / "cuda", stubs)
    argv = native.cumem_build_argv(tmp_path, tmp_path, cuda_home=cuda, python_include=py_include)
    assert argv[-2:] == [f"-L{cuda / stubs}", "-lcuda"]


def test_plan_links_the_given_driver_library(tmp_path, toolkit, py_include):
    lib = tmp_path / "drv" / "libcuda.so.1"
    lib.parent.mkdir()
    lib.write_text("")
    plan = native.cumem_build_argv(tmp_path, tmp_path, cuda_home=toolkit, python_include=py_include, libcuda=lib)
    assert plan[-2:] == [f"-L{lib.parent}", "-l:libcuda.so.1"]
    plan = native.cumem_build_argv(tmp_path, tmp_path, cuda_home=toolkit, python_include=py_include, libcuda=lib.parent)
    assert plan[-2:] == [f"-L{lib.parent}", "-lcuda"]


def test_plan_without_stubs_leaves_libcuda_to_the_linker(tmp_path, py_include):
    cuda = fake_toolkit(tmp_path / "cuda", stubs=None)
    argv = native.cumem_build_argv(tmp_path, tmp_path, cuda_home=cuda, python_include=py_include, compiler="clang++")
    assert argv[0] == "clang++" and argv[-1] == "-lcuda" and not any(a.startswith("-L") for a in argv)


def test_plan_defaults_to_this_python(tmp_path, toolkit):
    include = Path(sysconfig.get_paths()["include"])
    if not (include / "Python.h").is_file():
        needs.missing("this Python has no development headers")
    assert f"-I{include}" in native.cumem_build_argv(tmp_path, tmp_path, cuda_home=toolkit)


def test_cuda_home_comes_from_the_environment(tmp_path, toolkit):
    assert native.find_cuda_home({"CUDA_HOME": str(toolkit), "CUDA_PATH": "/nowhere"}) == toolkit
    assert native.find_cuda_home({"CUDA_PATH": str(toolkit)}) == toolkit


def test_missing_headers_are_the_machines_problem(tmp_path, toolkit):
    """Exit 12 (EnvironmentProblem), not 2 (a bug), naming the header and how to get it."""
    with pytest.raises(EnvironmentProblem, match=r"there is no .*/none/include/cuda\.h: .* set CUDA_HOME"):
        native.find_cuda_home({"CUDA_HOME": str(tmp_path / "none")})
    with pytest.raises(EnvironmentProblem, match=r"there is no .*include/cuda\.h"):
        native.cumem_build_argv(tmp_path, tmp_path, cuda_home=tmp_path)
    with pytest.raises(EnvironmentProblem, match=r"there is no .*Python\.h: .*python3-dev"):
        native.cumem_build_argv(tmp_path, tmp_path, cuda_home=toolkit, python_include=tmp_path)


def test_build_runs_the_plan(tmp_path, toolkit, py_include, monkeypatch):
    tree = tmp_path / "tree"
    (tree / "csrc").mkdir(parents=True)
    (tree / "csrc" / "cumem_allocator.cpp").write_text("")
    calls = []
    monkeypatch.setattr(cmd, "run", lambda argv, **kw: calls.append(list(argv)))
    kwargs = dict(cuda_home=toolkit, python_include=py_include)
    out = native.build_cumem_extension(tree, tmp_path / "out", **kwargs)
    assert out == tmp_path / "out" / "cumem_allocator.abi3.so" and out.parent.is_dir()
    assert calls == [native.cumem_build_argv(tree, tmp_path / "out", **kwargs)]
    with pytest.raises(BundleError, match="not a vLLM source tree"):
        native.build_cumem_extension(tmp_path / "nothing", tmp_path / "out", **kwargs)


# --- building and running the extension -------------------------------------------------


@pytest.fixture(scope="session")
def cuda_home() -> Path:
    try:
        home = native.find_cuda_home()
    except BundleError as exc:
        needs.missing(str(exc))
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        needs.missing("this Python has no development headers")
    if not (shutil.which("g++") and shutil.which("cc")):
        needs.missing("no C/C++ compiler")
    return home


@pytest.fixture(scope="session")
def fake_libcuda(cuda_home, tmp_path_factory) -> Path:
    """The folder holding the fake driver, libcuda.so.1 (and libcuda.so to link with)."""
    out = tmp_path_factory.mktemp("fake_libcuda")
    cmd.run([
        "cc", "-shared", "-fPIC", "-O2", f"-I{cuda_home}/include", "-Wl,-soname,libcuda.so.1",
        STUBS / "fake_libcuda.c", "-o", out / "libcuda.so.1",
    ])
    (out / "libcuda.so").symlink_to("libcuda.so.1")
    return out


@pytest.fixture(scope="session")
def extensions(cuda_home, fake_libcuda, lane_tree, tmp_path_factory):
    """``extensions(lane, variant)``: the extension built from that tree, built once."""
    out = tmp_path_factory.mktemp("cumem_ext")
    built: dict[tuple[str, str], Path] = {}

    def extension(lane: str, variant: str) -> Path:
        if (lane, variant) not in built:
            built[lane, variant] = native.build_cumem_extension(
                lane_tree(lane, variant), out / lane / variant, cuda_home=cuda_home, libcuda=fake_libcuda
            )
        return built[lane, variant]

    return extension


@pytest.fixture(params=LANES)
def lane(request) -> str:
    return request.param


def scenario(extensions, fake_libcuda, variant: str, name: str, lane: str, **env: str) -> dict:
    ext = extensions(lane, variant)
    proc = cmd.run(
        [sys.executable, STUBS / "cumem_scenarios.py", fake_libcuda / "libcuda.so.1", ext, name],
        env={**os.environ, "LD_LIBRARY_PATH": str(fake_libcuda), **env},
        echo=False,
    )
    return json.loads(proc.stdout)


VARIANTS = pytest.mark.parametrize("variant", ["pinned", "patched"])


@pytest.mark.native
@pytest.mark.integration
@VARIANTS
def test_extension_builds_and_round_trips(extensions, fake_libcuda, lane, variant):
    got = scenario(extensions, fake_libcuda, variant, "healthy_round_trip", lane)
    one = {"handles": 1, "mappings": 1, "reservations": 1}
    # Patched, the range is carved from the device's region of addresses (merged runs
    # are on by default), which stays reserved once the allocation is freed.
    left = {"pinned": 0, "patched": 1}[variant]
    assert got == {
        "allocated": one, "sleep_error": None, "asleep": {"handles": 0, "mappings": 0, "reservations": 1},
        "wake_error": None, "awake": one, "freed": {"handles": 0, "mappings": 0, "reservations": left},
    }


@pytest.mark.native
@pytest.mark.integration
@VARIANTS
@pytest.mark.parametrize("failed_path", ["stale_after_free", "stale_after_malloc"])
def test_failure_on_pytorch_path_does_not_fail_the_next_call(extensions, fake_libcuda, lane, variant, failed_path):
    got = scenario(extensions, fake_libcuda, variant, failed_path, lane)
    if variant == "pinned":
        stale = "an illegal memory access" if failed_path == "stale_after_free" else "out of memory"
        assert stale in got["wake_error"]  # a healthy wake raises the old error
    else:
        assert got["wake_error"] is None


@pytest.mark.native
@pytest.mark.integration
@VARIANTS
def test_error_reported_is_the_failing_calls_own(extensions, fake_libcuda, lane, variant):
    got = scenario(extensions, fake_libcuda, variant, "own_error", lane)
    expected = "an illegal memory access" if variant == "pinned" else "out of memory"
    assert got["wake_error"].startswith(f"CUDA Error: {expected}")


@pytest.mark.native
@pytest.mark.integration
@VARIANTS
@pytest.mark.parametrize("step", ["wake_map_fails", "wake_set_access_fails"])
def test_failed_map_releases_the_physical_handle(extensions, fake_libcuda, lane, variant, step):
    got = scenario(extensions, fake_libcuda, variant, step, lane)
    assert "out of memory" in got["error"]
    leaked = {"pinned": 1, "patched": 0}[variant]
    assert got["after_failure"]["handles"] == leaked
    if variant == "patched":
        assert got["after_failure"] == got["asleep"]  # as before the call: nothing mapped
        assert got["retry_error"] is None and got["after_retry"]["handles"] == 1
    elif step == "wake_set_access_fails":
        assert "invalid argument" in got["retry_error"]  # the address stayed mapped


@pytest.mark.native
@pytest.mark.integration
@VARIANTS
def test_failed_malloc_leaves_nothing_behind(extensions, fake_libcuda, lane, variant):
    got = scenario(extensions, fake_libcuda, variant, "malloc_map_fails", lane)
    assert got["malloc_returned"] == 0
    leaked = {"pinned": 1, "patched": 0}[variant]
    region = {"pinned": 0, "patched": 1}[variant]  # patched: the device's region, reserved once
    assert got["after"] == {"handles": leaked, "mappings": 0, "reservations": region}
    # Registered with Python before the mapping failed: taken back, or a later
    # sleep() backs up and unmaps an address that holds nothing.
    assert got["registered"] == leaked


@pytest.mark.native
@pytest.mark.integration
@VARIANTS
def test_failed_map_of_a_mapped_address_keeps_the_live_handle(extensions, fake_libcuda, lane, variant):
    got = scenario(extensions, fake_libcuda, variant, "wake_awake_allocation", lane)
    assert "invalid argument" in got["error"]  # cuMemMap: the address is mapped
    if variant == "pinned":
        # The slot names the new handle: the sleep releases it and leaks the live one.
        assert got["sleep_error"] is None and got["asleep"]["handles"] == 1
        return
    assert got["after_failure"] == {"handles": 1, "mappings": 1, "reservations": 1}
    assert got["sleep_error"] is None
    assert got["asleep"] == {"handles": 0, "mappings": 0, "reservations": 1}
    assert got["wake_error"] is None and got["awake"] == got["after_failure"]


@pytest.mark.native
@pytest.mark.integration
@VARIANTS
def test_a_refused_fabric_handle_is_asked_for_once(extensions, fake_libcuda, lane, variant):
    """Patch cumem-fabric-refused-once: each allocation (three made, each woken twice)
    still gets a POSIX file descriptor handle; the refused fabric request is made once,
    where the pinned extension makes it before every cuMemCreate."""
    got = scenario(extensions, fake_libcuda, variant, "fabric_refused", lane)
    reservations = {"pinned": 3, "patched": 1}[variant]  # patched: three ranges of one region
    assert got["errors"] == [] and got["counts"] == {"handles": 3, "mappings": 3, "reservations": reservations}
    fabric = {"pinned": 9, "patched": 1}[variant]
    assert got["woken_twice"] == {"fabric": fabric, "posix_fd": 9, "other": 0}
    assert got["made"] == {"fabric": {"pinned": 3, "patched": 1}[variant], "posix_fd": 3, "other": 0}


@pytest.mark.native
@pytest.mark.integration
@VARIANTS
def test_where_fabric_handles_are_granted_every_allocation_gets_one(extensions, fake_libcuda, lane, variant):
    got = scenario(extensions, fake_libcuda, variant, "fabric_granted", lane)
    assert got == {"creates": {"fabric": 6, "posix_fd": 0, "other": 0}, "errors": []}


@pytest.mark.native
@pytest.mark.integration
@pytest.mark.parametrize("lane", LANES)
def test_a_merged_run_maps_once_and_its_members_release_is_left_to_the_allocator(extensions, fake_libcuda, lane):
    """VLLM_CUMEM_MERGE_RUNS unset: on by default."""
    got = scenario(extensions, fake_libcuda, "patched", "merged_run", lane)
    assert got["back_to_back"] and got["sleep_errors"] == [] and got["map_error"] is None
    region = {"reservations": 1}  # the ranges are carved from one region, reserved once
    assert got["mapped"] == {"handles": 1, "mappings": 1, **region}
    assert got["after_free"] == got["mapped"]  # the slot of 0: my_free left the run alone
    assert got["unmap_error"] is None and got["free_range_error"] is None
    assert got["released"] == {"handles": 0, "mappings": 0, **region}
    assert got["freed"] == {"handles": 0, "mappings": 0, **region}


@pytest.mark.native
@pytest.mark.integration
@pytest.mark.parametrize("lane", LANES)
def test_with_the_switch_at_0_each_range_is_reserved_apart(extensions, fake_libcuda, lane):
    """VLLM_CUMEM_MERGE_RUNS=0: no region; the fake driver leaves a gap after each
    range it picks, so nothing lies back to back and the counts are the pinned tree's."""
    got = scenario(extensions, fake_libcuda, "patched", "merged_run", lane, VLLM_CUMEM_MERGE_RUNS="0")
    assert not got["back_to_back"]
    assert scenario(extensions, fake_libcuda, "patched", "healthy_round_trip", lane, VLLM_CUMEM_MERGE_RUNS="0")["freed"] == {
        "handles": 0, "mappings": 0, "reservations": 0}


def test_extension_never_exits_the_process(lane_tree, lane):
    source = (lane_tree(lane, "patched") / native.SOURCE).read_text()
    assert not re.search(r"\b(?:std::)?(?:exit|_exit|abort|terminate)\s*\(", source)
