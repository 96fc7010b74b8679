"""The vLLM under test: a folder holding the ``vllm`` package, found and read without importing it.

The parent process never imports vllm (nor torch): importing vLLM starts CUDA work in some
releases, and the parent must hold no CUDA context. The version comes from the install's
own metadata (``vllm-<version>.dist-info/METADATA``), else from ``vllm/_version.py`` read as
text; the lane is the one whose pinned release is exactly that version.
"""

from __future__ import annotations

import ast
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, EnvironmentProblem
from ..series.lane import Lane


@dataclass(frozen=True)
class Install:
    """An installed vLLM: ``root`` holds the ``vllm`` package (a site-packages, an unpacked wheel)."""

    root: Path
    version: str  # as the install says it, e.g. 0.21.0 or 0.21.0+cu130
    version_from: str  # the file the version was read from

    @property
    def package(self) -> Path:
        return self.root / "vllm"

    @property
    def release(self) -> str:
        """The version without its local part (+cu130): what a lane is pinned to."""
        return self.version.split("+", 1)[0]


def find_install(path: Path | None) -> Install:
    """The vLLM in ``path`` (a folder holding ``vllm/``), else the one this Python would import."""
    root = _given_root(path) if path is not None else _imported_root()
    version, source = read_version(root)
    return Install(root.resolve(), version, source)


def _given_root(path: Path) -> Path:
    if not (path / "vllm" / "__init__.py").is_file():
        hint = f"; give the folder above it, {path.parent}" if (path / "__init__.py").is_file() and path.name == "vllm" else ""
        raise ConfigError(f"--vllm-path {path} holds no vllm package ({path / 'vllm' / '__init__.py'} is missing){hint}")
    return path


def _imported_root() -> Path:
    # find_spec of a top-level name locates the package without running its __init__.
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None or not spec.origin.endswith("__init__.py"):
        raise EnvironmentProblem(
            "no vLLM is importable in this Python: install one, or give --vllm-path DIR "
            "(a folder holding the vllm package, e.g. an unpacked wheel)"
        )
    return Path(spec.origin).parent.parent


def read_version(root: Path) -> tuple[str, str]:
    """(version, the file it was read from): the dist-info's METADATA, else vllm/_version.py."""
    infos = sorted(root.glob("vllm-*.dist-info/METADATA"))
    if len(infos) == 1:
        version = _metadata_version(infos[0])
        if version:
            return version, str(infos[0])
    version_py = root / "vllm" / "_version.py"
    version = _version_py(version_py) if version_py.is_file() else None
    if version:
        return version, str(version_py)
    raise ConfigError(
        f"the vLLM at {root / 'vllm'} does not say its version (no single vllm-*.dist-info/METADATA, "
        "no __version__ in vllm/_version.py), so no lane can be chosen for it"
    )


def _metadata_version(path: Path) -> str | None:
    for line in path.read_text("utf-8", "replace").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip() or None
        if not line.strip():  # the headers end at the first blank line
            break
    return None


def _version_py(path: Path) -> str | None:
    """``__version__ = version = '0.21.0'`` (setuptools-scm's file), read without running it."""
    try:
        tree = ast.parse(path.read_text("utf-8", "replace"))
    except SyntaxError:
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)):
            return node.value.value
    return None


def lane_for(lanes: Sequence[Lane], install: Install, named: str | None) -> Lane:
    """The lane of exactly the release the install carries; refused when there is none, or
    when ``--lane`` names another."""
    versions = ", ".join(lane.version for lane in lanes)
    if named is not None and named != install.release:
        raise ConfigError(
            f"--lane {named} disagrees with the vLLM under test: {install.package} is vLLM {install.version} "
            f"(read from {install.version_from}); drop --lane, or test a vLLM {named} install"
        )
    for lane in lanes:
        if lane.version == install.release:
            return lane
    raise ConfigError(
        f"{install.package} is vLLM {install.version} (read from {install.version_from}), and no lane is for it "
        f"(lanes: {versions}): the engine check runs a lane's series on exactly its release"
    )
