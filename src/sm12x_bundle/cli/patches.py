"""The commands about the lanes' patches themselves: ``series``, ``check``, ``apply``, ``fetch``."""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..checks import check as check_mod
from ..checks import report
from ..context import Context
from ..errors import BundleError
from ..fsutil import check_replaceable, refuse_overlap, refuse_protected, write_file
from ..outputs.tree import write_tree
from ..series.lane import Fix, Lane, known_fixes
from . import arguments
from .command import Command, add_force_argument

# --- check ----------------------------------------------------------------------------------


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


def _check_run(ctx: Context, lane: Lane, version: str, fixes: dict[str, Fix], fuzz: int) -> check_mod.VersionReport:
    try:
        source = ctx.source(version)
    except BundleError as exc:
        return check_mod.VersionReport(version, "-", None, error=str(exc), error_code=exc.exit_code, lane=lane.version)
    return check_mod.check_lane(lane, source, fixes, fuzz)


def run_check(ctx: Context, args: argparse.Namespace) -> int:
    runs = check_runs(ctx, args.vllm, args.lane)  # every series parsed, every lane chosen, before any download
    fixes = known_fixes(ctx.lanes)
    fuzz = ctx.config.check.fuzz if args.fuzz is None else args.fuzz
    with ThreadPoolExecutor(max_workers=min(4, len(runs))) as pool:
        reports = list(pool.map(lambda run: _check_run(ctx, *run, fixes, fuzz), runs))
    if args.junit:
        write_file(Path(args.junit), report.to_junit(reports).encode(), what="JUnit report")
    sys.stdout.write(report.to_json(reports) if args.json else report.table(reports))
    return check_mod.exit_code(reports)


def _check_arguments(p: argparse.ArgumentParser) -> None:
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


CHECK = Command(
    "check",
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
    _check_arguments,
    run_check,
    {
        0: "every patch applies (a fix a lane does not carry because it landed upstream counts as fine)",
        2: "could not run: a malformed command line, an unknown --lane, a --vllm release below every "
        "lane (nothing fetched), or an unexpected failure (a bug)",
        10: "no conflict, but some patch a lane carries has landed upstream",
        20: "some patch conflicts, or a lane lacks a fix that has not landed upstream in the release checked",
        4: "could not run: a release could not be fetched or verified",
        5: None,
    },
)


# --- apply, series, fetch -------------------------------------------------------------------


def run_apply(ctx: Context, args: argparse.Namespace) -> int:
    lane = ctx.named_lane(args.lane)
    out = refuse_protected(args.out)
    refuse_overlap(out, ctx.inputs())
    check_replaceable(out, args.force)  # before any download
    source = ctx.source(lane.version)
    result = write_tree(lane.series, source, out, ctx.config.check.fuzz, args.force)
    for res in result.results:
        ctx.progress.say(f"{res.patch}: {res.summary()}")
    print(f"patched vLLM {source.version} tree written to {out}")
    return 0


def _apply_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, metavar="DIR", help="where to write the patched tree")
    p.add_argument("--lane", type=arguments.version, metavar="VERSION",
                   help="the lane to write (named by its pin's version; default: the config's first lane; "
                   "'build' writes every lane's tree)")
    add_force_argument(p, "replace DIR even if it holds files this tool did not write")


APPLY = Command(
    "apply",
    "write the patched tree (atomically: all of it or nothing)",
    "example: sm12x-bundle apply --out build/vllm-patched\n"
    "         sm12x-bundle apply --lane 0.33.0 --out build/vllm-0.33.0-patched",
    _apply_arguments,
    run_apply,
    {2: "could not run: a malformed command line, an unknown --lane (nothing written), or an "
        "unexpected failure (a bug)", 4: None, 5: None, 6: None, 11: None},
)


def run_series(ctx: Context, args: argparse.Namespace) -> int:
    sys.stdout.write(report.series_markdown(ctx.lanes) if args.markdown else report.series_table(ctx.lanes))
    return 0


def _series_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--markdown", action="store_true", help="print the README's patch table")


SERIES = Command(
    "series",
    "list the patches in order: kind, files, upstream PR and status",
    "example: sm12x-bundle series --markdown",
    _series_arguments,
    run_series,
    {5: None},
)


def run_fetch(ctx: Context, args: argparse.Namespace) -> int:
    print(ctx.source(args.vllm).root)
    return 0


def _fetch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm", type=arguments.version, metavar="VERSION", help="fetch this release instead of the pin")


FETCH = Command(
    "fetch",
    "download and verify a vLLM sdist into the cache; print the tree's path",
    "example: sm12x-bundle fetch --vllm 0.26.0",
    _fetch_arguments,
    run_fetch,
    {4: None},
)
