"""``sm12x-bundle selftest``: prove the cumem fixes on this node's GPU (selftest/ runs it)."""

from __future__ import annotations

import argparse
import dataclasses

from ..context import Context
from ..fsutil import write_file
from ..selftest import Options, plan, report, run_selftest
from . import arguments
from .command import Command

HELP = "prove the cumem fixes on this node's GPU, scenario by scenario"
EPILOG = """\
scenarios (each in its own process; --scenario NAME or NUMBER, repeatable):
  1 inflight-free  a pool tensor is freed while a write into it is still queued
  2 stale-error    a free fails on the PyTorch path, then a healthy wake_up
  3 partial-wake   wake_up fails part-way for lack of memory, then is retried
  4 stress         sleep/wake cycles with work in flight, several tags, varied sizes
  5 speed          sleep/wake GB/s against the pinned-copy ceiling; first-sleep cost
  6 double-wake    wake_up on an awake allocator, then sleep and wake (a regression
                   guard: pristine passes it too)
  7 failing-sleep  sleep() fails at the 4th of 8 pinned backups; tensors used; retried
  8 moe-churn      1-3 GiB transient buffers in the weights pool under a memory budget
                   (max_split_size_mb:20, as vLLM 0.21.0 loads a model)
  9 foreign-process  asleep, another process takes the memory, exits; wake_up retried
 10 fault-stress   10,000 cycles with failures injected at random points (--seed)
 11 first-sleep    the first sleep against the D2H ceiling; host RAM its backups take
 12 rotation       two 24 GiB engines on one GPU swapped in turn: first swap vs steady
 13 ranks          sleep and wake across ranks (one per GPU, or 4 on one GPU): a rank
                   fails (host memory, another process's memory); all ranks or none

examples:
  sm12x-bundle selftest --installed                 # the vLLM of this Python (bundle image)
  sm12x-bundle selftest --compare                   # the pinned tree, then the same tree patched
  sm12x-bundle selftest --compare --lane 0.33.0     # the same for the 0.33.0 lane
  sm12x-bundle selftest --compare PRISTINE PATCHED --json-out selftest.json
  sm12x-bundle selftest --tree build/vllm-patched --scenario stress --cycles 5000"""

EXIT_CODES: dict[int, str | None] = {
    0: "every scenario passes (--compare: the pristine tree fails scenarios 1-3, 7-9 and 11-13 and the "
    "patched tree passes every scenario; 9 only guards on vLLM 0.33.0 and later, whose wake_up resumes)",
    2: "could not run: the command line is malformed, or an unexpected failure (a bug)",
    3: "could not run: the configuration is malformed, or a size does not fit this GPU's free memory",
    4: "--compare without trees: the pin could not be fetched or verified",
    5: None,
    6: "--compare without trees: the series does not apply to the pin",
    7: "the cumem extension did not build",
    9: "some scenario did not pass (--compare: the fixes are not proven)",
    11: None,
    12: "this machine stands in the way: it lacks what the selftest needs (for --installed, a vLLM in "
    "this Python; a GPU, the cumem allocator, CUDA or Python headers: the message names it)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--tree", type=arguments.existing_folder, metavar="DIR",
                       help="a vLLM source tree (its csrc/ and vllm/)")
    which.add_argument("--installed", action="store_true", help="the vLLM installed in this Python, as it is")
    which.add_argument("--compare", nargs="*", type=arguments.existing_folder, metavar="TREE",
                       help="PRISTINE PATCHED: show that scenarios 1-3, 7-9 and 11-13 fail on the first and pass on the second "
                            "(no trees: the pinned tree of --lane and the same tree with its series applied)")
    p.add_argument("--lane", type=arguments.version, metavar="VERSION",
                   help="with --compare and no trees: the lane whose pin and series are compared "
                        "(default: the config's first lane)")
    p.add_argument("--scenario", action="append", type=arguments.known_by(plan.select), metavar="NAME",
                   help="run only this scenario (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--json-out", type=arguments.writable_file, metavar="FILE", help="also write the JSON report to FILE")
    p.add_argument("--size-gib", type=arguments.positive_float, metavar="GIB",
                   help="bytes asleep in partial-wake and speed (default: partial-wake 8 GiB, speed 32 GiB, "
                        "each at most a quarter of the free memory)")
    p.add_argument("--speed-gib", type=arguments.positive_float, metavar="GIB", help="bytes asleep in speed alone")
    p.add_argument("--stress-mib", type=arguments.positive_float, metavar="MIB",
                   help="bytes in the stress pools (default: 512 MiB or a twentieth of the free memory)")
    p.add_argument("--cycles", type=arguments.positive_int, default=1000, metavar="N",
                   help="stress sleep/wake cycles (default 1000)")
    p.add_argument("--fault-cycles", type=arguments.positive_int, default=10_000, metavar="N",
                   help="fault-stress sleep/wake cycles (default 10000)")
    p.add_argument("--seed", type=int, default=1, metavar="N",
                   help="seed of the stress layouts and of fault-stress's injections; a failure names it (default 1)")
    p.add_argument("--speed-target", type=arguments.fraction, default=0.9, metavar="FRACTION",
                   help="in the speed scenario, sleeps must reach this fraction of the pinned D2H ceiling "
                   "(default 0.9); wakes must reach 0.95 of the H2D ceiling into freshly created memory")
    p.add_argument("--wake-after", type=arguments.non_negative_float, default=0.0, metavar="SECONDS",
                   help="in the speed scenario, wait this long after each sleep before the wake is timed "
                        "(default 0: at once; a rotation wakes a peer long after it slept)")
    p.add_argument("--timeout", type=arguments.positive_float, default=1800, metavar="SECONDS",
                   help="limit for each scenario's process (default 1800)")
    p.add_argument("--python-include", type=arguments.existing_folder, metavar="DIR",
                   help="the folder holding Python.h, for building the extension (default: this Python's)")
    p.add_argument("--work", type=arguments.folder_path, metavar="DIR",
                   help="keep the builds and each scenario's JSON here (default: a temporary folder)")
    p.set_defaults(check_args=_check_args)


def _check_args(args: argparse.Namespace) -> str | None:
    if args.compare is not None and len(args.compare) not in (0, 2):
        return f"--compare takes two trees (PRISTINE PATCHED) or none, not {len(args.compare)}"
    if args.lane and args.compare != []:
        return "--lane goes with --compare and no trees (a tree given names its own release)"
    return None


def options(args: argparse.Namespace) -> Options:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Options) if hasattr(args, f.name)}
    return Options(**{**given, "scenarios": plan.select(args.scenario)})  # each name was checked while parsing


def run(ctx: Context, args: argparse.Namespace) -> int:
    rep = run_selftest(ctx, options(args))
    if args.json_out:
        write_file(args.json_out, report.to_json(rep).encode(), what="JSON report")
    print(report.to_json(rep) if args.json else report.table(rep), end="")
    return report.exit_code(rep)


SELFTEST = Command("selftest", HELP, EPILOG, add_arguments, run, EXIT_CODES)
