"""``sm12x-bundle rotate``: one swap of a rotation pool, over the servers' HTTP endpoints."""

from __future__ import annotations

import argparse
import json

from ..context import Context
from ..enginecheck.endpoints import Server
from ..enginecheck.swap import Swap, rotate
from . import arguments
from .command import Command

HELP = "swap two vLLM servers of a rotation pool: sleep the awake one, wake the other, check it serves"
EPILOG = """\
The servers run with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 (vLLM's /sleep,
/wake_up and /is_sleeping endpoints). rotate sleeps --from (POST /sleep?level=1), wakes
--to (POST /wake_up) and checks that --to serves (one greedy completion of a short
token-id prompt for the model GET /v1/models lists first). If --to does not take over, it
is put back to sleep and --from is woken again and checked, so the pool keeps serving; if
--from's sleep fails, --from is woken (vLLM leaves its scheduler paused) and checked.
Every stage's time is printed as the client sees it (HTTP round trip); --json prints the
same as JSON. Each request is bounded by --timeout.

examples:
  sm12x-bundle rotate --from http://10.0.0.5:8000 --to http://10.0.0.5:8001
  sm12x-bundle rotate --from http://127.0.0.1:8000 --to http://127.0.0.1:8001 --json"""

EXIT_CODES: dict[int, str | None] = {
    0: "--to took over and serves; --from sleeps",
    9: "no swap: --from did not sleep, or --to did not take over; --from was woken again and serves",
    8: "the pool does not serve: --to did not take over (or --from did not sleep) and --from could not be "
    "woken again (the lines say which stage failed)",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="source", required=True, type=arguments.http_url, metavar="URL",
                   help="the awake server (e.g. http://127.0.0.1:8000)")
    p.add_argument("--to", dest="target", required=True, type=arguments.http_url, metavar="URL",
                   help="the sleeping server that takes over")
    p.add_argument("--timeout", type=arguments.positive_float, default=300, metavar="SECONDS",
                   help="limit for each request (default 300)")
    p.add_argument("--no-check", action="store_true", help="do not send a completion to check that --to serves")
    p.add_argument("--json", action="store_true", help="print JSON instead of lines")


def words(swap: Swap) -> str:
    lines = [f"  {s['stage']}: {s['seconds']:.3f} s {'ok' if s['ok'] else 'FAILED: ' + s['error']}" for s in swap.stages]
    if swap.swapped:
        verdict = "swapped"
    elif swap.rolled_back:
        verdict = "NOT swapped: --from serves again"
    else:
        verdict = "NOT swapped, and --from does not serve: " + (swap.error or "")
    return "\n".join(["rotate:", *lines, f"rotate: {verdict}"]) + "\n"


def exit_code(swap: Swap) -> int:
    if swap.swapped:
        return 0
    return 9 if swap.rolled_back else 8


def run(ctx: Context, args: argparse.Namespace) -> int:
    swap = rotate(Server(args.source), Server(args.target), args.timeout, check=not args.no_check)
    print(json.dumps(swap.to_dict(), indent=2, sort_keys=True) if args.json else words(swap), end="\n" if args.json else "")
    return exit_code(swap)


ROTATE = Command("rotate", HELP, EPILOG, add_arguments, run, EXIT_CODES)
