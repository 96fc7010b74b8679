"""``sm12x-bundle engine-check``: vLLM's own engine on this GPU (enginecheck/ runs it)."""

from __future__ import annotations

import argparse

from ..context import Context
from ..errors import ConfigError
from ..enginecheck import plan, report, runner, table
from ..fsutil import write_file
from . import arguments
from .command import Command

HELP = "run vLLM's own engine on this GPU: sleep/wake, level 2, rotation, failures, pristine against patched"
EPILOG = """\
By default the check runs each engine as operators do: `vllm serve` (vLLM's own CLI, dev
mode, on a free port of 127.0.0.1) with CUDA graphs and torch.compile at the release's
defaults, driven over HTTP: /v1/completions with token-id prompts, POST /sleep?level=N,
POST /wake_up, GET /is_sleeping, and /health read after every call. What runs inside the
workers (allocator state, fault injection) is a worker extension (probe.Probe) called by
name through /collective_rpc on every rank. --driver api runs vllm.LLM instead (engine core
in its own process). --tp/--pp spread every engine over TP x PP GPUs (rank i on the i-th
visible device). The model is a Llama-shaped config.json the check writes, with dummy
weights (load_format="dummy", seeded): no hub, no tokenizer. The engine size follows the
GPU's free memory (NVML) unless --model-gib gives it.

which vLLM (--vllm-path DIR: a folder holding the vllm package, e.g. an unpacked wheel;
default: the one this Python imports, found without importing it):
  --installed  that vLLM as it is (e.g. in the target image with the overlays mounted)
  --compare    that vLLM (pristine) and a copy of it with the lane's series applied to
               its own files at fuzz 0 and the lane's cumem extension rebuilt here
               (needs g++ and the CUDA and Python headers; the lane's pinned sdist from
               the cache, from PyPI, or --sdist FILE); the copy is hard links but for
               the patched files (give --work on the install's file system)
The lane is the one pinned to exactly the install's vLLM version.

scenarios (--scenario LETTER or NAME, repeatable; default all, --quick: a only):
  a  cycles         sleep(1)/wake cycles; tokens after each wake equal those before;
                    memory freed; first sleep, later sleeps and wakes against the ceilings;
                    the first wake's stages (map, copy back, map what was discarded), where
                    the allocator records them (the patched one: last_wake_up_stages);
                    and one gc.collect() in every worker, timed
  b  level2         sleep(2), wake, reload the weights (vLLM's reload_weights, else the
                    dummy loader again: it writes the same seeded values); tokens
  c  rotation       two engines on one GPU, B starts while A sleeps, --swaps swaps
                    (the first once B's background fill, where there is one, is no
                    longer running: 120 s at most, the wait recorded);
                    first swap against steady ones, and against the ceilings; the
                    median steady swap against one H2D copy of a rank's weights at
                    the ceiling (reported, not judged); tokens;
                    where the allocator records them: what each sleep copied and
                    skipped and its checksum's time, the steady wakes' stages, B's
                    background fill before its first sleep; then every worker times
                    the driver's map calls on ranges of its own, also with copies
                    queued (a measurement)
  d1 failing-sleep  host memory for the backups runs out half-way through a sleep
                    (injected in the engine core); serve, sleep and wake again
  d2 held-wake      asleep; another process takes the GPU memory; the wake fails; it
                    lets go; the wake is retried
  e  cross-image    A asleep; an engine of the install as it is (pristine, with
                    --compare) starts, generates and exits; A wakes; tokens
  f  killed-worker  asleep; the last rank's worker is killed; the engine must say so
                    (calls fail, /health fails) within --timeout, never hang
  g  weight-changed sleep/wake; a weight (lm_head's rows) is changed in place on
                    every rank, the prefix cache emptied and the changed weight's
                    tokens taken; sleep/wake twice: the tokens must be the changed
                    weight's, never those before (a stale backup). Patched, a
                    sleep skips what is unchanged (on by default); with
                    VLLM_CUMEM_SKIP_UNCHANGED=0 in the engine's environment, and
                    on pristine, every sleep copies
With several GPUs, d1's fault and d2's held memory are on the last rank alone: all ranks
or none must sleep or wake, and the error must name the rank. The full run (not --quick)
makes a: 10 cycles with fresh 200-900-token prompts before the reference ones, then 20
with a fixed prompt.
A call that fails, hangs (--timeout) or kills the engine is recorded, never a crash of the
check: pristine's column shows what the unpatched engine does.

targets (judged on patched, or on the installed vLLM): tokens identical everywhere; first
sleep >= 0.8 of the pinned device-to-host ceiling; rotation's first swap <= 1.1x the median
steady swap; the slowest steady swap <= 1.25x its bytes' time at the ceilings; d1 and d2
survived. The ceilings (pinned copies of up to 4 GiB) are measured in the same run;
--quick measures none and judges tokens and survival only. Every process the check starts
runs in its own process group and is ended on success, failure, timeout and Ctrl-C; the
report gives the GPU memory in use afterwards (NVML).

examples:
  sm12x-bundle engine-check --compare --vllm-path /opt/vllm-0.21.0 --json-out engine.json
  sm12x-bundle engine-check --compare --vllm-path P --sdist vllm-0.21.0.tar.gz --scenario a,b
  sm12x-bundle engine-check --installed --quick --tp 2           # a rollout gate
  sm12x-bundle engine-check --compare --vllm-path P --tp 2 --vllm-arg=--compilation-config='{"cudagraph_mode":"FULL_AND_PIECEWISE"}'
  sm12x-bundle engine-check --installed --quick --job dsv4-flash   # as the config's job runs
  sm12x-bundle engine-check --installed --scenario c --model-gib 8 --swaps 8
  sm12x-bundle engine-check --compare --driver api --vllm-arg=--compilation-config='{"mode":"NONE","cudagraph_mode":"FULL"}'"""

EXIT_CODES: dict[int, str | None] = {
    0: "every scenario passes and every target holds on the vLLM under test (--compare: on the patched "
    "copy, and it is never worse than pristine)",
    3: "could not run: the vLLM under test is not a lane's release (or --lane names another), "
    "--vllm-path holds no vllm package, --job names no job, a --vllm-arg that --driver api cannot take "
    "(a value apart from its flag), or the "
    "engines do not fit the GPU's free memory or the host's",
    4: "--compare: the lane's pinned sdist could not be fetched, or --sdist does not match its sha256",
    5: None,
    6: "--compare: the lane's series does not apply to the install's own files",
    7: "--compare: the cumem extension did not build, or the ceilings process failed",
    9: "the check ran and something did not hold: a scenario did not pass or a target was missed on the "
    "vLLM under test (or patched is worse than pristine)",
    11: "--work names a folder that holds files this tool did not write",
    12: "this machine stands in the way: no NVIDIA driver or GPU (NVML), no vLLM importable in this Python, "
    "or (--compare) no g++, binutils, CUDA or Python headers",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--installed", action="store_true", help="the vLLM under test as it is")
    which.add_argument("--compare", action="store_true", help="the vLLM under test (pristine) and its patched copy")
    p.add_argument("--vllm-path", type=arguments.existing_folder, metavar="DIR",
                   help="the folder holding the vllm package (default: what this Python imports)")
    p.add_argument("--lane", type=arguments.version, metavar="VERSION",
                   help="refuse to run unless the vLLM under test is this lane's release")
    p.add_argument("--sdist", type=arguments.existing_file, metavar="FILE",
                   help="--compare: the lane's pinned sdist, when this machine cannot download it "
                        "(checked against the pin's sha256)")
    p.add_argument("--scenario", action="append", type=arguments.known_by(plan.select), metavar="NAME",
                   help="run only this scenario (letter or name, repeatable, comma lists)")
    p.add_argument("--quick", action="store_true",
                   help="one small engine (1 GiB of weights), scenario a, a few tokens, no ceilings: a rollout gate")
    p.add_argument("--model-gib", type=arguments.positive_float, metavar="GIB",
                   help="bf16 weights of each engine (default: 24.25 GiB alone, 12.55 GiB in pairs, "
                        "at most a third / a sixth of the free GPU memory)")
    p.add_argument("--swaps", type=arguments.positive_int, default=6, metavar="N",
                   help="rotation swaps, at least 4 (default 6)")
    p.add_argument("--driver", choices=plan.DRIVERS, default="serve",
                   help="serve (default): `vllm serve` driven over HTTP, as operators run it; api: vllm.LLM")
    p.add_argument("--tp", type=arguments.positive_int, metavar="N",
                   help="tensor-parallel size of every engine (default: from --vllm-arg or --job, else 1)")
    p.add_argument("--pp", type=arguments.positive_int, metavar="N",
                   help="pipeline-parallel size (default: from --vllm-arg or --job, else 1)")
    p.add_argument("--eager", action="store_true",
                   help="no CUDA graphs or torch.compile (default: the release's defaults, graphs on)")
    p.add_argument("--vllm-arg", action="append", default=[], metavar="ARG",
                   help="a flag for `vllm serve`, repeatable (--vllm-arg=--compilation-config={...}); the "
                        "check's own (model, sizes, address, parallel sizes) are left out and reported; "
                        "with --driver api each is an LLM(...) keyword: --NAME=VALUE (VALUE as JSON "
                        "where it parses), a bare --NAME for True, --NAME.KEY=VALUE for one key")
    p.add_argument("--job", metavar="NAME",
                   help="run as the configuration's job NAME runs: its tensor_parallel_size and extra_args")
    p.add_argument("--timeout", type=arguments.positive_float, default=300, metavar="SECONDS",
                   help="limit for each engine call (default 300; an engine's start gets twice as long)")
    p.add_argument("--work", type=arguments.folder_path, metavar="DIR",
                   help="keep the model folders, the patched copy, logs and bytecode here (default: a temporary folder)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--json-out", type=arguments.writable_file, metavar="FILE", help="also write the JSON report to FILE")
    p.set_defaults(check_args=_check_args)


def _check_args(args: argparse.Namespace) -> str | None:
    if args.sdist is not None and not args.compare:
        return "--sdist goes with --compare (the pinned sources build the patched copy's extension)"
    if args.swaps < 4:
        return f"--swaps must be at least 4 (the first swap and three steady ones), not {args.swaps}"
    return None


def engine_settings(ctx: Context, args: argparse.Namespace) -> plan.Parallel:
    """The driver, TP, PP, graphs and flags: the options, else the job's (--job)."""
    tp, vllm_args = args.tp, list(args.vllm_arg)
    if args.job:
        job = next((j for j in ctx.config.jobs if j.name == args.job), None)
        if job is None:
            names = ", ".join(j.name for j in ctx.config.jobs) or "none"
            raise ConfigError(f"--job {args.job}: no such job in the configuration (its jobs: {names})")
        tp, vllm_args = tp or job.tensor_parallel_size, [*job.extra_args, *vllm_args]
    return plan.parallel(args.driver, tp, args.pp, args.eager, vllm_args)


def options(ctx: Context, args: argparse.Namespace) -> runner.Options:
    return runner.Options(
        compare=args.compare, vllm_path=args.vllm_path, lane=args.lane, sdist=args.sdist,
        scenarios=plan.select(args.scenario, quick=args.quick), quick=args.quick, model_gib=args.model_gib,
        swaps=args.swaps, call_timeout=args.timeout, start_timeout=2 * args.timeout, work=args.work,
        parallel=engine_settings(ctx, args),
    )


def run(ctx: Context, args: argparse.Namespace) -> int:
    rep = runner.run_check(ctx, options(ctx, args))
    if args.json_out:
        write_file(args.json_out, report.to_json(rep).encode())
    print(report.to_json(rep) if args.json else table.table(rep), end="")
    return report.exit_code(rep)


ENGINE_CHECK = Command("engine-check", HELP, EPILOG, add_arguments, run, EXIT_CODES)
