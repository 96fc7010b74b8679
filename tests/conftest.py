"""Shared fixtures.

The pinned tree comes from the tool's own fetch (the real vLLM 0.21.0 sdist from PyPI,
downloaded once per machine into the cache and verified by sha256). Unit tests must not
start subprocesses they did not ask for: the ``no_stray_commands`` guard fails them.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from sm12x_bundle import config as config_mod
from sm12x_bundle.context import Context, shipped_series
from sm12x_bundle.outputs.tree import write_tree
from sm12x_bundle.progress import Progress
from sm12x_bundle.series.patch import load_series

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def default_context() -> Context:
    return Context(config_mod.parse(config_mod.default_text(), "<embedded default>", REPO), Progress.quiet())


@pytest.fixture(scope="session")
def series():
    return load_series(shipped_series())


@pytest.fixture(scope="session")
def pinned_source(default_context):
    return default_context.source()


@pytest.fixture(scope="session")
def pinned_tree(pinned_source) -> Path:
    """The pristine extracted vLLM 0.21.0 tree (read-only: copy before changing it)."""
    return pinned_source.root


@pytest.fixture(scope="session")
def patched_tree(tmp_path_factory, series, pinned_source) -> Path:
    """A tree with the whole series applied, written by the tool's own ``apply``."""
    out = tmp_path_factory.mktemp("patched") / "vllm"
    write_tree(series, pinned_source, out)
    return out


@pytest.fixture
def release_source(default_context):
    """Fetch another release the way ``check --vllm`` does."""
    return default_context.source
