"""Each lane's pristine and patched tree, for tests that run a scenario on every lane.

Import the fixture into a test module (``from lanekit import LANES, lane_tree  # noqa: F401``)
and ask it for ``lane_tree(version, "pinned" | "patched")``. The pristine tree is the
release's own sdist, fetched and verified by the tool (cached once per machine); the
patched one is that tree with the lane's shipped series applied by the tool's ``apply``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sm12x_bundle.series.lane import shipped_lanes

from sm12x_bundle.outputs.tree import write_tree
from sm12x_bundle.series.patch import load_series

REPO = Path(__file__).resolve().parents[1]
# The lanes whose allocator fixes the CPU tests prove; each has patches/<version>/series.
LANES = shipped_lanes()  # patches/<version>/series: the one list of lanes


@pytest.fixture(scope="session")
def lane_tree(default_context, tmp_path_factory):
    """``lane_tree(version, variant)``: the lane's pristine ("pinned") or patched tree."""
    made: dict[tuple[str, str], Path] = {}

    def tree(version: str, variant: str) -> Path:
        if (version, variant) not in made:
            source = default_context.source(version)
            if variant == "pinned":
                made[version, variant] = source.root
            else:
                out = tmp_path_factory.mktemp(f"patched-{version}") / "vllm"
                write_tree(load_series(REPO / "patches" / version / "series"), source, out)
                made[version, variant] = out
        return made[version, variant]

    return tree


def native_fixes(version: str) -> list[str]:
    """The ids of a lane's native patches, in series order: what its rebuilt cumem
    extension is built from (one list, read from the shipped series)."""
    series = load_series(REPO / "patches" / version / "series")
    return [p.id for p in series.patches if p.kind == "native"]
