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
    assert re.search(r"^exec scripts/test\b", ci, re.M)


def test_config_reference_names_every_key():
    import dataclasses

    from sm12x_bundle import config as config_mod

    reference = (REPO / "docs" / "configuration.md").read_text()  # the README links to it
    section = reference[reference.index("## Configuration") : reference.index("### The pin and the cache")]
    for cls in (config_mod.LaneConfig, config_mod.PinConfig, config_mod.CheckConfig, config_mod.OutputConfig, config_mod.TargetConfig, config_mod.ImageConfig, config_mod.JobConfig):
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in section or f".{f.name}`" in section or f", {f.name}" in section or f"`{f.name}," in section, f"{cls.__name__}.{f.name} is not in docs/configuration.md's reference"
