import os
from pathlib import Path

import pytest

from tools.patchkit import make_patch, write_series
from sm12x_bundle.checks.check import Outcome, check_tree, exit_code
from sm12x_bundle.errors import ApplyError, SeriesError
from sm12x_bundle.outputs.tree import write_tree
from sm12x_bundle.series.apply import HunkFailure, VirtualTree, apply_file_patch
from sm12x_bundle.series.patch import load_series, parse_patch
from sm12x_bundle.source.pin import SourceTree

BODY = "".join(f"line {i}\n" for i in range(1, 41))


def tree_with(tmp_path: Path, files: dict[str, str]) -> SourceTree:
    root = tmp_path / "tree"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return SourceTree(root, "9.9.9", None, "test tree")


def one(text: str):
    return parse_patch(text, Path("0001-x.patch")).files[0]


def test_applies_and_reports_offset(tmp_path):
    src = tree_with(tmp_path, {"f.py": "extra\nextra\n" + BODY})
    fp = one(make_patch({"f.py": (BODY, BODY.replace("line 20\n", "LINE 20\n"))}))
    vt = VirtualTree(src.root)
    [result] = apply_file_patch(vt, fp)
    assert result.offset == 2
    assert vt.edits["f.py"].lines[21] == "LINE 20"


def test_conflict_reports_lines_that_differ(tmp_path):
    src = tree_with(tmp_path, {"f.py": BODY.replace("line 19\n", "line nineteen\n")})
    fp = one(make_patch({"f.py": (BODY, BODY.replace("line 20\n", "LINE 20\n"))}))
    with pytest.raises(HunkFailure) as exc:
        apply_file_patch(VirtualTree(src.root), fp)
    assert exc.value.index == 1
    diff = exc.value.diff_lines()
    assert "-line 19" in diff and "+line nineteen" in diff
    assert diff[:2] == ["--- expected (patch)", "+++ found (tree)"]


def test_fuzz_zero_refuses_what_fuzz_one_accepts(tmp_path):
    src = tree_with(tmp_path, {"f.py": BODY.replace("line 17\n", "changed 17\n")})
    fp = one(make_patch({"f.py": (BODY, BODY.replace("line 20\n", "LINE 20\n"))}))
    with pytest.raises(HunkFailure):
        apply_file_patch(VirtualTree(src.root), fp, fuzz=0)
    vt = VirtualTree(src.root)
    [result] = apply_file_patch(vt, fp, fuzz=1)
    assert result.fuzz == 1 and "LINE 20" in vt.edits["f.py"].lines


def test_new_and_deleted_files(tmp_path):
    src = tree_with(tmp_path, {"gone.py": "bye\n"})
    patch = parse_patch(make_patch({"new/mod.py": (None, "hi\n"), "gone.py": ("bye\n", None)}), Path("p.patch"))
    vt = VirtualTree(src.root)
    for fp in patch.files:
        apply_file_patch(vt, fp)
    assert vt.edits["new/mod.py"].to_bytes() == b"hi\n"
    assert vt.edits["gone.py"] is None


def test_symlink_escape_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f.py").write_text(BODY)
    src = tree_with(tmp_path, {"keep.py": "x\n"})
    os.symlink(outside, src.root / "link")
    fp = one(make_patch({"link/f.py": (BODY, BODY.replace("line 2\n", "x\n"))}))
    with pytest.raises(SeriesError, match="outside the tree"):
        apply_file_patch(VirtualTree(src.root), fp)
    assert (outside / "f.py").read_text() == BODY


def _series(tmp_path, patches):
    return load_series(write_series(tmp_path / "patches", patches))


def test_classification_applies_landed_conflict(tmp_path):
    landed_text = BODY.replace("line 5\n", "fixed 5\n")
    src = tree_with(tmp_path, {"a.py": BODY, "b.py": landed_text, "c.py": BODY.replace("line 30\n", "other\n"), "d.py": "def f():\n    sync()\n"})
    series = _series(
        tmp_path,
        {
            "0001-applies.patch": make_patch({"a.py": (BODY, BODY.replace("line 9\n", "nine\n"))}),
            "0002-reversed.patch": make_patch({"b.py": (BODY, landed_text)}),
            "0003-probe.patch": make_patch({"d.py": ("def f():\n    pass\n", "def f():\n    flush()\n")}, Sm12x_Probe="d.py::f ~ sync\\(\\)"),
            "0004-conflict.patch": make_patch({"c.py": (BODY, BODY.replace("line 31\n", "x\n"))}),
        },
    )
    report = check_tree(series, src)
    got = [(r.patch, r.outcome, r.landed_by) for r in report.results]
    assert got == [
        ("applies", Outcome.APPLIES, None),
        ("reversed", Outcome.LANDED, "reverse-apply"),
        ("probe", Outcome.LANDED, "probe"),
        ("conflict", Outcome.CONFLICT, None),
    ]
    assert report.results[3].conflict.path == "c.py"
    assert exit_code([report]) == 20
    assert exit_code([check_tree(_series(tmp_path / "s2", {"0001-x.patch": make_patch({"b.py": (BODY, landed_text)})}), src)]) == 10


def test_later_patch_sees_earlier_patch(tmp_path):
    src = tree_with(tmp_path, {"a.py": BODY})
    step1 = BODY.replace("line 9\n", "nine\n")
    step2 = step1.replace("line 10\n", "ten\n")
    series = _series(tmp_path, {"0001-a.patch": make_patch({"a.py": (BODY, step1)}), "0002-b.patch": make_patch({"a.py": (step1, step2)})})
    report = check_tree(series, src)
    assert [r.outcome for r in report.results] == [Outcome.APPLIES, Outcome.APPLIES]
    assert report.tree.edits["a.py"].to_bytes().decode() == step2


def test_apply_is_atomic_and_reproducible(tmp_path):
    src = tree_with(tmp_path, {"a.py": BODY, "b.py": BODY})
    good = _series(tmp_path / "good", {"0001-a.patch": make_patch({"a.py": (BODY, BODY.replace("line 3\n", "three\n"))})})
    out = tmp_path / "out"
    write_tree(good, src, out)
    first = {p.relative_to(out): (p.read_bytes(), p.stat().st_mtime) for p in out.rglob("*") if p.is_file()}
    write_tree(good, src, out)
    second = {p.relative_to(out): (p.read_bytes(), p.stat().st_mtime) for p in out.rglob("*") if p.is_file()}
    assert first == second
    assert (out / "a.py").read_text().splitlines()[2] == "three"

    bad = _series(
        tmp_path / "bad",
        {
            "0001-a.patch": make_patch({"a.py": (BODY, BODY.replace("line 3\n", "THREE\n"))}),
            "0002-b.patch": make_patch({"b.py": (BODY.replace("line 7\n", "zzz\n"), BODY.replace("line 7\n", "yyy\n"))}),
        },
    )
    with pytest.raises(ApplyError, match="patch b does not apply.*b.py hunk #1"):
        write_tree(bad, src, out)
    # The earlier output is untouched, and no staging folder is left behind.
    assert (out / "a.py").read_text().splitlines()[2] == "three"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "good", "out", "tree"]
    with pytest.raises(ApplyError):
        write_tree(bad, src, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()
    # The pristine tree is never written.
    assert (src.root / "a.py").read_text() == BODY


# --- a file where a folder must be, a folder where a file must be ---------------------------


@pytest.mark.parametrize(
    "files, changes, path, found",
    [
        ({"vllm/a.py": "x\n"}, {"vllm/a.py/b.py": (None, "y\n")}, "vllm/a.py/b.py", "<vllm/a.py is a regular file>"),
        ({"vllm/a.py": "x\n"}, {"vllm": (None, "y\n")}, "vllm", "<vllm is a folder>"),
        # the series' own files: one patch adds a file, the next puts a file under it
        ({"vllm/a.py": "x\n"}, {"vllm/n.py": (None, "y\n"), "vllm/n.py/m.py": (None, "z\n")}, "vllm/n.py/m.py",
         "<vllm/n.py is a regular file>"),
        ({"vllm/a.py": "x\n"}, {"vllm/n/m.py": (None, "z\n"), "vllm/n": (None, "y\n")}, "vllm/n", "<vllm/n is a folder>"),
        ({"vllm/a.py": "x\n"}, {"vllm/a.py/b.py": ("y\n", "z\n")}, "vllm/a.py/b.py", "<vllm/a.py is a regular file>"),
    ],
    ids=["file-under-a-file", "file-over-a-folder", "under-an-added-file", "over-an-added-folder", "change-under-a-file"],
)
def test_a_file_where_a_folder_must_be_is_a_conflict_in_check_and_apply(tmp_path, files, changes, path, found):
    """It 'applied' in check and then failed in apply with exit 2, as a bug (FileExistsError)."""
    src = tree_with(tmp_path, files)
    patches = {f"{n:04d}-p{n}.patch": make_patch({p: c}) for n, (p, c) in enumerate(changes.items(), 1)}
    series = load_series(write_series(tmp_path / "patches", patches))
    report = check_tree(series, src)
    [conflict] = [r for r in report.results if r.outcome is Outcome.CONFLICT]
    said = found[1:-1]  # one fact, no diff to show
    assert (conflict.conflict.path, conflict.conflict.differs) == (path, (said,))
    assert exit_code([report]) == 20
    with pytest.raises(ApplyError, match="does not apply") as exc:
        write_tree(series, src, tmp_path / "out")
    assert exc.value.exit_code == 6 and said in str(exc.value) and "\n" not in str(exc.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["patches", "tree"]  # nothing written, nothing left


def test_a_file_the_series_deleted_may_become_a_folder(tmp_path):
    src = tree_with(tmp_path, {"vllm/a.py": "x\n"})
    series = load_series(write_series(tmp_path / "patches", {
        "0001-gone.patch": make_patch({"vllm/a.py": ("x\n", None)}),
        "0002-folder.patch": make_patch({"vllm/a.py/b.py": (None, "y\n")}),
    }))
    assert [r.outcome for r in check_tree(series, src).results] == [Outcome.APPLIES, Outcome.APPLIES]
    write_tree(series, src, tmp_path / "out")
    assert (tmp_path / "out" / "vllm" / "a.py" / "b.py").read_text() == "y\n"


def test_a_fifo_in_the_tree_where_a_patch_writes_is_a_conflict(tmp_path):
    src = tree_with(tmp_path, {"vllm/a.py": "x\n"})
    os.mkfifo(src.root / "vllm" / "pipe")
    vt = VirtualTree(src.root)
    with pytest.raises(HunkFailure) as exc:
        apply_file_patch(vt, one(make_patch({"vllm/pipe": (None, "y\n")})))
    assert exc.value.found == ["<vllm/pipe is a FIFO (named pipe)>"]


def test_an_overlay_refuses_a_file_under_an_image_file(tmp_path):
    """The overlay path patches an image's own copies the same way: a conflict naming the image."""
    from sm12x_bundle.containers import ImageFile
    from sm12x_bundle.plan.files import patch_image_files

    series = load_series(write_series(tmp_path, {
        "0001-a.patch": make_patch({"vllm/a.py": ("x\n", "y\n"), "vllm/a.py/b.py": (None, "z\n")}),
    }))
    originals = {"vllm/a.py": ImageFile(b"x\n", 0o644), "vllm/a.py/b.py": None}
    with pytest.raises(ApplyError) as exc:
        patch_image_files(series, originals, "image vllm/vllm-openai:v0.21.0", lambda p: "/usr/lib/" + p)
    assert exc.value.exit_code == 6
    assert str(exc.value).startswith("image vllm/vllm-openai:v0.21.0: patch a does not apply to /usr/lib/vllm/a.py/b.py")
    assert str(exc.value).endswith(": vllm/a.py is a regular file") and "\n" not in str(exc.value)
