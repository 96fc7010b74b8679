"""The real series against the real vLLM sdists (fetched once per machine, cached)."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from sm12x_bundle.checks.check import Outcome, check_tree
from sm12x_bundle.fsutil import MARKER
from sm12x_bundle.outputs.tree import write_tree
from sm12x_bundle.series.apply import VirtualTree
from sm12x_bundle.series.probes import probe_matches

pytestmark = pytest.mark.integration


def digest_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_every_patch_applies_to_the_pin_without_offsets(series, pinned_source):
    report = check_tree(series, pinned_source)
    assert [(r.patch, r.outcome, r.offsets) for r in report.results] == [
        (p.id, Outcome.APPLIES, ()) for p in series.patches
    ]


def test_headers_say_what_each_patch_is(series):
    for patch in series.patches:
        touches_native = any(p.startswith("csrc/") for p in patch.paths)
        assert patch.kind == ("native" if touches_native else "python"), patch.id
        if patch.kind == "native":
            assert patch.builds and patch.builds.endswith(".so")
        # Origin names the upstream discussion: a pull request, or an issue where no PR exists.
        assert re.fullmatch(r"https://github\.com/vllm-project/vllm/(pull|issues)/[0-9]+", patch.origin), patch.id


def test_no_probe_matches_the_pristine_pin(series, pinned_tree):
    tree = VirtualTree(pinned_tree)
    for patch in series.patches:
        for probe in patch.probes:
            assert not probe_matches(tree, probe), f"{patch.id}: probe {probe.pattern!r} matches 0.21.0"


def test_probes_match_the_pin_once_patched(series, patched_tree):
    tree = VirtualTree(patched_tree)
    for patch in series.patches:
        for probe in patch.probes:
            assert probe_matches(tree, probe), f"{patch.id}: probe does not recognise our own fix"


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_stream_aware_free_is_recognised_as_landed_in_later_releases(series, release_source, version):
    report = check_tree(series, release_source(version))
    results = {r.patch: r for r in report.results}
    assert results["cumem-stream-aware-free"].outcome is Outcome.LANDED
    assert results["cumem-stream-aware-free"].landed_by == "probe"
    # Rollback never landed upstream: 0.33.0 only resumes, so it must not read as landed.
    assert results["cumem-wake-up-rollback"].outcome is not Outcome.LANDED


def test_our_applier_agrees_with_gnu_patch(series, pinned_tree, tmp_path):
    """Cross-check the in-memory applier against GNU patch -F0 on a copy of the touched files."""
    if shutil.which("patch") is None:
        pytest.skip("GNU patch is not installed")
    work = tmp_path / "work"
    for rel in series.paths:
        if (pinned_tree / rel).exists():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(pinned_tree / rel, work / rel)
    for patch in series.patches:
        subprocess.run(["patch", "-p1", "-F0", "-s", "-i", str(patch.file)], cwd=work, check=True)
    report = check_tree(series, type("S", (), {"root": pinned_tree, "version": "0.21.0", "origin": "t", "sha256": None})())
    for rel, text in report.tree.changed().items():
        assert (work / rel).read_bytes() == text.to_bytes(), rel


def test_apply_output_is_reproducible_and_touches_only_the_series(series, pinned_source, tmp_path):
    first, second = tmp_path / "one", tmp_path / "two"
    write_tree(series, pinned_source, first)
    write_tree(series, pinned_source, second)
    a, b = digest_tree(first), digest_tree(second)
    assert a == b
    pristine = digest_tree(pinned_source.root)
    changed = {k for k in a.keys() | pristine.keys() if a.get(k) != pristine.get(k)}
    assert changed == set(series.paths) | {MARKER}  # and the marker that says the tree is ours
