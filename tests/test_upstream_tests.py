"""vLLM's own allocator tests (enginecheck/upstream.py and its pytest plugin).

The plan is read from the real pinned sdists (integration). The runner and the plugin run
for real here, each case in a pytest process of its own, against small vLLM stand-ins the
test writes (an installed package, and a source tree with an extension folder), since the
real tests need a GPU; the gpu-marked test at the end runs the real ones.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sm12x_bundle import native
from sm12x_bundle.enginecheck import upstream
from sm12x_bundle.enginecheck.upstream import BROKEN, ERROR, FAILED, HOLDS, PASSED, SKIPPED, UNPROVEN, VllmUnderTest
from sm12x_bundle.errors import BundleError
from sm12x_bundle.progress import Progress

QUIET = Progress.quiet()


@pytest.fixture(scope="module")
def sdist_0_33_0(default_context):
    return default_context.source("0.33.0").root


@pytest.mark.integration
def test_0_21_0_runs_its_three_tests_without_a_model(pinned_tree):
    plan = upstream.plan("0.21.0", pinned_tree)
    assert plan.test_file == "tests/basic_correctness/test_cumem.py"
    assert [c.name for c in plan.cases] == ["test_python_error", "test_basic_cumem", "test_cumem_with_cudagraph"]
    left = {x.function: (x.cases, x.why) for x in plan.left_out}
    assert left == {
        "test_end_to_end": (2, ("builds an engine (LLM(...), line 136) of 'hmellor/tiny-random-LlamaForCausalLM' and "
                                "'facebook/opt-125m': a model from the hub")),
        "test_deep_sleep": (1, "builds an engine (LLM(...), line 185) of 'hmellor/tiny-random-LlamaForCausalLM': a model from the hub"),
        "test_deep_sleep_async": (1, ("builds an engine (AsyncEngineArgs(...), line 217) of "
                                      "'hmellor/tiny-random-LlamaForCausalLM': a model from the hub")),
        "test_deep_sleep_fp8_kvcache": (1, "builds an engine (LLM(...), line 255) of 'Qwen/Qwen2-0.5B': a model from the hub"),
    }


@pytest.mark.integration
def test_0_33_0_runs_ten_functions_in_fourteen_cases(sdist_0_33_0):
    plan = upstream.plan("0.33.0", sdist_0_33_0)
    assert plan.test_file == "tests/basic_correctness/memory/cumem/test_cumem.py"
    assert [plan.nodeid(c).split("::")[1] for c in plan.cases] == [
        "test_python_error", "test_basic_cumem", "test_discard_tags",
        "test_selective_wake_restores_internal_tags[workspace]", "test_selective_wake_restores_internal_tags[default]",
        "test_workspace_scratch_discarded_on_sleep", "test_reentered_tag[x-freed]", "test_reentered_tag[x-alive]",
        "test_runtime_state_survives_sleep[sleep-1]", "test_runtime_state_survives_sleep[sleep-2]",
        "test_level2_discards_ordinary_tensor_with_weights_tag", "test_cumem_with_cudagraph",
        "test_cudagraph_pool_sleep[sleep-1]", "test_cudagraph_pool_sleep[sleep-2]",
    ]
    assert len({c.function for c in plan.cases}) == 10
    assert [(x.function, x.cases) for x in plan.left_out] == [
        ("test_release_kv_cache_memory_preserves_generation", 3), ("test_sleep_with_only_weights_asleep", 4)]
    assert all("'Qwen/Qwen3-0.6B': a model from the hub" in x.why for x in plan.left_out)


@pytest.mark.integration
def test_the_rootdir_holds_the_test_file_and_our_stand_ins_only(sdist_0_33_0, tmp_path):
    plan = upstream.plan("0.33.0", sdist_0_33_0)
    root = upstream.write_rootdir(plan, sdist_0_33_0, tmp_path / "root")
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert files == [".sm12x-bundle-output", "pytest.ini", "tests/__init__.py", "tests/basic_correctness/__init__.py",
                     "tests/basic_correctness/memory/__init__.py", "tests/basic_correctness/memory/cumem/__init__.py",
                     "tests/basic_correctness/memory/cumem/test_cumem.py", "tests/utils.py"]
    assert (root / plan.test_file).read_bytes() == (sdist_0_33_0 / plan.test_file).read_bytes()
    assert "from sm12x_bundle.enginecheck.upstream_plugin import create_new_process_for_each_test, requires_fp8" in \
        (root / "tests" / "utils.py").read_text()


# --- parametrize ids: ours against pytest's own collection --------------------------------

PARAMETRIZED = '''
import pytest

@pytest.mark.parametrize("first_level", [1, 2])
@pytest.mark.parametrize("second_level", ["a", "b"])
def test_stacked(first_level, second_level): pass

@pytest.mark.parametrize("tag", ["workspace", None], ids=["workspace", "default"])
def test_ids(tag): pass

@pytest.mark.parametrize("x", ["a/b", None, 1.5, True, -3, object()])
def test_values(x): pass

@pytest.mark.parametrize("a, b", [(1, "x"), (2, "y")])
def test_tuples(a, b): pass

@pytest.mark.parametrize(("a", "b"), [(1, None)])
@pytest.mark.skipif(False, reason="not skipped")
def test_tuple_names(a, b): pass

def test_plain(): pass
'''


def test_case_ids_are_the_ones_pytest_collects(tmp_path):
    (tmp_path / "test_ids.py").write_text(PARAMETRIZED)
    tree = ast.parse(PARAMETRIZED)
    ours = [f"test_ids.py::{upstream.Case(f.name, i).name}" for f in upstream._test_functions(tree) for i in upstream.case_ids(f)]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "test_ids.py"],
                          cwd=tmp_path, capture_output=True, text=True, check=True)
    assert ours == [line for line in proc.stdout.splitlines() if "::" in line]


def test_a_name_from_tests_utils_without_a_stand_in_is_refused(tmp_path):
    write(tmp_path / "tests/basic_correctness/test_cumem.py", "from ..utils import multi_gpu_test, requires_fp8\n")
    with pytest.raises(BundleError, match=r"test_cumem.py:1: imports multi_gpu_test from ..utils, which this runner has no stand-in"):
        upstream.plan("9.9.9", tmp_path)


def test_a_test_that_needs_a_conftest_fixture_is_left_out(tmp_path):
    write(tmp_path / "tests/basic_correctness/test_cumem.py", """
        import pytest
        @pytest.mark.parametrize("level", [1])
        def test_a(level, monkeypatch, dist_init): pass
    """)
    plan = upstream.plan("9.9.9", tmp_path)
    assert plan.cases == ()
    assert plan.left_out[0].why == "asks for dist_init, fixture(s) of upstream's conftest.py, which this runner does not load"


# --- the runner, for real, against small stand-ins for vLLM --------------------------------

UPSTREAM_LIKE = """
    import os
    import pytest
    from vllm import LLM
    from vllm.device_allocator.cumem import CuMemAllocator
    from ..utils import create_new_process_for_each_test, requires_fp8

    PIDS = {pids!r}

    def _note_pid():
        with open(PIDS, "a") as fh:
            fh.write(f"{{os.getpid()}}\\n")

    @create_new_process_for_each_test("fork")
    def test_sleep_and_wake():
        _note_pid()
        allocator = CuMemAllocator.get_instance()
        allocator.sleep()
        allocator.wake_up()
        assert allocator.awake

    @pytest.mark.parametrize("level", [1, 2], ids=["sleep-1", "sleep-2"])
    @create_new_process_for_each_test()
    def test_level(level):
        _note_pid()
        assert CuMemAllocator.get_instance().supports(level)

    def test_skipped():
        pytest.skip("no GPU here")

    def test_hangs():
        import time
        if os.environ.get("HANG") == "1":
            time.sleep(60)

    @create_new_process_for_each_test()
    def test_end_to_end():
        LLM("org/model").generate("hi")

    @requires_fp8
    def test_fp8_kvcache():
        LLM(model="org/fp8")
"""

CUMEM = """
    class CuMemAllocator:
        instance = None
        awake = True
        broken_level = {broken}

        @classmethod
        def get_instance(cls):
            cls.instance = cls.instance or cls()
            return cls.instance

        def sleep(self):
            self.awake = False

        def wake_up(self):
            self.awake = True

        def supports(self, level):
            return level != self.broken_level
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def sdist_like(root: Path, pids: Path) -> Path:
    for package in ("tests", "tests/basic_correctness"):
        write(root / package / "__init__.py", "")
    write(root / "tests/basic_correctness/test_cumem.py", UPSTREAM_LIKE.format(pids=str(pids)))
    return root


def installed_vllm(site: Path, broken_level: int | None = None, dist_info: bool = True) -> Path:
    write(site / "vllm/__init__.py", "def __getattr__(name):\n    raise AttributeError(name)\nLLM = object\n")
    if dist_info:  # an installed package has it; a source tree has PKG-INFO instead
        write(site / "vllm-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: vllm\nVersion: 1.0\n")
    write(site / "vllm/device_allocator/__init__.py", "")
    write(site / "vllm/device_allocator/cumem.py", CUMEM.format(broken=broken_level))
    return site


def test_each_case_runs_in_its_own_process_and_the_verdict_holds(tmp_path):
    pids = tmp_path / "pids.txt"
    source = sdist_like(tmp_path / "sdist", pids)
    plan = upstream.plan("9.9.9", source)
    assert [c.name for c in plan.cases] == ["test_sleep_and_wake", "test_level[sleep-1]", "test_level[sleep-2]",
                                            "test_skipped", "test_hangs"]
    assert [x.function for x in plan.left_out] == ["test_end_to_end", "test_fp8_kvcache"]
    targets = [VllmUnderTest("pristine", installed_vllm(tmp_path / "pristine")),
               VllmUnderTest("patched", installed_vllm(tmp_path / "patched"))]
    report = upstream.run_tests(plan, source, targets, tmp_path / "work", timeout=120, progress=QUIET)
    assert {label: [o.outcome for o in cases.values()] for label, cases in report.outcomes.items()} == {
        "pristine": [PASSED, PASSED, PASSED, SKIPPED, PASSED], "patched": [PASSED, PASSED, PASSED, SKIPPED, PASSED]}
    assert report.verdict() == HOLDS
    assert len(set(pids.read_text().split())) == 6  # three cases on each side, each in a process of its own
    assert report.loaded["patched"]["vllm_file"] == str(tmp_path / "patched/vllm/__init__.py")
    assert report.outcomes["pristine"]["test_skipped"].detail.endswith("no GPU here")
    assert report.lines()[-1] == "  verdict: every upstream test that passes on pristine passes on patched"


def test_a_pristine_pass_that_fails_on_patched_breaks_the_verdict(tmp_path):
    source = sdist_like(tmp_path / "sdist", tmp_path / "pids.txt")
    plan = upstream.plan("9.9.9", source)
    plan = upstream.Plan(plan.lane, plan.test_file, plan.cases[:3], plan.left_out, plan.packages)
    targets = [VllmUnderTest("pristine", installed_vllm(tmp_path / "pristine")),
               VllmUnderTest("patched", installed_vllm(tmp_path / "patched", broken_level=2))]
    report = upstream.run_tests(plan, source, targets, tmp_path / "work", timeout=120, progress=QUIET)
    assert report.outcomes["patched"]["test_level[sleep-2]"].outcome == FAILED
    assert report.outcomes["patched"]["test_level[sleep-2]"].detail == "assert False (test_cumem.py:26)"
    assert report.verdict() == BROKEN and report.broken() == ["test_level[sleep-2]"]
    assert report.to_dict()["verdict"] == BROKEN


def test_a_case_past_its_time_is_an_error_and_the_next_one_still_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("HANG", "1")
    source = sdist_like(tmp_path / "sdist", tmp_path / "pids.txt")
    plan = upstream.plan("9.9.9", source)
    plan = upstream.Plan(plan.lane, plan.test_file, plan.cases[3:], plan.left_out, plan.packages)  # skipped, hangs
    target = VllmUnderTest("pristine", installed_vllm(tmp_path / "pristine"))
    report = upstream.run_tests(plan, source, [target], tmp_path / "work", timeout=8, progress=QUIET)
    hung = report.outcomes["pristine"]["test_hangs"]
    assert hung.outcome == ERROR and "did not finish within 8 s" in hung.detail
    assert report.verdict() == UNPROVEN


def test_a_vllm_imported_from_elsewhere_is_an_error(tmp_path):
    source = sdist_like(tmp_path / "sdist", tmp_path / "pids.txt")
    plan = upstream.plan("9.9.9", source)
    plan = upstream.Plan(plan.lane, plan.test_file, plan.cases[:1], plan.left_out, plan.packages)
    (tmp_path / "empty").mkdir()
    target = VllmUnderTest("patched", tmp_path / "empty", python_path=(installed_vllm(tmp_path / "other"),))
    report = upstream.run_tests(plan, source, [target], tmp_path / "work", timeout=120, progress=QUIET)
    outcome = report.outcomes["patched"]["test_sleep_and_wake"]
    assert outcome.outcome == ERROR
    assert outcome.detail == f"imported vllm from {tmp_path / 'other/vllm/__init__.py'}, not from {tmp_path / 'empty'}"


def source_tree_vllm(tree: Path, ext: Path) -> None:
    """A source tree whose cumem.py imports its extension and a compiled module the tree lacks."""
    installed_vllm(tree, dist_info=False)
    write(tree / "PKG-INFO", "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
    write(tree / "vllm/device_allocator/cumem.py", textwrap.dedent(CUMEM.format(broken=None)) + textwrap.dedent("""
        import vllm._C  # a compiled module: a source tree has none
        from vllm import cumem_allocator
        lib_name = cumem_allocator.__file__
        cumem_available = True
    """))
    write(ext / "cumem_allocator.py", "")  # stands in for the .so built from the tree


def test_an_extension_other_than_the_one_built_from_the_tree_is_an_error(tmp_path):
    source = sdist_like(tmp_path / "sdist", tmp_path / "pids.txt")
    plan = upstream.plan("9.9.9", source)
    plan = upstream.Plan(plan.lane, plan.test_file, plan.cases[:1], plan.left_out, plan.packages)
    source_tree_vllm(tmp_path / "tree", tmp_path / "ext")
    target = VllmUnderTest("patched", tmp_path / "tree", tmp_path / "elsewhere" / "cumem_allocator.abi3.so")
    (tmp_path / "elsewhere").mkdir()
    write(tmp_path / "tree/vllm/cumem_allocator.py", "")  # the tree's own: found, since the target's folder holds none
    report = upstream.run_tests(plan, source, [target], tmp_path / "work", timeout=120, progress=QUIET)
    outcome = report.outcomes["patched"]["test_sleep_and_wake"]
    assert outcome.outcome == ERROR
    assert outcome.detail.startswith(f"cumem.py found the extension {tmp_path / 'tree/vllm/cumem_allocator.py'}, not the one built")


def test_a_source_tree_is_imported_with_its_extension_and_placeholders(tmp_path):
    source = sdist_like(tmp_path / "sdist", tmp_path / "pids.txt")
    plan = upstream.plan("9.9.9", source)
    plan = upstream.Plan(plan.lane, plan.test_file, plan.cases[:1], plan.left_out, plan.packages)
    source_tree_vllm(tmp_path / "tree", tmp_path / "ext")
    target = VllmUnderTest("pristine", tmp_path / "tree", tmp_path / "ext" / "cumem_allocator.py",
                           python_path=(installed_vllm(tmp_path / "decoy"),))  # a vllm later on PYTHONPATH loses
    report = upstream.run_tests(plan, source, [target], tmp_path / "work", timeout=120, progress=QUIET)
    assert report.outcomes["pristine"]["test_sleep_and_wake"].outcome == PASSED
    assert report.loaded["pristine"] == {"vllm_file": str(tmp_path / "tree/vllm/__init__.py"),
                                         "vllm_version": "9.9.9",  # the tree's, not the decoy's 1.0 further down
                                         "extension": str(tmp_path / "ext/cumem_allocator.py"),
                                         "cumem_available": True, "placeholders": ["vllm._C"]}
    assert "empty placeholders for vllm._C" in "\n".join(report.lines())


def test_a_source_tree_vllm_cannot_import_is_an_error_naming_it(tmp_path):
    source = sdist_like(tmp_path / "sdist", tmp_path / "pids.txt")
    plan = upstream.plan("9.9.9", source)
    plan = upstream.Plan(plan.lane, plan.test_file, plan.cases[:1], plan.left_out, plan.packages)
    write(tmp_path / "tree/vllm/__init__.py", "import no_such_module_here\n")
    target = VllmUnderTest("patched", tmp_path / "tree", tmp_path / "ext" / "cumem_allocator.abi3.so")
    with pytest.raises(BundleError, match="tree/PKG-INFO is missing: .* is not the tree of a vLLM sdist"):
        upstream.run_tests(plan, source, [target], tmp_path / "work", timeout=120, progress=QUIET)
    write(tmp_path / "tree/PKG-INFO", "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n")
    report = upstream.run_tests(plan, source, [target], tmp_path / "work", timeout=120, progress=QUIET)
    outcome = report.outcomes["patched"]["test_sleep_and_wake"]
    assert outcome.outcome == ERROR
    assert outcome.detail == "import vllm failed: ModuleNotFoundError: No module named 'no_such_module_here'"


# --- on a GPU: the real tests ---------------------------------------------------------------


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.integration
def test_the_upstream_allocator_tests_pass_on_the_pristine_trees_here(default_context, pinned_tree, tmp_path):
    """Each lane's no-model tests on this GPU: 0.21.0 against the vLLM installed in this
    Python (when that is 0.21.0), 0.33.0 against its pinned tree with the extension built alone."""
    if not _cuda():
        pytest.skip("needs a CUDA GPU")
    try:
        native.find_cuda_home()
    except BundleError as exc:
        pytest.skip(str(exc))
    runs = []
    installed = importlib.util.find_spec("vllm")
    if installed is not None and importlib.metadata.version("vllm") == "0.21.0":
        site = Path(next(iter(installed.submodule_search_locations))).parent
        runs.append((upstream.plan("0.21.0", pinned_tree), pinned_tree, VllmUnderTest("pristine", site)))
    tree = default_context.source("0.33.0").root
    ext = native.build_cumem_extension(tree, tmp_path / "ext")
    runs.append((upstream.plan("0.33.0", tree), tree, VllmUnderTest("pristine", tree, ext)))
    for plan, source, target in runs:
        report = upstream.run_tests(plan, source, [target], tmp_path / f"work-{plan.lane}", progress=QUIET)
        print("\n".join(report.lines()))
        assert [o.outcome for o in report.outcomes["pristine"].values()] == [PASSED] * len(plan.cases)


def test_one_side_run_later_is_compared_with_the_other_sides_earlier_results():
    plan = upstream.Plan("9.9.9", "tests/t/test_cumem.py", (upstream.Case("test_a"), upstream.Case("test_b", "x")), (), ("tests", "tests/t"))
    earlier = upstream.Report(plan, {"pristine": {"test_a": upstream.Outcome(PASSED), "test_b[x]": upstream.Outcome(PASSED)}},
                              {"pristine": {"vllm_file": "/p/vllm/__init__.py"}})
    now = upstream.Report(plan, {"patched": {"test_a": upstream.Outcome(PASSED), "test_b[x]": upstream.Outcome(FAILED, "boom")}})
    assert now.verdict() == UNPROVEN
    now.take(json.loads(json.dumps(earlier.to_dict())))
    assert now.verdict() == BROKEN and now.broken() == ["test_b[x]"]
    assert now.loaded["pristine"] == {"vllm_file": "/p/vllm/__init__.py"}
    other = upstream.Report(upstream.Plan("9.9.8", plan.test_file, plan.cases, (), plan.packages))
    with pytest.raises(BundleError, match="the earlier report ran another plan"):
        other.take(earlier.to_dict())
