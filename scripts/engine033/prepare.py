"""Make a 0.33.0 source tree an installed vLLM that torch 2.11 can run (scripts/gpu-engine-033.sh).

    python3 scripts/engine033/prepare.py TREE DEST [--real-c SO] [--python-include DIR]

DEST receives ``vllm/`` (the tree's, copied), ``vllm-<version>.dist-info/METADATA`` (the
sdist's PKG-INFO: vLLM picks its platform by its installed version) and, inside ``vllm/``:
- ``cumem_allocator.abi3.so`` built from the tree's own csrc/ (native.py, as the allocator
  tests build it);
- ``_C_stable_libtorch``: the wheel's compiled module when --real-c names it (its torch
  symbols are all in torch 2.11: docs/records/engine-0.33.0-route-study-2026-11-27.md),
  else c_stable_shim.py as ``_C_stable_libtorch.py`` (vllm/platforms/cuda.py:23 imports it
  unguarded);
- ``vllm_flash_attn/_vllm_fa2_C.py``, empty: on CUDA, v1/attention/backends/fa_utils.py
  imports vllm.vllm_flash_attn, which raises unless FA2 or FA3 imports; the engine runs
  TRITON_ATTN and never calls it.
Prints one JSON line saying what it put there.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FA_PLACEHOLDER = '"""sm12x-bundle: stands in for FlashAttention 2, which a TRITON_ATTN engine never calls."""\n'


def metadata(tree: Path, dest: Path) -> str:
    text = (tree / "PKG-INFO").read_text("utf-8", "replace")
    version = next(line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Version:"))
    info = dest / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(text)
    return version


def compiled(package: Path, real_c: Path | None) -> str:
    if real_c is not None:
        shutil.copyfile(real_c, package / "_C_stable_libtorch.abi3.so")
        return "real"
    shutil.copyfile(HERE / "c_stable_shim.py", package / "_C_stable_libtorch.py")
    return "torch shim"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("tree", type=Path)
    p.add_argument("dest", type=Path)
    p.add_argument("--real-c", type=Path)
    p.add_argument("--python-include", type=Path)
    a = p.parse_args(argv)
    sys.path.insert(0, str(HERE.parents[1] / "src"))
    from sm12x_bundle import native
    from sm12x_bundle.errors import BundleError

    shutil.rmtree(a.dest, ignore_errors=True)
    shutil.copytree(a.tree / "vllm", a.dest / "vllm", ignore=shutil.ignore_patterns("__pycache__"))
    version = metadata(a.tree, a.dest)
    try:
        extension = native.build_cumem_extension(a.tree, a.dest / "vllm", python_include=a.python_include)
    except BundleError as exc:
        print(f"prepare: the cumem extension of {a.tree} did not build: {exc}", file=sys.stderr)
        return 7
    c_module = compiled(a.dest / "vllm", a.real_c)
    (a.dest / "vllm" / "vllm_flash_attn" / "_vllm_fa2_C.py").write_text(FA_PLACEHOLDER)
    print(json.dumps({"dest": str(a.dest), "version": version, "extension": str(extension), "_C_stable_libtorch": c_module}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
