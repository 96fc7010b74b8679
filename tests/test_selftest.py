"""``selftest`` without a GPU: what runs where, how big, the verdict, the report, the
command line end to end (the child processes answered by a fake), the loader on small
fake trees, and (marker native/integration) the real extension built without a driver
and the real pinned cumem.py loaded against it.

The GPU runs themselves are recorded evidence (docs/results.md, docs/records/), not tests.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import needs
import pytest

from lanekit import LANES, lane_tree  # noqa: F401
from sm12x_bundle import cmd, native
from sm12x_bundle.cli import main
from sm12x_bundle.errors import BundleError, CommandError, ConfigError
from sm12x_bundle.selftest import faults, loader, measure, plan, report, runner, speed, stress
from sm12x_bundle.selftest.plan import GiB, MiB, Target
from sm12x_bundle.selftest.report import ERROR, FAIL, PASS, Report, ScenarioResult, TargetInfo

STUBS = Path(__file__).parent / "stubs"
H200_FREE = 139 * GiB


# --- scenario selection and the run plan --------------------------------------------------


def test_selection_by_name_number_and_list_keeps_the_fixed_order():
    names = [s.name for s in plan.select(["speed", "1", "stale-error,4"])]
    assert names == ["inflight-free", "stale-error", "stress", "speed"]
    assert plan.select(None) == plan.SCENARIOS
    assert plan.select([]) == plan.SCENARIOS


def test_unknown_scenario_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown scenario 'stres' \(did you mean 'stress'\?\)"):
        plan.select(["stres"])
    with pytest.raises(ConfigError, match="unknown scenario '14'"):
        plan.select(["14"])


def test_compare_runs_only_the_bug_scenarios_on_the_pristine_tree():
    pristine, patched = Target("pristine", Path("/a")), Target("patched", Path("/b"))
    got = [(t.label, s.number) for t, s in plan.runs([pristine, patched], plan.SCENARIOS)]
    assert got == [("pristine", n) for n in (1, 2, 3, 6, 7, 8, 9, 11, 12, 13)] + [("patched", n) for n in range(1, 14)]
    only_speed = plan.select(["speed"])
    assert [(t.label, s.name) for t, s in plan.runs([pristine, patched], only_speed)] == [("patched", "speed")]
    single = Target("tree", Path("/c"))
    assert len(plan.runs([single], plan.SCENARIOS)) == 13


# --- sizes -------------------------------------------------------------------------------------


def test_default_sizes_on_an_h200():
    s = plan.plan_sizes(H200_FREE)
    assert (s.partial_count, s.partial_each) == (8, 1 * GiB)
    assert (s.speed_bytes, s.speed_chunk) == (32 * GiB, 512 * MiB)
    assert s.stress_bytes == 512 * MiB and s.stress_cycles == 1000


def test_sizes_shrink_with_free_memory():
    s = plan.plan_sizes(24 * GiB)  # an RTX 5090 with a little in use
    assert s.partial_each * s.partial_count <= 6 * GiB
    assert s.speed_bytes <= 6 * GiB
    assert s.stress_bytes <= 24 * GiB // 20


@pytest.mark.parametrize("free", [600 * MiB, 3 * GiB + 12345, 31 * GiB + 7 * MiB, H200_FREE, 1 << 40])
def test_every_size_is_a_whole_number_of_granules(free):
    s = plan.plan_sizes(free)
    for n in (s.inflight_bytes, s.stale_bytes, s.partial_each, s.stress_bytes, s.speed_bytes, s.speed_chunk):
        assert n > 0 and n % plan.GRANULARITY == 0
    assert s.speed_bytes % s.speed_chunk == 0
    assert s.partial_each * s.partial_count <= free * 0.6 and s.speed_bytes <= free // 2


def test_given_sizes_are_used_and_checked_against_free_memory():
    s = plan.plan_sizes(H200_FREE, size_gib=16, stress_mib=256, cycles=5000)
    assert s.partial_each == 2 * GiB and s.speed_bytes == 16 * GiB
    assert s.stress_bytes == 256 * MiB and s.stress_cycles == 5000
    assert plan.plan_sizes(H200_FREE, size_gib=16, speed_gib=40).speed_bytes == 40 * GiB
    with pytest.raises(ConfigError, match=r"--size-gib 100 does not fit: the GPU has 139.0 GiB free"):
        plan.plan_sizes(H200_FREE, size_gib=100)
    with pytest.raises(ConfigError, match="--cycles must be at least 1"):
        plan.plan_sizes(H200_FREE, cycles=0)
    with pytest.raises(ConfigError, match="only 100 MiB free"):
        plan.plan_sizes(100 * MiB)
    with pytest.raises(ConfigError, match="--speed-gib must be positive"):
        plan.plan_sizes(H200_FREE, speed_gib=0)


# --- the verdict ------------------------------------------------------------------------------


def compare_report(outcomes: dict[tuple[str, str], str], version: str | None = None) -> Report:
    results = [ScenarioResult(name, label, kind, f"{label} {name} {kind}", 1.0) for (label, name), kind in outcomes.items()]
    targets = [TargetInfo("pristine", "/p", "/p/cumem.py", "/w/p.so", version=version),
               TargetInfo("patched", "/q", "/q/cumem.py", "/w/q.so", version=version)]
    return Report("compare", targets, {}, {}, results)


PROVEN = {("pristine", s.name): FAIL for s in plan.SCENARIOS if s.bug} | {
    ("pristine", s.name): PASS for s in plan.SCENARIOS if s.guard} | {
    ("patched", s.name): PASS for s in plan.SCENARIOS}


def test_compare_holds_when_each_bug_fails_on_pristine_and_patched_passes_all():
    rep = compare_report(PROVEN)
    assert report.holds(rep) and report.exit_code(rep) == 0
    assert report.row_verdict(rep, plan.BY_NAME["partial-wake"]) == (True, "proven: fails on pristine, passes on patched")


@pytest.mark.parametrize("change, words", [
    ({("pristine", "stale-error"): PASS}, "no teeth: pristine passes too"),
    ({("pristine", "stale-error"): ERROR}, "inconclusive: pristine could not run it"),
    ({("patched", "stale-error"): FAIL}, "patched does not pass"),
    ({("patched", "stale-error"): ERROR}, "patched does not pass"),
])
def test_compare_does_not_hold_without_teeth_or_with_a_patched_failure(change, words):
    rep = compare_report(PROVEN | change)
    assert report.row_verdict(rep, plan.BY_NAME["stale-error"]) == (False, words)
    assert report.exit_code(rep) == report.EXIT_FAILED == 9


def test_compare_fails_when_stress_or_speed_fails_on_patched():
    rep = compare_report(PROVEN | {("patched", "speed"): FAIL})
    assert report.row_verdict(rep, plan.BY_NAME["speed"]) == (False, "patched does not pass")
    assert report.exit_code(rep) == 9


def test_single_tree_passes_only_when_every_scenario_passes():
    target = [TargetInfo("installed", None, "/x/cumem.py", "/x/cumem_allocator.abi3.so")]
    ok = Report("single", target, {}, {}, [ScenarioResult(s.name, "installed", PASS, "ok") for s in plan.SCENARIOS])
    assert report.exit_code(ok) == 0
    ok.results[3].outcome = ERROR
    assert report.exit_code(ok) == 9
    assert report.exit_code(Report("single", target, {}, {}, [])) == 9  # nothing ran: nothing proven


def test_an_unknown_outcome_is_refused():
    with pytest.raises(ValueError):
        ScenarioResult("stress", "tree", "passed", "")


# --- the report ---------------------------------------------------------------------------------

ENV = {"gpu": "NVIDIA H200", "capability": "9.0", "driver": "580.159.04", "torch": "2.11.0+cu130",
       "cuda": "13.0", "free_bytes": 139 * GiB}

GOLDEN_TABLE = """\
vLLM cumem selftest on NVIDIA H200 (sm_90), driver 580.159.04, torch 2.11.0+cu130, CUDA 13.0, 139.0 GiB free
  pristine: /p
  patched: /q

#  scenario        pristine  patched  verdict
1  in-flight free  FAIL      PASS     proven: fails on pristine, passes on patched
2  stale error     PASS      PASS     no teeth: pristine passes too
4  stress          -         PASS     pass

1 pristine: pristine inflight-free fail [1.0 s]
1 patched: patched inflight-free pass [1.0 s]
2 pristine: pristine stale-error pass [1.0 s]
2 patched: patched stale-error pass [1.0 s]
4 patched: patched stress pass [1.0 s]

result: NOT proven (see the verdict column)
"""


def test_table_is_the_golden_one():
    rep = compare_report({("pristine", "inflight-free"): FAIL, ("pristine", "stale-error"): PASS,
                          ("patched", "inflight-free"): PASS, ("patched", "stale-error"): PASS,
                          ("patched", "stress"): PASS})
    rep.environment = ENV
    assert report.table(rep) == GOLDEN_TABLE


def test_table_names_placeholders_and_says_when_all_pass():
    rep = Report("single", [TargetInfo("tree", "/t", "/t/c.py", "/w/c.so", placeholders=["vllm._C"],
                                       platform="CudaPlatform")], ENV, {},
                 [ScenarioResult("speed", "tree", PASS, "fast")])
    text = report.table(rep)
    assert "  tree: /t (vLLM platform: CudaPlatform)\n" in text
    assert "placeholders for compiled modules the tree lacks: vllm._C" in text
    assert "5  speed     PASS  ok" in text
    assert text.endswith("result: all scenarios pass\n")


def test_json_is_deterministic_and_round_trips():
    rep = compare_report(PROVEN)
    rep.environment, rep.sizes = ENV, plan.plan_sizes(H200_FREE).to_dict()
    text = report.to_json(rep)
    assert text == report.to_json(report.from_json(text))
    doc = json.loads(text)
    assert doc["holds"] is True and doc["exit_code"] == 0 and doc["mode"] == "compare"
    assert doc["verdict"]["inflight-free"] == {"holds": True, "words": "proven: fails on pristine, passes on patched"}
    assert list(doc) == sorted(doc)


# --- the command, end to end, with the child processes answered by a fake ---------------------


def make_tree(root: Path) -> Path:
    (root / "vllm" / "device_allocator").mkdir(parents=True)
    (root / "vllm" / "device_allocator" / "cumem.py").write_text("# cumem\n")
    (root / "csrc").mkdir()
    (root / "csrc" / "cumem_allocator.cpp").write_text("// cpp\n")
    return root


class FakeChildren:
    """Answers the probe and each scenario the way a child would: a JSON file."""

    def __init__(self, outcomes: dict[tuple[str, str], str], *, free=H200_FREE):
        self.outcomes, self.free = outcomes, free
        self.calls: list[tuple[str, str, dict]] = []

    def __call__(self, argv, *, env=None, timeout=None, **kw):
        argv = [str(a) for a in argv]
        assert argv[:3] == [sys.executable, "-m", "sm12x_bundle.selftest.child"]
        assert env["PYTHONDONTWRITEBYTECODE"] == "1" and timeout
        scenario, out = argv[3], Path(argv[argv.index("--out") + 1])
        label = out.parent.name  # the runner keeps each target's results in WORK/LABEL/
        params = json.loads(argv[argv.index("--params") + 1])
        self.calls.append((label, scenario, params))
        if scenario == "probe":
            doc = {"outcome": PASS, "reason": "ok", "figures": {
                **ENV, "free_bytes": self.free, "cumem_py": f"/{label}/cumem.py",
                "extension": f"/{label}/cumem_allocator.abi3.so", "placeholders": ["vllm._C"]}}
        else:
            kind = self.outcomes[(label, scenario)]
            if kind == "die":
                raise CommandError(f"{argv[0]} ... failed with exit code 134:\nCUDA error: an illegal memory access")
            doc = {"outcome": kind, "reason": f"{scenario} {kind}", "figures": {}}
        out.write_text(json.dumps(doc))
        return subprocess.CompletedProcess(argv, 0, "", "")


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """Two small trees; the build, the argv plan and every child are fakes."""
    monkeypatch.chdir(tmp_path)
    trees = {"pristine": make_tree(tmp_path / "pristine"), "patched": make_tree(tmp_path / "patched")}
    builds = []

    def fake_build(tree, out, **kw):
        out.mkdir(parents=True, exist_ok=True)
        builds.append(tree)
        (out / native.ARTIFACT).write_bytes(b"")
        return out / native.ARTIFACT

    monkeypatch.setattr(native, "build_cumem_extension", fake_build)
    monkeypatch.setattr(native, "cumem_build_argv", lambda tree, out, **kw: ["g++", str(tree / native.SOURCE)])

    def install(outcomes, **kw) -> FakeChildren:
        fake = FakeChildren(outcomes, **kw)
        monkeypatch.setattr(cmd, "run", fake)
        fake.builds = builds
        return fake

    install.trees = trees
    return install


def test_compare_end_to_end_proves_and_exits_0(fake_gpu, capsys):
    fake = fake_gpu(PROVEN)
    t = fake_gpu.trees
    assert main(["selftest", "-q", "--compare", str(t["pristine"]), str(t["patched"]), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["holds"] and [r["target"] for r in doc["results"]].count("pristine") == 10
    assert fake.builds == [t["pristine"].resolve(), t["patched"].resolve()]
    ran = [(label, scenario) for label, scenario, _ in fake.calls]
    assert ran[:2] == [("pristine", "probe"), ("patched", "probe")]
    assert ("pristine", "stress") not in ran and ("patched", "speed") in ran
    params = dict((s, p) for _, s, p in fake.calls)["speed"]
    assert params["speed_bytes"] == 32 * GiB and params["speed_target"] == 0.9
    assert params["wake_after_s"] == 0.0
    assert doc["targets"][0]["build"] == ["g++", str(t["pristine"].resolve() / native.SOURCE)]


def test_wake_after_reaches_the_speed_scenario(fake_gpu, capsys):
    fake = fake_gpu(PROVEN)
    t = fake_gpu.trees
    main(["selftest", "-q", "--compare", str(t["pristine"]), str(t["patched"]), "--scenario", "speed",
          "--wake-after", "2.5", "--json"])
    params = dict((s, p) for _, s, p in fake.calls)["speed"]
    assert params["wake_after_s"] == 2.5


def test_compare_without_teeth_exits_9_and_says_so(fake_gpu, capsys, tmp_path):
    fake_gpu(PROVEN | {("pristine", "partial-wake"): PASS})
    t = fake_gpu.trees
    code = main(["selftest", "-q", "--compare", str(t["pristine"]), str(t["patched"]),
                 "--json-out", str(tmp_path / "r.json")])
    assert code == 9
    out = capsys.readouterr().out
    assert "no teeth: pristine passes too" in out and "result: NOT proven" in out
    assert json.loads((tmp_path / "r.json").read_text())["holds"] is False


def test_a_child_that_dies_is_an_error_with_its_last_words(fake_gpu, capsys):
    fake_gpu({("tree", "inflight-free"): "die"})
    assert main(["selftest", "-q", "--tree", str(fake_gpu.trees["patched"]), "--scenario", "1", "--json"]) == 9
    [result] = json.loads(capsys.readouterr().out)["results"]
    assert result["outcome"] == ERROR
    assert result["reason"] == "the scenario's process died before it reported: CUDA error: an illegal memory access"


def test_scenario_typo_fails_before_anything_is_built(fake_gpu, capsys):
    fake = fake_gpu({})
    with pytest.raises(SystemExit) as exc:  # a command-line value: argparse's exit 2
        main(["selftest", "-q", "--tree", str(fake_gpu.trees["patched"]), "--scenario", "sped"])
    assert exc.value.code == 2
    assert "did you mean 'speed'" in capsys.readouterr().err
    assert fake.calls == [] and fake.builds == []


@pytest.mark.parametrize("argv, message", [
    (["selftest"], "one of the arguments --tree --installed --compare is required"),
    (["selftest", "--installed", "--tree", "."], "not allowed with argument"),
    (["selftest", "--installed", "--cycles", "many"], "argument --cycles: must be a whole number, not 'many'"),
])
def test_argument_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_compare_takes_two_trees_or_none(fake_gpu, capsys):
    fake_gpu({})
    with pytest.raises(SystemExit) as exc:
        main(["selftest", "-q", "--compare", str(fake_gpu.trees["patched"])])
    assert exc.value.code == 2
    assert "--compare takes two trees (PRISTINE PATCHED) or none, not 1" in capsys.readouterr().err


def test_a_tree_without_the_allocator_is_refused(fake_gpu, tmp_path, capsys):
    fake = fake_gpu({})
    (tmp_path / "empty").mkdir()
    assert main(["selftest", "-q", "--tree", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "is not a vLLM source tree: vllm/device_allocator/cumem.py, csrc/cumem_allocator.cpp missing" in err
    assert "use --installed" in err and fake.calls == []


def test_a_probe_that_finds_cumem_unavailable_stops_the_run_loudly(fake_gpu, monkeypatch, capsys):
    fake = fake_gpu({})

    def unavailable(argv, **kw):
        out = Path(argv[argv.index("--out") + 1])
        out.write_text(json.dumps({"outcome": ERROR, "reason": "import ... failed: No module named 'zmq' (install pyzmq; ...)"}))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(cmd, "run", unavailable)
    assert main(["selftest", "-q", "--tree", str(fake_gpu.trees["patched"])]) == 12  # this node lacks pyzmq
    assert "install pyzmq" in capsys.readouterr().err and fake.calls == []


def test_installed_vllm_is_used_as_it_is(tmp_path, monkeypatch):
    site = tmp_path / "site"
    (site / "vllm" / "device_allocator").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    (site / "vllm" / "device_allocator" / "cumem.py").write_text("")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(BundleError, match="has no cumem allocator"):
        runner.stage(Target("installed", None), tmp_path / "work")
    (site / "vllm" / "cumem_allocator.abi3.so").write_bytes(b"")
    staged = runner.stage(Target("installed", None), tmp_path / "work", build=lambda *a, **k: pytest.fail("built"))
    assert staged.extension == site / "vllm" / "cumem_allocator.abi3.so" and staged.build is None
    assert staged.cumem_py == site / "vllm" / "device_allocator" / "cumem.py"


def test_child_argv_and_environment(tmp_path):
    staged = runner.Staged(Target("patched", tmp_path / "t"), tmp_path / "t/c.py", tmp_path / "w/e.so", None)
    argv = runner.child_argv(staged, "stress", {"b": 1, "a": 2}, tmp_path / "o.json")
    assert argv == [sys.executable, "-m", "sm12x_bundle.selftest.child", "stress", "--out", str(tmp_path / "o.json"),
                    "--tree", str(tmp_path / "t"), "--extension", str(tmp_path / "w/e.so"),
                    "--params", '{"a": 2, "b": 1}']
    installed = runner.Staged(Target("installed", None), Path("/x/c.py"), Path("/x/e.so"), None)
    assert "--tree" not in runner.child_argv(installed, "probe", {}, tmp_path / "o.json")
    env = runner.child_env({"PYTORCH_CUDA_ALLOC_CONF": "x"})
    src = str(Path(runner.__file__).resolve().parents[2])
    assert env["PYTHONPATH"].split(os.pathsep)[0] == src and env["PYTORCH_CUDA_ALLOC_CONF"] == "x"


# --- the loader, on fake trees (in a fresh interpreter: it changes sys.path) --------------------

FAKE_CUMEM = """\
import vllm._C  # noqa: the CUDA platform module does this
cumem_available = False
lib_name = None
try:
    from vllm.cumem_allocator import init_module
    from vllm.distributed.device_communicators.cuda_wrapper import CudaRTLibrary
    import vllm.cumem_allocator as ext
    lib_name = ext.__file__
    cumem_available = True
except ModuleNotFoundError:
    pass
"""


def fake_source_tree(root: Path, wrapper: str) -> tuple[Path, Path]:
    files = {
        "vllm/__init__.py": "",
        "vllm/device_allocator/__init__.py": "",
        "vllm/device_allocator/cumem.py": FAKE_CUMEM,
        "vllm/distributed/__init__.py": "",
        "vllm/distributed/device_communicators/__init__.py": "",
        "vllm/distributed/device_communicators/cuda_wrapper.py": wrapper,
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    ext = root.parent / "build" / "cumem_allocator.py"  # stands in for the built .so
    ext.parent.mkdir(exist_ok=True)
    ext.write_text("def init_module(*a): pass\n")
    return root, ext


def load_in_child(tree: Path, ext: Path) -> dict:
    code = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from sm12x_bundle.selftest import loader
        try:
            l = loader.load(Path({str(tree)!r}), Path({str(ext)!r}))
            print(json.dumps({{"ok": True, "extension": l.extension, "placeholders": l.placeholders,
                               "vllm": l.vllm_file}}))
        except loader.LoadError as e:
            print(json.dumps({{"ok": False, "error": str(e)}}))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=runner.child_env(), check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_loader_uses_the_trees_modules_and_the_built_extension(tmp_path):
    tree, ext = fake_source_tree(tmp_path / "tree", "class CudaRTLibrary: pass\n")
    got = load_in_child(tree, ext)
    assert got["ok"], got
    assert got["extension"] == str(ext.resolve())
    assert got["vllm"] == str((tree / "vllm" / "__init__.py").resolve())
    assert got["placeholders"] == ["vllm._C"]


def test_loader_names_the_module_that_cumem_py_would_swallow(tmp_path):
    tree, ext = fake_source_tree(tmp_path / "tree", "import sm12x_selftest_absent\n")
    got = load_in_child(tree, ext)
    assert got == {"ok": False, "error": "import vllm.distributed.device_communicators.cuda_wrapper failed: "
                                         "ModuleNotFoundError: No module named 'sm12x_selftest_absent'"}


def test_a_missing_package_from_the_field_notes_is_named_for_pip():
    words = loader.explain(ModuleNotFoundError("No module named 'zmq'", name="zmq"))
    assert words == ("ModuleNotFoundError: No module named 'zmq' (install pyzmq; cumem.py needs numpy, packaging, "
                     "psutil, pyzmq, regex, urllib3 at import time)")
    assert loader.explain(ValueError("x")) == "ValueError: x"


def test_loader_refuses_an_extension_other_than_the_built_one(tmp_path):
    tree, ext = fake_source_tree(tmp_path / "tree", "class CudaRTLibrary: pass\n")
    cumem = tree / "vllm/device_allocator/cumem.py"
    # as if /proc/self/maps had shown another library named cumem_allocator first
    cumem.write_text(cumem.read_text() + "lib_name = '/opt/other/vllm/cumem_allocator.abi3.so'\n")
    got = load_in_child(tree, ext)
    assert not got["ok"]
    assert got["error"] == (f"cumem.py found the extension /opt/other/vllm/cumem_allocator.abi3.so, "
                            f"not the one built from the tree ({ext})")


@pytest.mark.parametrize("name, matches", [
    ("vllm._C", True), ("vllm._C_stable_libtorch", True), ("vllm._moe_C", True), ("vllm._rocm_C", True),
    ("vllm._custom_ops", False), ("vllm.config", False), ("vllm._Cx", False), ("torch._C", False),
])
def test_placeholders_stand_in_only_for_compiled_modules(name, matches):
    assert bool(loader.COMPILED_MODULE.match(name)) is matches


def test_child_writes_its_result_even_when_the_tree_cannot_load(tmp_path):
    tree, ext = fake_source_tree(tmp_path / "tree", "import zmq\n")
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, "-m", "sm12x_bundle.selftest.child", "stress", "--out", str(out),
                    "--tree", str(tree), "--extension", str(ext)], env=runner.child_env(), check=True,
                   capture_output=True)
    doc = json.loads(out.read_text())
    assert doc["outcome"] == ERROR and doc["reason"]


# --- the stress pattern ---------------------------------------------------------------------------


def test_stress_layout_covers_every_tag_with_varied_sizes():
    layout = stress.stress_layout(512 * MiB, seed=1)
    assert {tag for tag, _ in layout} == {tag for tag, _, _ in stress.STRESS_TAGS}
    assert sum(n for _, n in layout) * 8 == pytest.approx(512 * MiB, rel=1e-6)
    sizes = {n for _, n in layout}
    assert len(sizes) >= 8 and min(sizes) < 1 * MiB // 8 < 16 * MiB // 8 < max(sizes)
    assert layout == stress.stress_layout(512 * MiB, seed=1)
    assert layout != stress.stress_layout(512 * MiB, seed=2)


def test_brief_keeps_one_short_line():
    long = "CuMemAllocator: wake_up failed for the allocation " + "x" * 200 + "\nsecond line"
    assert measure.brief(long).endswith("...") and len(measure.brief(long)) == 110
    assert measure.brief("CUDA Error: out of memory\nat line 3") == "CUDA Error: out of memory"


def test_stress_offloads_some_tags_and_discards_others():
    rng = random.Random(3)
    chosen = [stress.offloaded(c, rng) for c in range(1, 201)]
    assert all("st-weights" in c and "st-kv" not in c for c in chosen)
    assert all(("st-adapter" in c) == (i % 2 == 0) for i, c in enumerate(chosen, 1))
    assert 50 < sum("st-draft" in c for c in chosen) < 150
    seeds = {stress.seed_for(c, i) for c in range(1, 1001) for i in range(64)}
    assert len(seeds) == 1000 * 64


def test_fault_stress_layout_is_small_varied_and_replayable():
    layout = stress.fault_layout(32 * MiB, seed=1)
    assert {tag for tag, _ in layout} == {tag for tag, _, _ in stress.STRESS_TAGS}
    assert sum(n for _, n in layout) * 8 == pytest.approx(32 * MiB, rel=1e-6)
    sizes = {n for _, n in layout}
    assert len(sizes) >= 6 and max(sizes) <= 8 * MiB // 8 and min(sizes) < 256 * 1024 // 8
    assert layout == stress.fault_layout(32 * MiB, seed=1) != stress.fault_layout(32 * MiB, seed=2)


def test_injected_host_allocation_fails_at_the_kth_backup_and_counts_the_rest():
    torch = needs.module("torch")
    host = faults.HostAllocationFails(torch, k=3)
    kept = [host.empty(16, dtype=torch.uint8, device="cpu") for _ in range(2)]
    assert host.empty(16, dtype=torch.uint8) is not None  # not a backup: not counted
    with pytest.raises(RuntimeError, match="injected: pinned host allocation 3 failed"):
        host.empty(16, dtype=torch.uint8, device="cpu")
    assert host.alive() == 2 and host.uint8 is torch.uint8
    del kept
    assert host.alive() == 0


def test_injected_map_failure_fails_only_the_kth_call():
    mapped = []
    fails = faults.MapFails(mapped.append, k=2)
    fails("a")
    with pytest.raises(RuntimeError, match="injected: map 2 failed"):
        fails("b")
    fails("c")
    assert mapped == ["a", "c"]


def test_checkpoint_leaves_a_provisional_result(tmp_path, monkeypatch):
    monkeypatch.setattr(measure, "RESULT_PATH", str(tmp_path / "r.json"))
    measure.checkpoint(measure.outcome("fail", "died using unmapped memory", step=4))
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc == {"outcome": "fail", "reason": "died using unmapped memory", "figures": {"step": 4},
                   "provisional": True}


def test_a_child_that_dies_after_its_checkpoint_reports_the_checkpoint(tmp_path):
    staged = runner.Staged(Target("pristine", tmp_path), tmp_path / "cumem.py", tmp_path / "x.so", None)

    def dies(argv, **kw):
        out = Path(argv[argv.index("--out") + 1])
        out.write_text(json.dumps({**measure.outcome("fail", "sleep failed; the process died when the "
                                                               "tensors were next used"), "provisional": True}))
        raise CommandError("python ... failed with exit code 139:\nSegmentation fault")

    r = runner.run_scenario(staged, plan.BY_NAME["failing-sleep"], {}, tmp_path, timeout=5, run=dies)
    assert r.outcome == FAIL
    assert r.reason.endswith("(the process died: Segmentation fault)")


def test_a_regression_guard_holds_whatever_pristine_does():
    guard = plan.BY_NAME["double-wake"]
    assert guard.guard and not guard.bug
    for before in (PASS, FAIL):
        rep = compare_report(PROVEN | {("pristine", "double-wake"): before})
        assert report.row_verdict(rep, guard) == (True, f"regression guard (pristine {before.upper()}): not a proof")
    rep = compare_report(PROVEN | {("patched", "double-wake"): FAIL})
    assert report.row_verdict(rep, guard) == (False, "patched does not pass")


def test_a_bug_fixed_upstream_only_guards_on_that_release():
    """0.33.0's own code fixes scenario 9 (its wake_up resumes): its pristine tree passing
    it proves no patch, and is no failure; on 0.21.0 the same pristine pass is a proof
    without teeth."""
    assert [s.number for s in plan.SCENARIOS if s.proves("0.33.0")] == [1, 2, 3, 7, 8, 11, 12, 13]
    assert [s.number for s in plan.SCENARIOS if s.guards("0.33.0")] == [6, 9]
    assert [s.number for s in plan.SCENARIOS if s.proves("0.21.0")] == [1, 2, 3, 7, 8, 9, 11, 12, 13]
    assert plan.BY_NAME["foreign-process"].proves("0.33.0.post1") is False  # from the release named, on
    assert plan.BY_NAME["foreign-process"].proves("0.26.0") is True
    assert plan.BY_NAME["foreign-process"].proves("not-a-version") is True
    for before in (PASS, FAIL):
        rep = compare_report(PROVEN | {("pristine", "foreign-process"): before}, version="0.33.0")
        assert report.holds(rep)
        assert report.row_verdict(rep, plan.BY_NAME["foreign-process"]) == (
            True, f"regression guard (pristine {before.upper()}; fixed upstream from 0.33.0): not a proof")
    rep = compare_report(PROVEN | {("pristine", "foreign-process"): PASS}, version="0.21.0")
    assert report.row_verdict(rep, plan.BY_NAME["foreign-process"]) == (False, "no teeth: pristine passes too")


def test_transaction_scenario_sizes_on_an_h200_and_a_small_gpu():
    s = plan.plan_sizes(H200_FREE)
    assert (s.churn_min, s.churn_max, s.churn_buffers) == (1 * GiB, 3 * GiB, 16)
    assert s.churn_budget == 6 * GiB + 512 * MiB  # twice the largest buffer, the shards, a margin
    assert (s.sleep_count, s.sleep_each, s.sleep_fail_at) == (8, 256 * MiB, 4)
    assert (s.foreign_count, s.foreign_each) == (8, 1 * GiB)
    assert (s.fault_bytes, s.fault_cycles) == (32 * MiB, 10_000)
    for free in (600 * MiB, 24 * GiB, H200_FREE):
        s = plan.plan_sizes(free)
        for n in (s.sleep_each, s.churn_min, s.churn_max, s.churn_shard, s.churn_budget, s.foreign_each):
            assert n > 0 and n % plan.GRANULARITY == 0
        assert s.churn_budget < free // 2 and s.foreign_each * s.foreign_count <= free // 4
    with pytest.raises(ConfigError, match="--fault-cycles must be at least 1"):
        plan.plan_sizes(H200_FREE, fault_cycles=0)


# --- the real extension, built without a driver -----------------------------------------------------


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory) -> Path:
    try:
        cuda_home = native.find_cuda_home()
    except Exception as exc:
        needs.missing(str(exc))
    if not shutil.which("gcc"):
        needs.missing("no C compiler")
    out = tmp_path_factory.mktemp("fake_libcuda")
    cmd.run(["gcc", "-shared", "-fPIC", f"-I{cuda_home / 'include'}", "-Wl,-soname,libcuda.so.1",
             "-o", out / "libcuda.so.1", STUBS / "fake_libcuda.c"], echo=False)
    (out / "libcuda.so").symlink_to("libcuda.so.1")
    return out


@pytest.mark.native
@pytest.mark.integration
def test_stage_builds_the_pinned_extension_alone_without_a_driver(pinned_tree, fake_libcuda, tmp_path):
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").is_file():
        needs.missing("this Python has no development headers")

    def build(tree, out, **kw):
        return native.build_cumem_extension(tree, out, libcuda=fake_libcuda, **kw)

    staged = runner.stage(Target("pristine", pinned_tree), tmp_path, build=build)
    assert staged.extension == tmp_path / "pristine" / "ext" / "cumem_allocator.abi3.so"
    assert staged.extension.is_file() and staged.build[0] == "g++"
    assert staged.cumem_py == pinned_tree / "vllm" / "device_allocator" / "cumem.py"
    ctypes.CDLL(str(fake_libcuda / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(staged.extension))
    for symbol in ("my_malloc", "my_free", "PyInit_cumem_allocator"):
        assert hasattr(lib, symbol)


@pytest.mark.native
@pytest.mark.integration
@pytest.mark.parametrize("variant", ["pinned", "patched"])
@pytest.mark.parametrize("lane", LANES)
def test_each_lanes_cumem_py_loads_against_its_built_extension_on_a_cpu(lane_tree, lane, variant, fake_libcuda,
                                                                        tmp_path):
    """The real loader on each lane's real trees, as far as a machine without a GPU goes:
    cumem_available is True, cumem.py found the extension built from the tree, and the
    tree says which release it is (what decides the scenarios upstream has fixed)."""
    for module in ("torch", "numpy", "packaging", "psutil", "regex", "zmq", "urllib3"):
        needs.module(module)
    cudart = next(iter(sorted(Path(native.find_cuda_home()).glob("lib*/libcudart.so*"))), None)
    if cudart is None:
        needs.missing("no libcudart in the CUDA toolkit")
    tree = lane_tree(lane, variant)
    ext = native.build_cumem_extension(tree, tmp_path / "ext", libcuda=fake_libcuda)
    env = runner.child_env({"LD_LIBRARY_PATH": str(fake_libcuda), "VLLM_CUDART_SO_PATH": str(cudart)})
    code = (f"import sys; from pathlib import Path; from sm12x_bundle.selftest import loader, measure; "
            f"l = loader.load(Path({str(tree)!r}), Path({str(ext)!r})); "
            f"print(sys.modules['vllm'].__version__, measure.pin_memory(l.cumem), l.cumem.cumem_available, "
            f"l.extension)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-4:] == [lane, "True", "True", str(ext.resolve())]


def test_help_names_exactly_the_scenarios_that_prove_a_fix(capsys):
    # The --compare text is written by hand; it must name the scenarios the plan marks as proofs.
    from sm12x_bundle.selftest import plan as selftest_plan

    proofs = [s.number for s in selftest_plan.SCENARIOS if s.bug]
    assert proofs == [1, 2, 3, 7, 8, 9, 11, 12, 13]
    with pytest.raises(SystemExit):
        main(["selftest", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("scenarios 1-3, 7-9 and 11-13 fail on") == 1
    assert "scenarios 1-3, 7-9 and 11-13 and the patched tree" in text
    upstream = [s for s in selftest_plan.SCENARIOS if s.upstream_from]
    assert [(s.number, s.upstream_from) for s in upstream] == [(9, "0.33.0")]
    assert "9 only guards on vLLM 0.33.0 and later" in text
    for s in selftest_plan.SCENARIOS:
        assert f" {s.number} {s.name} " in text


@pytest.mark.integration
def test_compare_without_trees_uses_the_lane_named(tmp_path):
    import argparse

    from sm12x_bundle import config as config_mod
    from sm12x_bundle.context import Context
    from sm12x_bundle.progress import Progress
    from sm12x_bundle.selftest import resolve_targets

    ctx = Context(config_mod.parse(config_mod.default_text(), "<embedded default>", tmp_path), Progress.quiet())
    args = argparse.Namespace(installed=False, tree=None, compare=[], lane="0.33.0")
    pristine, patched = resolve_targets(ctx, args, tmp_path)
    assert pristine.tree == ctx.source("0.33.0").root
    cumem = "vllm/device_allocator/cumem.py"
    assert (patched.tree / cumem).read_text() != (pristine.tree / cumem).read_text()
    assert "_roll_back_wake_up" in (patched.tree / cumem).read_text()
    with pytest.raises(BundleError, match=r"--lane 0\.26\.0: the configuration has no such lane"):
        resolve_targets(ctx, argparse.Namespace(installed=False, tree=None, compare=[], lane="0.26.0"), tmp_path)


def test_lane_goes_with_compare_without_trees(fake_gpu, capsys):
    fake_gpu({})
    with pytest.raises(SystemExit) as exc:
        main(["selftest", "-q", "--tree", str(fake_gpu.trees["patched"]), "--lane", "0.33.0"])
    assert exc.value.code == 2 and "--lane goes with --compare and no trees" in capsys.readouterr().err


def test_speed_holds_the_wake_to_the_fresh_memory_ceiling():
    """A wake copies into memory it has just created, so the speed scenario
    holds it to 0.95 of the H2D ceiling into fresh memory, not to the ceiling of copies
    into memory in use; the sleep stays held to the D2H ceiling."""
    speed_shortfalls = speed.speed_shortfalls
    met = {"sleep_ratio": 0.96, "wake_ratio": 0.88, "wake_fresh_ratio": 0.97}
    assert speed_shortfalls(met, 0.9) == []
    assert speed_shortfalls({**met, "wake_fresh_ratio": 0.94}, 0.9) == ["wake below 95% of fresh"]
    assert speed_shortfalls({**met, "sleep_ratio": 0.85}, 0.9) == ["sleep below 90% of D2H"]
    assert speed_shortfalls({**met, "sleep_ratio": 0.85, "wake_fresh_ratio": 0.5}, 0.9) == [
        "sleep below 90% of D2H", "wake below 95% of fresh"]


def test_the_rotation_peer_runs_as_a_module():
    """Scenario 12 starts engine B with `python -m sm12x_bundle.selftest.engines`: the
    module must run its peer (it lost its main guard once, and every rotation failed with
    'peer exited')."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "sm12x_bundle.selftest.engines", "--help"],
                         capture_output=True, text=True)
    assert run.returncode == 0 and "--sizes" in run.stdout
