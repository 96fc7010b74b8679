"""``engine-check`` without a GPU: the vLLM under test and its lane, the model folder and
its size, the scenario plan, the patched copy against the real vLLM 0.21.0 wheel's layout,
the session protocol and the process groups (answered by tests/stubs/fake_engine_session.py,
the only fake), the targets, the verdict and the report.

The engine itself runs only on a GPU: the ``gpu`` tests at the end skip without one.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from sm12x_bundle.cli import main
from sm12x_bundle.enginecheck import (
    bench,
    changed,
    copies,
    failures,
    gpu,
    hostmem,
    install,
    model,
    plan,
    procs,
    protocol,
    releases,
    report,
    rotation,
    scenarios,
    table,
)
from sm12x_bundle.enginecheck.bench import Finding
from sm12x_bundle.enginecheck.model import GiB
from sm12x_bundle.plan.files import installed_paths
from sm12x_bundle.series.patch import load_series
from sm12x_bundle.errors import ApplyError, ConfigError, EnvironmentProblem
from sm12x_bundle.source import cache, fetch, index
from tools.golden.engine_check import (
    ALLOCATION,
    CEILINGS,
    H100,
    WEIGHTS_7B,
    WEIGHTS_13B,
    compare_report,
    compare_results,
    cycles_figures,
    rotation_figures,
)
from lanekit import native_fixes  # noqa: E402

STUBS = Path(__file__).parent / "stubs"
FAKE_SESSION = (sys.executable, str(STUBS / "fake_engine_session.py"))
# The real wheel, pinned by the sha256 PyPI's simple index (JSON form) lists for it.
WHEEL = "vllm-0.21.0-1-cp38-abi3-manylinux_2_24_x86_64.whl"
WHEEL_SHA256 = "f4a75b1391f44c67dc1ca268f5ffed9f6b7fdbc657c93db64e6892c5d1bc320b"


def cached_wheel() -> Path:
    """The wheel in the tool's cache (SM12X_BUNDLE_CACHE honoured), downloaded once."""
    where = cache.cache_dir()
    path = where / "sdists" / WHEEL_SHA256 / WHEEL
    if path.is_file() and fetch.sha256_of(path) == WHEEL_SHA256:
        return path
    url, listed = index.find_sdist(index.PYPI, WHEEL)
    assert listed == WHEEL_SHA256, f"PyPI lists sha256 {listed} for {WHEEL}"
    return fetch.download(url, WHEEL_SHA256, where, WHEEL)


@pytest.fixture(scope="session")
def wheel_root(tmp_path_factory) -> Path:
    """vLLM 0.21.0 installed as its wheel lays it out: vllm/'s Python files, its cumem
    extension and the dist-info (the other compiled kernels are left out)."""
    root = tmp_path_factory.mktemp("site-packages")
    with zipfile.ZipFile(cached_wheel()) as whl:
        wanted = [n for n in whl.namelist() if n.endswith(".py") or ".dist-info/" in n
                  or n == "vllm/cumem_allocator.abi3.so"]
        whl.extractall(root, wanted)
    return root


# --- the vLLM under test and its lane ----------------------------------------------------------


@pytest.mark.integration
def test_the_wheel_says_its_version_in_its_metadata_and_gets_its_lane(wheel_root, default_context):
    found = install.find_install(wheel_root)
    assert (found.version, Path(found.version_from).name) == ("0.21.0", "METADATA")
    assert install.lane_for(default_context.lanes, found, None).version == "0.21.0"
    assert install.lane_for(default_context.lanes, found, "0.21.0").version == "0.21.0"


@pytest.mark.integration
def test_without_dist_info_the_version_comes_from_version_py_read_as_text(wheel_root, tmp_path):
    (tmp_path / "vllm").mkdir()
    for name in ("__init__.py", "_version.py"):
        shutil.copy(wheel_root / "vllm" / name, tmp_path / "vllm" / name)
    found = install.find_install(tmp_path)
    assert (found.version, Path(found.version_from).name) == ("0.21.0", "_version.py")


def fake_install(root: Path, version: str) -> Path:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / f"vllm-{version}.dist-info").mkdir()
    (root / f"vllm-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root


def test_a_release_without_a_lane_and_a_disagreeing_lane_are_refused(tmp_path, default_context):
    other = install.find_install(fake_install(tmp_path / "a", "0.26.0+cu130"))
    assert other.release == "0.26.0"
    with pytest.raises(ConfigError, match=r"is vLLM 0.26.0\+cu130 .*no lane is for it \(lanes: 0.21.0, 0.33.0\)"):
        install.lane_for(default_context.lanes, other, None)
    ours = install.find_install(fake_install(tmp_path / "b", "0.21.0"))
    with pytest.raises(ConfigError, match=r"--lane 0.33.0 disagrees with the vLLM under test: .* is vLLM 0.21.0"):
        install.lane_for(default_context.lanes, ours, "0.33.0")


def test_a_folder_without_vllm_is_refused_and_the_package_folder_itself_gets_a_hint(tmp_path):
    with pytest.raises(ConfigError, match=r"--vllm-path .* holds no vllm package"):
        install.find_install(tmp_path)
    pkg = fake_install(tmp_path / "site", "0.21.0") / "vllm"
    with pytest.raises(ConfigError, match=r"give the folder above it, .*site$"):
        install.find_install(pkg)


def test_an_install_that_does_not_say_its_version_is_refused(tmp_path):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    with pytest.raises(ConfigError, match="does not say its version"):
        install.find_install(tmp_path)


def test_no_importable_vllm_is_the_machine_standing_in_the_way(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "path", [str(tmp_path)])  # an interpreter path that holds no vllm
    monkeypatch.delitem(sys.modules, "vllm", raising=False)  # another test may have loaded a tree's
    with pytest.raises(EnvironmentProblem, match="no vLLM is importable in this Python"):
        install.find_install(None)


# --- the GPU through NVML --------------------------------------------------------------------


def test_no_nvidia_library_is_the_machine_standing_in_the_way():
    with pytest.raises(EnvironmentProblem, match=r"no NVIDIA driver here: libnvidia-ml-absent.so.1 cannot be loaded"):
        gpu.Nvml("libnvidia-ml-absent.so.1")


# --- the model and its size -------------------------------------------------------------------


def test_the_model_shapes_are_llama_2s_own_with_their_published_parameter_counts():
    thirteen, seven = model.plan_model(plan.DEFAULT_SINGLE), model.plan_model(plan.DEFAULT_PAIR)
    assert (thirteen.hidden, thirteen.layers, thirteen.intermediate) == (5120, 40, 13824)
    assert thirteen.params() == 13_015_864_320  # Llama-2 13B
    assert (seven.hidden, seven.layers, seven.intermediate) == (4096, 32, 11008)
    assert seven.params() == 6_738_415_616  # Llama-2 7B
    assert round(thirteen.weight_bytes() / GiB, 2) == 24.24


@pytest.mark.parametrize("gib", [0.05, 0.5, 1, 3, 12.55, 24.25, 60, 140])
def test_a_planned_model_comes_near_its_target_and_keeps_32_layers_where_it_can(gib):
    shape = model.plan_model(int(gib * GiB))
    assert shape.layers >= 1 and shape.hidden % shape.heads == 0 and shape.heads % shape.kv_heads == 0
    layer = shape.layer_params() * model.BF16
    assert abs(shape.weight_bytes() - gib * GiB) <= max(layer, 0) or shape.layers == 1
    if gib >= 1:
        assert shape.layers >= model.MIN_LAYERS


def test_the_model_folder_holds_a_llama_config_alone(tmp_path):
    shape = model.plan_model(GiB)
    folder = model.write_model(tmp_path / "m", shape)
    assert [p.name for p in folder.iterdir()] == ["config.json"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (1024, shape.layers, 32000)
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]


def test_prompts_are_the_same_token_ids_every_time_and_inside_the_vocabulary():
    first, again = model.prompts(4, 32), model.prompts(4, 32)
    assert first == again and len(first) == 4 and all(len(p) == 32 for p in first)
    assert all(100 <= t < model.VOCAB for p in first for t in p)


# --- the scenario plan and the sizes --------------------------------------------------------


def test_scenarios_by_letter_name_and_list_keep_the_issues_order():
    assert [s.key for s in plan.select(["e", "rotation", "d2,a"])] == ["a", "c", "d2", "e"]
    assert plan.select(None) == plan.SCENARIOS
    assert [s.key for s in plan.select(None, quick=True)] == ["a"]
    assert [s.key for s in plan.select(["b"], quick=True)] == ["b"]


def test_an_unknown_scenario_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown scenario 'rotaton' \(did you mean 'rotation'\?\)"):
        plan.select(["rotaton"])


def test_each_scenario_runs_on_every_tree_both_columns_together():
    trees = [plan.Tree("pristine", Path("/p"), (Path("/p"),)), plan.Tree("patched", Path("/c"), (Path("/c"), Path("/p")))]
    got = [(s.key, t.label) for s, t in plan.runs(trees, plan.select(["a", "d1"]))]
    assert got == [("a", "pristine"), ("a", "patched"), ("d1", "pristine"), ("d1", "patched")]


def test_sizes_on_an_h100_are_the_issues_engines():
    sizes = plan.plan_sizes(plan.SCENARIOS, H100["free"], H100["total"], H100["host"])
    assert (sizes.single.shape.hidden, sizes.single.shape.layers) == (5120, 40)
    assert (sizes.pair.shape.hidden, sizes.pair.shape.layers) == (4096, 32)
    assert sizes.single.kv_cache_bytes == sizes.single.weight_bytes // 2 // plan.MiB * plan.MiB
    assert sizes.single.gpu_memory_utilization == 0.5 and sizes.pair.gpu_memory_utilization == 0.28
    assert (sizes.swaps, sizes.cycles, sizes.fixed_cycles, sizes.ceiling_bytes, sizes.max_tokens) == (6, 10, 20, 4 * GiB, 32)
    settings = sizes.single.settings(Path("/m"))
    assert settings["kv_cache_bytes"] == sizes.single.kv_cache_bytes and settings["max_model_len"] == 1024


def test_quick_is_one_small_engine_without_ceilings():
    sizes = plan.plan_sizes(plan.select(None, quick=True), H100["free"], H100["total"], H100["host"], quick=True)
    assert sizes.pair is None and sizes.ceiling_bytes is None
    assert sizes.single.shape.layers == 37 and sizes.single.shape.hidden == 1024
    assert (sizes.prompts, sizes.max_tokens) == (2, 8)


def test_a_size_that_does_not_fit_the_gpu_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match=r"too little free GPU memory: one engine of 24.2\d GiB of weights .* "
                                          r"the GPU has 30.0 GiB free of 79.6: give a smaller --model-gib"):
        plan.plan_sizes(plan.select(["a"]), 30 * GiB, H100["total"], H100["host"], model_gib=24.25)
    with pytest.raises(ConfigError, match=r"too little free GPU memory: one engine .* free GPU memory \(stop what"):
        plan.plan_sizes(plan.select(["a"]), 4 * GiB, H100["total"], H100["host"])
    fits = plan.plan_sizes(plan.select(["a"]), 8 * GiB, H100["total"], H100["host"])
    assert fits.single.weight_bytes <= 8 * GiB // 3 + fits.single.shape.layer_params() * model.BF16


def test_two_engines_need_room_for_the_sleeping_ones_residue():
    alone = plan.plan_sizes(plan.select(["a"]), 23 * GiB, H100["total"], H100["host"], model_gib=12)
    assert alone.pair is None and alone.single.gpu_memory_utilization == 0.27  # 21.5 GiB
    with pytest.raises(ConfigError, match="too little free GPU memory: two engines .* need 24.0 GiB"):
        plan.plan_sizes(plan.select(["c"]), 23 * GiB, H100["total"], H100["host"], model_gib=12)


def test_backups_that_may_not_fit_the_hosts_memory_are_refused():
    with pytest.raises(ConfigError, match=r"too little host memory: the backups of two engines .* may take 50.2 GiB"):
        plan.plan_sizes(plan.select(["c"]), H100["free"], H100["total"], 40 * GiB)


def test_fewer_than_four_swaps_are_refused():
    with pytest.raises(ConfigError, match="--swaps must be at least 4"):
        plan.plan_sizes(plan.select(["c"]), H100["free"], H100["total"], H100["host"], swaps=3)


def test_the_release_table_reads_each_lanes_row():
    assert releases.api_for("0.21.0").level1_offloads == ("weights",)
    assert releases.api_for("0.26.0").since == "0.21.0"
    assert releases.api_for("0.33.0+cu130").level2_offloads == ("runtime", "cudagraph")
    kwargs = releases.engine_kwargs(plan.plan_sizes(plan.select(["a"]), *H100.values()).single.settings(Path("/m")))
    assert kwargs["load_format"] == "dummy" and kwargs["skip_tokenizer_init"] and kwargs["enable_sleep_mode"]
    assert kwargs["attention_backend"] == "TRITON_ATTN" and kwargs["enforce_eager"]


# --- the patched copy, against the real wheel's layout ----------------------------------------


@pytest.fixture(scope="session")
def patched_copy(wheel_root, default_context, tmp_path_factory):
    """The tool's own patched copy of the wheel's install (the extension built here)."""
    found = install.find_install(wheel_root)
    lane = install.lane_for(default_context.lanes, found, None)
    work = tmp_path_factory.mktemp("work")
    facts, natives = copies.prepare_patched(found, lane, default_context.source, work, default_context.progress)
    return found, facts, natives


@pytest.mark.integration
@pytest.mark.native
def test_the_copys_patched_files_are_the_lanes_patched_tree_and_the_rest_are_hard_links(patched_copy, patched_tree):
    found, facts, _ = patched_copy
    replaced = {r["path"] for r in facts.replaced}
    assert "vllm/device_allocator/cumem.py" in replaced and "vllm/cumem_allocator.abi3.so" in replaced
    # every vllm/ file the lane's series installs, and the extension it rebuilds
    assert replaced == set(installed_paths(load_series(Path(__file__).resolve().parents[1] / "patches" / "0.21.0" / "series")))
    for path in replaced - {"vllm/cumem_allocator.abi3.so"}:
        assert (facts.root / path).read_bytes() == (patched_tree / path).read_bytes(), path
    for rel in (p.relative_to(found.root) for p in found.package.rglob("*") if p.is_file()):
        ours = (facts.root / rel).stat()
        theirs = (found.root / rel).stat()
        if str(rel) in replaced:
            assert ours.st_ino != theirs.st_ino, rel
        else:
            assert (ours.st_ino, ours.st_dev) == (theirs.st_ino, theirs.st_dev), rel
    existing = sum(1 for p in found.root.rglob("*") if p.is_file())
    assert facts.copied == 0 and facts.linked == existing - sum(r["pre_image_sha256"] is not None for r in facts.replaced)


@pytest.mark.integration
@pytest.mark.native
def test_the_install_is_never_written_through_a_link(patched_copy, wheel_root):
    _, facts, natives = patched_copy
    with zipfile.ZipFile(cached_wheel()) as whl:
        for r in facts.replaced:
            if r["pre_image_sha256"] is not None:
                assert (wheel_root / r["path"]).read_bytes() == whl.read(r["path"]), r["path"]
                assert copies.sha256_of(whl.read(r["path"])) == r["pre_image_sha256"]
    assert not (wheel_root / "vllm" / "device_allocator" / "cumem_backup_pool.py").exists()
    [built] = natives
    assert built["built_on"] == "host" and "libcuda.so.1" in built["links"]
    assert built["built_from"]["patches"] == native_fixes("0.21.0")


@pytest.mark.integration
def test_an_install_whose_file_differs_from_the_release_is_refused_naming_the_hunk(wheel_root, default_context, tmp_path):
    site = tmp_path / "site"
    shutil.copytree(wheel_root, site)
    cumem = site / "vllm" / "device_allocator" / "cumem.py"
    cumem.write_text(cumem.read_text().replace("def _python_free_callback", "def _python_free_callback_renamed"))
    found = install.find_install(site)
    with pytest.raises(ApplyError, match=r"the vLLM installed at .*site/vllm: patch cumem-stream-aware-free does "
                                         r"not apply to .*/device_allocator/cumem.py: hunk"):
        copies.plan_patched(found, install.lane_for(default_context.lanes, found, None), default_context.source)


def test_link_tree_links_files_keeps_links_and_leaves_out_bytecode(tmp_path):
    src = tmp_path / "src"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("a = 1\n")
    (src / "pkg" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"stale")
    (src / "pkg" / "link.py").symlink_to("a.py")
    assert copies.link_tree(src, tmp_path / "dest") == (1, 1)
    assert (tmp_path / "dest" / "pkg" / "a.py").stat().st_ino == (src / "pkg" / "a.py").stat().st_ino
    assert os.readlink(tmp_path / "dest" / "pkg" / "link.py") == "a.py"
    assert not (tmp_path / "dest" / "pkg" / "__pycache__").exists()
    copies.replace_file(tmp_path / "dest" / "pkg" / "a.py", b"a = 2\n", 0o644)
    assert (src / "pkg" / "a.py").read_text() == "a = 1\n"


# --- the protocol -------------------------------------------------------------------------------


def test_requests_round_trip_and_anything_else_is_refused():
    assert protocol.parse_request(protocol.request("sleep", level=1)) == ("sleep", {"level": 1})
    with pytest.raises(protocol.ProtocolError, match="unknown command 'nap'"):
        protocol.request("nap")
    for line in ("not json\n", "[1, 2]\n", '{"cmd": "nap"}\n', '{"cmd": "sleep", "args": 3}\n'):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_request(line)


def test_an_error_is_one_line_cut_to_a_limit():
    exc = RuntimeError("Call to sleep method failed:\n  CuMemAllocator: sleep failed\n")
    assert protocol.sentence(exc) == "RuntimeError: Call to sleep method failed: CuMemAllocator: sleep failed"
    assert len(protocol.sentence("x" * 5000)) == protocol.ERROR_LIMIT
    assert protocol.failed_reply(1.5, "boom") == {"ok": False, "seconds": 1.5, "error": "boom"}


# --- sessions in their own process groups (the fake session) ----------------------------------


def start_fake(groups: procs.Groups, tmp_path: Path, *flags: str) -> procs.Child:
    return groups.start([*FAKE_SESSION, *flags], dict(os.environ), tmp_path / "fake.log", "fake", echo=False)


def gone(pid: int, within: float = 10.0) -> bool:
    """The process ended (a zombie counts: it holds nothing)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def test_a_session_answers_each_request_with_one_reply(tmp_path):
    with procs.groups() as groups:
        child = start_fake(groups, tmp_path, "--fail-on", "wake")
        assert child.next_message(30)["event"] == "ready"
        reply = child.ask("generate", 30, prompts=[[1, 2], [3]], max_tokens=3)
        assert reply["ok"] and reply["tokens"] == [[3, 10, 17], [3, 10, 17]]
        assert child.ask("sleep", 30, level=1)["ok"]
        failed = child.ask("wake", 30)
        assert failed == {"ok": False, "seconds": 0.01, "error": "Exception: Call to wake method failed: injected"}
        assert child.ask("exit", 30)["ok"]
        assert child.exit_code(wait=30) == 0


def test_a_session_that_dies_is_a_reply_with_its_last_words(tmp_path):
    with procs.groups() as groups:
        child = start_fake(groups, tmp_path, "--die-on", "generate")
        child.next_message(30)
        reply = child.ask("generate", 30, prompts=[[1]], max_tokens=1)
        assert reply["ok"] is False and reply["died"]
        assert reply["error"].startswith("fake exited (code 134): ")
        assert reply["error"].endswith("CUDA error: an illegal memory access was encountered")
        assert child.ask("sleep", 30, level=1)["error"] == "fake had exited (code 134)"


def test_a_session_that_dies_while_its_engine_core_keeps_the_pipe_open_is_seen_dead_at_once(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    with procs.groups() as groups:
        child = start_fake(groups, tmp_path, "--die-on", "sleep", "--grandchild", str(pid_file))
        child.next_message(30)
        start = time.monotonic()
        reply = child.ask("sleep", 60, level=1)
        assert reply["died"] and "code 134" in reply["error"] and time.monotonic() - start < 10
        grandchild = int(pid_file.read_text())
        assert not gone(grandchild, within=0.1)  # alive until the group is ended
    assert gone(grandchild)


def test_a_session_that_hangs_is_ended_with_its_engine_core_when_the_call_times_out(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    with procs.groups() as groups:
        child = start_fake(groups, tmp_path, "--hang-on", "sleep", "--grandchild", str(pid_file))
        assert child.next_message(30)["event"] == "ready"
        grandchild = int(pid_file.read_text())
        assert os.getpgid(grandchild) == child.pid  # the engine core's stand-in shares the group
        reply = child.ask("sleep", 1, level=1)
        assert reply["timed_out"] and reply["error"] == "fake: no answer within 1 s"
        assert gone(child.pid) and gone(grandchild)


def test_every_group_ends_with_the_block_even_when_it_raises(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    with pytest.raises(RuntimeError, match="scenario broke"), procs.groups() as groups:
        child = start_fake(groups, tmp_path, "--grandchild", str(pid_file))
        child.next_message(30)
        raise RuntimeError("scenario broke")
    assert gone(child.pid) and gone(int(pid_file.read_text()))
    assert groups.started == 1


# The driver stands for the check run from a terminal, where Ctrl-C raises KeyboardInterrupt.
# A test run started as a background job (`cmd &` in a shell without job control) inherits
# SIGINT ignored, and Python then installs no handler of its own: the driver restores it.
DRIVER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from sm12x_bundle.enginecheck import procs
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fake, pid_file, log = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    with procs.groups() as groups:
        child = groups.start([sys.executable, fake, "--hang-on", "sleep", "--grandchild", pid_file],
                             dict(os.environ), log, "fake", echo=False)
        child.next_message(30)
        print(child.pid, flush=True)
        child.ask("sleep", 3600, level=1)
""")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_ends_every_group_the_check_started(tmp_path, signum):
    pid_file = tmp_path / "grandchild.pid"
    env = {**os.environ, "PYTHONPATH": str(Path(procs.__file__).resolve().parents[2])}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, FAKE_SESSION[1], str(pid_file), str(tmp_path / "log")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    session = int(driver.stdout.readline())
    grandchild = int(pid_file.read_text())
    time.sleep(0.3)  # the driver waits for the hung sleep's reply
    driver.send_signal(signum)
    _, err = driver.communicate(timeout=60)
    assert "KeyboardInterrupt" in err
    assert gone(session) and gone(grandchild)


def test_the_engine_core_is_found_among_the_sessions_descendants(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    with procs.groups() as groups:
        child = start_fake(groups, tmp_path, "--grandchild", str(pid_file))
        child.next_message(30)
        grandchild = int(pid_file.read_text())
        assert hostmem.descendants(child.pid) == [grandchild]
        core = hostmem.engine_core(child.pid)
        assert core["pid"] == grandchild and core["rss_bytes"] > 0 and core["name"].startswith(sys.executable)
        assert core["is_engine_core"] is False  # found as the largest descendant, not by vLLM's name
        assert set(hostmem.snapshot(child.pid)["session"]) == {"rss_bytes", "locked_bytes", "pinned_bytes"}
    assert hostmem.status(grandchild) is None or gone(grandchild)


def fake_bench(tmp_path: Path, groups: procs.Groups, *flags: str, scenario: str = "a") -> bench.Bench:
    sizes = plan.plan_sizes(plan.select([scenario]), *H100.values(), quick=True, swaps=4)
    models = {"single": tmp_path / "model", "pair": tmp_path / "model"}
    return bench.Bench(groups, None, sizes, models, None, None, tmp_path,
                       model.prompts(2, 4), call_timeout=5, start_timeout=30, session=(*FAKE_SESSION, *flags))


def test_an_engine_that_does_not_start_ends_the_scenario_as_an_error(tmp_path):
    tree = plan.Tree("patched", tmp_path, (tmp_path,))
    with procs.groups() as groups:
        b = fake_bench(tmp_path, groups, "--fail-start")
        f = Finding("a", "patched")
        with bench.recording(f), b.engine(tree, "single", "patched-cycles"):
            pytest.fail("the engine started")
    log = tmp_path / "logs" / "patched-cycles.log"
    assert f.outcome() == ("error", f"patched-cycles: the engine did not start: RuntimeError: no CUDA GPU (log: {log})")


def test_an_engine_that_imported_another_vllm_than_the_trees_is_refused(tmp_path):
    tree = plan.Tree("patched", tmp_path / "copy", (tmp_path / "copy",))
    with procs.groups() as groups:
        b = fake_bench(tmp_path, groups, "--vllm-file", "/usr/lib/python3/dist-packages/vllm/__init__.py")
        f = Finding("a", "patched")
        with bench.recording(f), b.engine(tree, "single", "patched-cycles"):
            pytest.fail("the engine was used")
    stray = "/usr/lib/python3/dist-packages/vllm/__init__.py"
    assert f.outcome() == ("error", f"patched-cycles: the engine loaded vllm_file {stray}, not from {tmp_path / 'copy'}")


def test_a_call_the_scenario_needs_that_fails_ends_it_as_a_failure_with_the_engines_words(tmp_path):
    tree = plan.Tree("pristine", tmp_path, (tmp_path,))
    with procs.groups() as groups:
        b = fake_bench(tmp_path, groups, "--fail-on", "wake")
        f = Finding("a", "pristine")
        with bench.recording(f), b.engine(tree, "single", "pristine-cycles") as e:
            ref = e.generate("generate before the first sleep")
            e.must("sleep", "sleep 1", level=1)
            f.tokens("cycle 1", ref, e.generate("generate"))
            e.must("wake", "wake 1")
        child = e.child
    assert f.outcome() == ("fail", "wake 1 failed: Exception: Call to wake method failed: injected")
    assert f.figures["tokens_identical"] is True and not child.alive()


def test_a_weight_changed_in_place_is_what_the_engine_serves_after_the_next_wakes(tmp_path):
    tree = plan.Tree("patched", tmp_path, (tmp_path,))
    with procs.groups() as groups:
        f = changed.weight_changed(fake_bench(tmp_path, groups), tree)
    assert f.outcome()[0] == "pass", f.outcome()
    assert f.figures["changed"] is True and f.figures["tokens_identical"] is True and len(f.figures["sleeps"]) == 3
    assert f.figures["sleeps"][0]["copied_bytes"] is None  # the stand-in's allocator does not say


def test_a_wake_that_restores_the_weights_from_before_the_change_is_a_stale_backup(tmp_path):
    tree = plan.Tree("patched", tmp_path, (tmp_path,))
    with procs.groups() as groups:
        f = changed.weight_changed(fake_bench(tmp_path, groups, "--stale-wake"), tree)
    outcome, words = f.outcome()
    assert outcome == "fail" and changed.STALE in words and f.figures["tokens_identical"] is False


def test_the_changed_weights_tokens_come_from_a_full_prefill_as_every_generate_after_a_wake(tmp_path):
    # The stand-in parts from a full prefill when every prompt is in its prefix cache, as
    # pristine 0.33.0 did at token 14 on 2026-11-29: the check empties the cache first.
    tree, said = plan.Tree("pristine", tmp_path, (tmp_path,)), []
    with procs.groups() as groups:
        b = fake_bench(tmp_path, groups, "--cached-prefix-differs")
        b.progress = SimpleNamespace(say=said.append)
        f = changed.weight_changed(b, tree)
    assert f.outcome()[0] == "pass", f.outcome()
    calls = [line.split(": ")[2].split(" ")[0] for line in said if line.startswith("engine-check: pristine-weight-changed: ")]
    assert calls[calls.index("perturb"):][:3] == ["perturb", "reset", "generate"]


def test_the_weight_change_rolls_lm_heads_rows_in_place_and_moves_every_greedy_token():
    torch = pytest.importorskip("torch")
    from sm12x_bundle.enginecheck import inject

    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(8, 16, bias=False)
    worker = SimpleNamespace(rank=1, model_runner=SimpleNamespace(get_model=lambda: model))
    hidden = torch.randn(4, 8)
    where, before = model.lm_head.weight.data_ptr(), model.lm_head(hidden).argmax(-1)
    assert inject.perturb_weights(worker, "1") == {"rank": 1, "changed": "lm_head.weight", "shape": [16, 8],
                                                   "rows_rolled": 1}
    assert model.lm_head.weight.data_ptr() == where  # in place: the allocation the backup is of
    assert torch.equal(model.lm_head(hidden).argmax(-1), (before + 1) % 16)
    early_stage = SimpleNamespace(model_runner=SimpleNamespace(get_model=torch.nn.Module))
    assert inject.perturb_weights(early_stage, 1) == {"rank": 0, "changed": None}


def test_the_allocator_state_says_what_the_last_sleep_copied_where_the_allocator_records_it():
    from sm12x_bundle.enginecheck import inject

    skip = SimpleNamespace(last_sleep_copied_bytes=5, last_sleep_skipped_bytes=7, last_sleep_checksum_s=0.1)
    assert inject._last_sleep(skip) == {"last_sleep_copied_bytes": 5, "last_sleep_skipped_bytes": 7,
                                        "last_sleep_checksum_s": 0.1, "last_sleep_stages": None,
                                        "last_wake_up_stages": None, "background_fill": None}
    assert set(inject._last_sleep(SimpleNamespace()).values()) == {None}


def test_address_runs_count_the_back_to_back_ranges():
    from sm12x_bundle.enginecheck.inject import address_runs

    assert address_runs([]) == 0
    assert address_runs([(0x3000, 0x1000), (0x1000, 0x1000), (0x2000, 0x1000)]) == 1  # in any order
    assert address_runs([(0x1000, 0x1000), (0x2000, 0x800), (0x3000, 0x1000)]) == 2  # a gap after 0x2800
    assert address_runs([(0x1000, 0x100), (0x9000, 0x100)]) == 2


def test_the_allocator_state_reports_the_background_fill_where_the_allocator_has_one():
    from sm12x_bundle.enginecheck import inject

    done = {"filled_bytes": 5, "seconds": 0.2, "state": "done", "dropped": 1}
    fill = SimpleNamespace(figures=lambda: done)
    assert inject._last_sleep(SimpleNamespace(background_fill=fill))["background_fill"] == done
    assert inject._last_sleep(SimpleNamespace(background_fill=None))["background_fill"] is None  # the skip off
    assert inject._last_sleep(SimpleNamespace(background_fill=object()))["background_fill"] is None  # no figures()
    assert inject._last_sleep(SimpleNamespace())["background_fill"] is None  # pristine


def test_a_workers_gc_collect_is_timed_with_the_objects_frozen_out_of_it():
    import gc
    from sm12x_bundle.enginecheck import inject, probe

    loose = inject.gc_collect_time(SimpleNamespace(rank=1))
    assert set(loose) == {"rank", "pid", "seconds", "frozen"} and (loose["rank"], loose["pid"]) == (1, os.getpid())
    assert isinstance(loose["seconds"], float) and loose["seconds"] > 0
    gc.freeze()  # as the patched series does after warm-up
    try:
        frozen = probe.Probe.sm12x_gc(SimpleNamespace(rank=0))  # the serve driver's name for it
        assert frozen["frozen"] == gc.get_freeze_count() > loose["frozen"]
    finally:
        gc.unfreeze()


def test_the_api_session_times_gc_collect_on_every_rank_through_collective_rpc():
    import json
    from sm12x_bundle.enginecheck import session

    workers = [SimpleNamespace(rank=0), SimpleNamespace(rank=1)]
    llm = SimpleNamespace(collective_rpc=lambda fn, args=(): [fn(w, *args) for w in workers])
    cmd, reply = session.answer(llm, json.dumps({"cmd": "gc", "args": {}}))
    assert cmd == "gc" and reply["ok"], reply
    assert [(r["rank"], r["pid"]) for r in reply["ranks"]] == [(0, os.getpid()), (1, os.getpid())]


def test_the_api_session_times_the_map_calls_on_every_rank_and_the_probe_passes_its_arguments(monkeypatch):
    import json
    import sys
    import types
    from sm12x_bundle.enginecheck import probe, session, vmm

    asked, beside = [], []

    class Copies:  # the copies the probe's maps run beside, by the copy engine and by a kernel
        BY = ("copy engine", "kernel")

        def __init__(self, torch, device, by):
            self.by = by

        def gbps(self):
            return 50.0 if self.by == "kernel" else 55.0

        def start(self):
            return lambda: False

    monkeypatch.setattr(vmm, "QueuedCopies", Copies)
    monkeypatch.setattr(vmm, "call_times", lambda device, count, size, ext, busy=None: asked.append(
        (device, count, size, ext)) or beside.append(sorted(busy)) or {"count": count, "size": size})
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=SimpleNamespace(
        current_device=lambda: 3, empty_cache=lambda: None)))
    fake_ext = types.ModuleType("vllm.cumem_allocator")
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    monkeypatch.setitem(sys.modules, "vllm.cumem_allocator", fake_ext)
    monkeypatch.setattr(sys.modules["vllm"], "cumem_allocator", fake_ext, raising=False)
    workers = [SimpleNamespace(rank=0), SimpleNamespace(rank=1)]
    llm = SimpleNamespace(collective_rpc=lambda fn, args=(): [fn(w, *args) for w in workers])
    cmd, reply = session.answer(llm, json.dumps({"cmd": "maps", "args": {"count": 20, "size_mib": 4}}))
    assert cmd == "maps" and reply["ok"], reply
    assert [(r["rank"], r["count"], r["size"]) for r in reply["ranks"]] == [(0, 20, 4 << 20), (1, 20, 4 << 20)]
    assert reply["ranks"][0]["copy_gbps"] == {"copy engine": 55.0, "kernel": 50.0}
    assert beside[0] == ["copies by the copy engine", "copies by the kernel"]
    assert probe.Probe.sm12x_maps(SimpleNamespace(rank=1), "7", "2")["count"] == 7  # the serve driver's strings
    assert asked[-1] == (3, 7, 2 << 20, fake_ext)
    alone = session.map_times(llm, 5, 1, only_rank=1)["ranks"]
    assert alone[0] == {"rank": 0, "pid": os.getpid(), "skipped": True} and alone[1]["count"] == 5
    assert len(asked) == 4  # rank 0 timed nothing the last time


class NoGpu:
    """NVML's answer for a machine without a GPU: nothing in use."""

    def used(self) -> int:
        return 0


def cycles_run(tmp_path: Path, *flags: str) -> tuple[Finding, str]:
    """Scenario a through the fake session; its progress output beside it."""
    import io

    from sm12x_bundle.progress import Progress

    tree, said = plan.Tree("pristine", tmp_path, (tmp_path,)), io.StringIO()
    with procs.groups() as groups:
        b = fake_bench(tmp_path, groups, *flags)
        b.gpu, b.progress = NoGpu(), Progress(said)
        return scenarios.cycles(b, tree), said.getvalue()


def test_scenario_a_times_one_gc_collect_in_every_worker_after_the_cycles(tmp_path):
    f, said = cycles_run(tmp_path)
    assert f.outcome()[0] == "pass", f.outcome()
    assert [(r["rank"], r["seconds"], r["frozen"]) for r in f.figures["gc_collect"]] == [(0, 0.45, 0)]
    assert said.rindex("pristine-cycles: wake ") < said.index("pristine-cycles: gc ")  # after the cycles


def test_a_gc_collect_that_cannot_be_timed_is_recorded_as_none_and_fails_nothing(tmp_path):
    f, said = cycles_run(tmp_path, "--fail-on", "gc")
    assert f.outcome()[0] == "pass", f.outcome()
    assert "gc_collect" in f.figures and f.figures["gc_collect"] is None
    assert "pristine-cycles: gc.collect() not timed: Exception: Call to gc method failed: injected" in said


def rotation_run(tmp_path: Path, *flags: str) -> Finding:
    tree = plan.Tree("patched", tmp_path, (tmp_path,))
    with procs.groups() as groups:
        return rotation.rotation(fake_bench(tmp_path, groups, *flags, scenario="c"), tree)


def test_each_swap_records_what_its_sleep_copied_and_its_wakes_stages_and_bs_fill_before(tmp_path):
    f = rotation_run(tmp_path, "--records")
    assert f.outcome()[0] == "pass", f.outcome()
    swaps = f.figures["swaps"]
    assert [(s["sleeps"], s["copied_bytes"], s["skipped_bytes"]) for s in swaps] == [
        ("B", GiB, 0), ("A", 0, GiB), ("B", 0, GiB), ("A", 0, GiB)]  # each engine's first sleep copies
    assert all(s["wake_stages"] == [{"map_restored_s": 0.01, "copy_s": 0.02, "map_emptied_s": 0.01,
                                     "copied_bytes": GiB}] for s in swaps)
    assert f.figures["b_fill_before_first_sleep"] == [{"filled_bytes": GiB, "seconds": 0.5, "state": "done",
                                                       "dropped": 0}]
    assert f.figures["a_first_sleep_checksum_s"] == [0.004] and all(s["checksum_s"] == [0.004] for s in swaps)
    assert f.figures["allocations"] == {"weights": [4]}  # the stand-in's one rank
    assert all(s["sleep_stages"] == [{"checksum_s": 0.004, "unmap_s": 0.03, "unmapped": 4,
                                      "gc_and_empty_cache_s": 0.001}] for s in swaps)


def test_the_first_swap_waits_for_bs_background_fill_and_records_the_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(rotation, "FILL_POLL_S", 0.01)
    f = rotation_run(tmp_path, "--records", "--fill-running", "3")
    assert f.outcome()[0] == "pass", f.outcome()
    assert [r["state"] for r in f.figures["b_fill_before_first_sleep"]] == ["done"]
    assert f.figures["b_fill_waited_s"] >= 0.02  # three polls said running
    f.figures["b_fill_waited_s"] = 0.52
    assert dict(table_rows("c", f.figures))["B's fill before its first sleep"] == \
        "1.00 GiB in 0.50 s, done (the check waited 0.52 s)"


def test_a_fill_still_running_after_the_longest_wait_is_timed_as_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(rotation, "FILL_POLL_S", 0.01)
    monkeypatch.setattr(rotation, "FILL_WAIT_S", 0.05)
    f = rotation_run(tmp_path, "--records", "--fill-running", "100000")
    assert f.outcome()[0] == "pass", f.outcome()
    assert [r["state"] for r in f.figures["b_fill_before_first_sleep"]] == ["running"]
    assert 0.05 <= f.figures["b_fill_waited_s"] < 5


def test_after_the_swaps_each_engine_times_the_map_calls_in_its_own_workers(tmp_path):
    import io

    from sm12x_bundle.progress import Progress

    tree, said = plan.Tree("patched", tmp_path, (tmp_path,)), io.StringIO()
    with procs.groups() as groups:
        b = fake_bench(tmp_path, groups, "--records", scenario="c")
        b.progress = Progress(said)
        f = rotation.rotation(b, tree)
    assert f.outcome()[0] == "pass", f.outcome()
    assert set(f.figures["map_calls"]) == {"A", "B"}  # one rank: no second call for it alone
    assert all(r[0]["best_s"]["extension create_and_map"] == 0.0146 for r in f.figures["map_calls"].values())
    said = said.getvalue()
    assert "engine-check: A: rank 0: the extension's create_and_map 73 us per allocation (200 x 12 MiB)" in said


def test_with_several_ranks_the_map_calls_are_timed_on_every_rank_then_on_rank_0_alone():
    def one(rank, us):
        return {"rank": rank, "count": 200, "size": 12 << 20, "best_s": {
            "extension create_and_map": us * 2e-4,
            "extension create_and_map, copies by the copy engine running": 4 * us * 2e-4}}

    class TwoRanks:
        def __init__(self):
            self.asked = []

        def map_calls(self, only_rank=""):
            self.asked.append(only_rank)
            if only_rank == "":
                return [one(0, 300), one(1, 350)]
            return [one(0, 220), {"rank": 1, "skipped": True}]

    said = []
    engines = {"A": TwoRanks(), "B": TwoRanks()}
    out = rotation.map_calls(SimpleNamespace(progress=SimpleNamespace(say=said.append)), engines)
    assert engines["A"].asked == ["", 0] and set(out) == {"A", "A rank 0 alone", "B", "B rank 0 alone"}
    assert "engine-check: A rank 0 alone: rank 0: the extension's create_and_map 220 us per allocation, " \
           "880 us with copies queued (200 x 12 MiB)" in said
    assert not any("rank 1" in line and "alone" in line for line in said)  # the skipped rank says nothing


def test_map_calls_an_engine_cannot_time_are_none_and_fail_nothing(tmp_path):
    f = rotation_run(tmp_path)  # this stand-in answers maps with no ranks
    assert f.outcome()[0] == "pass", f.outcome()
    assert f.figures["map_calls"] == dict.fromkeys(("A", "A rank 0 alone", "B", "B rank 0 alone"))


def test_the_allocation_counts_are_per_tag_and_rank_and_none_where_no_rank_says():
    state = {"ranks": [{"tags": {"weights": {"allocations": 500}, "kv_cache": {"allocations": 123}}},
                       {"tags": {"weights": {"allocations": 498}}}]}
    assert rotation.allocation_counts(state) == {"kv_cache": [123, None], "weights": [500, 498]}
    assert rotation.allocation_counts({"error": "the state call failed"}) is None


def test_swaps_of_an_allocator_that_keeps_no_records_say_none(tmp_path):
    f = rotation_run(tmp_path)
    assert f.outcome()[0] == "pass", f.outcome()
    assert {(s["copied_bytes"], s["skipped_bytes"], s["wake_stages"], s["checksum_s"], s["sleep_stages"])
            for s in f.figures["swaps"]} == {(None,) * 5}
    assert f.figures["a_first_sleep_checksum_s"] is None
    assert f.figures["b_fill_before_first_sleep"] is None
    rotation.rotation_figures(CEILINGS, f.figures)
    assert f.figures["wake_copy_ratios"] == []
    rows = dict(table_rows("c", f.figures))
    assert rows["sleeps copied / skipped"] == "-" and rows["steady wakes' stages"] == "not reported"
    assert rows["B's fill before its first sleep"] == "-"


def table_rows(key: str, figures: dict) -> list[tuple[str, str]]:
    result = report.ScenarioResult(key, "patched", "pass", "", 1, figures)
    return [(name, cell(result)) for name, cell in table.ROWS[key]]


def test_a_change_that_moves_no_token_is_an_error_not_a_pass(tmp_path, monkeypatch):
    monkeypatch.setattr(changed, "SEED", 32000)  # the stand-in's tokens are modulo 32000: no change
    tree = plan.Tree("patched", tmp_path, (tmp_path,))
    with procs.groups() as groups:
        f = changed.weight_changed(fake_bench(tmp_path, groups, "--stale-wake"), tree)
    assert f.outcome() == ("error", "the weight changed in place changed no token: a stale wake could not be told apart")
    assert f.figures["changed"] is False and "tokens_identical" not in f.figures


# --- figures, targets, the verdict and the report ----------------------------------------------

def test_speed_figures_set_each_sleep_and_wake_against_the_ceilings():
    figs = cycles_figures([0.51, 0.5, 0.48], [0.59, 0.6, 0.62])
    assert figs["first_sleep_ratio"] == pytest.approx(WEIGHTS_13B / 55e9 / 0.51)
    assert figs["later_sleep_ratio"] == pytest.approx(WEIGHTS_13B / 55e9 / 0.48)
    assert figs["wake_ratio"] == pytest.approx(WEIGHTS_13B / 53e9 / 0.59)
    assert figs["freed_share"] == 1.0 and figs["later_sleeps_s"] == [0.5, 0.48]
    bare = {"sleeps_s": [1.0], "wakes_s": [1.0], "offloaded_bytes": 1}
    scenarios.speed_figures(None, bare)
    assert "first_sleep_ratio" not in bare  # --quick: no ceilings, no ratios


def test_the_first_wakes_stages_are_read_from_every_rank_and_the_slowest_copy_judged():
    rank = {"map_restored_s": 0.04, "copy_s": 0.5, "map_emptied_s": 0.03, "copied_bytes": WEIGHTS_13B}
    slow = {**rank, "copy_s": 0.6}
    state = {"ranks": [{"rank": 0, "last_wake_up_stages": rank}, {"rank": 1, "last_wake_up_stages": slow}]}
    assert scenarios.wake_stages(state) == [rank, slow]
    state["ranks"][1]["last_wake_up_stages"] = None  # a rank of an allocator without the record
    assert scenarios.wake_stages(state) is None
    assert scenarios.wake_stages({"last_wake_up_stages": rank}) == [rank]  # one rank, not in a list
    figs = cycles_figures([0.51, 0.5, 0.5], [0.59] * 3, [rank, slow])
    assert figs["wake_copy_ratio"] == pytest.approx(WEIGHTS_13B / 53e9 / 0.6)
    assert "wake_copy_ratio" not in cycles_figures([0.51, 0.5, 0.5], [0.59] * 3)  # pristine keeps no record


def test_scenario_as_table_shows_the_slowest_ranks_gc_collect_and_its_frozen_objects():
    ranks = [{"rank": 0, "seconds": 0.44, "frozen": 0}, {"rank": 1, "seconds": 0.46, "frozen": 0}]
    res = [report.ScenarioResult("a", "pristine", "pass", "ok", 9, {"gc_collect": ranks}),
           report.ScenarioResult("a", "patched", "pass", "ok", 9,
                                 {"gc_collect": [{"rank": 0, "seconds": 0.002, "frozen": 412_345}]})]
    rows = table.scenario_block(compare_report(res), "a")
    assert any(r.split() == ["a", "worker's", "gc.collect()", "0.46", "s", "(0", "frozen)", "0.002", "s",
                             "(412,345", "frozen)"] for r in rows), rows
    res = [report.ScenarioResult("a", label, "pass", "ok", 9, {"gc_collect": None}) for label in ("pristine", "patched")]
    rows = table.scenario_block(compare_report(res), "a")
    assert [r.split() for r in rows if "gc.collect()" in r] == [["a", "worker's", "gc.collect()", "-", "-"]]


def test_rotation_figures_set_the_first_swap_against_the_steady_ones_and_the_ceilings():
    figs = rotation_figures(0.61, [0.60, 0.61, 0.60, 0.62, 0.60])
    assert figs["first_swap_s"] == pytest.approx(0.61) and figs["steady_median_s"] == pytest.approx(0.60)
    assert figs["first_over_steady"] == pytest.approx(0.61 / 0.60)
    assert figs["first_over_its_direction"] == pytest.approx(0.61 / statistics.median([0.61, 0.62]))  # swaps 3 and 5
    assert figs["ideal_swap_s"] == pytest.approx(WEIGHTS_7B / 55e9 + WEIGHTS_7B / 53e9)
    assert figs["steady_over_ideal"] == pytest.approx(0.62 / figs["ideal_swap_s"])
    assert figs["one_copy_s"] == pytest.approx(WEIGHTS_7B / 53e9)  # the weights at the H2D ceiling
    assert figs["steady_over_one_copy"] == pytest.approx(0.60 / figs["one_copy_s"])


def test_each_steady_wakes_copy_is_set_against_the_h2d_ceiling_on_its_slowest_rank():
    fast = {"map_restored_s": 0.02, "copy_s": 0.25, "map_emptied_s": 0.02, "copied_bytes": WEIGHTS_7B}
    slow = {**fast, "copy_s": 0.5}
    moved = {"copied_bytes": 0, "skipped_bytes": WEIGHTS_7B, "wake_stages": [fast, slow]}
    figs = rotation_figures(0.61, [0.60] * 5, moved)
    assert figs["wake_copy_ratios"] == pytest.approx([WEIGHTS_7B / 53e9 / 0.5] * 5)  # the first swap left out
    figs["swaps"][2]["wake_stages"] = None  # a swap whose wake was not recorded
    rotation.rotation_figures(CEILINGS, figs)
    assert len(figs["wake_copy_ratios"]) == 4
    assert rotation_figures(0.61, [0.60] * 5)["wake_copy_ratios"] == []  # pristine keeps no record


def test_the_rotation_rows_say_each_sleeps_copies_the_steady_wakes_and_bs_fill():
    fill = [{"filled_bytes": GiB, "seconds": 1.0, "state": "done", "dropped": 0},
            {"filled_bytes": GiB // 2, "seconds": 2.0, "state": "stopped", "dropped": 3}]
    first = {"copied_bytes": 2 * GiB, "skipped_bytes": 0}
    figs = rotation_figures(0.61, [0.60] * 5, {"copied_bytes": 0, "skipped_bytes": 2 * GiB, "wake_stages": [
        {"map_restored_s": 0.02, "copy_s": 0.25, "map_emptied_s": 0.03, "copied_bytes": WEIGHTS_7B}]}, fill)
    figs["swaps"][0].update(first)
    rows = dict(table_rows("c", figs))
    assert rows["sleeps copied / skipped"] == "2.00 / 0.00 GiB; 0.00 / 2.00 GiB (x5)"
    ratio = WEIGHTS_7B / 53e9 / 0.25
    assert rows["steady wakes' stages"] == f"map 0.02 s, copy 0.25 s ({ratio:.2f} of H2D), map discarded 0.03 s"
    assert rows["B's fill before its first sleep"] == "1.50 GiB in 2.00 s, done/stopped, 3 dropped"
    figs["swaps"][0]["skipped_bytes"] = None
    assert dict(table_rows("c", figs))["sleeps copied / skipped"].startswith("2.00 / - GiB; ")


def test_a_failure_names_the_allocation_by_its_tag_and_its_size_or_address():
    assert failures.names_allocation(ALLOCATION)
    assert not failures.names_allocation("Exception: Call to sleep method failed: injected fault: out of host "
                                         "memory for sleep backup #37 (262144000 bytes)")
    assert not failures.names_allocation("CUDA Error: invalid argument at cumem_allocator.cpp:145")


def test_tokens_that_part_say_where():
    assert bench.first_difference([[1, 2, 3]], [[1, 2, 3]]) is None
    assert bench.first_difference([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == "prompt 1, token 1: [5, 6] became [9, 6]"
    assert bench.first_difference([[1]], []) == "0 outputs for 1 prompts"
    f = Finding("a", "patched")
    assert f.tokens("cycle 1", [[1]], [[1]]) and not f.tokens("cycle 2", [[1]], [[2]])
    assert f.figures["tokens_identical"] is False
    assert f.outcome() == ("fail", "cycle 2: tokens differ: prompt 0, token 0: [1] became [2]")


def test_pristine_failing_where_patched_holds_is_the_proof_and_exits_0():
    rep = report.from_json(report.to_json(compare_report()))
    judged = rep.targets()
    assert {k: v["holds"] for k, v in judged["patched"].items()} == dict.fromkeys(judged["patched"], True)
    assert judged["pristine"]["first-sleep"] == {"holds": False, "value": "0.03 of D2H",
                                                 "words": "engine first sleep >= 0.8 of the D2H ceiling"}
    assert judged["pristine"]["failures"]["value"] == "d1 not survived, d2 not survived, f survived"
    assert judged["pristine"]["rotation-first"]["holds"] is False
    assert report.holds(rep) and report.exit_code(rep) == 0
    doc = json.loads(report.to_json(rep))
    assert doc["holds"] and doc["exit_code"] == 0 and doc["not_holding"] == []
    assert doc["card"]["name"] == "NVIDIA H100 80GB HBM3" and doc["date"].startswith("2026-11-26")


def replaced(results: list, key: str, tree: str, **changes) -> list:
    out = []
    for r in results:
        if (r.scenario, r.tree) == (key, tree):
            r = report.ScenarioResult(**{**r.__dict__, **changes})
        out.append(r)
    return out


@pytest.mark.parametrize("key, changes, why", [
    ("a", {"figures": {**cycles_figures([0.51, 0.5, 0.5], [0.59] * 3), "tokens_identical": False}},
     "target tokens on patched: not shown identical in a (they differ)"),
    ("a", {"figures": cycles_figures([1.2, 0.5, 0.5], [0.59] * 3)}, "target first-sleep on patched: 0.39 of D2H"),
    ("c", {"figures": rotation_figures(0.9, [0.60] * 5)}, "target rotation-first on patched: 1.50x"),
    ("c", {"figures": rotation_figures(0.7, [0.70] * 5)}, "target rotation-steady on patched: 1.40x"),
    ("d2", {"outcome": "fail", "figures": {"survived": False}}, "scenario d2 on patched: fail"),
    ("e", {"outcome": "error", "reason": "the engine did not start"}, "scenario e on patched: error"),
])
def test_anything_short_on_patched_exits_9_and_says_what(key, changes, why):
    rep = compare_report(replaced(compare_results(), key, "patched", **changes))
    assert report.exit_code(rep) == 9 and why in report.failures(rep)
    assert why in table.table(rep)


def test_a_killed_worker_run_alone_is_judged_by_its_calls_not_by_tokens():
    # As on two H200s (2026-11-27): --scenario f alone once crashed the table (no rows for f)
    # and failed the tokens target ("stopped before") though a dead worker serves nothing.
    results = [r for r in compare_results() if r.scenario == "f"]
    rep = compare_report(results)
    judged = rep.targets()["patched"]
    assert judged["tokens"]["holds"] is None and judged["failures"] == {
        "holds": True, "value": "f survived",
        "words": "failure scenarios survived (f: the killed worker reported, no hang)"}
    assert report.exit_code(rep) == 0
    text = table.table(rep)
    assert "/health fails" in text and "said within" in text and "4.40 s" in text


def test_a_killed_worker_that_hangs_fails_the_failures_target():
    results = replaced([r for r in compare_results() if r.scenario == "f"], "f", "patched",
                       outcome="fail", reason="no call hung: wake hung past --timeout")
    rep = compare_report(results)
    assert report.exit_code(rep) == 9 and "target failures on patched: f not survived" in report.failures(rep)


def test_patched_worse_than_pristine_is_named_even_where_both_miss_the_target():
    results = replaced(compare_results(), "b", "patched", outcome="error", reason="the engine did not start")
    rep = compare_report(replaced(results, "b", "pristine", outcome="pass"))
    assert "scenario b: pristine pass, patched error" in report.worse(rep)


def test_quick_judges_tokens_and_survival_not_speed():
    results = [report.ScenarioResult("a", "installed", "pass", "ok", 20, cycles_figures([3.0, 0.1, 0.1], [0.1] * 3))]
    rep = compare_report(results, quick=True)
    rep.mode, rep.trees = "installed", [{"label": "installed", "root": "/opt/P", "path": ["/opt/P"]}]
    assert rep.targets()["installed"]["first-sleep"]["holds"] is None
    assert report.exit_code(rep) == 0


def test_no_scenario_is_no_verdict():
    rep = compare_report([])
    assert report.exit_code(rep) == 9 and "no scenario ran" in report.failures(rep)


# --- the command line --------------------------------------------------------------------------


def nvml_or_none() -> gpu.Nvml | None:
    try:
        return gpu.Nvml()
    except EnvironmentProblem:
        return None


@pytest.mark.skipif(nvml_or_none() is not None, reason="this machine has an NVIDIA driver")
def test_no_gpu_is_exit_12_before_anything_is_written(tmp_path, capsys):
    work = tmp_path / "work"
    code = main(["engine-check", "-q", "--compare", "--vllm-path", str(fake_install(tmp_path / "site", "0.21.0")),
                 "--work", str(work)])
    assert code == 12 and not work.exists()
    assert "error: no NVIDIA driver here: libnvidia-ml.so.1 cannot be loaded" in capsys.readouterr().err


@pytest.mark.parametrize("version, argv, message", [
    ("0.26.0", [], "is vLLM 0.26.0 (read from"),
    ("0.21.0", ["--lane", "0.33.0"], "--lane 0.33.0 disagrees with the vLLM under test"),
])
def test_a_vllm_that_is_not_the_lanes_is_exit_3_before_the_gpu_is_asked(tmp_path, capsys, version, argv, message):
    site = fake_install(tmp_path / "site", version)
    assert main(["engine-check", "-q", "--installed", "--vllm-path", str(site), *argv]) == 3
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--installed", "--sdist", __file__], "--sdist goes with --compare"),
    (["--installed", "--swaps", "3"], "--swaps must be at least 4"),
    (["--installed", "--compare"], "not allowed with argument"),
    (["--installed", "--scenario", "d3"], "unknown scenario 'd3'"),
    (["--installed", "--model-gib", "0"], "must be a positive number"),
])
def test_a_malformed_command_line_is_exit_2(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["engine-check", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_help_teaches_with_examples_and_exit_codes(capsys):
    with pytest.raises(SystemExit):
        main(["engine-check", "--help"])
    out = capsys.readouterr().out
    assert "examples:" in out and "d1 failing-sleep" in out and "targets (judged on patched" in out
    assert "g  weight-changed" in out and "VLLM_CUMEM_SKIP_UNCHANGED=0" in out
    assert "and one gc.collect() in every worker, timed" in " ".join(out.split())
    for code in (0, 2, 3, 4, 6, 7, 9, 11, 12):
        assert f"\n  {code:<4}" in out, code


# --- on a GPU (the device machine): skipped elsewhere ------------------------------------------

NEEDS_GPU = "needs an NVIDIA GPU and its driver (the device machine: H100 or H200)"


@pytest.mark.gpu
def test_nvml_reads_the_card_without_a_cuda_context():
    nvml = nvml_or_none() or pytest.skip(NEEDS_GPU)
    card = nvml.card()
    assert card.total_bytes > card.free_bytes > 0 and card.name and card.driver


@pytest.mark.gpu
def test_the_quick_engine_check_passes_on_this_gpu(tmp_path):
    """SM12X_ENGINE_VLLM names the folder holding vLLM (else the one this Python imports)."""
    nvml_or_none() or pytest.skip(NEEDS_GPU)
    given = os.environ.get("SM12X_ENGINE_VLLM")
    try:
        found = install.find_install(Path(given) if given else None)
    except (ConfigError, EnvironmentProblem) as exc:
        pytest.skip(f"no vLLM to run: {exc} (set SM12X_ENGINE_VLLM)")
    out = tmp_path / "quick.json"
    code = main(["engine-check", "-q", "--installed", "--quick", "--vllm-path", str(found.root), "--json-out", str(out)])
    doc = json.loads(out.read_text())
    assert code == 0, doc["not_holding"]
    assert doc["cleanup"]["released"] and doc["results"][0]["figures"]["tokens_identical"]
