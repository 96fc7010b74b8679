"""The command line: exit codes, outputs and refusals, on small local trees and series."""

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tools.patchkit import make_patch, write_series
from sm12x_bundle.cli import COMMON_CODES, build_parser, command_exit_codes, main

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


def _help(name: str) -> str:
    return build_parser()._subparsers._group_actions[0].choices[name].format_help()


def _listed_codes(help_text: str) -> set[int]:
    block = help_text.split("exit codes:\n", 1)[1]
    return {int(m) for m in re.findall(r"^  (\d+) ", block, re.M)}


def test_each_help_lists_its_own_exit_codes():
    codes = command_exit_codes()
    for name in build_parser()._subparsers._group_actions[0].choices:
        assert _listed_codes(_help(name)) == set(COMMON_CODES) | set(codes[name]), name
    assert _listed_codes(_help("check")) == {0, 2, 3, 4, 5, 10, 12, 20}
    assert {10, 20}.isdisjoint(_listed_codes(_help("series")) | _listed_codes(_help("nomad")))
    assert 11 in _listed_codes(_help("nomad")) and 11 in _listed_codes(_help("apply"))


def test_selftest_help_says_one_thing_about_each_code():
    text = _help("selftest")
    assert "exit 0 when" not in text  # the table is the only place its codes are described
    assert re.search(r"^  2 +could not run: the command line is malformed", text, re.M)
    assert re.search(r"^  9 +some scenario did not pass", text, re.M)


def test_readme_exit_codes_agree_with_the_help():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    commands = readme.split("## Commands", 1)[1].split("|", 1)[0]
    assert {int(c) for c in re.findall(r"(\d+) \(", commands)} == set(COMMON_CODES)
    check = readme.split("### `check`", 1)[1].split("`--json`", 1)[0]
    sentence = check.split("Exit codes:", 1)[1]
    assert {int(c) for c in re.findall(r"\b(\d+) [a-z]", sentence)} == _listed_codes(_help("check"))
