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
    for node in _runtime_nodes(tree) if lazy else tree.body:
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


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (annotations only: nothing runs)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


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
    their module-level imports."""
    graph: dict[str, set[str]] = {}
    for name, path in modules().items():
        deps = imported(name, path, lazy=False)
        graph.setdefault(layer(name), set()).update(layer(m) for m in deps if layer(m) != layer(name))
    # cli, pipeline and the package itself gather the commands: they sit on top by design
    top = {"cli", "pipeline", "__main__", "sm12x_bundle"}
    graph = {k: v - top for k, v in graph.items() if k not in top}
    assert cycles(graph) == []


def test_no_module_imports_its_way_back_to_itself():
    """Module by module across the whole package, imports inside functions included: a
    deferred import is a cycle put off, not removed."""
    graph = {name: imported(name, path) for name, path in modules().items()}
    assert cycles(graph) == []


# What starts a process. cmd.py alone does, so that every command is echoed and every
# failure is one CommandError; text inside a string (a script run in an image) is not a call.
_STARTERS = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execlp", "spawnv", "spawnl", "posix_spawn"},
}


def process_starts(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        call = node.func if isinstance(node, ast.Call) else None
        if isinstance(call, ast.Attribute) and isinstance(call.value, ast.Name):
            if call.attr in _STARTERS.get(call.value.id, ()):
                found.append(f"{path.name}:{node.lineno}: {call.value.id}.{call.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module in _STARTERS:
            found += [f"{path.name}:{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if a.name in _STARTERS[node.module]]
    return found


def test_only_cmd_starts_processes():
    starts = [s for name, path in modules().items() if name != "sm12x_bundle.cmd" for s in process_starts(path)]
    assert starts == []


def test_the_process_check_sees_a_start(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import subprocess\nfrom os import system\nS = 'subprocess.run(x)'\nP: subprocess.Popen\nsubprocess.run(['true'])\n")
    assert process_starts(f) == ["m.py:2: from os import system", "m.py:5: subprocess.run"]


# The house, floor by floor from the ground: a module imports only from floors below its
# own (its own package aside). The pipeline reads upward: lanes (source, series) -> config
# -> plan -> outputs, the checks beside; the commands on top.
FLOORS = (
    ("errors", "sm12x_bundle"),
    ("progress", "cmd", "fsutil", "inputs", "values", "serve_flags"),
    ("containers", "native", "jobs"),
    ("source",),
    ("series",),
    ("checks", "config", "fingerprint"),
    ("context",),
    ("plan",),
    ("outputs",),
    ("pipeline", "selftest"),
    ("enginecheck",),
    ("cli",),
    ("__main__",),
)


def floor(module: str) -> int:
    return next(i for i, names in enumerate(FLOORS) if layer(module) in names)


def test_every_module_has_a_floor():
    assert all(any(layer(n) in names for names in FLOORS) for n in modules()), "add the new layer to FLOORS"


def test_no_arrow_points_up():
    """Imports inside functions included: every arrow points to a lower floor."""
    up = [
        f"{name} (floor {floor(name)}) imports {dep} (floor {floor(dep)})"
        for name, path in modules().items()
        for dep in sorted(imported(name, path))
        if layer(dep) != layer(name) and floor(dep) >= floor(name)
    ]
    assert up == []


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
