"""The README's promises: its two first commands, and the configuration reference it links to
(docs/configuration.md) naming every key (its patch table is a generated file:
tests/test_generated.py)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def test_first_lines_give_the_two_commands():
    block = re.search(r"```sh\n(.*?)```", README, re.S)
    assert block and README.index(block.group(0)) < 400
    commands = block.group(1).strip().splitlines()
    assert commands == ["python3 -m pip install -e . && sm12x-bundle build", "scripts/test"]


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^exec scripts/test -q$", ci, re.M)
    assert "SM12X_SKIP_DOCKER" not in ci  # CI runs the daemon tests: the README says so
    assert "`.ci/run`, the CI entry point, runs\n`scripts/test -q`, daemon included." in README


def test_what_scripts_test_does_is_what_the_readme_says():
    script = (REPO / "scripts" / "test").read_text()
    dockerd = (REPO / ".ci" / "dockerd.sh").read_text()
    assert "pip install -q -e '.[test]'" in script and "python3 tests/testinputs.py" in script
    unless_skipped = script.split('if [ "${SM12X_SKIP_DOCKER:-0}" != 1 ]; then\n', 1)[1].split("\nfi\n", 1)[0]
    assert ".ci/dockerd.sh start" in unless_skipped and "trap '.ci/dockerd.sh stop" in unless_skipped
    assert script.rstrip().endswith('python3 -m pytest "$@"')  # the arguments it is given
    assert "missing+=(docker.io)" in dockerd and "missing+=(debootstrap)" in dockerd
    first = README[: README.index("## What this is")]
    assert "`SM12X_SKIP_DOCKER=1 scripts/test` starts no\ndaemon" in first
    assert "daemon tests remove the images they built" in first  # tests/test_docker_cleanup.py


def test_the_command_table_lists_every_command():
    from sm12x_bundle.cli import COMMANDS

    table = README.split("| command | what it does |", 1)[1].split("\n\n", 1)[0]
    for command in COMMANDS:
        assert f"| `{command.name}" in table, command.name
    assert "| `config show` |" in table and "| `config init [FILE]` |" in table


def test_config_reference_names_every_key():
    import dataclasses

    from sm12x_bundle import config as config_mod

    reference = (REPO / "docs" / "configuration.md").read_text()  # the README links to it
    section = reference[reference.index("## Configuration") : reference.index("### The pin and the cache")]
    for cls in (config_mod.LaneConfig, config_mod.PinConfig, config_mod.CheckConfig, config_mod.OutputConfig, config_mod.TargetConfig, config_mod.ImageConfig, config_mod.JobConfig):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in section or f".{f.name}`" in section or f", {f.name}" in section or f"`{f.name}," in section, f"{cls.__name__}.{f.name} is not in docs/configuration.md's reference"
