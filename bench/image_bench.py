#!/usr/bin/env python3
"""How long `sm12x-bundle image` takes on a warm base, the native build included.

Needs a Docker daemon (``eval "$(.ci/dockerd.sh start)"``). The base is the stand-in
of tests/docker_support.py (the real vLLM 0.21.0 files at the official root, built once
and then warm); the pinned sdist comes from the cache. Each run removes the builder
and bundle images first, so the extension is compiled every time and nothing but the
base is cached. Prints wall-clock seconds for the whole command (the base inspection,
the builder, the bundle build and the check in a container) and where they went.

Target: under 60 s on this 2-core machine. For scale: a full vLLM
source build costs 2-4 hours (peers' figure).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

import docker_support  # noqa: E402  (tests/ holds the stand-in builder)

from sm12x_bundle import config as config_mod  # noqa: E402
from sm12x_bundle.context import Context  # noqa: E402
from sm12x_bundle.containers import DockerEngine, docker_engine  # noqa: E402
from sm12x_bundle.outputs import image  # noqa: E402
from sm12x_bundle.progress import Progress  # noqa: E402

TARGET_S = 60.0
TAG = "sm12x-bench/bundle:latest"


class TimedEngine:
    """The Docker engine, with the seconds spent in each of its calls added up."""

    def __init__(self, engine: DockerEngine):
        self.engine = engine
        self.spent: dict[str, float] = defaultdict(float)

    def __getattr__(self, name):
        call = getattr(self.engine, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                label = name if name != "build" else f"build {args[2].split(':')[0]}"
                self.spent[label] += time.perf_counter() - start

        return timed


def _forget(engine: DockerEngine, ref_prefix: str) -> None:
    for img in engine.client.images.list():
        for tag in img.tags:
            if tag.startswith(ref_prefix):
                engine.client.images.remove(tag, force=True, noprune=False)


def one_run(ctx: Context, base: str, engine: DockerEngine) -> tuple[float, dict[str, float]]:
    _forget(engine, "sm12x-bundle-builder:")
    _forget(engine, TAG.split(":")[0])
    timed = TimedEngine(engine)
    cfg = config_mod.ImageConfig(base=base, tag=TAG)
    with tempfile.TemporaryDirectory(prefix="image-bench-") as out:
        start = time.perf_counter()
        image.build_bundle(ctx, cfg, timed, Path(out))
        return time.perf_counter() - start, dict(timed.spent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    if not os.environ.get("DOCKER_HOST"):
        print('DOCKER_HOST is unset: eval "$(.ci/dockerd.sh start)" first', file=sys.stderr)
    engine = docker_engine()
    engine.ping()
    ctx = Context(config_mod.parse(config_mod.default_text(), "<embedded default>", REPO), Progress.quiet())
    print(f"machine: {os.cpu_count()} CPUs; warming the stand-in base ...", flush=True)
    base = docker_support.ensure_vllm_standin(engine, docker_support.ensure_base(engine), ctx.source(), "official")
    print(f"base: {base.ref}; series: {', '.join(ctx.series.ids)}")
    runs = [one_run(ctx, base.ref, engine) for _ in range(args.repeat)]
    best, spent = min(runs, key=lambda r: r[0])
    detail = ", ".join(f"{k} {v:.1f} s" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]))
    print(f"runs: {', '.join(f'{r[0]:.1f} s' for r in runs)}")
    print(f"bundle image on a warm base, native build included: {best:6.1f} s "
          f"(target < {TARGET_S:.0f} s: {'ok' if best < TARGET_S else 'MISSED'})")
    print(f"  of which: {detail}")
    print("a full vLLM source build: peers report 2-4 hours")
    return 0


if __name__ == "__main__":
    sys.exit(main())
