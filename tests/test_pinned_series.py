"""Each lane's real series against the real vLLM sdists (fetched once per machine, cached).

Every test that says "the pin" runs once per lane of the embedded default: the lane's own
series on the lane's own pristine release."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import needs
import pytest

from sm12x_bundle.series.lane import shipped_lanes

from sm12x_bundle.checks.check import Outcome, check_tree
from sm12x_bundle.fsutil import MARKER
from sm12x_bundle.outputs.tree import write_tree
from sm12x_bundle.series.apply import VirtualTree
from sm12x_bundle.series.probes import probe_matches

pytestmark = pytest.mark.integration

LANES = shipped_lanes()  # patches/<version>/series: the one list of lanes


@pytest.fixture(params=LANES)
def lane(request, default_context):
    return default_context.lane(request.param)


@pytest.fixture
def lane_source(lane, default_context):
    return default_context.source(lane.version)


def digest_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def test_every_patch_applies_to_the_pin_without_offsets(lane, lane_source):
    report = check_tree(lane.series, lane_source)
    assert [(r.patch, r.outcome, r.offsets) for r in report.results] == [
        (p.id, Outcome.APPLIES, ()) for p in lane.series.patches
    ]


def test_headers_say_what_each_patch_is(lane):
    for patch in lane.series.patches:
        touches_native = any(p.startswith("csrc/") for p in patch.paths)
        assert patch.kind == ("native" if touches_native else "python"), patch.id
        if patch.kind == "native":
            assert patch.builds and patch.builds.endswith(".so")
        # Origin names the upstream discussion: a pull request, or an issue where no PR exists;
        # "none" for a fix of our own that nothing upstream corresponds to (Bug then names
        # the related discussions).
        if patch.origin == "none":
            assert patch.headers.get("Bug"), patch.id
            continue
        assert re.fullmatch(r"https://github\.com/vllm-project/vllm/(pull|issues)/[0-9]+", patch.origin), patch.id


def test_the_probes_do_not_all_match_the_pristine_pin(lane, lane_source):
    # A fix is landed when every one of its probes matches. Part of a fix may have landed
    # (0.33.0's free callback synchronizes, its sleep() does not), so one probe may match.
    tree = VirtualTree(lane_source.root)
    for patch in lane.series.patches:
        if patch.probes:
            matching = [p.pattern for p in patch.probes if probe_matches(tree, p)]
            assert len(matching) < len(patch.probes), f"{patch.id}: every probe matches {lane.version}"


def test_probes_match_the_pin_once_patched(lane, lane_source):
    tree = check_tree(lane.series, lane_source).tree  # the lane's patched tree, in memory
    for patch in lane.series.patches:
        for probe in patch.probes:
            assert probe_matches(tree, probe), f"{patch.id}: probe does not recognise our own fix on {lane.version}"


@pytest.mark.parametrize("version", ["0.26.0", "0.33.0"])
def test_stream_aware_free_is_half_landed_in_later_releases(series, release_source, version):
    # 0.26.0 made the free callback synchronize; sleep() still unmaps without waiting, so
    # the fix is not reported as landed: one probe matches, the other does not.
    report = check_tree(series, release_source(version))
    results = {r.patch: r for r in report.results}
    assert results["cumem-stream-aware-free"].outcome is not Outcome.LANDED
    free_callback, sleep = series.patches[0].probes
    tree = VirtualTree(release_source(version).root)
    assert probe_matches(tree, free_callback) and not probe_matches(tree, sleep)
    # Rollback never landed upstream: 0.33.0 only resumes, so it must not read as landed.
    assert results["cumem-wake-up-rollback"].outcome is not Outcome.LANDED


def test_git_am_takes_the_series_as_mails(lane, lane_source, tmp_path):
    """Each patch is one `git format-patch` mail: `git am` applies the series in order, and
    the commit it makes carries the headers as its message and only the diff as its change."""
    needs.tool("git", "git")
    work = tmp_path / "work"
    for rel in lane.series.paths:
        if (lane_source.root / rel).exists():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lane_source.root / rel, work / rel)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=work, check=True)
    subprocess.run([*git, "add", "-A"], cwd=work, check=True)
    subprocess.run([*git, "commit", "-qm", "pristine", "--allow-empty"], cwd=work, check=True)
    subprocess.run([*git, "am", "-q", *[str(p.file) for p in lane.series.patches]], cwd=work, check=True)
    for n, patch in enumerate(reversed(lane.series.patches)):
        message = subprocess.run([*git, "log", "-1", "--format=%B", f"HEAD~{n}"], cwd=work, check=True,
                                 capture_output=True, text=True).stdout
        assert message.startswith(patch.subject.removeprefix("[PATCH] ")), patch.id
        assert "\n---\n" not in message and "Origin: " in message, f"{patch.id}: more than one mail separator"


def test_our_applier_agrees_with_gnu_patch(lane, lane_source, tmp_path):
    """Cross-check the in-memory applier against GNU patch -F0 on a copy of the touched files."""
    series, pinned_tree = lane.series, lane_source.root
    needs.tool("patch", "GNU patch")
    work = tmp_path / "work"
    for rel in series.paths:
        if (pinned_tree / rel).exists():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(pinned_tree / rel, work / rel)
    for patch in series.patches:
        subprocess.run(["patch", "-p1", "-F0", "-s", "-i", str(patch.file)], cwd=work, check=True)
    report = check_tree(series, lane_source)
    for rel, text in report.tree.changed().items():
        assert (work / rel).read_bytes() == text.to_bytes(), rel


def test_apply_output_is_reproducible_and_touches_only_the_series(lane, lane_source, tmp_path):
    series, pinned_source = lane.series, lane_source
    first, second = tmp_path / "one", tmp_path / "two"
    write_tree(series, pinned_source, first)
    write_tree(series, pinned_source, second)
    a, b = digest_tree(first), digest_tree(second)
    assert a == b
    pristine = digest_tree(pinned_source.root)
    changed = {k for k in a.keys() | pristine.keys() if a.get(k) != pristine.get(k)}
    assert changed == set(series.paths) | {MARKER}  # and the marker that says the tree is ours


def test_check_agrees_with_each_fix_upstream_status(lane, lane_source):
    """What the headers say upstream did, the check must see in the lane's own release: no lane
    carries a fix merged whole at or before its release (check would exit 10); a fix that landed
    partly shows its probes split (partly landed) from that release on, and not before; a fix
    still open or closed unmerged is not reported landed at all."""
    from sm12x_bundle.checks.check import check_lane
    from sm12x_bundle.series.lane import known_fixes, version_key

    report = check_lane(lane, lane_source, known_fixes([lane]))
    results = {r.patch: r for r in report.results}
    for patch in lane.series.patches:
        status, result = patch.upstream, results[patch.id]
        assert status is not None, f"{patch.id}: no Sm12x-Upstream-Status"
        since = status.applied.release is not None and version_key(lane.version) >= version_key(status.applied.release)
        assert not (status.state == "merged" and since), f"{patch.id}: merged in {status.applied.release}, carried by {lane.version}"
        assert result.outcome is Outcome.APPLIES, patch.id
        if status.state == "partly" and len(patch.probes) > 1:
            assert result.partly_landed == since, f"{patch.id} on {lane.version}: {result.summary()}"
        else:
            assert not result.partly_landed, f"{patch.id} on {lane.version}: {result.summary()}"
