"""HCL2 text from a tree of blocks, attributes and comments, as `nomad fmt` would leave it
(attributes aligned on '=', blocks and runs of attributes apart by one blank line). What a
Nomad job holds is outputs/nomad.py's; how it is spelled in HCL is here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class Block:
    kind: str
    labels: tuple[str, ...] = ()
    body: list = field(default_factory=list)  # (name, value) pairs, Block, Comment


@dataclass
class Comment:
    text: str


def text(block: Block) -> list[str]:
    """The block's lines, at the top level."""
    return _lines(block, 0)


def _lines(block: Block, depth: int) -> list[str]:
    pad = "  " * depth
    head = " ".join([block.kind] + [string(label) for label in block.labels])
    return [f"{pad}{head} {{", *_body_lines(block.body, depth + 1), f"{pad}}}"]


def _body_lines(items: list, depth: int) -> list[str]:
    """Runs of attributes (aligned on '=') and blocks, separated by blank lines."""
    chunks: list[list] = []
    for item in items:
        last = chunks[-1][-1] if chunks else None
        # A comment belongs to what follows it; attributes in a row share one chunk.
        if isinstance(last, Comment) or (isinstance(item, tuple) and isinstance(last, tuple)):
            chunks[-1].append(item)
        else:
            chunks.append([item])
    out: list[str] = []
    for chunk in chunks:
        out += [""] if out else []
        width = max((len(i[0]) for i in chunk if isinstance(i, tuple)), default=0)
        for item in chunk:
            out += _item_lines(item, depth, width)
    return out


def _item_lines(item: object, depth: int, width: int) -> list[str]:
    pad = "  " * depth
    if isinstance(item, Comment):
        return [f"{pad}# {item.text}"]
    if isinstance(item, Block):
        return _lines(item, depth)
    name, value = item  # type: ignore[misc]
    head = f"{pad}{name.ljust(width)} = "
    if isinstance(value, list) and len(value) > 2:
        rows = (", ".join(_hcl_value(v) for v in row) for row in _flag_rows(value))
        return [head + "[", *(f"{pad}  {row}," for row in rows), f"{pad}]"]
    return [head + _hcl_value(value)]


def _flag_rows(values: list) -> list[list]:
    """One row per argument, a flag's value on the flag's row: easier to read and diff."""
    rows: list[list] = []
    for v in values:
        if rows and len(rows[-1]) == 1 and str(rows[-1][0]).startswith("-") and not str(v).startswith("-"):
            rows[-1].append(v)
        else:
            rows.append([v])
    return rows


def _hcl_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_hcl_value(v) for v in value) + "]"
    return string(str(value))


# Nomad interpolates these at run time, in HCL and JSON alike; any other "${" is escaped so
# that the HCL decodes to exactly the JSON's string.
_RUNTIME = re.compile(r"\$\{(?!(?:node|attr|meta|device)\.[A-Za-z0-9_.\-]+\}|NOMAD_[A-Za-z0-9_]+\})")


def string(s: str) -> str:
    s = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    s = _RUNTIME.sub("$${", s.replace("%{", "%%{"))
    return f'"{s}"'
