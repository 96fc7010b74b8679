"""The command line: exit codes, outputs and refusals, on small local trees and series."""

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from patchkit import make_patch, write_series
from sm12x_bundle.cli import build_parser, main

BODY = "".join(f"line {i}\n" for i in range(1, 31))


@pytest.fixture
def project(tmp_path, monkeypatch):
    """A working directory with a local vLLM-like tree and a config that uses it."""
    tree = tmp_path / "vllm-src"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    (tree / "vllm" / "a.py").write_text(BODY)
    (tree / "PKG-INFO").write_text("Version: 0.21.0\n")
    monkeypatch.chdir(tmp_path)

    def configure(patches: dict[str, str]) -> Path:
        write_series(tmp_path / "patches", patches)
        cfg = tmp_path / "sm12x-bundle.yaml"
        cfg.write_text(f"pin:\n  version: '0.21.0'\n  source: {tree}\nseries: patches/series\n")
        return tmp_path

    return configure


def change(old: str, new: str) -> str:
    return make_patch({"vllm/a.py": (BODY, BODY.replace(old, new))})


def test_check_all_apply_exits_0_and_prints_table(project, capsys):
    project({"0001-one.patch": change("line 3\n", "three\n")})
    assert main(["check", "-q"]) == 0
    out = capsys.readouterr().out
    assert "one" in out and "applies" in out


def test_check_conflict_exits_20_with_json_and_junit(project, capsys, tmp_path):
    project({"0001-one.patch": make_patch({"vllm/a.py": (BODY.replace("line 5\n", "x\n"), BODY.replace("line 5\n", "y\n"))})})
    assert main(["check", "-q", "--json", "--junit", str(tmp_path / "r.xml")]) == 20
    [entry] = json.loads(capsys.readouterr().out)
    assert entry["result"] == "conflict"
    assert entry["patches"][0]["conflict"]["path"] == "vllm/a.py"
    suite = ET.parse(tmp_path / "r.xml").getroot().find("testsuite")
    assert suite.get("failures") == "1" and suite.find("testcase/failure") is not None


def test_check_landed_exits_10(project, capsys):
    project({"0001-one.patch": make_patch({"vllm/a.py": (BODY.replace("line 5\n", "x\n"), BODY)})})
    assert main(["check", "-q"]) == 10
    assert "landed upstream (reverse-apply)" in capsys.readouterr().out


def test_bad_config_exits_3_with_location(project, capsys):
    project({"0001-one.patch": change("line 3\n", "three\n")})
    Path("sm12x-bundle.yaml").write_text("pinn: {}\n")
    assert main(["check"]) == 3
    err = capsys.readouterr().err
    assert "sm12x-bundle.yaml:1: unknown key 'pinn' (did you mean 'pin'?)" in err
    assert "Traceback" not in err


def test_unsafe_series_exits_5_before_any_fetch(project, capsys):
    project({"0001-one.patch": change("line 3\n", "three\n").replace("vllm/a.py", "../../etc/passwd")})
    assert main(["check", "-q"]) == 5
    assert "refused" in capsys.readouterr().err


def test_unreachable_release_is_could_not_run(project, capsys, tmp_path):
    project({"0001-one.patch": change("line 3\n", "three\n")})
    cfg = Path("sm12x-bundle.yaml")
    cfg.write_text(cfg.read_text().replace("pin:\n", f"pin:\n  index_url: {(tmp_path / 'no-index').as_uri()}\n"))
    assert main(["check", "-q", "--vllm", "9.9.9"]) == 4
    out = capsys.readouterr().out
    assert "9.9.9" in out and "could not run" in out


def test_apply_writes_tree_or_nothing(project, tmp_path):
    project({"0001-one.patch": change("line 3\n", "three\n")})
    assert main(["apply", "-q", "--out", "out"]) == 0
    assert (tmp_path / "out" / "vllm" / "a.py").read_text().splitlines()[2] == "three"
    project({"0001-one.patch": change("line 3\n", "three\n"), "0002-two.patch": change("line 9\n", "nine\n").replace("line 8", "eight")})
    assert main(["apply", "-q", "--out", "fresh"]) == 6
    assert not (tmp_path / "fresh").exists()


def test_help_teaches_exit_codes_and_examples():
    parser = build_parser()
    text = parser.format_help()
    assert "20  check: some patch conflicts" in text
    check_help = parser._subparsers._group_actions[0].choices["check"].format_help()
    assert "--vllm VERSION" in check_help and "example: sm12x-bundle check" in check_help
