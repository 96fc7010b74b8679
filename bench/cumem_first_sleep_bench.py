#!/usr/bin/env python3
"""The first sleep of a process, under PyTorch's pinned-memory settings.

    python bench/cumem_first_sleep_bench.py TREE [--size-gib 8] [--conf CONF ...] [--json-out FILE]
        [--python-include DIR]

Needs a CUDA GPU. Runs the selftest's speed scenario on TREE (its extension built
alone, its own cumem.py) once per PYTORCH_CUDA_ALLOC_CONF value, each in a fresh
process, and prints the first sleep (which pins the host memory for the backups)
against the steady sleep and the device-to-host ceiling of the same run. The default
confs compare PyTorch's default pinned allocator (cudaHostAlloc) with its
malloc + parallel page mapping + cudaHostRegister path, which holds no more host
memory than the bytes offloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
if str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from sm12x_bundle.selftest import plan, runner  # noqa: E402

CONFS = ("", "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
         "pinned_use_cuda_host_register:True,pinned_num_register_threads:16")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--size-gib", type=float, default=8.0)
    p.add_argument("--conf", action="append", help="a PYTORCH_CUDA_ALLOC_CONF value (repeatable; '' = default)")
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path, help="the folder holding Python.h (default: this Python's)")
    args = p.parse_args()
    confs = args.conf if args.conf is not None else list(CONFS)
    rows = []
    with tempfile.TemporaryDirectory(prefix="cumem-first-sleep-") as tmp:
        work = Path(tmp)
        staged = runner.stage(plan.Target("tree", args.tree.resolve()), work, python_include=args.python_include)
        free = runner.probe(staged, work)["free_bytes"]
        sizes = plan.plan_sizes(free, size_gib=args.size_gib)
        params = runner.scenario_params(sizes, 0.0)
        speed = plan.BY_NAME["speed"]
        for i, conf in enumerate(confs):
            r = runner.run_scenario(staged, speed, params, work / f"conf{i}", timeout=900,
                                    env={"PYTORCH_CUDA_ALLOC_CONF": conf})
            f = r.figures
            rows.append({"conf": conf, "outcome": r.outcome, "reason": r.reason, **f})
            if "first_sleep_s" not in f:
                print(f"[{conf or 'default'}] {r.outcome}: {r.reason}", flush=True)
                continue
            print(f"[{conf or 'default'}] {sizes.speed_bytes / 2**30:.1f} GiB: first sleep {f['first_sleep_s']:.2f} s "
                  f"({f['first_sleep_gbps']:.1f} GB/s), steady sleep {f['sleep_gbps']:.1f} GB/s, "
                  f"D2H ceiling {f['d2h_ceiling_gbps']:.1f} GB/s, wake {f['wake_gbps']:.1f} GB/s", flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps({"bytes": sizes.speed_bytes, "rows": rows}, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
