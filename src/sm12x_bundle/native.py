"""Build vLLM's cumem allocator extension on its own.

``csrc/cumem_allocator.cpp`` (with ``cumem_allocator_compat.h`` beside it) uses only
Python's stable ABI and the CUDA driver API, so it builds with one compiler call in
seconds, where rebuilding vLLM takes hours. The result replaces
``vllm/cumem_allocator.abi3.so``; cumem.py finds the loaded library by the name
``cumem_allocator``, so the file name must keep it.

:func:`cumem_build_argv` returns the exact compiler command (the plan);
:func:`build_cumem_extension` runs it. The GPU selftest, the overlay builder and
``docker/Dockerfile.builder`` run the same line.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Mapping
from pathlib import Path

from . import cmd
from .errors import BundleError

SOURCE = Path("csrc/cumem_allocator.cpp")
ARTIFACT = "cumem_allocator.abi3.so"
# CMakeLists.txt builds the extension with ``USE_SABI 3.8`` (0.21.0 up to 0.33.0).
PY_LIMITED_API = "0x03080000"
# Where CUDA toolkits keep the stub libcuda.so (no driver needed to link against it).
_STUB_DIRS = ("lib64/stubs", "lib/stubs", "targets/x86_64-linux/lib/stubs",
              "targets/sbsa-linux/lib/stubs")


def find_cuda_home(env: Mapping[str, str] | None = None) -> Path:
    """CUDA_HOME, else CUDA_PATH, else /usr/local/cuda; it must hold include/cuda.h."""
    env = os.environ if env is None else env
    cuda_home = Path(env.get("CUDA_HOME") or env.get("CUDA_PATH") or "/usr/local/cuda")
    _require_cuda_h(cuda_home)
    return cuda_home


def _require_cuda_h(cuda_home: Path) -> None:
    if not (cuda_home / "include" / "cuda.h").is_file():
        raise BundleError(
            f"{cuda_home / 'include' / 'cuda.h'} not found: install the CUDA toolkit "
            "headers or point CUDA_HOME at a CUDA toolkit"
        )


def _link_args(cuda_home: Path, libcuda: Path | None) -> list[str]:
    """Link against ``libcuda`` (a library file or the folder that holds
    libcuda.so), else the toolkit's stub, else wherever the linker finds -lcuda."""
    if libcuda is not None:
        if libcuda.is_dir():
            return [f"-L{libcuda}", "-lcuda"]
        return [f"-L{libcuda.parent}", f"-l:{libcuda.name}"]
    for sub in _STUB_DIRS:
        if (cuda_home / sub / "libcuda.so").is_file():
            return [f"-L{cuda_home / sub}", "-lcuda"]
    return ["-lcuda"]


def cumem_build_argv(
    tree: Path,
    out_dir: Path,
    *,
    cuda_home: Path | None = None,
    python_include: Path | None = None,
    libcuda: Path | None = None,
    compiler: str = "g++",
) -> list[str]:
    """The one compiler command that builds ``tree``'s extension into ``out_dir``."""
    cuda_home = find_cuda_home() if cuda_home is None else cuda_home
    _require_cuda_h(cuda_home)
    if python_include is None:
        python_include = Path(sysconfig.get_paths()["include"])
    if not (python_include / "Python.h").is_file():
        raise BundleError(
            f"{python_include / 'Python.h'} not found: install the Python development "
            "headers or pass the folder that holds Python.h"
        )
    return [
        compiler,
        "-shared",
        "-fPIC",
        "-O2",
        "-std=c++17",
        f"-DPy_LIMITED_API={PY_LIMITED_API}",
        f"-I{cuda_home / 'include'}",
        f"-I{python_include}",
        str(tree / SOURCE),
        "-o",
        str(out_dir / ARTIFACT),
        *_link_args(cuda_home, libcuda),
    ]


def build_cumem_extension(
    tree: Path,
    out_dir: Path,
    *,
    cuda_home: Path | None = None,
    python_include: Path | None = None,
    libcuda: Path | None = None,
    compiler: str = "g++",
) -> Path:
    """Compile ``tree``/csrc/cumem_allocator.cpp; return the built .so."""
    if not (tree / SOURCE).is_file():
        raise BundleError(f"{tree / SOURCE} not found: {tree} is not a vLLM source tree")
    argv = cumem_build_argv(
        tree,
        out_dir,
        cuda_home=cuda_home,
        python_include=python_include,
        libcuda=libcuda,
        compiler=compiler,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd.run(argv)
    return out_dir / ARTIFACT
