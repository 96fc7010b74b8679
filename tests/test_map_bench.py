"""bench/cumem_map_bench.py and the probe's VMM module without a GPU: the enum reader,
the thread accounting and the bench's --help."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sm12x_bundle.enginecheck import vmm

BENCH = Path(__file__).resolve().parents[1] / "bench" / "cumem_map_bench.py"


def test_the_driver_enums_are_read_from_cuda_h(tmp_path):
    values = {name: i + 1 for i, name in enumerate(vmm.ENUMS)}
    values["CU_MEM_HANDLE_TYPE_FABRIC"] = 0x8
    header = tmp_path / "cuda.h"
    header.write_text("typedef enum {\n" + "".join(
        f"    {name} = {hex(v) if name.endswith('FABRIC') else v},\n" for name, v in values.items()) + "} x;\n")
    assert vmm.cuda_enums(header) == values


def test_a_missing_enum_is_named(tmp_path):
    header = tmp_path / "cuda.h"
    header.write_text("typedef enum { CU_MEM_ALLOCATION_TYPE_PINNED = 1 } x;\n")
    with pytest.raises(vmm.VmmError, match="CU_MEM_LOCATION_TYPE_DEVICE not found"):
        vmm.cuda_enums(header)


def test_the_bench_names_a_missing_enum_without_a_traceback(tmp_path):
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda.h").write_text("typedef enum { CU_MEM_ALLOCATION_TYPE_PINNED = 1 } x;\n")
    env = {"CUDA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    run = subprocess.run([sys.executable, str(BENCH), str(tmp_path)], capture_output=True, text=True, env=env)
    assert run.returncode == 1
    assert "cumem_map_bench: CU_MEM_LOCATION_TYPE_DEVICE not found" in run.stderr
    assert "Traceback" not in run.stderr


def test_thread_cpu_names_this_thread_and_busiest_sorts_by_use():
    mine = vmm.thread_cpu()
    assert any(name.split(" ", 1)[0].isdigit() for name in mine)
    before = {"1 a": 1.0, "2 b": 0.0}
    after = {"1 a": 1.5, "2 b": 0.1, "3 c": 0.0}
    assert vmm.busiest_threads(before, after, 1.0) == [["1 a", 0.5], ["2 b", 0.1]]


def test_help_says_what_it_measures():
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, check=True).stdout
    assert "create as the extension does" in out and "--threads" in out


WAKE_BENCH = BENCH.parent / "cumem_wake_maps_bench.py"


def load_wake_bench():
    import importlib.util

    spec = importlib.util.spec_from_file_location("cumem_wake_maps_bench", WAKE_BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_wake_bench_reads_an_allocation_layout_and_refuses_a_bad_one():
    import argparse

    mod = load_wake_bench()
    assert mod.layout("500x12") == (500, 12 << 20) and mod.layout("1X1") == (1, 1 << 20)
    for bad in ("500", "0x12", "ax12"):
        with pytest.raises(argparse.ArgumentTypeError, match="COUNTxMIB|at least 1"):
            mod.layout(bad)


def test_the_wake_bench_refuses_an_unknown_other_before_it_builds_anything(tmp_path):
    run = subprocess.run([sys.executable, str(WAKE_BENCH), str(tmp_path), "--other", "none,nobody"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "--other 'none,nobody': each must be one of" in run.stderr
    assert "Traceback" not in run.stderr and list(tmp_path.iterdir()) == []


def test_the_wake_bench_help_says_what_happens_between_the_sleep_and_the_wake():
    out = subprocess.run([sys.executable, str(WAKE_BENCH), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert "release-hog" in out and "--weights" in out
