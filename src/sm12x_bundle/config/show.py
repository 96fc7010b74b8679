"""The effective configuration as YAML, each value with where it came from.

``config show`` prints it: every key of every section, in the dataclasses' order, with a
comment naming the line of the file (or of the embedded default) that set it, or saying that
the value is the tool's built-in default (the dataclass's, or every shipped lane when the
document names none). The output is itself a configuration that loads to the same values.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from .model import Config

BUILT_IN = "built-in default"
SHIPPED_LANES = "built-in default: every series the tool ships, pinned by data/releases.json"
# Shown as ``lanes:``: the one-lane form (pin + series) is the same lane, and origin and
# base_dir are where the document was found, not settings.
HIDDEN = ("pin", "series", "origin", "base_dir")
# Where a one-lane document (pin: + series:) wrote what show prints as lanes[0].
ONE_LANE = {"version": "pin.version", "sha256": "pin.sha256", "source": "pin.source",
            "index_url": "pin.index_url", "series": "series"}


class _Sources:
    """Which line set each key, by its dotted name (``jobs[0].env.HF_HOME``)."""

    def __init__(self, config: Config, lines: dict[str, int]):
        self.lines = dict(lines)
        # escaped: a newline in a file name would end the comment and start a key
        self.where = "embedded default" if config.origin.startswith("<") else config.origin.encode("unicode_escape").decode()
        self.shipped = not {"lanes", "pin", "series"} & lines.keys()
        if "lanes" not in lines:  # the one-lane form: its keys stand for lanes[0]'s
            for key, old in ONE_LANE.items():
                if old in lines:
                    self.lines[f"lanes[0].{key}"] = lines[old]

    def of(self, key: str) -> str:
        if key in self.lines:
            return f"{self.where}:{self.lines[key]}"
        return SHIPPED_LANES if key == "lanes" and self.shipped else BUILT_IN


def _scalar(value: Any) -> str:
    """A YAML scalar or empty collection that reads back as ``value`` (JSON is YAML)."""
    if isinstance(value, tuple):
        return json.dumps(list(value))
    return json.dumps(value)


def _is_records(value: Any) -> bool:
    return isinstance(value, tuple) and bool(value) and dataclasses.is_dataclass(value[0])


def _entries(name: str, value: Any, key: str, indent: str, src: _Sources) -> list[tuple[str, str]]:
    """(YAML line, where it came from) for one key and everything under it."""
    if dataclasses.is_dataclass(value):
        return [(f"{indent}{name}:", src.of(key))] + _fields(value, key, indent + "  ", src)
    if _is_records(value):
        rows = [(f"{indent}{name}:", src.of(key))]
        for i, item in enumerate(value):
            fields = _fields(item, f"{key}[{i}]", indent + "    ", src)
            first, where = fields[0]
            rows += [(f"{indent}  - {first.lstrip()}", where)] + fields[1:]
        return rows
    if isinstance(value, dict) and value:
        return [(f"{indent}{name}:", src.of(key))] + [
            (f"{indent}  {json.dumps(k)}: {_scalar(v)}", src.of(f"{key}.{k}")) for k, v in value.items()
        ]
    return [(f"{indent}{name}: {_scalar(value)}", src.of(key))]


def _fields(value: Any, key: str, indent: str, src: _Sources) -> list[tuple[str, str]]:
    rows = []
    for f in dataclasses.fields(value):
        if not (isinstance(value, Config) and f.name in HIDDEN):
            rows += _entries(f.name, getattr(value, f.name), f"{key}.{f.name}" if key else f.name, indent, src)
    return rows


def render(config: Config, lines: dict[str, int]) -> str:
    """The effective ``config`` as YAML; ``lines``: where the document set each key
    (``config.load_located``)."""
    sources = _Sources(config, lines)
    rows = _fields(config, "", "", sources)
    width = max(len(text) for text, _ in rows) + 2
    head = f"# the effective configuration, read from {sources.where}\n"
    return head + "".join(f"{text:<{width}}# {where}\n" for text, where in rows)
