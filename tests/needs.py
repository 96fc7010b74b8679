"""When a test cannot run here: skip, with the reason, or fail where nothing may be missing.

scripts/test installs and fetches everything the suite needs and then sets
SM12X_REQUIRE_INPUTS=1 (CI runs scripts/test): from then on a missing module, tool, header
or file fails the test that needs it instead of skipping it, so CI never reports a test as
skipped that it simply did not run. Without the variable (a plain ``pytest`` run on a
workstation) the same test skips and says what it lacks. A missing Docker daemon has its own
rule (docker_support.unavailable, SM12X_REQUIRE_DOCKER).
"""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest

REQUIRED = os.environ.get("SM12X_REQUIRE_INPUTS") == "1"


def missing(reason: str) -> None:
    """Skip the test for ``reason``, or fail it where scripts/test promised everything."""
    if REQUIRED:
        pytest.fail(f"SM12X_REQUIRE_INPUTS=1 (set by scripts/test), but {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)  # module level too: an import at the top


def module(name: str) -> ModuleType:
    """``import name``, or missing() when it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"the Python module {name} cannot be imported ({exc})")
        raise  # not reached: missing() raises


def tool(name: str, what: str) -> str:
    """The path of the command ``name``, or missing() when it is not on PATH."""
    found = shutil.which(name)
    if found is None:
        missing(f"{what} is not installed (no {name} on PATH)")
    return found
