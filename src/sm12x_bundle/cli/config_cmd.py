"""``sm12x-bundle config show`` and ``config init [FILE]``: the configuration itself.

``show`` prints the effective configuration (the one every other command would use) as YAML,
each value with where it came from (config/show.py). ``init`` writes the embedded default to a
new file, to start one's own from; it never replaces a file.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .. import config as config_mod
from ..config.show import render
from ..context import Context
from ..errors import OutputError, environment_problem
from .command import Command


def show(ctx: Context, args: argparse.Namespace) -> int:
    # Read again, keeping each key's line; the same file the command line named or found.
    config, lines = config_mod.load_located(args.config)
    print(render(config, lines), end="")
    return 0


def init(ctx: Context, args: argparse.Namespace) -> int:
    path = Path(args.file)
    if os.path.lexists(path):  # a link too, even one that points nowhere
        raise OutputError(f"{path} already exists: config init never replaces a file (move it away, or name another)")
    try:
        # O_EXCL: a file that appears after the check above is not replaced either.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(config_mod.default_text())
    except FileExistsError:
        raise OutputError(f"{path} already exists: config init never replaces a file") from None
    except OSError as exc:
        raise environment_problem(exc, f"write the configuration {path}") from None
    print(f"wrote the embedded default configuration to {path.resolve()}")
    if path.name != config_mod.LOCAL_CONFIG or path.resolve().parent != Path.cwd().resolve():
        print(f"use it with --config {path} (or name it ./{config_mod.LOCAL_CONFIG})")
    return 0


def run(ctx: Context, args: argparse.Namespace) -> int:
    return args.action(ctx, args)


def _common(p: argparse.ArgumentParser) -> None:
    """--config and -q after the action too; SUPPRESS keeps what was given before it."""
    p.add_argument("--config", type=Path, metavar="FILE", default=argparse.SUPPRESS,
                   help="configuration file (YAML)")
    p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help="quiet")


def _action(actions, name: str, help_text: str, codes: dict[int, str | None]) -> argparse.ArgumentParser:
    """One action's parser, its --help with the examples and the exit codes it can return."""
    table = Command(name, help_text, EXAMPLES, _common, run, codes).exit_code_table()
    p = actions.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".",
                           epilog=EXAMPLES + "\n\n" + table, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    return p


def _arguments(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    s = _action(actions, "show", SHOW_HELP, {})
    s.set_defaults(action=show)
    i = _action(actions, "init", INIT_HELP, CONFIG.exit_codes)
    i.add_argument("file", nargs="?", default=config_mod.LOCAL_CONFIG, metavar="FILE",
                   help=f"where to write it (default: ./{config_mod.LOCAL_CONFIG}, which every command then reads)")
    i.set_defaults(action=init)


SHOW_HELP = ("print the effective configuration as YAML, each value with where it came from: a line of "
             "the file (or of the embedded default), or the tool's built-in default")
INIT_HELP = "write the embedded default configuration to a new file FILE, to edit; an existing file is refused"
EXAMPLES = ("example: sm12x-bundle config show                  # what build would use here\n"
            "         sm12x-bundle config init                  # ./sm12x-bundle.yaml, then edit it\n"
            "         sm12x-bundle config init site.yaml && sm12x-bundle config show --config site.yaml")

CONFIG = Command(
    "config",
    "show the effective configuration (config show) or start one from the embedded default (config init [FILE])",
    EXAMPLES,
    _arguments,
    run,
    {11: "config init: FILE already exists (it is never replaced); nothing was written"},
)
