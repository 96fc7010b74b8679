"""Lanes: each pinned vLLM release and the series written for it.

The shipped layout keeps one folder per lane, ``patches/<version>/series``, beside
``patches/fixes/<fix>/`` (what a fix keeps once for every lane that carries it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..source.pin import Pin
from . import sources
from .patch import Patch, Probe, Series, parse_probes

_PARTS = re.compile(r"([0-9]+(?:\.[0-9]+)*)(?:(a|b|rc)([0-9]+))?(?:\.post([0-9]+))?(?:\.dev([0-9]+))?")
_PRE = {"a": 0, "b": 1, "rc": 2}


@dataclass(frozen=True)
class Lane:
    """One pinned release (version, sdist sha256) and the series written against it."""

    version: str
    pin: Pin
    series: Series


@dataclass(frozen=True)
class Fix:
    """One fix as the shipped layout knows it: every lane's patch for it, and its probes."""

    id: str
    patches: tuple[Patch, ...]  # each lane's own patch for this fix, in lane order
    probes: tuple[Probe, ...]  # from patches/fixes/<fix>/upstream, else from the patches


def known_fixes(lanes: Iterable[Lane]) -> dict[str, Fix]:
    """Every fix a lane carries or ``patches/fixes/*/upstream`` names, in the lanes' order."""
    lanes = tuple(lanes)
    patches: dict[str, list[Patch]] = {}
    for lane in lanes:
        for patch in lane.series.patches:
            patches.setdefault(patch.id, []).append(patch)
    folders = {lane.series.file.parent.parent / "fixes" for lane in lanes}
    upstream = {f.parent.name: f for folder in sorted(folders) for f in sorted(folder.glob("*/upstream"))}
    fixes = {}
    for fix in list(patches) + sorted(set(upstream) - set(patches)):
        found = tuple(patches.get(fix, ()))
        fixes[fix] = Fix(fix, found, _fix_probes(upstream.get(fix), found))
    return fixes


def _fix_probes(upstream: Path | None, patches: tuple[Patch, ...]) -> tuple[Probe, ...]:
    if upstream is not None:
        specs = [line for key, value in sources.read_upstream(upstream) if key == "Sm12x-Probe" for line in value]
        return parse_probes("\n".join(line.partition(":")[2].strip() for line in specs), str(upstream))
    return next((p.probes for p in patches if p.probes), ())


def version_key(version: str) -> tuple:
    """Release order as pip sees it (PEP 440: 0.9 < 0.21.0 < 0.33.0rc1 < 0.33.0 < 0.33.0.post1)."""
    m = _PARTS.match(version.split("+", 1)[0])
    if not m:
        raise ValueError(f"{version!r} is not a version number")
    release, pre, pre_n, post, dev = m.groups()
    numbers = [int(n) for n in release.split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()  # 0.33 and 0.33.0 are the same release
    if pre:
        phase: tuple = (0, _PRE[pre], int(pre_n))
    elif dev is not None and post is None:
        phase = (-1,)  # 0.33.0.dev1 comes before 0.33.0a1
    else:
        phase = (1,)
    return (
        tuple(numbers),
        phase,
        -1 if post is None else int(post),
        float("inf") if dev is None else int(dev),
    )


def nearest_at_or_below(versions: Iterable[str], version: str) -> str | None:
    """The highest of ``versions`` that is not above ``version``; None below all of them."""
    target = version_key(version)
    below = [v for v in versions if version_key(v) <= target]
    return max(below, key=version_key) if below else None


def shipped_patches() -> Path | None:
    """The patches/ folder shipped with the tool: packaged in a wheel, or a checkout's."""
    packaged = resources.files("sm12x_bundle").joinpath("_patches")
    if packaged.is_dir():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[3] / "patches"
    return checkout if checkout.is_dir() else None


def shipped_lanes() -> tuple[str, ...]:
    """The versions with a shipped series (``patches/<version>/series``), in release order."""
    root = shipped_patches()
    if root is None:
        return ()
    found = []
    for child in root.iterdir():
        if (child / "series").is_file() and _PARTS.fullmatch(child.name):
            found.append(child.name)
    return tuple(sorted(found, key=version_key))


def shipped_series(version: str) -> Path | None:
    """The shipped series of exactly this release, if the tool ships one."""
    root = shipped_patches()
    return root / version / "series" if root is not None and version in shipped_lanes() else None
