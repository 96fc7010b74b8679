"""The ``sm12x-bundle`` command: parse arguments, resolve the config once, run one command.

The pipeline is lanes (pin + series) -> plan -> outputs (tree, overlays, image, Nomad), with
checks beside it. Each subcommand is a :class:`~.command.Command` in a module of this package
(the command line lives here, the work in the packages it calls); library code raises typed
errors and only :func:`main` turns them into a sentence and an exit code.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path

from .. import __version__, cmd
from .. import config as config_mod
from ..context import Context
from ..errors import BundleError, EnvironmentProblem, ToolMismatch, environment_problem, is_environment, sanitize
from ..fingerprint import tool_fingerprint
from ..progress import Progress
from .build import BUILD
from .command import COMMON_CODES, MEANINGS, Command, add_common, rows
from .config_cmd import CONFIG
from .engine_check import ENGINE_CHECK
from .image import IMAGE
from .nomad import NOMAD
from .overlay import OVERLAY
from .patches import APPLY, CHECK, FETCH, SERIES
from .rotate import ROTATE
from .selftest import SELFTEST

# In the order --help lists them: the patches, the outputs, the proofs, the whole pipeline.
COMMANDS: tuple[Command, ...] = (SERIES, CHECK, APPLY, FETCH, OVERLAY, IMAGE, NOMAD, SELFTEST, ENGINE_CHECK, ROTATE,
                                 BUILD, CONFIG)

DESCRIPTION = """\
Build a patched vLLM for consumer Blackwell (SM120/SM121) sleep-mode rotation pools.

The pipeline: each lane (a pinned vLLM sdist from PyPI, verified by sha256, and the
series written for it) -> the plan for each target -> outputs: the patched tree,
per-file overlays, the bundle image and Nomad job specs. 'check' reports, for any vLLM
release, which patches apply, conflict or have landed upstream; 'selftest' and
'engine-check' prove the fixes on this node's GPU.

Configuration: the embedded default, replaced by ./sm12x-bundle.yaml when present,
replaced by --config FILE when given.
"""


def command_exit_codes() -> dict[str, dict[int, str | None]]:
    """Each command's own exit codes (None: the common meaning)."""
    return {c.name: c.exit_codes for c in COMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sm12x-bundle",
        description=DESCRIPTION,
        epilog="exit codes (each command's --help lists its own):\n" + rows(MEANINGS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--require-tool",
        metavar="FINGERPRINT",
        help="run only if this sm12x-bundle's fingerprint (version and sha256 of its files and series) is "
        "FINGERPRINT, else exit 13 before anything runs; a gated Nomad job's gate passes the fingerprint of "
        "the sm12x-bundle that rendered the job",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in COMMANDS:
        p = sub.add_parser(
            command.name,
            help=command.help,
            description=command.help[0].upper() + command.help[1:] + ".",
            epilog=command.epilog + "\n\n" + command.exit_code_table(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_common(p)
        command.add_arguments(p)
        p.set_defaults(run=command.run, command_parser=p)
    return parser


def require_tool(argv: Sequence[str] | None) -> None:
    """``--require-tool FINGERPRINT``, checked before the rest of the command line: a checkout
    of another version may not know the command's options, and would name those instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    names = {c.name for c in COMMANDS}
    head = argv[: next((i for i, a in enumerate(argv) if a in names), len(argv))]
    pre = argparse.ArgumentParser(prog="sm12x-bundle", add_help=False, allow_abbrev=False)
    pre.add_argument("--require-tool")
    required = pre.parse_known_args(head)[0].require_tool
    if required is None:
        return
    ours = tool_fingerprint()
    if required != ours:
        raise ToolMismatch(
            f"this sm12x-bundle is {ours}, but the job was rendered by {required}: mount a checkout of the "
            "sm12x-bundle that rendered the job, or render the job again with this one"
        )


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """argparse, then the command's own check of options that depend on each other
    (``check_args``, set by its add_arguments); both exit 2 with one sentence."""
    args = parser.parse_args(argv)
    check = getattr(args, "check_args", None)
    problem = check(args) if check else None
    if problem:
        args.command_parser.error(problem)
    return args


def _unexpected(exc: Exception) -> int:
    """A bug: one sentence naming it and where its trace went; SM12X_DEBUG=1 prints the trace."""
    trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    if os.environ.get("SM12X_DEBUG") == "1":
        sys.stderr.write(trace)
        saved = "printed above"
    else:
        saved = _save_trace(trace)
    what = " ".join(f"{type(exc).__name__}: {exc}".split())  # one line, whatever the exception holds
    print(sanitize(f"sm12x-bundle: error: unexpected failure, a bug in sm12x-bundle: {what}{where}; the full trace "
                   f"is {saved}"), file=sys.stderr)
    return BundleError.exit_code


def _save_trace(trace: str) -> str:
    try:
        fd, path = tempfile.mkstemp(prefix="sm12x-bundle-trace-", suffix=".txt")
        with os.fdopen(fd, "w") as fh:
            fh.write(trace)
    except OSError as exc:
        return f"not saved ({exc.strerror}); SM12X_DEBUG=1 prints it here"
    return f"written to {path} (SM12X_DEBUG=1 prints it here)"


def _environment(exc: OSError) -> int:
    """A stray OSError that names a path or is the machine's (a full disk): exit 12, one sentence."""
    what = environment_problem(exc, f"use {exc.filename}" if exc.filename is not None else "go on")
    print(f"sm12x-bundle: error: {sanitize(str(what))}", file=sys.stderr)
    return what.exit_code


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that it unwinds as Ctrl-C does: every scratch
    and staging folder is removed on the way out."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While main runs, SIGTERM raises Terminated (only the main thread may set a handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stdout_gone() -> int:
    """The reader of stdout went away (``sm12x-bundle series | head -1``): nothing is left to
    say to it, so the run ends quietly with 141, as a program that SIGPIPE ends does. stdout
    is pointed at /dev/null so that Python's last flush does not complain."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return BROKEN_PIPE


BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader left


def _working_directory() -> None:
    try:
        os.getcwd()
    except FileNotFoundError:
        raise EnvironmentProblem("the working directory no longer exists (it was deleted): cd to a folder that "
                                 "exists and run again") from None


def main(argv: Sequence[str] | None = None) -> int:
    with _sigterm_unwinds():
        try:
            return _main(argv)
        except BrokenPipeError:
            return _stdout_gone()
        except Terminated:
            print("sm12x-bundle: terminated (SIGTERM)", file=sys.stderr)
            return 128 + signal.SIGTERM


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    try:
        # A malformed command line exits 2 here, before anything runs; a report path this
        # machine will not let us write raises EnvironmentProblem (exit 12), also before.
        require_tool(argv)
        _working_directory()
        args = parse_args(parser, argv)
        config = config_mod.load(args.config)
        progress = Progress.quiet() if args.quiet else Progress.stderr()
        with cmd.echo_commands(not args.quiet):
            code = args.run(Context(config, progress), args)
        sys.stdout.flush()  # a reader that left is found here, not in Python's last flush
        return code
    except BundleError as exc:
        print(f"sm12x-bundle: error: {sanitize(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except Terminated:
        raise
    except KeyboardInterrupt:
        print("sm12x-bundle: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        raise
    except OSError as exc:  # the last line of defence: each step names its own paths first
        if _no_temp_folder(exc):
            return _environment_sentence("no usable temp folder (TMPDIR, /tmp, /var/tmp, the working directory): "
                                         "set TMPDIR to a folder this user can write")
        if exc.filename is None and not is_environment(exc) and not isinstance(exc, shutil.Error):
            return _unexpected(exc)
        return _environment(exc)
    except RuntimeError as exc:
        if str(exc).startswith("Symlink loop"):  # pathlib's word (Python < 3.13) for ELOOP
            return _environment_sentence(f"a path goes through a loop of symbolic links ({exc}): fix the links")
        return _unexpected(exc)
    except Exception as exc:  # noqa: BLE001 - a user sees a sentence, never a traceback
        return _unexpected(exc)


def _no_temp_folder(exc: OSError) -> bool:
    return exc.filename is None and "No usable temporary directory" in str(exc)


def _environment_sentence(text: str) -> int:
    print(f"sm12x-bundle: error: cannot go on: {sanitize(text)}", file=sys.stderr)
    return EnvironmentProblem.exit_code


__all__ = ["COMMANDS", "COMMON_CODES", "build_parser", "command_exit_codes", "main"]
