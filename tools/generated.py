"""Every file in the repository that is made from other files: what it is made from and how.

One entry per group of files that one render makes. ``bin/regenerate`` writes what differs;
tests/test_generated.py fails, naming the file, while a committed file differs from its
render. A file is in step when its bytes are exactly those of ``render(root)``.

Not here, because they are not derived from the repository: data/releases.json and
data/gpu-payload.json (pins read from PyPI, refreshed by bin/update-releases and
bin/update-gpu-payload), tests/data/test-inputs.json (pins of the tests' inputs),
nomad/example-manifest.json (what ``sm12x-bundle overlay`` wrote; its extension's hash
depends on the compiler, see nomad/README.md), and docker/Dockerfile.* (templates written
by hand; their renders are the golden image files below).

To add a golden file: write the function that renders it next to its inputs under
tools/golden/ and add an entry to ``golden()``. A new golden Nomad job needs only a line in
tools/golden/nomad.py's ``GOLDEN``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

from sm12x_bundle import config as config_mod
from sm12x_bundle import fsutil
from sm12x_bundle.checks.report import series_markdown
from sm12x_bundle.context import Context
from sm12x_bundle.errors import OutputError
from sm12x_bundle.outputs import nomad
from sm12x_bundle.progress import Progress
from sm12x_bundle.series import sources
from tools.golden import engine_check as golden_engine_check
from tools.golden import image as golden_image
from tools.golden import nomad as golden_nomad

ROOT = Path(__file__).resolve().parents[1]
SERIES_TABLE = re.compile(r"(<!-- series-table.*?-->\n)(.*?)(<!-- /series-table -->)", re.S)


@dataclasses.dataclass(frozen=True)
class Generated:
    """Files one render makes: their paths (relative to the repository), what they are made
    from (one line, for people), and the render (root -> {path: bytes}, every path once)."""

    paths: tuple[str, ...]
    made_from: str
    render: Callable[[Path], dict[str, bytes]]


def _patch(rel: str) -> Generated:
    fix = sources.fix_id(Path(rel))
    return Generated((rel,), f"patches/fixes/{fix}/new/ and upstream, and the patch's own headers and hunks",
                     lambda root: {rel: sources.refreshed(root / rel)})


def _readme(root: Path) -> dict[str, bytes]:
    text = (root / "README.md").read_text("utf-8")
    if not SERIES_TABLE.search(text):
        raise OutputError("README.md: the series table's markers (<!-- series-table ... --> and "
                          "<!-- /series-table -->) are missing: put them back where the table goes")
    default = config_mod.parse(config_mod.default_text(), "<embedded default>", root)
    table = series_markdown(Context(default, Progress.quiet()).lanes)
    return {"README.md": SERIES_TABLE.sub(lambda m: m.group(1) + table + m.group(3), text, count=1).encode()}


def _examples(root: Path) -> dict[str, bytes]:
    folder = root / "nomad"
    cfg = config_mod.parse(config_mod.default_text(), "<embedded default>", folder)
    manifests = nomad.find_manifests(cfg, [folder / "example-manifest.json"])
    return {f"nomad/{name}": data for name, data in nomad.render_jobs(cfg, manifests).items()}


def _example_names(root: Path) -> tuple[str, ...]:
    cfg = config_mod.parse(config_mod.default_text(), "<embedded default>", root / "nomad")
    return tuple(f"nomad/{job.name}.nomad.{ext}" for job in cfg.jobs for ext in ("hcl", "json"))


def _golden_job(name: str, render: Callable[[], dict[str, bytes]]) -> Generated:
    folder = "tests/golden/nomad"
    return Generated(
        (f"{folder}/{name}.nomad.hcl", f"{folder}/{name}.nomad.json"),
        f"tools/golden/nomad.py's {name}, rendered by outputs/nomad.py",
        lambda root: {f"{folder}/{file}": data for file, data in render().items()},
    )


def golden() -> list[Generated]:
    """The golden files the tests compare renders with, rendered from tools/golden/."""
    image_folder = "tests/golden/image"
    return [
        *(_golden_job(name, render) for name, render in golden_nomad.GOLDEN.items()),
        Generated(
            (f"{image_folder}/Dockerfile.builder", f"{image_folder}/Dockerfile.bundle"),
            "tools/golden/image.py's example plan, rendered from docker/Dockerfile.* by outputs/image.py",
            lambda root: {f"{image_folder}/{name}": data for name, data in golden_image.render().items()},
        ),
        Generated(
            ("tests/golden/engine_check/compare.txt",),
            "tools/golden/engine_check.py's compare report, rendered by enginecheck/table.py",
            lambda root: {"tests/golden/engine_check/compare.txt": golden_engine_check.render()},
        ),
    ]


def registry(root: Path = ROOT) -> list[Generated]:
    """Every generated file of the repository at ``root``."""
    patches = sorted(str(p.relative_to(root)) for p in (root / "patches").glob("*/*.patch"))
    return [
        *(_patch(rel) for rel in patches),
        Generated(("README.md",), "the series table: `sm12x-bundle series --markdown` of the embedded "
                  "default's lanes, between its markers", _readme),
        Generated(_example_names(root), "the embedded default config's jobs and nomad/example-manifest.json, "
                  "rendered by outputs/nomad.py", _examples),
        *golden(),
    ]


def expected(entry: Generated, root: Path = ROOT) -> dict[str, bytes]:
    """The entry's render; a render that makes other files than the entry names is a bug here."""
    files = entry.render(root)
    if sorted(files) != sorted(entry.paths):
        raise AssertionError(f"the render of {entry.paths} made {sorted(files)}")
    return files


def committed(root: Path, rel: str) -> bytes | None:
    path = root / rel
    return path.read_bytes() if path.is_file() else None


def stale(root: Path = ROOT) -> dict[str, bytes]:
    """Every generated file whose committed bytes differ from its render (or that is missing),
    with the bytes it should hold. Renders everything before returning: nothing is written."""
    out = {}
    for entry in registry(root):
        for rel, data in expected(entry, root).items():
            if committed(root, rel) != data:
                out[rel] = data
    return out


def write(files: dict[str, bytes], root: Path = ROOT) -> None:
    """Replace each file atomically, keeping its mode (0644 for a new one)."""
    for rel, data in files.items():
        path = root / rel
        mode = path.stat().st_mode & 0o777 if path.is_file() else 0o644
        fsutil.write_file(path, data, mode, "generated file")
