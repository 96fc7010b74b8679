"""Gather the wheels scripts/gpu-engine-033.sh installs on the GPU machine (run here, with network).

    python3 scripts/engine033/wheels.py DEST

DEST receives the 0.21.0 payload's pinned `dependencies` (src/sm12x_bundle/data/gpu-payload.json):
the third-party packages vLLM's offline LLM(...) path imports that the machine's image lacks.
vLLM 0.33.0's engine path imports no package beyond them and the machine's own (the static
crawl in docs/records/engine-0.33.0-route-study-2026-11-27.md), so no wheel is added for it.
Each comes from the cache (SM12X_BUNDLE_CACHE, else ~/.cache/sm12x-bundle), else from the
index, verified by its pinned sha256 (enginecheck/payload.py's fetch_wheel). vLLM's own
wheel is not gathered: 0.33.0 runs from its source tree.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from sm12x_bundle.enginecheck import payload  # noqa: E402
from sm12x_bundle.errors import BundleError  # noqa: E402
from sm12x_bundle.source import cache  # noqa: E402


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    dest = Path(argv[0])
    dest.mkdir(parents=True, exist_ok=True)
    pins = payload.load_pins()
    total = 0
    try:
        for wheel in pins.dependencies:
            found = payload.fetch_wheel(cache.cache_dir(), wheel, pins.index)
            shutil.copyfile(found, dest / wheel.filename)
            total += found.stat().st_size
    except BundleError as exc:
        print(f"wheels: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"{len(pins.dependencies)} wheels, {total / 1e6:.1f} MB, in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
