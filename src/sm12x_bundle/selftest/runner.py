"""The parent side: build each tree's extension, start one process per scenario.

Every scenario runs in a fresh interpreter (``python -m sm12x_bundle.selftest.child``):
the C extension keeps global state, and a CUDA fault poisons the process's context
for good. The child writes its result as JSON to a file; the parent reads it even
when the child dies afterwards, and turns a death before it into an ``error``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import sm12x_bundle

from .. import cmd, native
from ..errors import BundleError, CommandError, EnvironmentProblem, VerifyError
from .plan import Scenario, Sizes, Target
from .report import ERROR, ScenarioResult

CUMEM_PY = Path("vllm/device_allocator/cumem.py")


@dataclass(frozen=True)
class Staged:
    """A target ready to run: where its cumem.py is, and the extension it loads."""

    target: Target
    cumem_py: Path
    extension: Path
    build: list[str] | None  # the compiler command that made the extension


def stage(
    target: Target,
    work: Path,
    *,
    python_include: Path | None = None,
    build: Callable[..., Path] | None = None,
) -> Staged:
    """Build the target tree's extension alone into ``work``; for the installed
    vLLM, find the extension it ships."""
    if target.tree is None:
        return _stage_installed(target)
    tree = target.tree
    missing = [p for p in (CUMEM_PY, native.SOURCE) if not (tree / p).is_file()]
    if missing:
        raise BundleError(
            f"{tree} is not a vLLM source tree: {', '.join(map(str, missing))} missing "
            "(for the vLLM installed in this Python, use --installed)"
        )
    out = work / target.label / "ext"
    argv = native.cumem_build_argv(tree, out, python_include=python_include)
    ext = (build or native.build_cumem_extension)(tree, out, python_include=python_include)
    if "cumem_allocator" not in ext.name:
        raise VerifyError(f"the built extension {ext} must have 'cumem_allocator' in its name")
    return Staged(target, tree / CUMEM_PY, ext, argv)


def _stage_installed(target: Target) -> Staged:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise EnvironmentProblem("no vLLM is installed in this Python (" + sys.executable + "): give --tree")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    cumem_py = pkg / "device_allocator" / "cumem.py"
    exts = sorted(pkg.glob("cumem_allocator*.so"))
    if not cumem_py.is_file() or not exts:
        raise EnvironmentProblem(f"the vLLM installed at {pkg} has no cumem allocator (cumem.py and cumem_allocator*.so)")
    return Staged(target, cumem_py, exts[0], None)


def child_argv(staged: Staged, scenario: str, params: Mapping, out: Path) -> list[str]:
    """The command that runs one scenario (or the probe) in a fresh interpreter."""
    argv = [sys.executable, "-m", "sm12x_bundle.selftest.child", scenario, "--out", str(out)]
    if staged.target.tree is not None:
        argv += ["--tree", str(staged.target.tree), "--extension", str(staged.extension)]
    argv += ["--params", json.dumps(dict(params), sort_keys=True)]
    return argv


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment, plus what every child needs: our package importable, no
    bytecode written into a (possibly cached) tree, vLLM's per-sleep logs quiet."""
    env = dict(os.environ)
    ours = str(Path(sm12x_bundle.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ours, env.get("PYTHONPATH")]))
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.update(extra or {})
    return env


def run_child(
    staged: Staged,
    scenario: str,
    params: Mapping,
    out: Path,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    run: Callable | None = None,
) -> tuple[dict | None, str]:
    """Run the child; return (its JSON document or None, the tail of its output)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.exists():
        out.unlink()
    tail = ""
    try:
        proc = (run or cmd.run)(child_argv(staged, scenario, params, out), env=child_env(env), timeout=timeout)
        tail = _tail((proc.stdout or "") + (proc.stderr or ""))
    except CommandError as exc:
        tail = _tail(str(exc))
    if out.is_file():
        return json.loads(out.read_text()), tail
    return None, tail


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def probe(staged: Staged, work: Path, *, timeout: float = 300, run: Callable | None = None) -> dict:
    """Load the target's cumem.py in a child and read the GPU; raise when cumem is
    unavailable there (vLLM would silently run without sleep mode)."""
    doc, tail = run_child(staged, "probe", {}, work / staged.target.label / "probe.json", timeout=timeout, run=run)
    if doc is None:
        raise BundleError(f"{_where(staged)}: the probe process died before it reported:\n{tail}")
    if doc.get("outcome") != "pass":
        raise EnvironmentProblem(f"{_where(staged)}: {doc.get('reason', 'the probe failed')}")
    return doc["figures"]


def _where(staged: Staged) -> str:
    return f"{staged.target.label} ({staged.target.tree or 'installed vLLM'})"


def scenario_params(sizes: Sizes, speed_target: float, seed: int = 1, wake_after: float = 0.0) -> dict:
    params = sizes.to_dict()
    params["speed_target"] = speed_target
    params["seed"] = seed
    params["wake_after_s"] = wake_after
    return params


def run_scenario(
    staged: Staged,
    scenario: Scenario,
    params: Mapping,
    work: Path,
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    run: Callable | None = None,
) -> ScenarioResult:
    out = work / staged.target.label / f"{scenario.number}-{scenario.name}.json"
    start = time.monotonic()
    doc, tail = run_child(staged, scenario.name, params, out, timeout=timeout, env=env, run=run)
    seconds = time.monotonic() - start
    if doc is None:
        reason = "the scenario's process died before it reported" + (f": {tail.splitlines()[-1]}" if tail else "")
        return ScenarioResult(scenario.name, staged.target.label, ERROR, reason, seconds, {"output_tail": tail})
    reason, figures = doc["reason"], doc.get("figures", {})
    if doc.get("provisional"):  # written before a step that may kill the process, which it did
        reason += " (the process died" + (f": {tail.splitlines()[-1]})" if tail else ")")
        figures = {**figures, "output_tail": tail}
    return ScenarioResult(scenario.name, staged.target.label, doc["outcome"], reason, seconds, figures)

