"""Every generated file is in step with what it is made from (tools/generated.py): its
committed bytes are exactly its render. After an intended change, run ``bin/regenerate``
and review the diff.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from sm12x_bundle.cli import main
from sm12x_bundle.errors import OutputError
from tools import generated

ENTRIES = generated.registry()


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.paths[0] for e in ENTRIES])
def test_in_step(entry):
    for rel, data in generated.expected(entry).items():
        held = generated.committed(generated.ROOT, rel)
        assert held is not None, f"{rel} is missing: run bin/regenerate (made from {entry.made_from})"
        assert held == data, f"{rel} is stale: run bin/regenerate (made from {entry.made_from})"


def test_every_kind_is_registered():
    paths = {rel for entry in ENTRIES for rel in entry.paths}
    assert len(paths) == sum(len(entry.paths) for entry in ENTRIES), "a file is in two entries"
    assert {p.split("/")[0] for p in paths} == {"patches", "README.md", "nomad", "tests"}
    golden = {str(p.relative_to(generated.ROOT)) for p in (generated.ROOT / "tests/golden").rglob("*") if p.is_file()}
    assert golden <= paths, f"golden files nobody renders: {sorted(golden - paths)}"


@pytest.fixture
def copy(tmp_path):
    """The generated files and what they are made from, in a folder of their own."""
    for rel in ("patches", "nomad", "tests/golden"):
        shutil.copytree(generated.ROOT / rel, tmp_path / rel)
    shutil.copy(generated.ROOT / "README.md", tmp_path / "README.md")
    return tmp_path


def test_write_replaces_only_the_stale_files(copy):
    golden, example = copy / "tests/golden/image/Dockerfile.bundle", copy / "nomad/mimo-flash.nomad.json"
    golden.write_bytes(golden.read_bytes().replace(b"FROM", b"FROm", 1))
    example.unlink()
    other = copy / "tests/golden/image/notes.txt"  # not generated: never touched
    other.write_text("kept\n")
    before = {p: p.stat().st_mtime_ns for p in copy.rglob("*") if p.is_file() and p not in (golden, example)}
    stale = generated.stale(copy)
    assert sorted(stale) == ["nomad/mimo-flash.nomad.json", "tests/golden/image/Dockerfile.bundle"]
    generated.write(stale, copy)
    assert generated.stale(copy) == {}
    assert golden.read_bytes() == (generated.ROOT / "tests/golden/image/Dockerfile.bundle").read_bytes()
    assert {p: p.stat().st_mtime_ns for p in before} == before and other.read_text() == "kept\n"


def test_readme_without_its_markers_is_refused_before_anything_is_written(copy):
    readme = copy / "README.md"
    readme.write_text(readme.read_text().replace("<!-- /series-table -->", ""))
    with pytest.raises(OutputError, match="series table's markers"):
        generated.stale(copy)


def test_check_exits_0_in_step():
    proc = subprocess.run([sys.executable, str(generated.ROOT / "bin/regenerate"), "--check"],
                          capture_output=True, text=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_the_nomad_examples_are_what_the_nomad_command_renders(tmp_path, monkeypatch, capsys):
    """nomad/README.md: bin/regenerate renders what `sm12x-bundle nomad --manifest
    nomad/example-manifest.json` writes with the embedded default config."""
    monkeypatch.chdir(tmp_path)  # no sm12x.yaml here: the embedded default
    manifest = generated.ROOT / "nomad/example-manifest.json"
    assert main(["nomad", "--manifest", str(manifest), "--out", str(tmp_path / "out")]) == 0
    (entry,) = [e for e in ENTRIES if e.paths[0].startswith("nomad/")]
    assert {f"nomad/{p.name}": p.read_bytes() for p in (tmp_path / "out").glob("*.nomad.*")} == generated.expected(entry)
