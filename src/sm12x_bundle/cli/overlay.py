"""``sm12x-bundle overlay``: per-file overlays for each target image (outputs/overlay.py renders them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..context import Context
from ..outputs import overlay
from ..outputs.verify import Verified, verify_overlay
from ..plan.originals import connect
from ..plan.target import select_targets, target_options_problem
from ..progress import Progress
from . import arguments
from .command import Command, add_force_argument


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", action="append", type=arguments.folder_name, metavar="NAME",
                   help="a config target (repeatable; default: all)")
    p.add_argument("--image", type=arguments.image_ref, metavar="REF", help="an ad hoc target: this image, not in the config")
    p.add_argument("--root", type=arguments.absolute_path, metavar="PATH",
                   help="with --image: vLLM's package folder in it (default: ask the image)")
    p.add_argument("--verify", action="store_true", help="check each overlay inside its image before keeping it")
    p.add_argument("--manifest", type=arguments.existing_file, metavar="FILE",
                   help="with --verify: check this existing overlay instead")
    p.add_argument("--out", type=Path, metavar="DIR", help="where overlays go (default: output.overlays, 'overlays')")
    add_force_argument(p, "write DIR/<target> even if it holds files this tool did not write")
    p.set_defaults(check_args=_check_args)


def _check_args(args: argparse.Namespace) -> str | None:
    """Options that depend on each other, refused while parsing (exit 2)."""
    if args.manifest is not None and not args.verify:
        return "--manifest is for --verify: it checks an existing overlay"
    return target_options_problem(args.target, args.image, args.root)


def run(ctx: Context, args: argparse.Namespace) -> int:
    if args.manifest is not None:
        return _verify_existing(ctx, args)
    targets = select_targets(ctx.config, args.target, args.image, args.root)
    written, reports = overlay.make_and_write_reports(ctx, targets, args.verify, args.out, args.force)
    for made, folder in written:
        origin = f"image {made.image}" if made.image_id else f"the pinned vLLM {made.versions['vllm']} tree"
        print(f"{made.target}: {folder} ({len(made.files)} files, lane {made.pin['version']}, from {origin})")
    for report in reports:
        _print_verified(ctx.progress, report)
    return 0


def _verify_existing(ctx: Context, args: argparse.Namespace) -> int:
    engine = connect(True, ctx.progress)
    _print_verified(ctx.progress, verify_overlay(engine, args.manifest, args.image))
    return 0


def _print_verified(progress: Progress, report: Verified) -> None:
    overlay.say_verified(progress, report)
    print(f"verified in {report.image}: {len(report.ok)} checks passed, {len(report.notes)} notes")


OVERLAY = Command(
    "overlay",
    "per-file overlays: the image's own files, patched, to bind-mount read-only",
    "example: sm12x-bundle overlay --verify --target vllm-openai-v0.21.0\n"
    "         sm12x-bundle overlay --image glm:nvfp4 --root /opt/vllm/vllm\n"
    "         sm12x-bundle overlay --verify --manifest overlays/vllm-openai-v0.21.0/current.json",
    _arguments,
    run,
    {
        4: None,
        5: "could not run: the patch series is malformed or unsafe, or no lane is for the vLLM release "
        "an image carries (the message names the lanes)",
        6: None, 7: None, 8: None, 9: None, 11: None,
    },
)
