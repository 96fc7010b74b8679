"""The example the golden Dockerfiles (tests/golden/image/) are rendered from.

A small vLLM-shaped tree (one Python file, one native source) and a two-patch series (a
Python fix, a native fix), planned as a bundle on a fake base image whose id and digest are
fixed. tests/test_image.py builds its plans from the same pieces; ``bin/regenerate`` writes
the golden files and tests/test_generated.py fails while one differs from its render.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from sm12x_bundle import config as config_mod
from sm12x_bundle.config import TargetConfig
from sm12x_bundle.containers import OFFICIAL_VLLM_ROOT, ImageFile
from sm12x_bundle.context import Context
from sm12x_bundle.outputs import image, native_build
from sm12x_bundle.plan import originals as plan_originals
from sm12x_bundle.plan import target as plan_target
from sm12x_bundle.progress import Progress
from tools.patchkit import make_patch, write_series

EPOCH = {"SOURCE_DATE_EPOCH": "1790000000"}
BASE_ID = "sha256:" + "b" * 64
BASE_DIGEST = "sha256:" + "e" * 64  # its manifest digest, as a registry would report it

CUMEM_OLD = "".join(f"line {n}\n" for n in range(1, 12))
CUMEM_NEW = CUMEM_OLD.replace("line 6\n", "line 6 (fixed)\n")
CPP_OLD = '#include "cumem_allocator_compat.h"\n' + "".join(f"int v{n} = {n};\n" for n in range(10))
CPP_NEW = CPP_OLD.replace("int v5 = 5;\n", "int v5 = 55;\n")
COMPAT = "#pragma once\n#include <cuda.h>\n"
# The base's cached bytecode of the patched module, which the bundle must drop.
GOLDEN_BYTECODE = {"vllm/device_allocator/cumem.py": [
    OFFICIAL_VLLM_ROOT + "/device_allocator/__pycache__/cumem.cpython-312.pyc"]}


def write_tree(folder: Path) -> Path:
    """The pinned tree, as folder/vllm-0.21.0."""
    root = folder / "vllm-0.21.0"
    files = {
        "PKG-INFO": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.21.0\n",
        "vllm/__init__.py": "",
        "vllm/device_allocator/cumem.py": CUMEM_OLD,
        "csrc/cumem_allocator.cpp": CPP_OLD,
        "csrc/cumem_allocator_compat.h": COMPAT,
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def native_headers(**extra: str) -> dict[str, str]:
    return {"Sm12x_Kind": "native", "Sm12x_Builds": "vllm/cumem_allocator.abi3.so", **extra}


def write_example_series(folder: Path) -> Path:
    """The two-patch series, as folder/patches/series."""
    return write_series(
        folder / "patches",
        {
            "0001-cumem-fix.patch": make_patch(
                {"vllm/device_allocator/cumem.py": (CUMEM_OLD, CUMEM_NEW)}, "cumem fix", Last_Update="2026-11-20"
            ),
            "0002-native-fix.patch": make_patch(
                {"csrc/cumem_allocator.cpp": (CPP_OLD, CPP_NEW)}, "native fix", **native_headers()
            ),
        },
    )


def example_context(folder: Path, tree: Path, series_file: Path) -> Context:
    text = (
        f"pin:\n  version: '0.21.0'\n  source: {tree}\nseries: {series_file}\n"
        "image:\n  base: example/vllm-openai:v0.21.0\n  tag: example/bundle:test\n"
    )
    # A cache of its own: the fake images reuse ids for other content.
    return Context(config_mod.parse(text, "test.yaml", folder), Progress.quiet(), folder / "cache")


def fake_base(ctx: Context, **changes) -> image.BaseImage:
    return dataclasses.replace(image.BaseImage(ctx.config.image.base, BASE_ID, BASE_DIGEST), **changes)


def fake_target(ctx: Context, pre_images=None, **side_changes) -> plan_target.TargetPlan:
    """The base planned as a target, its files the pinned tree's (``pre_images`` replaces some)."""
    cfg = ctx.config.image
    t = TargetConfig(name=cfg.tag, image=cfg.base, root=OFFICIAL_VLLM_ROOT, pinned=True)
    side = plan_originals.pinned_side(t, ctx.source())
    tree_read = side.read

    def read(paths):
        got = tree_read(paths)
        for path, data in (pre_images or {}).items():
            if path in got:
                got[path] = None if data is None else ImageFile(data, 0o644)
        return got

    fields = {"image_id": BASE_ID, "import_error": "ModuleNotFoundError: torch", "bytecode": {}, "read": read}
    side = dataclasses.replace(side, **{**fields, **side_changes})
    return plan_target.plan_lane(t, ctx.lanes[0], side, ctx.source, BASE_ID)


def make_plan(ctx: Context, env=EPOCH, labels=None, **side_changes) -> image.BundlePlan:
    base = fake_base(ctx, labels=labels or {})
    return image.plan_bundle(ctx.config.image, fake_target(ctx, **side_changes), ctx.source(), base, env)


def render() -> dict[str, bytes]:
    """Dockerfile.builder and Dockerfile.bundle of the example, by file name."""
    with tempfile.TemporaryDirectory(prefix="sm12x-golden-image-") as tmp:
        folder = Path(tmp)
        ctx = example_context(folder, write_tree(folder), write_example_series(folder))
        plan = make_plan(ctx, bytecode=GOLDEN_BYTECODE)
        return {
            "Dockerfile.builder": native_build.builder_dockerfile(plan.builder).encode(),
            "Dockerfile.bundle": image.bundle_dockerfile(plan).encode(),
        }
