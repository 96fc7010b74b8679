#!/usr/bin/env python3
"""How long `sm12x-bundle check` takes from a warm cache.

Prints wall-clock seconds for (1) the series against the cached pinned tree and (2) a
three-release matrix (the pin, 0.26.0, 0.33.0), each as a whole command (Python start-up
included), best of --repeat runs. The first run warms the cache (downloads and
extractions are not counted); a second one, RACY_NS later, lets the records of freshly
extracted trees settle, so the timed runs see what every later run sees (source/record.py).
Targets: < 5 s and < 20 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

MATRIX = ["--vllm", "0.26.0", "--vllm", "0.33.0"]


def timed(argv: list[str]) -> tuple[float, int]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "sm12x_bundle", *argv], capture_output=True, text=True)
    return time.perf_counter() - start, proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {os.cpu_count()} CPUs; warming the cache ...", flush=True)
    _, code = timed(["check", "-q", *MATRIX])
    time.sleep(2.1)
    timed(["check", "-q", *MATRIX])
    print(f"warm-up exit code {code} (0 all apply, 10 landed, 20 conflict)")
    for label, argv, target in (
        ("check, pinned tree", ["check", "-q"], 5.0),
        ("check, 3-release matrix", ["check", "-q", *MATRIX], 20.0),
    ):
        best = min(timed(argv)[0] for _ in range(args.repeat))
        print(f"{label:<26} {best:6.2f} s   (target < {target:.0f} s: {'ok' if best < target else 'MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
