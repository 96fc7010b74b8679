"""New files kept as source beside their patch (src/sm12x_bundle/series/sources.py).

The shipped patches must carry each file of their source folder exactly as it is in the
repository; ``bin/refresh-patch-sources`` rewrites them after an edit.
"""

from __future__ import annotations

import difflib
import shutil
from pathlib import Path

import pytest

from patchkit import make_patch
from sm12x_bundle.errors import SeriesError
from sm12x_bundle.series import sources

PATCHES = Path(__file__).resolve().parents[1] / "patches"
WITH_SOURCES = sorted(str(p.relative_to(PATCHES)) for p in PATCHES.glob("*/*.patch") if sources.source_folder(p))


def test_the_patches_that_keep_new_files_as_source():
    assert "0.21.0/0004-triton-sparse-mla-fallback.patch" in WITH_SOURCES
    assert "0.21.0/0005-cumem-backup-pool.patch" in WITH_SOURCES


@pytest.mark.parametrize("name", WITH_SOURCES)
def test_patch_carries_its_source_folder_as_it_is(name):
    assert sources.refresh(PATCHES / name, check=True), f"{name} is stale: run bin/refresh-patch-sources"


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
