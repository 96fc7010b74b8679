"""``sm12x-bundle build``: the whole pipeline for the config, planned first (pipeline.py), then run."""

from __future__ import annotations

import argparse

from ..context import Context
from ..pipeline import plan, preflight, run_steps
from .command import Command, add_force_argument


def run(ctx: Context, args: argparse.Namespace) -> int:
    steps = plan(ctx, args.image)
    out = preflight(ctx, steps, args.force)
    if args.dry_run:
        for n, step in enumerate(steps, 1):
            print(f"{n}. {step.label:<14} -> {step.destination}")
            print("".join(f"     {line}\n" for line in step.details), end="")
        return 0
    print("\n".join(run_steps(ctx, steps, out, False if args.no_verify else None, args.force)))
    return 0


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true",
                   help="check what build checks before its first step (the series, the output folders, a Docker "
                   "daemon and images where a step needs them), print the steps and where each output goes; write "
                   "nothing")
    p.add_argument("--image", action="store_true", help="also build the bundle image (needs a Docker daemon)")
    p.add_argument("--no-verify", action="store_true", help="do not verify overlays inside the target images")
    add_force_argument(p, "write the outputs even into folders that hold files this tool did not write")


BUILD = Command(
    "build",
    "run the whole pipeline: pin, check, patched tree, overlays, Nomad specs (and the image)",
    "example: sm12x-bundle build            # the embedded default, no Docker daemon needed\n"
    "         sm12x-bundle build --image    # also the bundle image",
    _arguments,
    run,
    {4: None, 5: None, 6: None, 7: None, 8: None, 9: None, 11: None},
)
