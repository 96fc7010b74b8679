"""The README's promises: its two first commands, and the patch table in step with the series."""

import re
from pathlib import Path

from sm12x_bundle.checks.report import series_markdown

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


def test_patch_table_is_generated_from_the_series(series):
    table = re.search(r"<!-- series-table.*?-->\n(.*?)<!-- /series-table -->", README, re.S)
    assert table, "README lost its series table markers"
    assert table.group(1) == series_markdown(series)
