"""The bench scripts under bench/, imported as modules so that tests can call their parts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_bench(path: Path) -> ModuleType:
    """Import the bench script at ``path`` under its file name (its __main__ block does not run)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
