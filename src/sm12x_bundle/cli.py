"""The ``sm12x-bundle`` command: parse arguments, resolve the config once, run one step.

The pipeline is pin -> series -> outputs (tree, overlays, image, Nomad), with checks
beside it. Each subcommand is a short function over a :class:`Context`; library code
raises typed errors and only :func:`main` turns them into a sentence and an exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import __version__
from . import config as config_mod
from .checks import check as check_mod
from .checks import report
from .context import Context
from .errors import BundleError, ConfigError
from .fsutil import write_file
from .progress import Progress

EXIT_CODES = """\
exit codes:
  0   success (check: every patch applies)
  10  check: no conflict, but some patch has landed upstream
  20  check: some patch conflicts
  2   could not run: an unexpected failure
  3   could not run: the configuration is malformed
  4   could not run: the pinned source could not be fetched or verified
  5   could not run: the patch series is malformed or unsafe
  6   apply/overlay/image: a patch does not apply
  7   could not run: an external command (compiler, docker) failed
  8   could not run: the container engine is unreachable or refused
  9   a built artifact failed its verification
"""

DESCRIPTION = """\
Build a patched vLLM for consumer Blackwell (SM120/SM121) sleep-mode rotation pools.

The pipeline: the pin (a vLLM sdist from PyPI, verified by sha256) -> the series
(patches/series) -> outputs: the patched tree, per-file overlays, the bundle image
and Nomad job specs. 'check' reports, for any vLLM release, which patches apply,
which conflict and which have landed upstream.

Configuration: the embedded default, replaced by ./sm12x-bundle.yaml when present,
replaced by --config FILE when given.
"""


def _check_source(ctx: Context, version: str | None, fuzz: int) -> check_mod.VersionReport:
    label = version or ctx.config.pin.version
    try:
        source = ctx.source(version)
    except BundleError as exc:
        return check_mod.VersionReport(label, "-", None, error=str(exc), error_code=exc.exit_code)
    return check_mod.check_tree(ctx.series, source, fuzz)


def cmd_check(ctx: Context, args: argparse.Namespace) -> int:
    versions: list[str | None] = [None]
    for v in list(ctx.config.check.versions) + (args.vllm or []):
        if v != ctx.config.pin.version and v not in versions:
            versions.append(v)
    fuzz = ctx.config.check.fuzz if args.fuzz is None else args.fuzz
    ctx.series  # parse (and refuse an unsafe series) before any download
    with ThreadPoolExecutor(max_workers=min(4, len(versions))) as pool:
        reports = list(pool.map(lambda v: _check_source(ctx, v, fuzz), versions))
    if args.junit:
        write_file(Path(args.junit), report.to_junit(reports).encode())
    sys.stdout.write(report.to_json(reports) if args.json else report.table(reports))
    return check_mod.exit_code(reports)


def cmd_apply(ctx: Context, args: argparse.Namespace) -> int:
    from .outputs.tree import write_tree

    source = ctx.source()
    out = Path(args.out)
    result = write_tree(ctx.series, source, out, ctx.config.check.fuzz)
    for res in result.results:
        ctx.progress.say(f"{res.patch}: {res.summary()}")
    print(f"patched vLLM {source.version} tree written to {out}")
    return 0


def cmd_series(ctx: Context, args: argparse.Namespace) -> int:
    sys.stdout.write(report.series_markdown(ctx.series) if args.markdown else report.series_table(ctx.series))
    return 0


def cmd_fetch(ctx: Context, args: argparse.Namespace) -> int:
    source = ctx.source(args.vllm)
    print(source.root)
    return 0


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, metavar="FILE", help="configuration file (YAML)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output on stderr")


def _commands() -> dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable]]:
    """name -> (help, epilog, add_arguments, run)."""

    def check_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--vllm", action="append", metavar="VERSION", help="also check this vLLM release (repeatable)")
        p.add_argument("--json", action="store_true", help="print JSON instead of the table")
        p.add_argument("--junit", metavar="FILE", help="also write a JUnit XML report to FILE")
        p.add_argument("--fuzz", type=int, help="context lines a hunk may ignore (default 0)")

    def apply_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", required=True, metavar="DIR", help="where to write the patched tree")

    def fetch_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--vllm", metavar="VERSION", help="fetch this release instead of the pin")

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
            "report which patches apply, conflict, or have landed upstream",
            "example: sm12x-bundle check --vllm 0.26.0 --vllm 0.33.0 --junit check.xml",
            check_args,
            cmd_check,
        ),
        "apply": (
            "write the patched tree (atomically: all of it or nothing)",
            "example: sm12x-bundle apply --out build/vllm-patched",
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


# Output steps and the selftest register their own subcommands: each module has
# COMMANDS = {name: (help, epilog, add_arguments(parser), run(ctx, args) -> int)}.
PLUGINS = ("outputs.overlay", "outputs.image", "outputs.nomad", "selftest", "pipeline")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sm12x-bundle",
        description=DESCRIPTION,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, epilog, add_args, run) in _commands().items():
        p = sub.add_parser(
            name,
            help=help_text,
            description=help_text[0].upper() + help_text[1:] + ".",
            epilog=epilog + "\n\n" + EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _add_common(p)
        add_args(p)
        p.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_mod.load(args.config)
        progress = Progress.quiet() if args.quiet else Progress.stderr()
        return args.run(Context(config, progress), args)
    except BundleError as exc:
        print(f"sm12x-bundle: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("sm12x-bundle: interrupted", file=sys.stderr)
        return 130


__all__ = ["main", "build_parser", "ConfigError"]
