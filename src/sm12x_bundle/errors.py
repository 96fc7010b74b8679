"""Typed errors. Each kind of failure has its own exit code, documented in --help.

Library code raises these; only ``cli.main`` turns them into a message and an exit code.
"""

from __future__ import annotations

import errno
import re


class BundleError(Exception):
    """Base class: a failure the operator can act on. The message is one sentence."""

    exit_code = 2


class ConfigError(BundleError):
    """The configuration file (or a command-line override) is malformed."""

    exit_code = 3


class FetchError(BundleError):
    """The pinned source could not be fetched, verified or extracted."""

    exit_code = 4


class SeriesError(BundleError):
    """The patch series is malformed or unsafe."""

    exit_code = 5


class ApplyError(BundleError):
    """A patch does not apply to the tree it must apply to."""

    exit_code = 6


class CommandError(BundleError):
    """An external command (compiler, docker) failed."""

    exit_code = 7


class EngineError(BundleError):
    """The container engine is unreachable or refused an operation."""

    exit_code = 8


class VerifyError(BundleError):
    """A built artifact failed its check (hash, compile, import, pre-image)."""

    exit_code = 9


class EnvironmentProblem(BundleError):
    """This machine stands in the way, not the input and not the tool: a path that cannot be
    read or written (permissions, a read-only or full file system, something other than a
    regular file or folder where one must be), or a compiler, header or daemon a step needs
    is missing. The message names the path or the tool and the system's own words."""

    exit_code = 12


class OutputError(BundleError):
    """An output path is refused: it holds files this tool did not write, or it is
    the working directory, the home folder, the root or a folder above the working
    directory. Nothing was written."""

    exit_code = 11


class ToolMismatch(BundleError):
    """``--require-tool``: the sm12x-bundle running is not the one that rendered the job (its
    version or files differ). Nothing ran."""

    exit_code = 13


# What the machine does to a write or a read, never what the input or the tool does: a full
# or read-only file system, permissions, quotas, a failing disk, no descriptors left.
ENVIRONMENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EMFILE, errno.ENFILE,
     errno.EBUSY, errno.EXDEV, errno.ETXTBSY}
)


def is_environment(exc: OSError) -> bool:
    """Whether an OSError is this machine's doing (a full disk), not the input's (a name too long)."""
    return exc.errno in ENVIRONMENT_ERRNOS


def environment_problem(exc: OSError, doing: str) -> EnvironmentProblem:
    """One sentence for an OSError: what was being done (``doing``: 'write the patched tree
    build/x'), the path the system names and its own words. A failed copy of many files
    (shutil.Error, one entry per file) is summed up by its first file and a count."""
    failures = _copy_failures(exc)
    if failures:
        _src, dst, why = failures[0]
        words = re.sub(r"^\[Errno \d+\] |: '.*'$", "", str(why))
        more = f", and {len(failures) - 1} more" if len(failures) > 1 else ""
        return EnvironmentProblem(f"cannot {doing}: {words} (at {dst}{more})")
    words = exc.strerror or str(exc)
    where = f" ({exc.filename})" if exc.filename is not None and str(exc.filename) not in doing else ""
    return EnvironmentProblem(f"cannot {doing}{where}: {words}")


def _copy_failures(exc: OSError) -> list[tuple[str, str, str]]:
    """shutil.Error's entries (source, destination, why), or [] for any other OSError."""
    entries = exc.args[0] if exc.args and isinstance(exc.args[0], list) else []
    return [e for e in entries if isinstance(e, tuple) and len(e) == 3]


# What a terminal takes as a command, not text: C0 controls but newline and tab (ESC starts
# the sequences that move the cursor, retitle the window or rewrite the screen), DEL, C1
# controls (0x9b is a one-byte CSI), the bidirectional overrides that reorder what is shown,
# the line separators and lone surrogates.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]")


def sanitize(text: str) -> str:
    """``text`` safe to print to a terminal: every control character a patch subject, a file
    name or a tree's text may carry is shown as its escape (``\\x1b``), never sent raw.
    Progress lines and error messages go through it."""
    return _UNPRINTABLE.sub(lambda m: repr(m.group())[1:-1] if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)
