"""HCL2 text from a tree of blocks, attributes and comments, as `nomad fmt` would leave it
(attributes aligned on '=', blocks and runs of attributes apart by one blank line). What a
Nomad job holds is outputs/nomad.py's; how it is spelled in HCL is here.

Every value reaches the text through :func:`string` (a quoted string that decodes to exactly
the value) or :func:`comment` (a line comment that ends where it says); nothing is pasted.
:func:`literal` is string's inverse, for reading back what was written.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

from ..errors import ConfigError


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


def comment(text: str) -> str:
    """A ``#`` line comment holding ``text``: a newline would end it and make the rest HCL, so
    a control, line-separator or invisible formatting character is refused (config/ refuses
    them in every value first; this is the writer's own guard)."""
    if any(unicodedata.category(c) in _UNSAFE for c in text):
        raise ConfigError(f"an HCL comment cannot hold a control or line-separator character: {text!r}")
    return f"# {text}".rstrip()


def _item_lines(item: object, depth: int, width: int) -> list[str]:
    pad = "  " * depth
    if isinstance(item, Comment):
        return [pad + comment(item.text)]
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


# Nomad's runtime variables: an HCL2 job file leaves "${node.unique.name}" unevaluated, and
# Nomad fills it in when it places the task, as it does for the same text in the API JSON.
# Written as they are, so the HCL reads as Nomad's docs write it.
_RUNTIME = re.compile(r"\$\{(?:(?:node|attr|meta|device)\.[A-Za-z0-9_.\-]+|NOMAD_[A-Za-z0-9_]+)\}")
_UNSAFE = ("Cc", "Cf", "Zl", "Zp")
_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def string(s: str) -> str:
    """A quoted HCL string that decodes to exactly ``s``, the API JSON's string: quotes,
    backslashes and controls escaped; "%{" and every "${" but a runtime variable's doubled
    (HCL's escape for a literal); a runtime variable right after a "$" doubled too, or the
    two would read as the escape "$${"."""
    out = "".join(_ESCAPES.get(c) or (_unicode_escape(c) if unicodedata.category(c) in _UNSAFE else c) for c in s)
    out = out.replace("%{", "%%{")
    return '"' + re.sub(r"\$\{", lambda m: _interpolation(out, m.start()), out) + '"'


def _interpolation(s: str, at: int) -> str:
    runtime = _RUNTIME.match(s, at) and not (at and s[at - 1] == "$")
    return "${" if runtime else "$${"


def _unicode_escape(c: str) -> str:
    return f"\\u{ord(c):04x}" if ord(c) < 0x10000 else f"\\U{ord(c):08x}"


def literal(s: str) -> str:
    """What a string that python-hcl2 read (backslash escapes decoded, template escapes kept)
    means to Nomad: "$${" and "%%{" are a literal "${" and "%{" (HCL's scanner takes the
    longest match, left to right); a runtime variable stays as it is. Any other interpolation
    or a template directive is refused: the tool never writes one."""
    out, i = [], 0
    while i < len(s):
        if s.startswith(("$${", "%%{"), i):
            out.append(s[i + 1 : i + 3])
            i += 3
        elif s.startswith("${", i) and _RUNTIME.match(s, i):
            end = _RUNTIME.match(s, i).end()  # type: ignore[union-attr]
            out.append(s[i:end])
            i = end
        elif s.startswith(("${", "%{"), i):
            raise ValueError(f"an interpolation or directive the writer never makes: {s!r}")
        else:
            out.append(s[i])
            i += 1
    return "".join(out)
