"""Reading one YAML document into the dataclasses of model.py: bounded (size, depth, no
anchors or tags beyond plain data), every unknown key refused with the nearest valid one
suggested, every value's line remembered for the checks' ``file:line: key``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError
from ..values import did_you_mean
from .model import Config, PinConfig, _shipped_lanes
from .rules import validate


class _Node:
    """A YAML value with the line it was written on."""

    __slots__ = ("value", "line", "lines")

    def __init__(self, value: Any, line: int, lines: dict[str, int] | None = None):
        self.value = value
        self.line = line
        self.lines = lines or {}


MAX_DEPTH = 32


def _compose(text: str, origin: str) -> _Node:
    try:
        loader = _BoundedLoader(text, origin)  # its reader refuses a control character here
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}:{_error_line(exc, text)}: not valid YAML: {_problem(exc)}") from None
    if root is None or root.tag.endswith(":null") or isinstance(root, yaml.MappingNode) and not root.value:
        raise ConfigError(
            f"{origin}:1: the file holds no settings (it is empty, only comments, or {{}}): a config file "
            "replaces the embedded default whole; write the settings, or leave the file out to use the default"
        )
    return _plain(root, origin)


def _error_line(exc: yaml.YAMLError, text: str) -> int:
    """The line a YAML error is on: its mark's, or (a reader error) its character position's."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return mark.line + 1
    position = getattr(exc, "position", None)
    return text[:position].count("\n") + 1 if isinstance(position, int) else 1


def _problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.reader.ReaderError):
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"the character #x{char:04x} is not allowed in YAML (a control character or a NUL byte)"
    return " ".join(str(getattr(exc, "problem", None) or exc).split())


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader's composer, refusing before each node is built what could make a few lines
    cost gigabytes or overflow the stack: anchors and aliases (seven lines, each a list that
    names the line before it nine times, expand to 4.8 million values), and nesting beyond
    MAX_DEPTH (the composer recurses once per level)."""

    def __init__(self, text: str, origin: str):
        super().__init__(text)
        self.origin = origin
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise ConfigError(
                f"{self.origin}:{line}: anchors and aliases are not allowed in a config "
                f"(found {sign}{event.anchor}): write each value where it is used"
            )
        nests = isinstance(event, yaml.CollectionStartEvent)  # a mapping or a list: one level more
        if nests and self.depth == MAX_DEPTH:
            raise ConfigError(f"{self.origin}:{line}: nested more than {MAX_DEPTH} levels deep: refused")
        self.depth += nests
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= nests


_SAFE_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("map", "seq", "str", "int", "float", "bool", "null")}


def _plain(node: yaml.Node, origin: str) -> _Node:
    line = node.start_mark.line + 1
    if node.tag not in _SAFE_TAGS:
        raise ConfigError(f"{origin}:{line}: not valid YAML: the tag {node.tag} is not allowed here")
    if isinstance(node, yaml.MappingNode):
        out: dict[str, _Node] = {}
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            if not isinstance(key_node, yaml.ScalarNode) or not isinstance(key, str):
                raise ConfigError(f"{origin}:{key_node.start_mark.line + 1}: keys must be strings")
            if key in out:
                raise ConfigError(f"{origin}:{key_node.start_mark.line + 1}: duplicate key {key!r}")
            out[key] = _plain(value_node, origin)
            lines[key] = key_node.start_mark.line + 1
        return _Node(out, line, lines)
    if isinstance(node, yaml.SequenceNode):
        return _Node([_plain(v, origin) for v in node.value], line)
    return _Node(_scalar(node, f"{origin}:{line}"), line)


def _scalar(node: yaml.Node, where: str) -> Any:
    # SafeLoader's own constructor, so "0.70" is a float and "0.21.0" a string
    # exactly as yaml.safe_load would read them.
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    except ValueError:  # Python reads at most 4300 digits into an int (sys.int_info)
        raise ConfigError(f"{where}: not valid YAML: a number of {len(node.value)} digits, too long to read") from None
    finally:
        loader.dispose()


def _convert(tp: Any, node: _Node, where: str, origin: str, lines: dict[str, int]) -> Any:
    """Turn a located YAML value into the annotated type, or raise a located error.

    ``lines`` collects the line of every key and list item, so the checks that run
    after the whole document is read can still name file:line:key."""
    at = f"{origin}:{node.line}: {where}"
    origin_tp = typing.get_origin(tp)
    if origin_tp in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if node.value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, node, where, origin, lines)
    if dataclasses.is_dataclass(tp):
        return _build(tp, node, where, origin, lines)
    if origin_tp is tuple:
        if not isinstance(node.value, list):
            raise ConfigError(f"{at} must be a list")
        inner = typing.get_args(tp)[0]
        items = []
        for i, v in enumerate(node.value):
            lines[f"{where}[{i}]"] = v.line
            items.append(_convert(inner, v, f"{where}[{i}]", origin, lines))
        return tuple(items)
    if origin_tp is dict:
        if not isinstance(node.value, dict):
            raise ConfigError(f"{at} must be a mapping")
        lines.update({f"{where}.{k}": node.lines.get(k, node.line) for k in node.value})
        return {k: _convert(str, v, f"{where}.{k}", origin, lines) for k, v in node.value.items()}
    value = node.value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ConfigError(f"{at} must be a string: quote it ({value!r} was read as a number)")
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{at} must be {tp.__name__}, not {type(value).__name__}")
    problem = _unreadable(value)
    if problem:
        raise ConfigError(f"{at}: {problem}")
    return value


def _unreadable(value: Any) -> str | None:
    """What no setting may hold, whatever its key: a float that is not a number (.nan, .inf),
    a NUL character (no path, name or command line can carry it) or half of a UTF-16 pair
    ("\\ud800": YAML's escapes allow it, UTF-8 cannot write it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, not {value}"
    if isinstance(value, str) and "\0" in value:
        return "holds a NUL character (\\0): refused"
    if isinstance(value, str) and any("\ud800" <= c <= "\udfff" for c in value):
        return "holds a lone UTF-16 surrogate (an escape such as \\ud800), which is not a character: refused"
    return None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # slow; a list of 1,000 jobs would ask it 1,000 times


def _build(cls: type, node: _Node, where: str, origin: str, lines: dict[str, int]) -> Any:
    if not isinstance(node.value, dict):
        raise ConfigError(f"{origin}:{node.line}: {where or 'the document'} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("origin", "base_dir")}
    hints = _hints(cls)
    kwargs = {}
    for key, value in node.value.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            line = node.lines.get(key, node.line)
            raise ConfigError(f"{origin}:{line}: unknown key {name!r}{did_you_mean(key, fields)}")
        lines[name] = node.lines.get(key, node.line)
        kwargs[key] = _convert(hints[key], value, name, origin, lines)
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{origin}:{node.line}: {where or 'the document'} needs {', '.join(missing)}")
    return cls(**kwargs)


def parse(text: str, origin: str, base_dir: Path) -> Config:
    """Parse one YAML document into a Config and check every value (file access: only
    whether each lane's series file is a regular file)."""
    return parse_located(text, origin, base_dir)[0]


def parse_located(text: str, origin: str, base_dir: Path) -> tuple[Config, dict[str, int]]:
    """``parse``, and the line of every key and list item the document itself wrote
    (``jobs[0].name`` -> 31): what ``config show`` says each value came from."""
    lines: dict[str, int] = {}
    config = _build(Config, _compose(text, origin), "", origin, lines)
    written = dict(lines)
    config = dataclasses.replace(config, origin=origin, base_dir=str(base_dir))
    if not {"lanes", "pin", "series"} & lines.keys():  # no lane named: every lane the tool ships
        config = dataclasses.replace(config, lanes=_shipped_lanes())
        lines.update({"lanes": 1, **{f"lanes[{i}]": 1 for i in range(len(config.lanes))}})
    validate(config, lines)
    if "lanes" in lines:  # the one-lane names repeat the first lane for one-lane callers
        first = config.lanes[0]
        pin = PinConfig(first.version, first.sha256, first.index_url, first.source)
        config = dataclasses.replace(config, pin=pin, series=first.series)
    return config, written
