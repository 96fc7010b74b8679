"""One scenario in a fresh interpreter (started by runner.py; safe to run by hand):

    python -m sm12x_bundle.selftest.child SCENARIO --out RESULT.json \\
        [--tree TREE --extension EXT.so] [--params JSON]

Writes ``{"outcome", "reason", "figures"}`` to RESULT.json, then leaves at once
(``os._exit``): after a CUDA fault, the interpreter's own teardown would only add
errors from the poisoned context.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from pathlib import Path

from . import loader
from . import measure, scenarios
from .measure import first_line, outcome


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sm12x_bundle.selftest.child")
    p.add_argument("scenario")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tree", type=Path)
    p.add_argument("--extension", type=Path)
    p.add_argument("--params", default="{}")
    return p.parse_args(argv)


def run(scenario: str, tree: Path | None, extension: Path | None, params: dict) -> dict:
    try:
        loaded = loader.load(tree, extension)
    except loader.LoadError as exc:
        return outcome("error", str(exc))
    import torch

    if not torch.cuda.is_available():
        return outcome("error", f"torch {torch.__version__} sees no CUDA GPU")
    if scenario == "probe":
        return scenarios.probe(torch, loaded)
    if scenario not in scenarios.RUNNERS:
        return outcome("error", f"unknown scenario {scenario!r}")
    # As vLLM's engine does once it has started (freeze_gc_heap): the objects of
    # start-up are frozen, so the gc.collect() in every sleep() does not walk them.
    gc.collect()
    gc.freeze()
    return scenarios.RUNNERS[scenario](torch, loaded.cumem, params)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    measure.RESULT_PATH = str(args.out)
    try:
        doc = run(args.scenario, args.tree, args.extension, json.loads(args.params))
    except Exception as exc:
        doc = outcome("error", f"unexpected {type(exc).__name__}: {first_line(exc)}", traceback=traceback.format_exc())
    tmp = args.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True))
    tmp.replace(args.out)
    print(f"{args.scenario}: {doc['outcome']}: {doc['reason']}", flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
