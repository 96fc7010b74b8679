"""Reading a file somebody else wrote (a config, a series, a patch): a regular file of
bounded size, read without ever waiting.

The path is looked at before it is opened, so a FIFO, a socket, a device or a folder is
refused by name instead of read: a FIFO blocks until a writer comes, ``/dev/zero`` never
ends. The file is then opened non-blocking and looked at again through its descriptor (the
path may have been swapped in between), and at most ``limit + 1`` bytes are read, so a file
larger than the limit is refused without being read whole.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from .errors import BundleError

MIB = 1 << 20

_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
}


def kind(mode: int) -> str:
    """What a stat mode names, in words ("a folder", "a FIFO (named pipe)", ...)."""
    return "a regular file" if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be read as a file, in words that follow its name; None: it can."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except NotADirectoryError:
        return "does not exist (one of the folders on its way is a file)"
    except OSError as exc:
        return f"is out of reach ({exc.strerror})"
    return None if stat.S_ISREG(mode) else f"is {kind(mode)}, not a regular file"


def read_bounded(path: Path, limit: int, error: type[BundleError], what: str) -> bytes:
    """The bytes of the regular file ``path`` (at most ``limit``), or ``error`` with one
    sentence naming ``what`` and the path."""
    problem = file_problem(path)
    if problem:
        raise error(f"cannot read {what} {path}: it {problem}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # swapped since it was looked at
            raise error(f"cannot read {what} {path}: it is {kind(mode)}, not a regular file")
        data = _read_up_to(fd, limit + 1)
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise error(f"{what} {path} is larger than {_size(limit)}: refused")
    return data


def _read_up_to(fd: int, count: int) -> bytes:
    chunks, left = [], count
    while left > 0:
        chunk = os.read(fd, min(left, MIB))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _size(limit: int) -> str:
    return f"{limit // MIB} MiB" if limit % MIB == 0 else f"{limit} bytes"


def decode_utf8(data: bytes, error: type[BundleError], path: Path) -> str:
    """``data`` (read from ``path``) as text, or ``error`` naming the file, the line and the
    first byte that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise error(f"{path} is not UTF-8 text (line {line}, byte {exc.start}: {data[exc.start]:#04x})") from None


def parse_json(data: bytes, error: type[BundleError], path: Path, what: str) -> Any:
    """``data`` (read from ``path``) as JSON, or ``error`` with one sentence: not UTF-8, not
    JSON (where, never what the file holds), or nested too deeply to read (the parser
    recurses once per level: a few hundred kilobytes of '[' overflow it)."""
    text = decode_utf8(data, error, path)
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{what} {path} is nested too deeply to read: refused") from None
    except json.JSONDecodeError as exc:
        raise error(f"{what} {path} is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise error(f"{what} {path} is not JSON that can be read ({exc})") from None


def read_json(path: Path, limit: int, error: type[BundleError], what: str) -> Any:
    """The JSON document in the regular file ``path`` (at most ``limit`` bytes)."""
    return parse_json(read_bounded(path, limit, error, what), error, path, what)
