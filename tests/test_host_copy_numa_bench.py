"""bench/host_copy_numa_bench.py without a GPU: the CPU-list reader, the nodes it finds and
where move_pages(2) says a buffer's pages lie."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest

from benchkit import BENCH_DIR, load_bench

BENCH = BENCH_DIR / "host_copy_numa_bench.py"


@pytest.fixture(scope="module")
def bench():
    return load_bench(BENCH)


def test_a_cpu_list_is_read_as_sysfs_writes_it(bench):
    assert bench.cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert bench.cpu_list("") == set()


def test_every_cpu_this_process_may_use_lies_on_a_node_found(bench):
    found = set().union(*bench.nodes().values())
    assert os.sched_getaffinity(0) <= found


def test_a_buffer_s_sampled_pages_are_placed_or_the_refusal_is_said(bench):
    size = 64 * bench.PAGE
    buf = ctypes.create_string_buffer(size)
    ctypes.memset(buf, 1, size)  # touched: every page has a node
    counts = bench.pages_on(ctypes.addressof(buf), size, samples=8)
    assert sum(counts.values()) == 8
    placed = {k for k in counts if k >= 0}
    if placed:  # move_pages answered: each page on a node that has CPUs here
        assert placed <= set(bench.nodes()) and sum(counts[k] for k in placed) == 8
    else:  # refused (a sandbox): one -errno for all of them
        assert len(counts) == 1


def test_help_says_what_it_measures():
    out = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, check=True).stdout
    assert "--gib" in out and "NUMA node" in out
