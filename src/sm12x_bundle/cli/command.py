"""What every subcommand is made of, and the words its --help shares with the others.

A :class:`Command` is one subcommand: its help, an epilog that teaches (examples), the
options it adds, the function it runs over a :class:`~sm12x_bundle.context.Context`, and
the exit codes it can return in its own words. The exit codes' common meanings live here
once, so every --help and the README's table say the same (tests/test_cli.py).
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..context import Context

# What each exit code means; a command's --help lists only the codes it can return, in its
# own words where it has them.
MEANINGS = {
    0: "success",
    2: "could not run: a malformed command line (a usage error or a refused option value; nothing "
    "ran), or an unexpected failure (a bug; the message says where its trace was written)",
    3: "could not run: the configuration is malformed (the message names file:line: key)",
    4: "could not run: the pinned source could not be fetched or verified",
    5: "could not run: the patch series is malformed or unsafe",
    6: "a patch does not apply",
    7: "an external command (compiler, docker) failed",
    8: "the container engine is unreachable or refused",
    9: "a built artifact failed its verification",
    10: "check: no conflict, but some patch has landed upstream",
    11: "an output path is refused (it holds files this tool did not write, or it is a protected "
    "folder, a mount point, or a device, FIFO or socket where a file goes): nothing was written",
    12: "this machine stands in the way: a path it cannot read or write (a read-only or full file "
    "system, permissions, /proc or /sys), something other than a folder where one must be, or a "
    "compiler or header a step needs is missing (the message names the path or the tool)",
    13: "--require-tool: this sm12x-bundle is not the one that rendered the job (the message names both "
    "fingerprints); nothing ran",
    20: "check: some patch conflicts",
}
# Every command can exit 0, 2 (the command line, or a bug), 3 (the configuration) and 12
# (this machine: a path it cannot read or write, a missing tool).
COMMON_CODES = (0, 2, 3, 12)

Run = Callable[[Context, argparse.Namespace], int]


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    epilog: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Run
    exit_codes: dict[int, str | None] = field(default_factory=dict)  # None: the common meaning

    def exit_code_table(self) -> str:
        """The 'exit codes:' block of this command's --help."""
        merged: dict[int, str | None] = {c: None for c in COMMON_CODES}
        merged.update(self.exit_codes)
        return "exit codes:\n" + rows({c: merged[c] or MEANINGS[c] for c in merged})


def rows(meanings: dict[int, str]) -> str:
    return "".join(
        textwrap.fill(text, width=92, initial_indent=f"  {code:<4}", subsequent_indent=" " * 6) + "\n"
        for code, text in sorted(meanings.items())
    )


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="FILE", help="configuration file (YAML)")
    p.add_argument("-q", "--quiet", action="store_true",
                   help="quiet: nothing on stderr but errors (no progress, no command lines)")


def add_force_argument(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--force``, worded the same for every command that writes an output folder."""
    parser.add_argument(
        "--force",
        action="store_true",
        help=f"{help_text}; without it such a folder is refused (exit 11). '', '.', '~', '/', the "
        "system's top-level folders (/etc, /usr, ...), the folders above the working directory or home, "
        "mount points and folders that hold one are refused even with it",
    )
