"""What a fix keeps once for every lane (src/sm12x_bundle/series/sources.py).

Every lane's patch must carry each file of its fix's ``new/`` folder exactly as it is in
the repository, and the upstream metadata lines of its fix's ``upstream`` file exactly as
they are there; ``bin/regenerate`` rewrites them after an edit, and tests/test_generated.py
fails while one differs.
"""

from __future__ import annotations

import difflib
import shutil
from pathlib import Path

import pytest

from tools.patchkit import make_patch
from sm12x_bundle.errors import SeriesError
from sm12x_bundle.series import sources

PATCHES = Path(__file__).resolve().parents[1] / "patches"
WITH_SOURCES = sorted(str(p.relative_to(PATCHES)) for p in PATCHES.glob("*/*.patch") if sources.source_folder(p))
LANE_PATCHES = sorted(str(p.relative_to(PATCHES)) for p in PATCHES.glob("*/*.patch"))


def test_the_patches_that_keep_new_files_as_source():
    assert "0.21.0/0004-triton-sparse-mla-fallback.patch" in WITH_SOURCES
    assert "0.21.0/0005-cumem-backup-pool.patch" in WITH_SOURCES


def test_an_edit_without_refreshing_is_caught_and_refresh_touches_only_its_section(tmp_path):
    patch = tmp_path / "0.21.0" / "0005-cumem-backup-pool.patch"
    patch.parent.mkdir()
    shutil.copy(PATCHES / "0.21.0" / patch.name, patch)
    folder = tmp_path / "fixes" / "cumem-backup-pool" / "new"
    shutil.copytree(PATCHES / "fixes" / "cumem-backup-pool" / "new", folder)
    module = folder / "vllm/device_allocator/cumem_backup_pool.py"
    module.write_text(module.read_text() + "# edited\n")
    before = patch.read_text()
    assert not sources.refresh(patch, check=True) and patch.read_text() == before
    assert not sources.refresh(patch)
    after = patch.read_text()
    assert sources.refresh(patch, check=True)
    changed = [line for line in difflib.ndiff(before.splitlines(), after.splitlines()) if line[:1] in "+-"]
    n = len(module.read_text().splitlines())
    assert [line[:9] for line in changed[:2]] == ["- index 0", "+ index 0"]  # the blob id
    assert changed[2:] == [f"- @@ -0,0 +1,{n - 1} @@", f"+ @@ -0,0 +1,{n} @@", "+ +# edited"]


# What `git format-patch` (2.39) wrote for an empty file, one without its last newline and a
# one-line file, after the mail's headers; then its signature.
GIT_SECTIONS = """\
diff --git a/vllm/e.py b/vllm/e.py
new file mode 100644
index 0000000..e69de29
diff --git a/vllm/n.py b/vllm/n.py
new file mode 100644
index 0000000..0a207c0
--- /dev/null
+++ b/vllm/n.py
@@ -0,0 +1,2 @@
+a
+b
\\ No newline at end of file
diff --git a/vllm/z.py b/vllm/z.py
new file mode 100644
index 0000000..587be6b
--- /dev/null
+++ b/vllm/z.py
@@ -0,0 +1 @@
+x
"""
SIGNATURE = "-- \n2.39.5\n\n"


def test_sections_are_what_git_writes():
    head = make_patch({})
    files = {"vllm/e.py": b"", "vllm/n.py": b"a\nb", "vllm/z.py": b"x\n"}
    assert sources.regenerate(head + SIGNATURE, files) == head + GIT_SECTIONS + SIGNATURE
    git = head + GIT_SECTIONS + SIGNATURE
    assert sources.regenerate(git, files) == git


def test_regenerate_replaces_in_place_and_inserts_in_path_order():
    text = make_patch({"vllm/a.py": ("x\n", "y\n"), "vllm/c.py": ("x\n", "y\n")})
    files = {"vllm/b.py": b"new\n", "vllm/d.py": b"\fform feed\rreturn\n"}
    once = sources.regenerate(text, files)
    assert sources.regenerate(once, files) == once
    order = [line.split()[2] for line in once.splitlines() if line.startswith("diff --git")]
    assert order == ["a/vllm/a.py", "a/vllm/b.py", "a/vllm/c.py", "a/vllm/d.py"]
    assert once.replace(sources.new_file_section("vllm/b.py", b"new\n"), "").replace(
        sources.new_file_section("vllm/d.py", files["vllm/d.py"]), "") == text


def test_a_removed_dash_line_is_not_taken_for_the_signature():
    text = make_patch({"vllm/a.md": ("- \nx\n", "x\n")})
    assert "\n-- \n" in text
    assert sources.regenerate(text, {"vllm/b.py": b"y\n"}) == text + sources.new_file_section("vllm/b.py", b"y\n")


def test_a_file_the_patch_changes_is_not_overwritten():
    text = make_patch({"vllm/a.py": ("x\n", "y\n")})
    with pytest.raises(SeriesError, match="changes it instead of adding it"):
        sources.regenerate(text, {"vllm/a.py": b"y\n"})


# --- upstream metadata, kept once per fix -------------------------------------


@pytest.mark.parametrize("name", LANE_PATCHES)
def test_every_lane_patch_has_its_fix_upstream_file(name):
    """Its lines are in the patch as they are there: tests/test_generated.py."""
    upstream = sources.upstream_file(PATCHES / name)
    assert upstream.is_file(), (
        f"{name}: its fix has no {upstream.relative_to(PATCHES.parent)} (Origin, Bug, Forwarded, "
        "Applied-Upstream, Sm12x-Probe lines, kept once for every lane): write it"
    )


def test_the_shipped_fixes_keep_their_upstream_metadata_once():
    fixes = sorted(p.parent.name for p in PATCHES.glob("fixes/*/upstream"))
    assert fixes == [
        "cumem-backup-pool",
        "cumem-error-code-reset",
        "cumem-fabric-refused-once",
        "cumem-merged-runs",
        "cumem-rank-transactions",
        "cumem-run-reservations",
        "cumem-skip-unchanged",
        "cumem-stream-aware-free",
        "cumem-wake-up-rollback",
        "triton-sparse-mla-fallback",
    ]


def _lane_copy(tmp_path: Path, name: str) -> Path:
    patch = tmp_path / name
    patch.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(PATCHES / name, patch)
    fix = tmp_path / "fixes" / sources.fix_id(patch)
    fix.mkdir(parents=True, exist_ok=True)
    shutil.copy(PATCHES / "fixes" / fix.name / "upstream", fix / "upstream")
    return patch


def test_an_upstream_edit_reaches_every_lane_and_touches_only_those_lines(tmp_path):
    lanes = [_lane_copy(tmp_path, "0.21.0/0005-cumem-backup-pool.patch"),
             _lane_copy(tmp_path, "0.33.0/0004-cumem-backup-pool.patch")]
    upstream = tmp_path / "fixes" / "cumem-backup-pool" / "upstream"
    upstream.write_text(upstream.read_text().replace("Applied-Upstream: no", "Applied-Upstream: 0.34.0")
                        .replace("Sm12x-Upstream-Status: open,", "Sm12x-Upstream-Status: merged,")
                        .replace(" #58066 open,", " #58066 merged,")
                        + "Sm12x-Probe: vllm/envs.py ~ BACKUP_POOL\n")
    for patch in lanes:
        before = patch.read_text()
        assert not sources.refresh(patch, check=True) and patch.read_text() == before
        assert not sources.refresh(patch)
        assert sources.refresh(patch, check=True)
        changed = [line for line in difflib.ndiff(before.splitlines(), patch.read_text().splitlines())
                   if line[:1] in "+-"]
        status = "Sm12x-Upstream-Status: {}, checked 2026-11-27"
        ref = " #58066 {}, opt-in preparation of the first sleep's backup buffers"
        assert changed == ["- Applied-Upstream: no", "+ Applied-Upstream: 0.34.0",
                           "- " + status.format("open"), "+ " + status.format("merged"),
                           "- " + ref.format("open"), "+ " + ref.format("merged"),
                           "+ Sm12x-Probe: vllm/envs.py ~ BACKUP_POOL"]


def test_a_lane_patch_edited_by_hand_is_caught_and_rewritten(tmp_path):
    patch = _lane_copy(tmp_path, "0.33.0/0002-cumem-wake-up-rollback.patch")
    text = patch.read_text()
    patch.write_text(text.replace("Applied-Upstream: no\n", "Applied-Upstream: no\nSm12x-Probe: vllm/envs.py ~ x\n"))
    assert not sources.refresh(patch, check=True)
    assert not sources.refresh(patch) and patch.read_text() == text


def test_continuation_lines_are_rewritten_with_their_field():
    text = (PATCHES / "0.21.0" / "0004-triton-sparse-mla-fallback.patch").read_text()
    upstream = sources.read_upstream(PATCHES / "fixes" / "triton-sparse-mla-fallback" / "upstream")
    edited = text.replace(" https://github.com/vllm-project/vllm/pull/40991\n", "", 1)
    assert edited != text and sources.with_upstream(edited, upstream) == text


def test_upstream_file_holds_upstream_metadata_only(tmp_path):
    bad = tmp_path / "upstream"
    bad.write_text("Origin: x\nForwarded: no\nApplied-Upstream: no\nLast-Update: 2026-11-22\n")
    with pytest.raises(SeriesError, match="Last-Update is not upstream metadata"):
        sources.read_upstream(bad)
    bad.write_text("Origin: x\nApplied-Upstream: no\n")
    with pytest.raises(SeriesError, match="missing Forwarded"):
        sources.read_upstream(bad)
    bad.write_text("Origin: x\n\nForwarded: no\n")
    with pytest.raises(SeriesError, match="upstream:2: expected a 'Key: value' line"):
        sources.read_upstream(bad)
