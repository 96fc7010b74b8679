"""The ``sm12x-bundle`` command: parse arguments, resolve the config once, run one step.

The pipeline is pin -> series -> outputs (tree, overlays, image, Nomad), with checks
beside it. Each subcommand is a short function over a :class:`Context`; library code
raises typed errors and only :func:`main` turns them into a sentence and an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import textwrap
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import __version__, arguments, cmd
from . import config as config_mod
from .checks import check as check_mod
from .checks import report
from .context import Context
from .errors import BundleError, ConfigError, environment_problem, is_environment
from .fsutil import add_force_argument, write_file
from .progress import Progress
from .series.lane import Lane, known_fixes

# What each exit code means; a command's --help lists only the codes it can return
# (EXIT_CODES here and in each plugin module), in its own words where it has them.
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
    20: "check: some patch conflicts",
}
# Every command can exit 0, 2 (the command line, or a bug), 3 (the configuration) and 12
# (this machine: a path it cannot read or write, a missing tool).
COMMON_CODES = (0, 2, 3, 12)

EXIT_CODES: dict[str, dict[int, str | None]] = {
    "series": {5: None},
    "check": {
        0: "every patch applies (a fix a lane does not carry because it landed upstream counts as fine)",
        2: "could not run: a malformed command line, an unknown --lane, a --vllm release below every "
        "lane (nothing fetched), or an unexpected failure (a bug)",
        10: "no conflict, but some patch a lane carries has landed upstream",
        20: "some patch conflicts, or a lane lacks a fix that has not landed upstream in the release checked",
        4: "could not run: a release could not be fetched or verified",
        5: None,
    },
    "apply": {2: "could not run: a malformed command line, an unknown --lane (nothing written), or an "
              "unexpected failure (a bug)", 4: None, 5: None, 6: None, 11: None},
    "fetch": {4: None},
}


def exit_code_table(codes: dict[int, str | None]) -> str:
    """The 'exit codes:' block of one command's --help (None: the common meaning)."""
    merged: dict[int, str | None] = {c: None for c in COMMON_CODES}
    merged.update(codes)
    return "exit codes:\n" + _rows({c: merged[c] or MEANINGS[c] for c in merged})


def _all_codes_table() -> str:
    return "exit codes (each command's --help lists its own):\n" + _rows(MEANINGS)


def _rows(meanings: dict[int, str]) -> str:
    return "".join(
        textwrap.fill(text, width=92, initial_indent=f"  {code:<4}", subsequent_indent=" " * 6) + "\n"
        for code, text in sorted(meanings.items())
    )


DESCRIPTION = """\
Build a patched vLLM for consumer Blackwell (SM120/SM121) sleep-mode rotation pools.

The pipeline: the pin (a vLLM sdist from PyPI, verified by sha256) -> the series
(patches/series) -> outputs: the patched tree, per-file overlays, the bundle image
and Nomad job specs. 'check' reports, for any vLLM release, which patches apply,
which conflict and which have landed upstream.

Configuration: the embedded default, replaced by ./sm12x-bundle.yaml when present,
replaced by --config FILE when given.
"""


def _lane_for_release(ctx: Context, version: str, named: str | None) -> Lane:
    """The lane ``--vllm VERSION`` is checked with, said on stderr with the reason."""
    if named:
        lane, why = ctx.named_lane(named), "named by --lane"
    else:
        lane, why = ctx.lane_for(version), f"the nearest lane at or below {version}"
    if lane is None:
        raise BundleError(
            f"--vllm {version} is below every lane (the lanes: {ctx.lane_versions}), so no series is "
            "written for it: name one with --lane"
        )
    ctx.progress.say(f"check: vLLM {version} with lane {lane.version} ({why})")
    return lane


def check_runs(ctx: Context, vllm: list[str] | None, named: str | None) -> list[tuple[Lane, str]]:
    """(lane, release) pairs to check: each --vllm release with its lane; without --vllm,
    every lane (or the one --lane names) at its own pin, plus each check.versions release
    with the lane nearest at or below it."""
    if vllm:
        return [(_lane_for_release(ctx, v, named), v) for v in dict.fromkeys(vllm)]
    lanes = [ctx.named_lane(named)] if named else list(ctx.lanes)
    runs = [(lane, lane.version) for lane in lanes]
    for v in ctx.config.check.versions:
        lane = ctx.lane_for(v)
        if lane in lanes and (lane, v) not in runs:
            runs.append((lane, v))
    return runs


def _check_run(ctx: Context, lane: Lane, version: str, fixes: dict, fuzz: int) -> check_mod.VersionReport:
    try:
        source = ctx.source(version)
    except BundleError as exc:
        return check_mod.VersionReport(version, "-", None, error=str(exc), error_code=exc.exit_code, lane=lane.version)
    return check_mod.check_lane(lane, source, fixes, fuzz)


def cmd_check(ctx: Context, args: argparse.Namespace) -> int:
    runs = check_runs(ctx, args.vllm, args.lane)  # every series parsed, every lane chosen, before any download
    fixes = known_fixes(ctx.lanes)
    fuzz = ctx.config.check.fuzz if args.fuzz is None else args.fuzz
    with ThreadPoolExecutor(max_workers=min(4, len(runs))) as pool:
        reports = list(pool.map(lambda run: _check_run(ctx, *run, fixes, fuzz), runs))
    if args.junit:
        write_file(Path(args.junit), report.to_junit(reports).encode(), what="JUnit report")
    sys.stdout.write(report.to_json(reports) if args.json else report.table(reports))
    return check_mod.exit_code(reports)


def cmd_apply(ctx: Context, args: argparse.Namespace) -> int:
    from .fsutil import check_replaceable, refuse_protected
    from .outputs.tree import write_tree

    lane = ctx.named_lane(args.lane)
    out = refuse_protected(args.out)
    check_replaceable(out, args.force)  # before any download
    source = ctx.source(lane.version)
    result = write_tree(lane.series, source, out, ctx.config.check.fuzz, args.force)
    for res in result.results:
        ctx.progress.say(f"{res.patch}: {res.summary()}")
    print(f"patched vLLM {source.version} tree written to {out}")
    return 0


def cmd_series(ctx: Context, args: argparse.Namespace) -> int:
    sys.stdout.write(report.series_markdown(ctx.lanes) if args.markdown else report.series_table(ctx.lanes))
    return 0


def cmd_fetch(ctx: Context, args: argparse.Namespace) -> int:
    source = ctx.source(args.vllm)
    print(source.root)
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="FILE", help="configuration file (YAML)")
    p.add_argument("-q", "--quiet", action="store_true", help="quiet: nothing on stderr but errors (no progress, no command lines)")


def _commands() -> dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable]]:
    """name -> (help, epilog, add_arguments, run)."""

    def check_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--vllm", action="append", type=arguments.version, metavar="VERSION",
                       help="check this vLLM release instead of each lane's pin (repeatable), with the lane "
                       "--lane names, else the lane whose pin is nearest at or below it")
        p.add_argument("--lane", type=arguments.version, metavar="VERSION",
                       help="check only this lane (named by its pin's version): at its pin, or against each --vllm")
        p.add_argument("--json", action="store_true", help="print JSON instead of the table")
        p.add_argument("--junit", type=arguments.writable_file, metavar="FILE",
                       help="also write a JUnit XML report to FILE")
        p.add_argument("--fuzz", type=arguments.non_negative_int, metavar="N",
                       help="context lines a hunk may ignore, 0 or more (default: check.fuzz, 0)")

    def apply_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", required=True, metavar="DIR", help="where to write the patched tree")
        p.add_argument("--lane", type=arguments.version, metavar="VERSION",
                       help="the lane to write (named by its pin's version; default: the config's first lane; "
                       "'build' writes every lane's tree)")
        add_force_argument(p, "replace DIR even if it holds files this tool did not write")

    def fetch_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--vllm", type=arguments.version, metavar="VERSION",
                       help="fetch this release instead of the pin")

    def series_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--markdown", action="store_true", help="print the README's patch table")

    commands = {
        "series": (
            "list the patches in order: kind, files, upstream PR and status",
            "example: sm12x-bundle series --markdown",
            series_args,
            cmd_series,
        ),
        "check": (
            "report, for each lane, which patches apply, conflict, or have landed upstream",
            "By default every lane is checked against its own pin, plus each check.versions release\n"
            "against the lane nearest at or below it. A fix the shipped layout knows (another lane's\n"
            "patch, or patches/fixes/<fix>/upstream) that a lane does not carry gets a row: 'not\n"
            "carried: landed upstream (probe|reverse-apply)', or 'not carried, and not landed\n"
            "upstream' (exit 20). Where a fix's probes disagree, a row adds 'partly landed upstream:\n"
            "PATH::QUALNAME; not landed: PATH::QUALNAME' (the exit code stays the patch's own).\n\n"
            "example: sm12x-bundle check\n"
            "         sm12x-bundle check --vllm 0.26.0 --junit check.xml   # with lane 0.21.0\n"
            "         sm12x-bundle check --lane 0.33.0 --vllm 0.26.0",
            check_args,
            cmd_check,
        ),
        "apply": (
            "write the patched tree (atomically: all of it or nothing)",
            "example: sm12x-bundle apply --out build/vllm-patched\n"
            "         sm12x-bundle apply --lane 0.33.0 --out build/vllm-0.33.0-patched",
            apply_args,
            cmd_apply,
        ),
        "fetch": (
            "download and verify a vLLM sdist into the cache; print the tree's path",
            "example: sm12x-bundle fetch --vllm 0.26.0",
            fetch_args,
            cmd_fetch,
        ),
    }
    for name in PLUGINS:
        commands.update(importlib.import_module(f"sm12x_bundle.{name}").COMMANDS)
    return commands


def command_exit_codes() -> dict[str, dict[int, str | None]]:
    """Each command's own exit codes: the built-in ones, then each plugin module's EXIT_CODES."""
    codes = dict(EXIT_CODES)
    for name in PLUGINS:
        codes.update(importlib.import_module(f"sm12x_bundle.{name}").EXIT_CODES)
    return codes


# Output steps and the selftest register their own subcommands: each module has
# COMMANDS = {name: (help, epilog, add_arguments(parser), run(ctx, args) -> int)}.
PLUGINS = ("outputs.overlay", "outputs.image", "outputs.nomad", "selftest", "enginecheck.command", "pipeline")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sm12x-bundle",
        description=DESCRIPTION,
        epilog=_all_codes_table(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    codes = command_exit_codes()
    for name, (help_text, epilog, add_args, run) in _commands().items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text[0].upper() + help_text[1:] + ".",
            epilog=epilog + "\n\n" + exit_code_table(codes[name]),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_common(p)
        add_args(p)
        p.set_defaults(run=run, command_parser=p)
    return parser


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
    print(f"sm12x-bundle: error: unexpected failure, a bug in sm12x-bundle: {what}{where}; the full trace is {saved}",
          file=sys.stderr)
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
    print(f"sm12x-bundle: error: {what}", file=sys.stderr)
    return what.exit_code


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        # A malformed command line exits 2 here, before anything runs; a report path this
        # machine will not let us write raises EnvironmentProblem (exit 12), also before.
        args = parse_args(parser, argv)
        config = config_mod.load(args.config)
        progress = Progress.quiet() if args.quiet else Progress.stderr()
        with cmd.echo_commands(not args.quiet):
            return args.run(Context(config, progress), args)
    except BundleError as exc:
        print(f"sm12x-bundle: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("sm12x-bundle: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:  # the last line of defence: each step names its own paths first
        if exc.filename is None and not is_environment(exc) and not isinstance(exc, shutil.Error):
            return _unexpected(exc)
        return _environment(exc)
    except Exception as exc:  # noqa: BLE001 - a user sees a sentence, never a traceback
        return _unexpected(exc)


__all__ = ["main", "build_parser", "ConfigError"]
