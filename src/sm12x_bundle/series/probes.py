"""Landed-upstream probes: does the target tree already carry the fix in its own form?

A probe is data (``PATH[::QUALNAME] ~ REGEX``), never code: the file is parsed, not
imported, and the regex is searched in the named function's source.
"""

from __future__ import annotations

import ast
import re

from .apply import VirtualTree
from .patch import Probe


def _python_segment(source: str, qualname: str) -> str | None:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    scope: list[ast.stmt] = tree.body
    node = None
    for part in qualname.split("."):
        node = next(
            (
                n
                for n in scope
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part
            ),
            None,
        )
        if node is None:
            return None
        scope = node.body
    return ast.get_source_segment(source, node) if node is not None else None


def _c_segment(source: str, name: str) -> str | None:
    """The body of C/C++ function ``name``: its signature line through the matching brace."""
    for m in re.finditer(rf"\b{re.escape(name)}\s*\([^;{{}}]*\)\s*[^;{{}}]*\{{", source):
        depth, i = 0, m.end() - 1
        while i < len(source):
            depth += {"{": 1, "}": -1}.get(source[i], 0)
            if depth == 0:
                return source[m.start() : i + 1]
            i += 1
    return None


def segment(source: str, path: str, qualname: str | None) -> str | None:
    if qualname is None:
        return source
    if path.endswith(".py"):
        return _python_segment(source, qualname)
    return _c_segment(source, qualname.rsplit(".", 1)[-1])


def probe_matches(tree: VirtualTree, probe: Probe) -> bool:
    """True when the probe's file (as the tree holds it now) shows the fix."""
    current = tree.read(probe.path)
    if current is None:
        return False
    text = segment(current.to_bytes().decode("utf-8", "replace"), probe.path, probe.qualname)
    return text is not None and re.search(probe.pattern, text, re.MULTILINE) is not None
