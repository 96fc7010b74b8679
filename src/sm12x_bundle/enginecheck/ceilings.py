"""The pinned-copy ceilings, measured in the same run in a short process of their own:

    python -m sm12x_bundle.enginecheck.ceilings --bytes N

Device-to-host into pinned host memory (what a sleep's copies can reach) and host-to-device
from it (a wake's), each the best of three copies of N bytes, printed as one JSON line.
torch is imported only in that process: the parent holds no CUDA context.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass

from .. import cmd
from ..errors import CommandError


@dataclass(frozen=True)
class Ceilings:
    bytes: int
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "d2h_gbps": self.d2h_bytes_per_s / 1e9, "h2d_gbps": self.h2d_bytes_per_s / 1e9}

    def sleep_seconds(self, nbytes: int) -> float:
        """How long copying ``nbytes`` device-to-host takes at the ceiling."""
        return nbytes / self.d2h_bytes_per_s

    def wake_seconds(self, nbytes: int) -> float:
        return nbytes / self.h2d_bytes_per_s


def measure(nbytes: int, env: Mapping[str, str], timeout: float = 300) -> Ceilings:
    """Run the measuring process (through cmd.run) and read its line."""
    argv = [sys.executable, "-m", "sm12x_bundle.enginecheck.ceilings", "--bytes", str(nbytes)]
    proc = cmd.run(argv, env=env, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise CommandError(f"{' '.join(argv)} printed no figures")
    doc = json.loads(lines[-1])
    return Ceilings(doc["bytes"], doc["d2h_gbps"] * 1e9, doc["h2d_gbps"] * 1e9)


def _best(torch, copy, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        copy()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sm12x_bundle.enginecheck.ceilings")
    p.add_argument("--bytes", type=int, required=True)
    nbytes = p.parse_args(argv).bytes
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.fill_(1)
    host.copy_(device)  # every page touched once before timing
    d2h = _best(torch, lambda: host.copy_(device, non_blocking=True))
    h2d = _best(torch, lambda: device.copy_(host, non_blocking=True))
    doc = {"bytes": nbytes, "d2h_gbps": nbytes / d2h / 1e9, "h2d_gbps": nbytes / h2d / 1e9,
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "pid": os.getpid()}
    print(json.dumps(doc), flush=True)


if __name__ == "__main__":
    main()

