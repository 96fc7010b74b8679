"""bench/cumem_map_bench.py without a GPU: its enum reader and its --help."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "cumem_map_bench.py"


def load():
    spec = importlib.util.spec_from_file_location("cumem_map_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_driver_enums_are_read_from_cuda_h(tmp_path):
    mod = load()
    values = {name: i + 1 for i, name in enumerate(mod.ENUMS)}
    values["CU_MEM_HANDLE_TYPE_FABRIC"] = 0x8
    header = tmp_path / "cuda.h"
    header.write_text("typedef enum {\n" + "".join(
        f"    {name} = {hex(v) if name.endswith('FABRIC') else v},\n" for name, v in values.items()) + "} x;\n")
    assert mod.cuda_enums(header) == values


def test_a_missing_enum_is_named(tmp_path):
    header = tmp_path / "cuda.h"
    header.write_text("typedef enum { CU_MEM_ALLOCATION_TYPE_PINNED = 1 } x;\n")
    with pytest.raises(SystemExit, match="CU_MEM_LOCATION_TYPE_DEVICE not found"):
        load().cuda_enums(header)


def test_help_says_what_it_measures():
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, check=True).stdout
    assert "create as the extension does" in out and "--threads" in out
