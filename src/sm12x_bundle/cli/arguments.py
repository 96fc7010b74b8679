"""Command-line value types: each refuses a bad value with one sentence while argparse
parses, so nothing has run and nothing is written when a value is wrong.

argparse turns the sentence into ``sm12x-bundle CMD: error: argument --X: SENTENCE``
and exit code 2, the code for a malformed command line. A well-formed path this machine
will not let the tool write (a read-only folder, /proc) is EnvironmentProblem instead (exit
12), raised while parsing too, so nothing has run either. The checks shared with the
configuration (versions, image references, digests, paths) come from values.py, as the
config's do, so an option and the key it overrides are refused in the same words.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from .. import fsutil, values
from ..errors import ConfigError, EnvironmentProblem


def _from(problem: Callable[[str], str | None]) -> Callable[[str], str]:
    def check(value: str) -> str:
        sentence = problem(value)
        if sentence:
            raise argparse.ArgumentTypeError(sentence)
        return value

    return check


def known_by(select: Callable[[list[str]], object]) -> Callable[[str], str]:
    """A name that ``select`` knows (a scenario), refused in select's own words (its ConfigError)."""

    def check(value: str) -> str:
        try:
            select([value])
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return check


version = _from(values.version_problem)
image_ref = _from(values.image_problem)
image_tag = _from(lambda v: values.image_problem(v, digest_allowed=False))
digest = _from(values.digest_problem)
absolute_path = _from(values.absolute_problem)
text = _from(values.text_problem)
line = _from(values.line_problem)
shell_line = _from(values.shell_line_problem)
folder_name = _from(values.folder_name_problem)


def _number(kind: type, value: str) -> int | float:
    try:
        return kind(value)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"must be {what}, not {value!r}") from None


def non_negative_int(value: str) -> int:
    n = _number(int, value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {n}")
    return int(n)


def positive_int(value: str) -> int:
    n = _number(int, value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {n}")
    return int(n)


def positive_float(value: str) -> float:
    x = _number(float, value)
    if not x > 0 or x == float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a positive number, not {value}")
    return float(x)


def non_negative_float(value: str) -> float:
    x = _number(float, value)
    if not 0 <= x < float("inf"):  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {value}")
    return float(x)


def fraction(value: str) -> float:
    x = _number(float, value)
    if not 0 < x <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], not {value}")
    return float(x)


def existing_file(value: str) -> Path:
    path = Path(value)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{value!r} is not a file" if path.exists() else f"{value!r} does not exist")
    return path


def existing_folder(value: str) -> Path:
    path = Path(value)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is not a folder" if path.exists() else f"{value!r} does not exist")
    return path


def folder_path(value: str) -> Path:
    """A folder that may not exist yet, but whose path is not a file."""
    if not value.strip():
        raise argparse.ArgumentTypeError("must name a folder, not ''")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a file, not a folder")
    return path


def writable_file(value: str) -> Path:
    """A file path to write a report to: a new file or a regular one (never a folder, a
    device such as /dev/null, a FIFO or a socket, links followed: exit 2), under a folder
    this machine lets the tool write (else EnvironmentProblem, exit 12, also before anything runs)."""
    if not value.strip() or value.endswith(("/", os.sep)):
        raise argparse.ArgumentTypeError(f"must name a file, not {value!r}")
    path = Path(value)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{value!r} is a folder: name a file in it, e.g. {path / 'report.xml'}")
    problem = fsutil.not_a_file(path)
    if problem:
        raise argparse.ArgumentTypeError(f"{value!r} {problem}, not a regular file: name a new file or a regular one")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {value!r}: {parent} is a file, not a folder")
    fsutil.check_parent(path, "report")  # not under /proc or /sys
    if not os.access(parent, os.W_OK | os.X_OK):  # also false for root on a read-only file system
        raise EnvironmentProblem(f"cannot write the report {value}: the folder {parent} is {_why_unwritable(parent)}")
    return path


def _why_unwritable(folder: Path) -> str:
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        return "on a read-only file system"
    return "not writable (Permission denied)"


def http_url(value: str) -> str:
    """An http:// or https:// address with a host (a vLLM server's base URL)."""
    from urllib.parse import urlsplit

    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c in value for c in "\r\n\t "):
        raise argparse.ArgumentTypeError(f"must be an http:// or https:// address such as http://127.0.0.1:8000, "
                                         f"not {value!r}")
    return value.rstrip("/")
