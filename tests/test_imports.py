"""The package's import graph: every module imports alone, and the packages form no cycle.

The pipeline's layers import one way: source and series below, the plan above them, the
outputs above the plan (an output renders a plan; the plan never imports an output).
Read from the source with ``ast`` (no import side effects), so a cycle anywhere is named.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "sm12x_bundle"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: Path, lazy: bool = True) -> set[str]:
    """The package's modules ``name`` imports at module level, and (``lazy``) in a function."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    known = modules()
    out = set()
    tree = ast.parse(path.read_text("utf-8"))
    for node in ast.walk(tree) if lazy else tree.body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.add(full if full in known else base)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m in known and m != name}


def layer(module: str) -> str:
    """``sm12x_bundle.plan.target`` -> ``plan``; a top-level module is its own layer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle found by depth-first search (one per back edge)."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_plan_never_imports_an_output():
    for name, path in modules().items():
        if layer(name) == "plan":
            outputs = sorted(m for m in imported(name, path) if layer(m) == "outputs")
            assert not outputs, f"{name} imports {outputs}: an output renders a plan, never the other way"


def test_the_layers_form_no_cycle():
    """Packages (source, series, checks, plan, outputs, selftest) and top-level modules, by
    their module-level imports. (Known, left as it is: config.py imports outputs/nomad.py's
    budget arithmetic inside a function, a deferred edge back up the layers.)"""
    graph: dict[str, set[str]] = {}
    for name, path in modules().items():
        deps = imported(name, path, lazy=False)
        graph.setdefault(layer(name), set()).update(layer(m) for m in deps if layer(m) != layer(name))
    # cli, pipeline and the package itself gather the commands: they sit on top by design
    top = {"cli", "pipeline", "__main__", "sm12x_bundle"}
    graph = {k: v - top for k, v in graph.items() if k not in top}
    assert cycles(graph) == []


def test_the_image_side_modules_form_no_cycle():
    """Module by module inside plan/ and outputs/ (the old overlay <-> manifest bounce)."""
    graph = {
        name: {m for m in imported(name, path) if layer(m) in ("plan", "outputs")}
        for name, path in modules().items()
        if layer(name) in ("plan", "outputs")
    }
    assert cycles(graph) == []


@pytest.mark.parametrize("name", sorted(n for n in modules() if layer(n) in ("plan", "outputs")))
def test_each_module_imports_alone(name):
    proc = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_checker_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
