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
import shutil
import sysconfig
from collections.abc import Mapping
from pathlib import Path

from . import cmd
from .errors import BundleError, EnvironmentProblem

SOURCE = Path("csrc/cumem_allocator.cpp")
ARTIFACT = "cumem_allocator.abi3.so"
# CMakeLists.txt builds the extension with ``USE_SABI 3.8`` (0.21.0 up to 0.33.0).
PY_LIMITED_API = "0x03080000"
# Where CUDA toolkits keep the stub libcuda.so (no driver needed to link against it).
_STUB_DIRS = ("lib64/stubs", "lib/stubs", "targets/x86_64-linux/lib/stubs",
              "targets/sbsa-linux/lib/stubs")
# What a build on this machine runs: the compiler, and binutils' readelf and nm, which read
# what it built (outputs/native_build.py).
HOST_TOOLS = ("g++", "readelf", "nm")


def find_cuda_home(env: Mapping[str, str] | None = None) -> Path:
    """CUDA_HOME, else CUDA_PATH, else /usr/local/cuda; it must hold include/cuda.h and
    include/cuda_runtime_api.h (EnvironmentProblem, exit 12)."""
    cuda_home = _cuda_home(env)
    _require_cuda_h(cuda_home)
    return cuda_home


def _cuda_home(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    return Path(env.get("CUDA_HOME") or env.get("CUDA_PATH") or "/usr/local/cuda")


def _require_cuda_h(cuda_home: Path) -> None:
    problem = _cuda_h_problem(cuda_home)
    if problem:
        raise EnvironmentProblem(f"building the cumem extension needs {problem}")


# The CUDA headers the extension's source includes (csrc/cumem_allocator_compat.h).
CUDA_HEADERS = ("cuda.h", "cuda_runtime_api.h")


def _cuda_h_problem(cuda_home: Path) -> str | None:
    missing = [cuda_home / "include" / name for name in CUDA_HEADERS if not (cuda_home / "include" / name).is_file()]
    if not missing:
        return None
    return (
        f"CUDA's headers (there is no {missing[0]}: install a CUDA toolkit's headers and set CUDA_HOME to the "
        "folder that holds include/cuda.h; without CUDA_HOME, /usr/local/cuda)"
    )


def _python_h_problem(python_include: Path) -> str | None:
    if (python_include / "Python.h").is_file():
        return None
    return f"Python's headers (there is no {python_include / 'Python.h'}: Debian and Ubuntu: apt-get install python3-dev)"


def check_host_toolchain(why: str, env: Mapping[str, str] | None = None) -> None:
    """What building the extension on this machine needs, checked before anything is fetched
    or written: g++, readelf and nm on PATH, CUDA's cuda.h (CUDA_HOME) and Python.h. One
    sentence names all that is missing and how to get it (EnvironmentProblem, exit 12)."""
    path = (os.environ if env is None else env).get("PATH")
    tools = [tool for tool in HOST_TOOLS if shutil.which(tool, path=path) is None]
    problems = [f"{_words(tools)} on PATH (Debian and Ubuntu: apt-get install g++ binutils)"] if tools else []
    problems += [p for p in (_cuda_h_problem(_cuda_home(env)), _python_h_problem(_python_include())) if p]
    if problems:
        raise EnvironmentProblem(f"building the cumem extension on this machine ({why}) needs {_words(problems)}")


def _words(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else items[0]


def _python_include() -> Path:
    """SM12X_PYTHON_INCLUDE (a folder holding Python.h, for a Python installed without its
    headers: the extension uses the stable ABI only, so any Python 3.8+ headers build it),
    else this Python's own."""
    return Path(os.environ.get("SM12X_PYTHON_INCLUDE") or sysconfig.get_paths()["include"])


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
        python_include = _python_include()
    problem = _python_h_problem(python_include)
    if problem:
        raise EnvironmentProblem(f"building the cumem extension needs {problem}")
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
