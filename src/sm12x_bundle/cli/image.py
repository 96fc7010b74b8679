"""``sm12x-bundle image``: the bundle image (outputs/image.py plans, renders and builds it)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .. import containers
from ..config import ImageConfig
from ..context import Context
from ..outputs.dockerfile import PIN_REPOSITORY
from ..outputs.image import build_bundle, bundle_context, listing, plan_from_base
from ..outputs.native_build import builder_context
from . import arguments
from .command import Command, add_force_argument


def _config(ctx: Context, args: argparse.Namespace) -> ImageConfig:
    overrides = {
        key: getattr(args, key)
        for key in ("base", "base_digest", "root", "tag", "revision", "builder_base", "builder_setup")
        if getattr(args, key, None) is not None
    }
    return dataclasses.replace(ctx.config.image, **overrides)


def _dry_run(ctx: Context, cfg: ImageConfig, out: Path) -> int:
    plan = plan_from_base(ctx, cfg, None)
    if plan.builder is not None:
        files = builder_context(plan.builder)
        print(f"== {out / 'builder'}/Dockerfile (from docker/Dockerfile.builder)\n")
        print(files["Dockerfile"][0].decode())
        print(f"== build context {out / 'builder'}\n{listing(files)}\n")
    files = bundle_context(plan)
    print(f"== {out / 'bundle'}/Dockerfile (from docker/Dockerfile.bundle)\n")
    print(files["Dockerfile"][0].decode())
    print(f"== build context {out / 'bundle'}\n{listing(files)}")
    print(
        f"\n(dry run: no daemon asked; the base's vLLM root is taken as {plan.side.root} and its "
        f"files as the first lane's pinned tree, vLLM {plan.target.lane.version}'s; a build "
        "reads both from the image, whose vLLM version selects the lane, and names it in FROM by a local "
        f"tag made from its id, {PIN_REPOSITORY}:<id>)"
    )
    if plan.base.digest_note:
        print(f"base.digest label omitted: {plan.base.digest_note}")
    return 0


def run(ctx: Context, args: argparse.Namespace) -> int:
    cfg = _config(ctx, args)
    out = Path(args.out) if args.out else Path(ctx.config.output.dir) / "image"
    if args.dry_run:
        return _dry_run(ctx, cfg, out)
    result = build_bundle(ctx, cfg, containers.docker_engine(), out, push=args.push or cfg.push, force=args.force)
    imports = (
        f"imported {len(result.imported)}"
        if result.plan.side.import_error is None
        else f"import not checked (the base cannot import vLLM: {result.plan.side.import_error})"
    )
    print(
        f"{result.tag} ({result.image_id[:19]}) built on {result.plan.base.name}: "
        f"{result.checked} files match the manifest, {result.compiled} modules compile, {imports}"
        + (f"; pushed {result.tag}" if args.push or cfg.push else "")
    )
    if result.plan.base.digest_note:
        print(f"note: {result.plan.base.digest_note}")
    print(f"build contexts in {out}")
    return 0


def _arguments(p: argparse.ArgumentParser) -> None:
    # Each override is checked in the same words as the image.* key it replaces.
    p.add_argument("--base", type=arguments.image_ref, metavar="IMAGE", help="base vLLM image (default: image.base in the config)")
    p.add_argument("--base-digest", type=arguments.digest, metavar="SHA256", help="registry digest the base must have (sha256:...)")
    p.add_argument("--root", type=arguments.absolute_path, metavar="PATH",
                   help="vLLM install root inside the base (default: ask its python3)")
    p.add_argument("--tag", type=arguments.image_tag, metavar="TAG", help="tag of the bundle image (default: image.tag)")
    p.add_argument("--revision", type=arguments.line, metavar="REV",
                   help="org.opencontainers.image.revision (default: the series sha256)")
    p.add_argument("--builder-base", type=arguments.image_ref, metavar="IMAGE",
                   help="image the extension is built in (default: the base)")
    p.add_argument("--builder-setup", type=arguments.shell_line, metavar="SHELL", help="shell line run in the builder before compiling")
    p.add_argument("--out", metavar="DIR", help="where the build contexts go (default: <output.dir>/image)")
    p.add_argument("--push", action="store_true", help="push the tag after the check passes")
    p.add_argument("--dry-run", action="store_true", help="print the Dockerfiles and build contexts; ask no daemon")
    add_force_argument(p, "replace DIR/builder and DIR/bundle even if they hold files this tool did not write")


IMAGE = Command(
    "image",
    "build the bundle image: the base vLLM image with the series applied, then check it",
    "example: sm12x-bundle image --tag registry.example/sm12x-bundle:0.21.0 --push\n"
    "         sm12x-bundle image --dry-run",
    _arguments,
    run,
    {
        4: None,
        5: "could not run: the patch series is malformed or unsafe, or no lane is for the vLLM release "
        "the base image carries (the message names the lanes)",
        6: None, 7: None, 8: None, 9: None, 11: None,
    },
)
