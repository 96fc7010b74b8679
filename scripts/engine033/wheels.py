"""Gather the wheels scripts/gpu-engine-033.sh installs on the GPU machine (run here, with network).

    python3 scripts/engine033/wheels.py DEST

DEST receives the 0.21.0 payload's pinned `dependencies` (src/sm12x_bundle/data/gpu-payload.json):
the third-party packages vLLM's offline LLM(...) path imports that the machine's image lacks.
plus ENGINE_033: what vLLM 0.33.0's model loader imports beyond them. The static crawl in
docs/records/engine-0.33.0-route-study-2026-11-27.md missed compressed-tensors (0.33.0's
base_loader imports it for every model, through log_online_quantization); the first GPU
run (2026-11-27) stopped there. loguru is its one requirement the payload lacks.
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


# Pinned as requirements/common.txt of 0.33.0 asks (compressed-tensors == 0.17.0), by the
# sha256 PyPI lists for each file.
ENGINE_033 = (
    payload.Wheel("compressed_tensors-0.17.0-py3-none-any.whl",
                  "4a1b89b508f7efb8ffb4eee8a6e69e0452d9b080cae130146025c64fbe9fa9aa"),
    payload.Wheel("loguru-0.7.3-py3-none-any.whl",
                  "31a33c10c8e1e10422bfd431aeb5d351c7cf7fa671e3c4df004162264b28220c"),
)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    dest = Path(argv[0])
    dest.mkdir(parents=True, exist_ok=True)
    pins = payload.load_pins()
    total = 0
    try:
        for wheel in (*pins.dependencies, *ENGINE_033):
            found = payload.fetch_wheel(cache.cache_dir(), wheel, pins.index)
            shutil.copyfile(found, dest / wheel.filename)
            total += found.stat().st_size
    except BundleError as exc:
        print(f"wheels: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"{len(pins.dependencies) + len(ENGINE_033)} wheels, {total / 1e6:.1f} MB, in {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
