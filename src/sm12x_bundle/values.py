"""The value checks shared by the config file and the command line, so that ``--vllm ''``
and ``pin.version: ''`` get the same sentence; and :class:`Where`, which names a config
value as ``file:line: key``.

A leaf: it imports nothing of the package but its errors (config, jobs and the CLI's
argument types import it).
"""

from __future__ import annotations

import difflib
import math
import posixpath
import re
import typing
import unicodedata
from urllib.parse import urlsplit

from .errors import ConfigError

_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?(\+[A-Za-z0-9.]+)?")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# One path component that is not '.' or '..': it names a folder.
_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# A job name names a Nomad job, its service (a DNS label) and its files.
JOB_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Docker's reference grammar (distribution/reference), without the rarely used corners.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
# A registry host is told apart from a path the way Docker does: it has a '.', a port, or is localhost.
_DOMAIN = r"(?:(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+|[A-Za-z0-9-]+(?=:[0-9]+/))(?::[0-9]+)?/)?"
_TAG = r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
_IMAGE_TAG = re.compile(rf"{_DOMAIN}{_COMPONENT}(?:/{_COMPONENT})*{_TAG}")
_IMAGE_REF = re.compile(rf"{_DOMAIN}{_COMPONENT}(?:/{_COMPONENT})*{_TAG}(?:@sha256:[0-9a-f]{{64}})?")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


# Characters no generated file can carry as they are: a newline ends an HCL comment or a
# Dockerfile instruction, so what follows it would be read as structure; the other controls,
# line separators and invisible format characters (bidi overrides) make a line say one thing
# and show another. Unicode categories: Cc control, Cf format, Zl line and Zp paragraph separator.
_UNSAFE_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")


def control_problem(value: str, allowed: str = "") -> str | None:
    """Every string of a config reaches a generated file (HCL, API JSON, a Dockerfile, a
    shell line) or a path: none may hold a control or invisible formatting character
    (``allowed``: those a value that only ever becomes a quoted string may hold)."""
    for i, char in enumerate(value):
        if unicodedata.category(char) in _UNSAFE_CATEGORIES and char not in allowed:
            return (
                f"must not hold a control or invisible formatting character ({char!r} at position {i}): "
                "it would change what the generated HCL, JSON or Dockerfile says"
            )
    return None


def _printable(key: str) -> str:
    """A key path as one line: a mapping's key may hold what control_problem refuses."""
    return "".join(repr(c)[1:-1] if unicodedata.category(c) in _UNSAFE_CATEGORIES else c for c in key)


def shell_line_problem(value: str) -> str | None:
    """A shell line that becomes one Dockerfile RUN instruction (image.builder_setup): one
    line, not continued into the template's next instruction, no heredoc."""
    problem = line_problem(value)
    if problem:
        return problem
    if value.rstrip().endswith("\\"):
        return f"must not end in a backslash (it would continue into the Dockerfile's next instruction): {value!r}"
    if "<<" in value:
        return f"must not hold '<<' (BuildKit reads a heredoc there and takes the Dockerfile's next lines): {value!r}"
    return None


# Nomad keeps sizes and durations as Go int64: seconds become nanoseconds in the API JSON,
# MiB become bytes (shm_size; the scheduler's memory), GiB become bytes in the checks.
INT64_MAX = (1 << 63) - 1
_UNITS = {"_s": 1_000_000_000, "_mb": 1 << 20, "_gib": 1 << 30}


def number_problem(key: str, value: int | float) -> str | None:
    """A number Nomad (and the tool's own arithmetic) can hold: finite, and within int64
    once converted to the unit the job spec carries (nanoseconds, bytes)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, not {value}"
    scale = next((unit for suffix, unit in _UNITS.items() if key.endswith(suffix)), 1)
    if abs(value) * scale > INT64_MAX:
        unit = {1: "", 1_000_000_000: " in nanoseconds", 1 << 20: " in bytes", 1 << 30: " in bytes"}[scale]
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        return f"is too large: {shown} does not fit a 64-bit integer{unit} (the most is {INT64_MAX // scale})"
    return None


def version_problem(value: str) -> str | None:
    if not _VERSION.fullmatch(value):
        return f"must be a vLLM release version such as 0.21.0, not {value!r}"
    return None


def sha256_problem(value: str) -> str | None:
    if not _SHA256.fullmatch(value):
        return f"must be 64 lowercase hex digits (a sha256), not {value!r}"
    return None


def digest_problem(value: str) -> str | None:
    if not _DIGEST.fullmatch(value):
        return f"must be a registry digest 'sha256:' + 64 lowercase hex digits, not {value!r}"
    return None


def image_problem(value: str, digest_allowed: bool = True) -> str | None:
    pattern = _IMAGE_REF if digest_allowed else _IMAGE_TAG
    if not pattern.fullmatch(value):
        return f"must be an image reference such as vllm/vllm-openai:v0.21.0, not {value!r}"
    return None


def url_problem(value: str, schemes: tuple[str, ...] = ("http", "https", "file")) -> str | None:
    if control_problem(value):
        return control_problem(value)
    parts = urlsplit(value)
    if parts.scheme not in schemes or (parts.scheme != "file" and not parts.netloc):
        return f"must be a URL starting with {' or '.join(s + '://' for s in schemes)}, not {value!r}"
    return None


def folder_name_problem(value: str) -> str | None:
    if not _FOLDER_NAME.fullmatch(value):
        return (
            "must be letters, digits, '.', '_' or '-', starting with a letter or digit "
            f"(it names a folder), not {value!r}"
        )
    return None


def absolute_problem(value: str) -> str | None:
    if control_problem(value):
        return control_problem(value)
    if not value.startswith("/") or posixpath.normpath(value) != value:
        return f"must be a normalised absolute path, not {value!r}"
    return None


def text_problem(value: str) -> str | None:
    return control_problem(value) or ("must not be empty" if not value.strip() else None)


def line_problem(value: str) -> str | None:
    """A value that lands on one line (a Dockerfile label, a RUN line)."""
    if "\n" in value or "\r" in value:
        return f"must be one line, not {value!r}"
    return text_problem(value)  # refuses every other control character


def did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Where:
    """Turns a key path (``jobs[1].port``) into ``file:line: key``: the key's own line
    when the file wrote it, else the nearest enclosing key's."""

    def __init__(self, origin: str, lines: dict[str, int]):
        self.origin = origin
        self.lines = lines

    def line(self, key: str) -> int:
        while key:
            if key in self.lines:
                return self.lines[key]
            parent = re.fullmatch(r"(.*)(\.[^.\[]*|\[\d+\])", key)
            key = parent.group(1) if parent else ""
        return 1

    def fail(self, key: str, problem: str) -> typing.NoReturn:
        raise ConfigError(f"{self.origin}:{self.line(key)}: {_printable(key)}: {problem}")

    def check(self, key: str, problem: str | None) -> None:
        if problem:
            self.fail(key, problem)
