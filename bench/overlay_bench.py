#!/usr/bin/env python3
"""How long `sm12x-bundle overlay` takes for one target from a warm cache.

Prints wall-clock seconds for the whole command (Python start-up included), best of
--repeat runs, into a scratch folder. The first run warms the cache (the pinned sdist's
download and extraction are not counted). Without --image it makes one default target
(--target, default the 0.21.0 lane's) from the pinned tree, as a fresh machine without a
daemon does (DOCKER_HOST is pointed at nothing); with --image REF it reads that image through the daemon in DOCKER_HOST
(add --verify to include the in-image check). Each run patches cumem.py and rebuilds
the cumem extension (two compiler calls). Target: < 10 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

TARGET_S = 10.0


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sm12x_bundle", *argv], capture_output=True, text=True, env=env)
    return time.perf_counter() - start, proc.returncode, proc.stderr.strip().splitlines()[-1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--image", metavar="REF", help="an image in the daemon (default: the pinned tree, no daemon)")
    parser.add_argument("--root", metavar="PATH", help="with --image: vLLM's folder in it (default: ask the image)")
    parser.add_argument("--verify", action="store_true", help="with --image: include overlay --verify")
    parser.add_argument("--target", default="vllm-openai-v0.21.0", help="without --image: the default target to make")
    args = parser.parse_args()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory(prefix="overlay-bench-") as out:
        argv = ["overlay", "-q", "--out", out]
        if args.image:
            argv += ["--image", args.image] + (["--root", args.root] if args.root else [])
            argv += ["--verify"] if args.verify else []
            label = f"overlay, image {args.image}" + (" + verify" if args.verify else "")
        else:
            env["DOCKER_HOST"] = "unix:///nonexistent/docker.sock"
            argv += ["--target", args.target]
            label = f"overlay, default target {args.target}, pinned tree, no daemon"
        print(f"machine: {os.cpu_count()} CPUs; warming the cache ...", flush=True)
        _, code, err = timed(argv, env)
        if code != 0:
            print(f"warm-up failed with exit code {code}: {err}")
            return code
        best = min(timed(argv, env)[0] for _ in range(args.repeat))
    verdict = "ok" if best < TARGET_S else "MISSED"
    print(f"{label}: {best:.2f} s   (target < {TARGET_S:.0f} s: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
