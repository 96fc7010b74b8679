#!/usr/bin/env python3
"""What the background fill costs serving: decode-like steps per second while a tree's own
fill backs the weights up, against the same steps without it.

    python bench/cumem_fill_cost_bench.py TREE [--weights 500x12] [--shares 0.25,1.0]
        [--rounds 5] [--batch 8] [--host-us 300] [--json-out FILE] [--python-include DIR]

Needs a CUDA GPU. Loads TREE's own cumem.py against its extension (built alone) with
VLLM_CUMEM_SKIP_UNCHANGED=1, and allocates the weights (COUNTxMIB allocations of bf16
matrices 2048 wide, tag ``weights``; the default is one rank of the engine check's 12 GiB
model at TP=2). The serving stand-in is a decode step at batch BATCH: one CUDA graph
multiplies the batch by every weight matrix (it reads all the weights, as a decode step
does), the host waits for it as a sampler does, then spends HOST_US microseconds of Python
(the scheduler's and the detokenizer's share of a step) holding the GIL, as the engine core
does in the process where, at TP=1, the fill's thread runs.

Each round, for each fill pace in ``--shares`` (the share of the device-to-host link the
fill may hold: the series' default is 0.25; 1.0 rests not at all): steps are counted while
the tree's ``start_background_fill()`` runs to its end, then for as long again without it.
The fill's backups and checksums are dropped after each round, so that every round fills
all the weights. It prints, per pace, the steps per second with and without the fill and
the loss (1 - with / without), each round and the median; the issue's bound is a loss
below 2%. It changes nothing: it measures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
for _path in (SRC, Path(__file__).resolve().parent):  # the package; the wake bench's layout
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from cumem_wake_maps_bench import layout  # noqa: E402  (one COUNTxMIB reader for both benches)
from sm12x_bundle import native  # noqa: E402
from sm12x_bundle.selftest import loader  # noqa: E402

WIDTH = 2048  # the matrices' inner size: the engine check's 12 GiB model's hidden size


def shares(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated shares, such as 0.25,1.0") from None
    if not out or any(not 0 < s <= 1 for s in out):
        raise argparse.ArgumentTypeError(f"{text!r}: each share must be above 0 and at most 1")
    return out


def decode_step(torch, weights: list, batch: int):
    """A function that runs one decode-like step: the graph over every weight, the wait."""
    x = torch.randn(batch, WIDTH, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm the kernels up before the capture
        outs = [x @ w.T for w in weights]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [x @ w.T for w in weights]
    done = torch.cuda.Event()

    def step() -> None:
        graph.replay()
        done.record()
        done.synchronize()
    step.outputs = outs  # kept alive with the graph
    return step


def busy(seconds: float) -> None:
    """Python holding the GIL for ``seconds``, as the engine core's own work does."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1


def steps_while(step, host_s: float, running, limit_s: float = 60.0) -> tuple[int, float]:
    """(steps, seconds) while ``running()`` holds."""
    count, start = 0, time.perf_counter()
    while running() and time.perf_counter() - start < limit_s:
        step()
        busy(host_s)
        count += 1
    return count, time.perf_counter() - start


def steps_for(step, host_s: float, seconds: float) -> tuple[int, float]:
    end = time.perf_counter() + seconds
    return steps_while(step, host_s, lambda: time.perf_counter() < end)


def forget_fill(alloc) -> None:
    """Drop the fill's backups and checksums: the next fill starts from nothing."""
    alloc.background_fill.stop()
    for data in alloc.pointer_to_data.values():
        alloc._release_backup(data)
    alloc.background_fill = None


def one_round(alloc, checksum_mod, step, host_s: float, share: float) -> dict:
    checksum_mod.FILL_SHARE = share  # read when the fill is made
    alloc.start_background_fill()
    fill = alloc.background_fill
    with_fill = steps_while(step, host_s, lambda: fill.state == "running")
    figures = fill.figures()
    without = steps_for(step, host_s, with_fill[1])
    forget_fill(alloc)
    rate_with, rate_without = with_fill[0] / with_fill[1], without[0] / without[1]
    return {"share": share, "fill": figures, "steps_with": with_fill[0], "seconds_with": with_fill[1],
            "steps_without": without[0], "seconds_without": without[1],
            "steps_per_s_with": rate_with, "steps_per_s_without": rate_without,
            "loss": 1.0 - rate_with / rate_without}


def run(args, cumem) -> dict:
    import torch

    checksum_mod = sys.modules[cumem.BackgroundFill.__module__]
    alloc = cumem.CuMemAllocator.get_instance()
    if alloc.skip_unchanged is None:
        raise SystemExit("cumem_fill_cost_bench: the tree's allocator has no unchanged-skip "
                         "(VLLM_CUMEM_SKIP_UNCHANGED=1 was set): this tree has no fill")
    count, size = args.weights
    rows = size // (WIDTH * 2)
    with alloc.use_memory_pool("weights"):
        weights = [torch.randn(rows, WIDTH, dtype=torch.bfloat16, device="cuda") for _ in range(count)]
    # The checksum's kernel compiled now, not inside the first round's fill.
    alloc.skip_unchanged.checksum.sums([(weights[0].data_ptr(), size)], weights[0].device)
    step = decode_step(torch, weights, args.batch)
    steps_for(step, args.host_us * 1e-6, 1.0)  # warm
    rounds = [one_round(alloc, checksum_mod, step, args.host_us * 1e-6, share)
              for _ in range(args.rounds) for share in args.shares]
    return {"gpu": torch.cuda.get_device_name(), "weights": [count, size], "batch": args.batch,
            "host_us": args.host_us, "rounds": rounds,
            "median_loss": {str(s): statistics.median(r["loss"] for r in rounds if r["share"] == s)
                            for s in args.shares}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tree", type=Path)
    p.add_argument("--weights", type=layout, default=layout("500x12"))
    p.add_argument("--shares", type=shares, default=shares("0.25,1.0"),
                   help="the fill's paces to measure (default 0.25, the series' own, and 1.0, unpaced)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--host-us", type=float, default=300.0)
    p.add_argument("--json-out", type=Path)
    p.add_argument("--python-include", type=Path)
    args = p.parse_args()
    if args.rounds < 1 or args.batch < 1 or args.host_us < 0:
        p.error("--rounds and --batch must be at least 1, --host-us at least 0")
    os.environ["VLLM_CUMEM_SKIP_UNCHANGED"] = "1"
    os.environ.pop("VLLM_CUMEM_BACKGROUND_FILL", None)
    work = Path(tempfile.mkdtemp(prefix="cumem-fill-cost-bench-"))
    ext = native.build_cumem_extension(args.tree.resolve(), work, python_include=args.python_include)
    cumem = loader.load(args.tree.resolve(), ext).cumem
    result = run(args, cumem)
    for r in result["rounds"]:
        print(f"share {r['share']:.2f}: fill {r['fill']['filled_bytes'] / 2**30:.2f} GiB in "
              f"{r['fill']['seconds']:.2f} s ({r['fill']['state']}); steps/s {r['steps_per_s_with']:.1f} with, "
              f"{r['steps_per_s_without']:.1f} without; loss {r['loss'] * 100:+.2f}%", flush=True)
    for share, loss in result["median_loss"].items():
        print(f"median loss at share {share}: {loss * 100:+.2f}% (bound: 2%)")
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
