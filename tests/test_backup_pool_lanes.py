"""The backup pool's cumem.py tests (test_backup_pool.py) on the 0.33.0 lane.

0.33.0's patch 0003 carries the same module (patches/fixes/cumem-backup-pool/new/) with
hooks written against 0.33.0's cumem.py. Each test of test_backup_pool.py that drives the
patched cumem.py runs here unchanged on 0.33.0's patched tree, and the switched-off test
compares with 0.33.0's pristine backups.
"""

from __future__ import annotations

import pytest

import test_backup_pool as pool_tests
from lanekit import lane_tree  # noqa: F401
from test_cumem_patches import FakeCuda

pytestmark = pytest.mark.integration

THROUGH_CUMEM = [
    pool_tests.test_sleep_backs_up_into_the_pool_and_wake_gives_it_back,
    pool_tests.test_failed_sleep_returns_every_span_once,
    pool_tests.test_failed_wake_keeps_every_backup,
    pool_tests.test_level_2_sleep_holds_no_pinned_memory,
]


@pytest.mark.parametrize("test", THROUGH_CUMEM, ids=lambda t: t.__name__)
def test_on_0_33_0(test, lane_tree, monkeypatch):
    monkeypatch.delenv("VLLM_SM12X_BACKUP_POOL", raising=False)
    monkeypatch.delenv("VLLM_SM12X_BACKUP_POOL_TAGS", raising=False)
    test(lane_tree("0.33.0", "patched"), FakeCuda(), monkeypatch)


def test_switched_off_the_backups_are_0_33_0s(lane_tree, monkeypatch):
    pool_tests.test_switched_off_the_backups_are_0_21_0s(
        lane_tree("0.33.0", "patched"), lane_tree("0.33.0", "pinned"), FakeCuda(), monkeypatch
    )


def test_envs_registers_the_switches_on_0_33_0(lane_tree, monkeypatch):
    pool_tests.test_envs_registers_the_switches(lane_tree("0.33.0", "patched"), monkeypatch)
