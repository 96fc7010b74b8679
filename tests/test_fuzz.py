"""Fuzz the untrusted-input parsers with a small, fixed budget (docs/fuzzing.md).

The generators and properties live in fuzzkit.py; scripts/fuzz runs the same ones for longer.
``derandomize`` makes every CI run try the same inputs, so a failure here reproduces.
"""

from __future__ import annotations

import hashlib
import signal
from pathlib import Path

import pytest
from fuzzkit import (
    ARCHIVES,
    CONFIG_INPUTS,
    PATCH_INPUTS,
    Archive,
    Member,
    archive_bytes,
    check_config,
    check_extract,
    check_patch,
)
from hypothesis import HealthCheck, Phase, given, settings
from tools.patchkit import make_patch

from sm12x_bundle import config as config_mod
from sm12x_bundle.errors import ConfigError, FetchError, SeriesError
from sm12x_bundle.series.apply import HunkFailure, VirtualTree, apply_file_patch
from sm12x_bundle.series.patch import FilePatch, load_series, parse_patch
from sm12x_bundle.source.extract import cached_tree

CI = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


@CI
@given(ARCHIVES)
def test_sdist_extractor_extracts_inside_or_refuses(archive):
    check_extract(archive)


@CI
@given(PATCH_INPUTS)
def test_patch_parser_and_applier_apply_conflict_or_refuse(data):
    check_patch(data)


# A config that hangs costs its whole time bound on every replay, so CI reports the input
# it found as it is; scripts/fuzz shrinks it.
@settings(CI, max_examples=150, phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(CONFIG_INPUTS)
def test_config_loader_loads_or_refuses_in_bounded_time_and_memory(data):
    check_config(data)


# ---- what the fuzzers found, kept as plain regression tests (docs/fuzzing.md lists them)


def _extract(tmp_path: Path, *members: Member) -> Path:
    data = archive_bytes(Archive(members, "gz", None, b"", (), False), str(tmp_path / "sentinel"))
    sdist = tmp_path / "sdists" / hashlib.sha256(data).hexdigest() / "vllm-9.0.0.tar.gz"
    sdist.parent.mkdir(parents=True)
    sdist.write_bytes(data)
    return cached_tree(sdist, tmp_path / "cache")


def _m(kind: str, name: str, link: str = "", data: bytes = b"", size: int | None = None) -> Member:
    return Member(kind, name, link, data, size, 0o644)


def test_a_top_level_entry_that_is_not_a_folder_is_refused(tmp_path):
    with pytest.raises(FetchError, match="top-level entry 'vllm-9.0.0' is not a directory"):
        _extract(tmp_path, _m("file", "vllm-9.0.0", data=b"x"))


def test_a_hard_link_to_no_earlier_file_is_refused(tmp_path):
    with pytest.raises(FetchError, match="hard link to 'top/later', which is not an earlier file"):
        _extract(tmp_path, _m("hardlink", "top/h", "top/later"), _m("file", "top/later", data=b"x"))


def test_symlinks_that_chain_out_of_the_tree_are_refused(tmp_path):
    # Each link stays inside on paper; together a -> (top/.)/../../x leaves the tree.
    with pytest.raises(FetchError, match="member 'top/a' goes through the symlink 'top/b'"):
        _extract(tmp_path, _m("dir", "top"), _m("symlink", "top/a", "b/../../x"), _m("symlink", "top/b", "."))
    assert not (tmp_path / "cache" / "trees").exists() or not any((tmp_path / "cache" / "trees").iterdir())


@pytest.mark.parametrize(
    "members",
    [  # tarfile cannot make these links: a folder is in the way, the parent is a file, the
        # names are too long; it then extracted the link's target in its place, which
        # recursed until RecursionError
        (_m("dir", "top/a"), _m("symlink", "top/a", "a")),
        (_m("file", "top/a"), _m("symlink", "top/a/a", "a")),
        (_m("symlink", "top/" + "l" * 300, "m" * 300), _m("symlink", "top/" + "m" * 300, "l" * 300)),
    ],
)
def test_a_loop_of_symlinks_is_refused(tmp_path, members):
    with pytest.raises(FetchError, match="is part of a loop of symlinks"):
        _extract(tmp_path, *members)


@pytest.mark.parametrize("name", ["./top/b/keep/.", "./top/.", "", "top/x/", "top//x"])
def test_a_link_whose_name_is_not_plain_is_refused(tmp_path, name):
    # tarfile failed to make './top/.' (or '', the destination itself) and, resolving it from
    # its name as written, extracted the link itself in its place until RecursionError.
    with pytest.raises(FetchError, match="is a link whose name is not plain"):
        _extract(tmp_path, _m("symlink", name, "."))


def test_a_sparse_member_is_refused(tmp_path):
    # Its header may declare any size at no cost: 1 GiB here, from 3 bytes of data.
    with pytest.raises(FetchError, match="member 'top/big' is a sparse file"):
        _extract(tmp_path, _m("sparse", "top/big", data=b"abc", size=1 << 30))


def test_an_extended_header_of_impossible_size_is_refused(tmp_path):
    with pytest.raises(FetchError, match="declares a size too large to read"):
        _extract(tmp_path, _m("pax-huge", "top/x", size=1 << 62))


def _patch_file(tmp_path: Path, data: bytes) -> Path:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "0001-x.patch").write_bytes(data)
    (tmp_path / "p" / "series").write_text("0001-x.patch\n")
    return tmp_path / "p" / "series"


def test_a_file_mode_that_is_not_octal_is_a_series_error(tmp_path):
    text = make_patch({"a.py": (None, "x\n")}).replace("new file mode 100644", "new file mode 10x644")
    with pytest.raises(SeriesError, match="'new file mode 10x644' does not end in an octal file mode"):
        load_series(_patch_file(tmp_path, text.encode()))


def test_a_patch_that_is_not_utf8_is_a_series_error(tmp_path):
    data = make_patch({"a.py": ("x\n", "y\n")}).encode().replace(b"+y", b"+\xff")
    with pytest.raises(SeriesError, match="0001-x.patch is not UTF-8 text"):
        load_series(_patch_file(tmp_path, data))
    (tmp_path / "p" / "series").write_bytes(b"0001-\xff.patch\n")
    with pytest.raises(SeriesError, match="series is not UTF-8 text"):
        load_series(tmp_path / "p" / "series")


def test_a_huge_hunk_line_number_is_searched_from_the_end_of_the_file(tmp_path):
    (tmp_path / "a.py").write_text("x\n")
    text = make_patch({"a.py": ("x\n", "y\n")}).replace("@@ -1 +1 @@", "@@ -1000000000000000000 +1 @@")
    fp = parse_patch(text, Path("p.patch")).files[0]
    signal.signal(signal.SIGALRM, _too_slow)
    signal.alarm(10)  # it took forever: the search counted up to the claimed line
    try:
        tree = VirtualTree(tmp_path)
        apply_file_patch(tree, fp)
    finally:
        signal.alarm(0)
    assert tree.changed()["a.py"].lines == ["y"]


def _too_slow(*_):
    raise TimeoutError("the hunk search did not finish in 10 s")


def test_a_symlink_loop_or_an_overlong_name_in_the_tree_is_a_series_error(tmp_path):
    (tmp_path / "loop").symlink_to("loop")
    fp = parse_patch(make_patch({"loop/a.py": ("x\n", "y\n")}), Path("p.patch")).files[0]
    with pytest.raises(SeriesError, match="cannot be read in the tree"):
        apply_file_patch(VirtualTree(tmp_path), fp)
    with pytest.raises(SeriesError, match="has a name longer than 255 bytes"):  # refused as the patch is read
        parse_patch(make_patch({"x" * 300 + ".py": ("x\n", "y\n")}), Path("p.patch"))


@pytest.mark.parametrize("new, deleted", [(True, False), (False, True)])
def test_a_file_patch_without_hunks_conflicts_instead_of_crashing(tmp_path, new, deleted):
    (tmp_path / "a.py").write_text("x\n")
    fp = FilePatch("a.py", (), new_file=new, deleted=deleted)
    with pytest.raises(HunkFailure, match="a.py: hunk #1"):
        apply_file_patch(VirtualTree(tmp_path), fp)


def test_a_number_too_long_to_read_is_a_config_error(tmp_path):
    # Python reads at most 4300 digits into an int: the YAML constructor's ValueError was a bug (exit 2).
    path = tmp_path / "c.yaml"
    path.write_text("check:\n  fuzz: " + "9" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: not valid YAML: a number of 5000 digits, too long to read"):
        config_mod.load(path)
