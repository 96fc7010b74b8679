"""vLLM's own allocator tests, from a lane's pinned sdist, against pristine and patched vLLM.

Planning reads the sdist's ``tests/**/test_cumem.py`` with ``ast`` and imports nothing:
each test function either runs, or is left out with the reason read from its body (it
builds an engine, which loads a model from the hub; it needs a fixture of upstream's
conftest.py). Parametrized functions give one case each, named as pytest names them.

Running copies that one file into a minimal rootdir of our own (the packages' empty
``__init__.py`` files, a ``pytest.ini`` and a ``tests/utils.py`` of stand-ins) and runs
every case in a pytest process of its own. Upstream's ``tests/utils.py`` and
``tests/conftest.py`` are not used: they import much of the serving stack (the API server,
anthropic, tblib, the hub) and the conftest's autouse fixtures only reset state between
tests in one process (an HTTP client, dynamo, the distributed environment) or are opt-in
(``VLLM_TEST_CLEAN_GPU_MEMORY``). The test files take two names from ``tests/utils.py``:
``create_new_process_for_each_test``, whose fork gives each test a process of its own,
which the runner's one process per case gives here; and ``requires_fp8``, used only by a
test that loads a model. upstream_plugin.py holds the stand-ins and loads a source tree.

vLLM under test is either installed (a folder laid out like site-packages, first on
PYTHONPATH: vLLM's wheel, or a copy of it with a lane's files patched) or a source tree
with the cumem extension built from it alone (native.py); a source tree has none of
vLLM's compiled kernels, so the plugin gives empty placeholders for the ones imported and
the result names them (selftest/loader.py does the same for the allocator selftest).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path

import sm12x_bundle

from .. import cmd, fsutil
from ..errors import BundleError, CommandError
from ..progress import Progress

PLUGIN = "sm12x_bundle.enginecheck.upstream_plugin"
TEST_GLOB = "tests/**/test_cumem.py"
# The names a test file may take from vLLM's tests/utils.py: upstream_plugin.py has a stand-in for each.
STAND_INS = ("create_new_process_for_each_test", "requires_fp8")
# Calls that build a vLLM engine: the model they name comes from the hub.
ENGINE_CALLS = ("LLM", "AsyncEngineArgs", "EngineArgs", "AsyncLLMEngine", "from_engine_args")
# pytest's own fixtures (a test that asks for another one needs upstream's conftest.py).
PYTEST_FIXTURES = frozenset({
    "monkeypatch", "tmp_path", "tmp_path_factory", "tmpdir", "tmpdir_factory", "request", "capsys",
    "capfd", "capsysbinary", "capfdbinary", "caplog", "recwarn", "pytestconfig", "record_property",
    "record_testsuite_property", "record_xml_attribute", "cache", "doctest_namespace", "subtests",
})
PASSED, FAILED, ERROR, SKIPPED = "passed", "failed", "error", "skipped"


# --- the plan: which tests run, read from the sdist --------------------------------------


@dataclass(frozen=True)
class Case:
    """One test that runs: a function, and its parametrize id when it has one."""

    function: str
    id: str | None = None

    @property
    def name(self) -> str:
        return self.function if self.id is None else f"{self.function}[{self.id}]"


@dataclass(frozen=True)
class LeftOut:
    function: str
    cases: int
    why: str


@dataclass(frozen=True)
class Plan:
    lane: str
    test_file: str  # relative to the sdist's root
    cases: tuple[Case, ...]
    left_out: tuple[LeftOut, ...]
    packages: tuple[str, ...]  # the folders from tests/ down to the test file's, which need __init__.py

    def nodeid(self, case: Case) -> str:
        return f"{self.test_file}::{case.name}"

    def to_dict(self) -> dict:
        return {"lane": self.lane, "test_file": self.test_file, "cases": [c.name for c in self.cases],
                "left_out": [{"function": x.function, "cases": x.cases, "why": x.why} for x in self.left_out]}


def find_test_file(source_root: Path) -> str:
    """The one ``tests/**/test_cumem.py`` of an sdist's tree, relative to it."""
    found = sorted(p.relative_to(source_root).as_posix() for p in source_root.glob(TEST_GLOB))
    if len(found) != 1:
        where = ", ".join(found) if found else "none"
        raise BundleError(f"{source_root}: expected one {TEST_GLOB} (vLLM's allocator tests), found {where}")
    return found[0]


def plan(lane: str, source_root: Path) -> Plan:
    """What runs of ``source_root``'s allocator tests, and what is left out and why."""
    test_file = find_test_file(source_root)
    tree = ast.parse((source_root / test_file).read_text("utf-8"), filename=test_file)
    _check_imports(tree, test_file)
    cases: list[Case] = []
    left: list[LeftOut] = []
    for func in _test_functions(tree):
        ids = case_ids(func)
        why = needs_more_than_a_gpu(func)
        if why:
            left.append(LeftOut(func.name, len(ids), why))
        else:
            cases += [Case(func.name, i) for i in ids]
    folders = Path(test_file).parent.parts
    packages = tuple("/".join(folders[: n + 1]) for n in range(len(folders)))
    return Plan(lane, test_file, tuple(cases), tuple(left), packages)


def _test_functions(tree: ast.Module) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test")]


def _check_imports(tree: ast.Module, test_file: str) -> None:
    """The test file may take from vLLM's tests/ package only what the stand-ins provide."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom):
            continue
        module = node.module or ""
        from_tests = node.level > 0 or module == "tests" or module.startswith("tests.")
        if not from_tests:
            continue
        names = [a.name for a in node.names]
        is_utils = module.split(".")[-1] == "utils" and (node.level > 0 or module == "tests.utils")
        unknown = [n for n in names if n not in STAND_INS] if is_utils else names
        if unknown:
            dots = "." * node.level
            raise BundleError(f"{test_file}:{node.lineno}: imports {', '.join(unknown)} from {dots}{module}, "
                              f"which this runner has no stand-in for (it has: {', '.join(STAND_INS)})")


def needs_more_than_a_gpu(func: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """Why a test cannot run on a GPU alone (it loads a model, or needs upstream's conftest), or None."""
    for node in ast.walk(func):
        if isinstance(node, ast.Call):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if callee in ENGINE_CALLS:
                return f"builds an engine ({callee}(...), line {node.lineno}) of {_model_of(node, func)}: a model from the hub"
    params = [a.arg for a in func.args.args + func.args.kwonlyargs]
    fixtures = [p for p in params if p not in _parametrized(func) and p not in PYTEST_FIXTURES]
    if fixtures:
        return f"asks for {', '.join(fixtures)}, fixture(s) of upstream's conftest.py, which this runner does not load"
    return None


def _model_of(call: ast.Call, func: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    """The model an engine call names: a literal, or the values a parametrized argument takes."""
    arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "model"), None)
    if isinstance(arg, ast.Constant):
        return repr(arg.value)
    if isinstance(arg, ast.Name):
        values = _parametrized(func).get(arg.id)
        if values is not None:
            return " and ".join(repr(v) for v in values)
        for node in ast.walk(func):  # model = "org/name" earlier in the body
            assigns = isinstance(node, ast.Assign) and any(getattr(t, "id", None) == arg.id for t in node.targets)
            if assigns and isinstance(node.value, ast.Constant):
                return repr(node.value.value)
    return "a model"


# --- parametrize: the ids pytest gives -------------------------------------------------


def _parametrize_marks(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.Call]:
    """The function's @pytest.mark.parametrize calls, nearest the def first (pytest's order)."""
    marks = [d for d in func.decorator_list
             if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr == "parametrize"]
    return list(reversed(marks))


def _argnames(mark: ast.Call) -> list[str]:
    names = ast.literal_eval(mark.args[0])
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


def _parametrized(func: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, list]:
    """argname -> its values (a literal list), for single-name parametrize marks."""
    out = {}
    for mark in _parametrize_marks(func):
        names = _argnames(mark)
        try:
            values = ast.literal_eval(mark.args[1])
        except ValueError:
            values = [None] * len(mark.args[1].elts)
        for name in names:
            out[name] = values if len(names) == 1 else []
    return out


def _mark_ids(mark: ast.Call) -> list[str]:
    """The ids of one parametrize mark: its ids= list, else pytest's own for each value."""
    given = next((k.value for k in mark.keywords if k.arg == "ids"), None)
    if given is not None:
        return [str(x) for x in ast.literal_eval(given)]
    names = _argnames(mark)
    out = []
    for n, node in enumerate(mark.args[1].elts):
        values = node.elts if len(names) > 1 and isinstance(node, ast.Tuple) else [node]
        out.append("-".join(_value_id(v, name, n) for v, name in zip(values, names)))
    return out


def _value_id(node: ast.expr, argname: str, index: int) -> str:
    """pytest's id of one value: str() of a number, a string, a bool or None; else argname + index."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return f"{argname}{index}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return str(value)
    return f"{argname}{index}"


def case_ids(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str | None]:
    """The ids of a function's cases (stacked marks: nearest the def varies slowest, comes first)."""
    marks = _parametrize_marks(func)
    if not marks:
        return [None]
    return ["-".join(combo) for combo in product(*(_mark_ids(m) for m in marks))]


# --- the rootdir: the one test file and our stand-ins, nothing else of upstream's -------

PYTEST_INI = """\
# Written by sm12x-bundle (enginecheck/upstream.py). A rootdir of its own, so that
# vLLM's pyproject.toml and tests/conftest.py are not read.
[pytest]
"""


def stand_in_utils(test_file: str) -> str:
    return (
        f'"""Written by sm12x-bundle: stand-ins for what {test_file} imports from vLLM\'s\n'
        'tests/utils.py (see sm12x_bundle/enginecheck/upstream.py for why not the real one)."""\n\n'
        f"from {PLUGIN} import {', '.join(STAND_INS)}  # noqa: F401\n"
    )


def write_rootdir(the_plan: Plan, source_root: Path, dest: Path) -> Path:
    """The rootdir that pytest runs in: the packages' __init__.py files and the test file,
    read from the sdist now, beside our pytest.ini and tests/utils.py; ``dest`` is replaced."""
    with fsutil.replace_dir(dest, what="upstream tests folder") as staging:
        (staging / "pytest.ini").write_text(PYTEST_INI)
        for package in the_plan.packages:
            init = source_root / package / "__init__.py"
            if not init.is_file():
                raise BundleError(f"{init} is missing: {the_plan.test_file} imports from its package")
            (staging / package).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(init, staging / package / "__init__.py")
        (staging / "tests" / "utils.py").write_text(stand_in_utils(the_plan.test_file))
        shutil.copyfile(source_root / the_plan.test_file, staging / the_plan.test_file)
    return dest


# --- vLLM under test, and one process per case -------------------------------------------


@dataclass(frozen=True)
class VllmUnderTest:
    """pristine or patched: installed (``root`` is a site folder holding vllm/) or a source
    tree (``root``) with the cumem extension built from it (``extension``)."""

    label: str
    root: Path
    extension: Path | None = None
    python_path: tuple[Path, ...] = ()  # more folders for PYTHONPATH, after root (e.g. the payload's)

    @property
    def is_tree(self) -> bool:
        return self.extension is not None


@dataclass(frozen=True)
class Outcome:
    outcome: str  # passed, failed, error, skipped
    detail: str = ""
    seconds: float | None = None


def case_argv(the_plan: Plan, case: Case, target: VllmUnderTest, rootdir: Path, result: Path) -> list[str]:
    """The command that runs one case in a fresh interpreter."""
    argv = [sys.executable, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-c", str(rootdir / "pytest.ini"),
            "--rootdir", str(rootdir), "-q", "-rA", "--sm12x-result", str(result)]
    if target.is_tree:
        argv += ["--sm12x-tree", str(target.root), "--sm12x-extension", str(target.extension)]
    return argv + [the_plan.nodeid(case)]


def write_metadata(tree: Path, dest: Path) -> Path:
    """A folder holding ``vllm-<version>.dist-info/METADATA`` for a source tree: its sdist's
    PKG-INFO, which is core metadata. vLLM finds its platform by its installed version (a
    version with 'cpu' in it is a CPU build): without metadata a source tree runs on
    UnspecifiedPlatform, where 0.33.0 has no sleep-mode allocator, and a vLLM installed
    further down PYTHONPATH would answer with its own version."""
    pkg_info = tree / "PKG-INFO"
    if not pkg_info.is_file():
        raise BundleError(f"{pkg_info} is missing: {tree} is not the tree of a vLLM sdist (its version is unknown)")
    text = pkg_info.read_text("utf-8", "replace")
    version = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Version:")), None)
    if not version:
        raise BundleError(f"{pkg_info} names no Version")
    with fsutil.replace_dir(dest, what="metadata folder") as staging:
        (staging / f"vllm-{version}.dist-info").mkdir()
        (staging / f"vllm-{version}.dist-info" / "METADATA").write_text(text)
    return dest


def case_env(target: VllmUnderTest, metadata: Path | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment, with the vLLM under test first on PYTHONPATH (installed; a source tree:
    its metadata) and our package importable; no bytecode written into a tree that may be cached."""
    env = dict(os.environ)
    ours = str(Path(sm12x_bundle.__file__).resolve().parents[1])
    first = [str(metadata)] if target.is_tree else [str(target.root)]
    paths = [*first, *map(str, target.python_path), ours, env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_case(the_plan: Plan, case: Case, target: VllmUnderTest, rootdir: Path, result: Path, *,
             timeout: float, metadata: Path | None = None, run: Callable = cmd.run) -> tuple[Outcome, dict]:
    """Run one case in its own process; read its outcome from the file the plugin wrote."""
    result.unlink(missing_ok=True)
    tail = ""
    try:
        run(case_argv(the_plan, case, target, rootdir, result), cwd=rootdir, env=case_env(target, metadata), timeout=timeout)
    except CommandError as exc:  # a failing test exits 1: its outcome is in the file
        tail = "\n".join(str(exc).strip().splitlines()[-12:])
    doc = json.loads(result.read_text()) if result.is_file() else {}
    found = doc.get("outcomes", {}).get(case.name)
    if found:
        return Outcome(found["outcome"], found.get("detail", ""), found.get("seconds")), doc
    reason = doc.get("error") or tail or "the pytest process wrote no result"
    return Outcome(ERROR, reason), doc


def _loaded_from(target: VllmUnderTest, doc: Mapping) -> str | None:
    """Why the process did not test ``target`` (it imported vllm, or cumem.py found its
    extension, elsewhere), or None."""
    vllm_file, extension = doc.get("vllm_file"), doc.get("extension")
    if vllm_file and not Path(vllm_file).resolve().is_relative_to(target.root.resolve()):
        return f"imported vllm from {vllm_file}, not from {target.root}"
    if target.is_tree and extension and Path(extension).resolve() != target.extension.resolve():
        return f"cumem.py found the extension {extension}, not the one built from the tree ({target.extension})"
    return None


# --- the report ---------------------------------------------------------------------------

HOLDS = "holds"  # every upstream test that passes on pristine passes on patched
BROKEN = "broken"  # some test that passes on pristine does not pass on patched
UNPROVEN = "unproven"  # no test passed on pristine (or one side was not run): nothing was shown


@dataclass
class Report:
    plan: Plan
    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=dict)  # label -> case name -> outcome
    loaded: dict[str, dict] = field(default_factory=dict)  # label -> what the processes imported

    def broken(self, pristine: str = "pristine", patched: str = "patched") -> list[str]:
        """The cases that pass on pristine and do not pass on patched."""
        before, after = self.outcomes.get(pristine, {}), self.outcomes.get(patched, {})
        return [c.name for c in self.plan.cases
                if before.get(c.name, Outcome(ERROR)).outcome == PASSED and after.get(c.name, Outcome(ERROR)).outcome != PASSED]

    def verdict(self, pristine: str = "pristine", patched: str = "patched") -> str:
        if pristine not in self.outcomes or patched not in self.outcomes:
            return UNPROVEN
        if self.broken(pristine, patched):
            return BROKEN
        passed = any(o.outcome == PASSED for o in self.outcomes[pristine].values())
        return HOLDS if passed else UNPROVEN

    def to_dict(self) -> dict:
        return {
            "plan": self.plan.to_dict(),
            "results": {label: {name: {"outcome": o.outcome, "detail": o.detail, "seconds": o.seconds}
                                for name, o in cases.items()} for label, cases in self.outcomes.items()},
            "loaded": self.loaded,
            "verdict": self.verdict(),
            "broken": self.broken(),
        }

    def take(self, doc: Mapping, labels: Sequence[str] | None = None) -> None:
        """Take the results of ``labels`` (None: every one this report lacks) from an earlier
        report's to_dict() of the same plan: one side may run in one process tree, the other later."""
        if doc.get("plan") != self.plan.to_dict():
            raise BundleError("the earlier report ran another plan (another lane or test file): its results cannot be compared")
        for label, cases in doc.get("results", {}).items():
            if (labels is None and label not in self.outcomes) or (labels is not None and label in labels):
                self.outcomes[label] = {name: Outcome(o["outcome"], o.get("detail", ""), o.get("seconds"))
                                        for name, o in cases.items()}
                self.loaded[label] = dict(doc.get("loaded", {}).get(label, {}))

    def lines(self) -> list[str]:
        labels = sorted(self.outcomes, key=lambda label: (label != "pristine", label != "patched", label))
        width = max([len(c.name) for c in self.plan.cases] + [4])
        out = [f"vLLM {self.plan.lane}: {self.plan.test_file}",
               f"  {'test':<{width}}  " + "  ".join(f"{label:<8}" for label in labels)]
        for case in self.plan.cases:
            cells = [self.outcomes[label].get(case.name, Outcome("not run")).outcome for label in labels]
            out.append(f"  {case.name:<{width}}  " + "  ".join(f"{c:<8}" for c in cells))
        out += [f"  left out: {x.function} ({x.cases} case{'s' if x.cases > 1 else ''}): {x.why}" for x in self.plan.left_out]
        for label, seen in self.loaded.items():
            held = f"; empty placeholders for {', '.join(seen['placeholders'])}" if seen.get("placeholders") else ""
            unavailable = "; cumem unavailable (cumem_available is False)" if seen.get("cumem_available") is False else ""
            out.append(f"  {label}: vllm {seen.get('vllm_version')} from {seen.get('vllm_file')} on {seen.get('platform')}, "
                       f"cumem extension {seen.get('extension')}{unavailable}{held}")
        verdict = {HOLDS: "every upstream test that passes on pristine passes on patched",
                   BROKEN: "some upstream tests pass on pristine and not on patched: " + ", ".join(self.broken()),
                   UNPROVEN: "nothing shown: no upstream test passed on pristine, or a side was not run"}
        out.append(f"  verdict: {verdict[self.verdict()]}")
        return out


def run_tests(the_plan: Plan, source_root: Path, targets: Sequence[VllmUnderTest], work: Path, *,
              timeout: float = 300, run: Callable = cmd.run, progress: Progress | None = None) -> Report:
    """Every case of ``the_plan`` against every target, each in a process of its own."""
    progress = progress or Progress.stderr()
    rootdir = write_rootdir(the_plan, source_root, work / f"vllm-{the_plan.lane}-tests")
    report = Report(the_plan)
    for target in targets:
        results = work / f"vllm-{the_plan.lane}-{target.label}"
        results.mkdir(parents=True, exist_ok=True)
        metadata = write_metadata(target.root, results / "metadata") if target.is_tree else None
        report.outcomes[target.label] = {}
        for n, case in enumerate(the_plan.cases, 1):
            outcome, doc = run_case(the_plan, case, target, rootdir, results / f"{n:02d}.json", timeout=timeout,
                                    metadata=metadata, run=run)
            wrong = _loaded_from(target, doc)
            report.outcomes[target.label][case.name] = Outcome(ERROR, wrong) if wrong else outcome
            _note_loaded(report.loaded.setdefault(target.label, {}), doc)
            progress.say(f"vLLM {the_plan.lane} {target.label}: {case.name}: {report.outcomes[target.label][case.name].outcome}")
    return report


def _note_loaded(seen: dict, doc: Mapping) -> None:
    for key in ("vllm_file", "vllm_version", "platform", "extension", "cumem_available"):
        if doc.get(key) is not None:
            seen.setdefault(key, doc[key])
    names = set(seen.get("placeholders", [])) | set(doc.get("placeholders", []))
    seen["placeholders"] = sorted(names)
