"""A stand-in for the engine session (sm12x_bundle.enginecheck.session) that needs no GPU.

It is the engine check's only fake: it speaks the session protocol (protocol.py) and
answers like an engine would, so the parent's side (procs.py, bench.Engine) is tested
for real: its process groups, timeouts, dead children and Ctrl-C. The engine itself runs
only on a GPU. Behaviour is chosen by flags:

  --settings JSON          accepted and ignored, as the real session's
  --grandchild FILE        fork a process that sleeps (the engine core's stand-in) and write its pid
  --hang-on CMD            never answer CMD
  --die-on CMD             exit with code 134 and a CUDA-like line on stderr on CMD
  --fail-on CMD            answer CMD with ok: false
  --fail-start             answer the start with event: failed
  --vllm-file PATH         say that the engine imported vllm from PATH
  --stale-wake             a sleep after the first copies nothing, so a wake restores the
                           weights as they were at the first sleep (a weight changed in place
                           in between is lost: the unchanged-skip's danger)
  --records                the state says what the patched allocator records: the last
                           sleep's copied and skipped bytes (the first sleep copies the
                           1 GiB of weights, a later one skips them), the last wake's
                           stages, and a background fill that is done
  --fill-running N         with --records, the fill says it is running for the first N
                           state calls
  --cached-prefix-differs  a generate whose prompts are all in the prefix cache (generated
                           since the last sleep or reset) gives other tokens from the third
                           on, as pristine 0.33.0's engine gave at token 14 (2026-11-29)

gc (one timed gc.collect() in every worker) answers one rank: 0.45 s, nothing frozen.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

# The "weights": an offset every token moves by; perturb changes it in place, a sleep backs
# it up, a wake restores the backup.
WEIGHTS = {"now": 0, "backup": None}
CACHED: set[tuple[int, ...]] = set()  # the prompts the prefix cache holds
STATE_CALLS = [0]
POOL = 1 << 30
# What the patched allocator records, answered with --records.
RECORDS = {"last_sleep_copied_bytes": None, "last_sleep_skipped_bytes": None, "last_wake_up_stages": {},
           "background_fill": {"filled_bytes": POOL, "seconds": 0.5, "state": "done", "dropped": 0}}


def tokens(prompts: list[list[int]], n: int, cached_prefix_differs: bool = False) -> list[list[int]]:
    hit = cached_prefix_differs and all(tuple(p) in CACHED for p in prompts)
    CACHED.update(tuple(p) for p in prompts)
    return [[(sum(p) + i * 7 + WEIGHTS["now"] + (hit and i >= 2)) % 32000 for i in range(n)] for p in prompts]


def weights(cmd: str, args: dict, stale_wake: bool) -> dict:
    """sleep, wake and perturb acting on the fake weights."""
    if cmd == "perturb":
        WEIGHTS["now"] += int(args.get("seed", 1))
        return {"ranks": [{"rank": 0, "changed": "lm_head.weight"}]}
    if cmd == "sleep" and not (stale_wake and WEIGHTS["backup"] is not None):
        WEIGHTS["backup"] = WEIGHTS["now"]
    if cmd == "wake" and WEIGHTS["backup"] is not None:
        WEIGHTS["now"] = WEIGHTS["backup"]
    return {}


def grandchild(pid_file: str) -> None:
    pid = os.fork()
    if pid == 0:  # stays in its parent's process group, as vLLM's engine core does
        while True:
            time.sleep(1)
    with open(pid_file, "w") as fh:
        fh.write(str(pid))


def record(cmd: str) -> None:
    """The allocator's records after a sleep or a wake."""
    if cmd == "sleep":
        first = RECORDS["last_sleep_copied_bytes"] is None
        RECORDS.update(last_sleep_copied_bytes=POOL if first else 0, last_sleep_skipped_bytes=0 if first else POOL,
                       last_sleep_checksum_s=0.004,
                       last_sleep_stages={"checksum_s": 0.004, "unmap_s": 0.03, "unmapped": 4,
                                          "gc_and_empty_cache_s": 0.001})
    if cmd == "wake":
        RECORDS["last_wake_up_stages"] = {"map_restored_s": 0.01, "copy_s": 0.02, "map_emptied_s": 0.01,
                                          "copied_bytes": POOL}


def answer(cmd: str, args: dict, flags: argparse.Namespace) -> dict:
    records = flags.records
    if cmd == "generate":
        return {"tokens": tokens(args["prompts"], args["max_tokens"], flags.cached_prefix_differs)}
    if cmd in ("sleep", "reset"):
        CACHED.clear()
    if cmd == "gc":  # one rank, its heap not frozen: pristine 0.21.0's worker after warm-up
        return {"ranks": [{"rank": 0, "pid": os.getpid(), "seconds": 0.45, "frozen": 0}]}
    if cmd == "maps" and records:  # one rank's map calls, as inject.map_call_times answers
        return {"ranks": [{"rank": 0, "pid": os.getpid(), "count": args.get("count", 200), "size": 12 << 20,
                           "best_s": {"extension create_and_map": 0.0146, "map": 0.001}}]}
    if cmd == "state":
        tags = {"weights": {"allocations": 4, "bytes": POOL, "asleep": 0, "backed_up_bytes": 0}}
        STATE_CALLS[0] += 1
        running = STATE_CALLS[0] <= flags.fill_running
        fill = {**RECORDS["background_fill"], **({"state": "running"} if running else {})}
        return {"tags": tags, "is_sleeping": False, **({**RECORDS, "background_fill": fill} if records else {})}
    record(cmd)
    return {}


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--settings", "--grandchild", "--hang-on", "--die-on", "--fail-on", "--vllm-file"):
        p.add_argument(flag)
    p.add_argument("--fail-start", action="store_true")
    p.add_argument("--stale-wake", action="store_true")
    p.add_argument("--records", action="store_true")
    p.add_argument("--fill-running", type=int, default=0)
    p.add_argument("--cached-prefix-differs", action="store_true")
    args = p.parse_args()
    print("fake engine: starting", file=sys.stderr, flush=True)
    if args.grandchild:
        grandchild(args.grandchild)
    if args.fail_start:
        print(json.dumps({"event": "failed", "error": "RuntimeError: no CUDA GPU", "seconds": 0.1}), flush=True)
        return
    ready = {"event": "ready", "seconds": 0.1, "vllm": "0.21.0", "pid": os.getpid(), "vllm_file": args.vllm_file}
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        cmd = request["cmd"]
        if cmd == args.hang_on:
            time.sleep(3600)
        if cmd == args.die_on:
            print("CUDA error: an illegal memory access was encountered", file=sys.stderr, flush=True)
            os._exit(134)
        if cmd == args.fail_on:
            reply = {"ok": False, "seconds": 0.01, "error": f"Exception: Call to {cmd} method failed: injected"}
        else:
            reply = {"ok": True, "seconds": 0.01, **answer(cmd, request["args"], args),
                     **weights(cmd, request["args"], args.stale_wake)}
        print(json.dumps(reply), flush=True)
        if cmd == "exit":
            return


if __name__ == "__main__":
    main()
