"""``sm12x-bundle nomad``: the Nomad job specs (outputs/nomad.py renders them)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..context import Context
from ..errors import ConfigError
from ..fsutil import refuse_protected
from ..outputs.nomad import find_manifests, render_jobs, write_jobs
from . import arguments
from .command import Command, add_force_argument


def run(ctx: Context, args: argparse.Namespace) -> int:
    config = ctx.config
    if not config.jobs:
        raise ConfigError(f"{config.origin}: no jobs to render: add a 'jobs:' list (example: the embedded default, shown by nomad/README.md)")
    files = render_jobs(config, find_manifests(config, args.manifest or ()))
    out = refuse_protected(args.out, "Nomad folder") if args.out is not None else Path(config.output.dir) / "nomad"
    for path, changed in write_jobs(files, out, args.force):
        print(f"{path}{'' if changed else ' (unchanged)'}")
    print(
        f"{len(config.jobs)} job(s): memory budget fits, HCL and JSON read back as the same job; "
        "not submitted (no Nomad here: run 'nomad job validate' on a cluster). Nomad deploys each job on "
        "its own: run one, wait until 'nomad job status JOB' shows its deployment successful, then the next"
    )
    return 0


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", metavar="DIR", help="where to write the specs (default: <output.dir>/nomad)")
    p.add_argument(
        "--manifest",
        action="append",
        type=arguments.existing_file,
        metavar="FILE",
        help="an overlay manifest to use instead of <output.overlays>/<target>/current.json (repeatable)",
    )
    add_force_argument(p, "overwrite files of the same name in DIR even if DIR is not marked as written by this tool")


NOMAD = Command(
    "nomad",
    "render Nomad job specs (HCL2 and API JSON) for the config's jobs",
    "example: sm12x-bundle nomad --manifest nomad/example-manifest.json --out nomad",
    _arguments,
    run,
    {9: "the generated HCL and API JSON do not read back as the same job (a bug in sm12x-bundle; nothing written)", 11: None,
     12: "this machine stands in the way: a job's target has no overlay manifest here (run 'overlay' "
     "first, or give --manifest), or a path it cannot read or write"},
)
