"""`config show` (the effective configuration, each value with where it came from) and
`config init [FILE]` (the embedded default written to a new file, never over one)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from sm12x_bundle import config as config_mod
from sm12x_bundle.cli import main

LINE = re.compile(r"^(?P<yaml>.*?\S)\s+# (?P<src>[^#]*)$")


def _show(capsys, *args: str) -> list[tuple[str, str]]:
    assert main(["config", "show", *args]) == 0
    out = capsys.readouterr().out
    rows = out.splitlines()
    assert rows[0].startswith("# the effective configuration, read from ")
    return [(m["yaml"], m["src"]) for m in map(LINE.match, rows[1:])]


def _source(rows: list[tuple[str, str]], start: str) -> str:
    [src] = [src for text, src in rows if text.strip().lstrip("- ").startswith(start)][:1]
    return src


def test_show_names_the_line_of_the_embedded_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rows = _show(capsys)
    default = config_mod.default_text().splitlines()
    line = default.index("  fuzz: 0") + 1
    assert _source(rows, "fuzz: 0") == f"embedded default:{line}"
    assert _source(rows, "cuda_home:") == "built-in default"  # image: is not in the embedded default
    assert _source(rows, "lanes:").startswith("built-in default: every series the tool ships")
    assert all(src for _, src in rows), "every line says where its value came from"


def test_show_reads_back_as_the_same_configuration(tmp_path, monkeypatch, capsys):
    """What show prints is a configuration: loaded, it gives the values every command uses."""
    monkeypatch.chdir(tmp_path)
    assert main(["config", "show"]) == 0
    printed = capsys.readouterr().out
    (tmp_path / "shown.yaml").write_text(printed)
    again = config_mod.load(tmp_path / "shown.yaml")
    first = config_mod.load(None, tmp_path)
    keep = {"origin": first.origin, "base_dir": first.base_dir}
    assert dataclasses.replace(again, **keep) == first
    assert yaml.safe_load(printed)["output"] == {"dir": "build", "overlays": "overlays"}


def test_show_names_the_file_line_and_the_built_in_defaults(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "site.yaml").write_text("# site\npin:\n  version: \"0.21.0\"\noutput:\n  dir: out\n")
    rows = _show(capsys, "--config", "site.yaml")
    assert _source(rows, "dir: \"out\"") == "site.yaml:5"
    assert _source(rows, "overlays: \"overlays\"") == "built-in default"
    assert _source(rows, "version: \"0.21.0\"") == "site.yaml:3"  # the one-lane form's pin is lanes[0]
    assert _source(rows, "jobs: []") == "built-in default"


def test_show_refuses_a_malformed_file_with_its_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.yaml").write_text("output:\n  dri: out\n")
    assert main(["config", "show", "--config", "bad.yaml"]) == 3
    assert "bad.yaml:2: unknown key 'output.dri'" in capsys.readouterr().err


def test_init_writes_the_embedded_default_and_says_where(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "init"]) == 0
    written = tmp_path / "sm12x-bundle.yaml"
    assert written.read_text() == config_mod.default_text()
    assert str(written) in capsys.readouterr().out
    assert main(["config", "show"]) == 0
    assert f"read from {written}" in capsys.readouterr().out  # every command now reads it


def test_init_never_replaces_a_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "site.yaml"
    mine.write_text("output:\n  dir: mine\n")
    assert main(["config", "init", "site.yaml"]) == 11
    assert mine.read_text() == "output:\n  dir: mine\n"
    assert "site.yaml already exists" in capsys.readouterr().err
    (tmp_path / "dangling.yaml").symlink_to(tmp_path / "nowhere.yaml")
    assert main(["config", "init", "dangling.yaml"]) == 11
    assert not (tmp_path / "nowhere.yaml").exists()


def test_init_into_a_missing_folder_is_this_machine(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["config", "init", "no/such/site.yaml"]) == 12
    err = capsys.readouterr().err
    assert err.startswith("sm12x-bundle: error: cannot write the configuration no/such/site.yaml")
    assert list(Path(tmp_path).iterdir()) == []
