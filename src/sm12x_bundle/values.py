"""The value checks shared by the config file and the command line, so that ``--vllm ''``
and ``pin.version: ''`` get the same sentence; and :class:`Where`, which names a config
value as ``file:line: key``.

A leaf: it imports nothing of the package but its errors (config, jobs and the CLI's
argument types import it).
"""

from __future__ import annotations

import difflib
import posixpath
import re
import typing
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
    if not value.startswith("/") or posixpath.normpath(value) != value:
        return f"must be a normalised absolute path, not {value!r}"
    return None


def text_problem(value: str) -> str | None:
    return "must not be empty" if not value.strip() else None


def line_problem(value: str) -> str | None:
    """A value that lands on one line (a Dockerfile label, a RUN line)."""
    if "\n" in value or "\r" in value:
        return f"must be one line, not {value!r}"
    return text_problem(value)


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
        raise ConfigError(f"{self.origin}:{self.line(key)}: {key}: {problem}")

    def check(self, key: str, problem: str | None) -> None:
        if problem:
            self.fail(key, problem)
