"""The child side: import a tree's own cumem.py against the extension built from it.

The tree's real modules are imported, not copies: the tree goes first on sys.path
and the folder holding the built ``cumem_allocator.abi3.so`` goes first on
``vllm.__path__``, so ``vllm.cumem_allocator`` is the extension built from that tree
(cumem.py then finds it in /proc/self/maps by its name). A source tree has none of
vLLM's compiled kernels; the CUDA platform module imports two of them (``vllm._C``,
``vllm._C_stable_libtorch``) only to register torch ops that the allocator never calls,
so a source tree gets empty placeholders for exactly those compiled modules that it
lacks, and the report names them.

cumem.py turns a missing module into ``cumem_available = False`` and carries on; vLLM
would then run without sleep mode. Here that is an error naming the module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

# vllm._C, vllm._moe_C, vllm._C_stable_libtorch, vllm._rocm_C, ...: built by CMake.
COMPILED_MODULE = re.compile(r"^vllm\._(?:\w+_)?C(?:_\w+)?$")
# What cumem.py imports inside its ``try: ... except ModuleNotFoundError`` guard.
GUARDED = ("vllm.cumem_allocator", "vllm.distributed.device_communicators.cuda_wrapper")
# The pip packages that cumem.py needs at import time (FIELD-NOTES), by module name.
IMPORT_NEEDS = {"numpy": "numpy", "packaging": "packaging", "psutil": "psutil", "regex": "regex",
                "zmq": "pyzmq", "urllib3": "urllib3"}


class LoadError(Exception):
    """The tree's cumem.py cannot run here; the message says why."""


class CompiledPlaceholders(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: an empty module for a compiled vLLM module that no
    other finder found. Records what it stood in for."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, name, path=None, target=None):
        if COMPILED_MODULE.match(name):
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = "sm12x-bundle selftest placeholder: this source tree has no compiled kernels"
        self.names.append(module.__name__)


@dataclass
class Loaded:
    cumem: types.ModuleType
    vllm_file: str
    extension: str
    placeholders: list[str] = field(default_factory=list)


def explain(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    for module, package in IMPORT_NEEDS.items():
        if getattr(exc, "name", None) == module or f"No module named '{module}'" in str(exc):
            needs = ", ".join(sorted(set(IMPORT_NEEDS.values())))
            return f"{text} (install {package}; cumem.py needs {needs} at import time)"
    return text


def import_vllm(tree: Path | None, extension: Path | None, placeholders: CompiledPlaceholders) -> str:
    """``import vllm``: from ``tree``, with ``extension``'s folder first on vllm.__path__ and
    ``placeholders`` standing in for the compiled modules it lacks (tree None: the installed
    vLLM). Return the vllm/__init__.py imported."""
    if tree is not None:
        sys.path.insert(0, str(tree))
        sys.meta_path.append(placeholders)
    try:
        import vllm
    except Exception as exc:
        raise LoadError(f"import vllm failed: {explain(exc)}") from exc
    vllm_file = str(Path(vllm.__file__).resolve())
    if tree is not None:
        if not Path(vllm_file).is_relative_to(tree.resolve()):
            raise LoadError(f"import vllm found {vllm_file}, not the tree {tree}")
        vllm.__path__.insert(0, str(extension.parent))
    return vllm_file


def load(tree: Path | None, extension: Path | None) -> Loaded:
    """Import ``tree``'s cumem.py against ``extension`` (both None: the installed vLLM)."""
    placeholders = CompiledPlaceholders()
    vllm_file = import_vllm(tree, extension, placeholders)
    # What cumem.py imports inside its guard, imported first and unguarded: a failure
    # there would only set cumem_available = False, and leave half-imported packages
    # behind that hide the cause from a second try.
    for module in GUARDED:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise LoadError(f"import {module} failed: {explain(exc)}") from exc
    try:
        cumem = importlib.import_module("vllm.device_allocator.cumem")
    except Exception as exc:
        raise LoadError(f"import vllm.device_allocator.cumem failed: {explain(exc)}") from exc
    if not cumem.cumem_available:
        raise LoadError(f"cumem_available is False in {cumem.__file__}: {why_unavailable()}")
    lib = str(Path(cumem.lib_name).resolve())
    if extension is not None and lib != str(extension.resolve()):
        raise LoadError(f"cumem.py found the extension {lib}, not the one built from the tree ({extension})")
    return Loaded(cumem, vllm_file, lib, placeholders.names)


def why_unavailable() -> str:
    """Redo the step of cumem.py's import guard that was not redone before it."""
    try:
        importlib.import_module("vllm.distributed.device_communicators.cuda_wrapper").CudaRTLibrary()
    except Exception as exc:
        return f"CudaRTLibrary() failed (libcudart must be loaded by torch): {explain(exc)}"
    return "its import guard failed, but CudaRTLibrary() succeeds when redone"
