"""The example jobs the golden Nomad files (tests/golden/nomad/) are rendered from.

Each golden job is a job of a small config (one pinned target, ``TARGETS``) rendered with a
stand-in manifest (``manifest()``): ``GOLDEN`` names each job's files and says how to render
them. tests/test_nomad.py reads these jobs for its own checks; ``bin/regenerate`` writes the
golden files and tests/test_generated.py fails while one differs from its render.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from sm12x_bundle import config as config_mod
from sm12x_bundle.outputs import nomad

ROOT = "/usr/local/lib/python3.12/dist-packages/vllm"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def manifest() -> dict:
    """A two-file manifest in the docs/design.md schema (hashes of stand-in bytes)."""
    files = [
        ("/device_allocator/cumem.py", ["cumem-stream-aware-free", "cumem-wake-up-rollback"], "0644"),
        ("/cumem_allocator.abi3.so", ["cumem-error-code-reset"], "0755"),
    ]
    entries = [
        {
            "container_path": ROOT + rel,
            "source": "files" + ROOT + rel,
            "pre_image_sha256": _sha("original " + rel),
            "sha256": _sha("patched " + rel),
            "patches": patches,
            "mode": mode,
        }
        for rel, patches, mode in files
    ]
    return {
        "schema": 1,
        "target": "vllm-openai-v0.21.0",
        "image": "vllm/vllm-openai:v0.21.0",
        "image_id": None,
        "vllm_root": ROOT,
        "versions": {"vllm": "0.21.0", "torch": None, "triton": None, "flashinfer": None, "deep_gemm": None},
        "pin": {"version": "0.21.0", "sha256": "05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058"},
        "series_sha256": _sha("series"),
        "content_hash": "0123456789abcdef",
        "files": sorted(entries, key=lambda f: f["container_path"]),
    }


TARGETS = """\
targets:
  - name: vllm-openai-v0.21.0
    image: vllm/vllm-openai:v0.21.0
    pinned: true
"""

HOST_JOB = """\
  - name: host-job
    model: /models/DeepSeek-V4-Flash
    served_model_name: deepseek-v4-flash
    target: vllm-openai-v0.21.0
    tensor_parallel_size: 4
    gpus: 4
    gpu_allocation: device
    gpu_model: "RTX PRO 6000"
    gpu_memory_utilization: 0.70
    non_cumem_gib: 22
    peer_residue_gib: 4.8
    port: 8001
    max_model_len: 131072
    extra_args: ["--max-num-seqs", "12"]
    env: {HF_HUB_OFFLINE: "1"}
    host_mounts: {/models: /srv/models}
    overlay_delivery: host
    load_time_s: 1200
"""

ARTIFACT_JOB = """\
  - name: artifact-job
    model: /models/MiMo-V2.5-Flash
    target: vllm-openai-v0.21.0
    tensor_parallel_size: 4
    gpus: 4
    gpu_allocation: shared
    gpu_ids: ["0", "1", "2", "3"]
    node_constraints: {"${meta.gpu_pool}": rtx-pro-6000-tp4-a}
    gpu_memory_utilization: 0.70
    non_cumem_gib: 22
    peer_residue_gib: 4.8
    port: 8002
    overlay_delivery: artifact
    artifact_base_url: https://overlays.example.internal/sm12x/
    service_provider: consul
    readonly_rootfs: true
"""


# A rotation peer with the engine gate, as the seeds' jobs would turn it on (host delivery).
GATED_JOB = """\
  - name: gated-job
    model: /models/DeepSeek-V4-Flash
    target: vllm-openai-v0.21.0
    tensor_parallel_size: 4
    gpus: 4
    gpu_allocation: shared
    gpu_ids: ["0", "1", "2", "3"]
    node_constraints: {"${meta.gpu_pool}": rtx-pro-6000-tp4-a}
    gpu_memory_utilization: 0.70
    non_cumem_gib: 22
    peer_residue_gib: 4.8
    port: 8003
    extra_args: ["--max-num-seqs", "12", "--enforce-eager"]
    env: {HF_HUB_OFFLINE: "1"}
    host_mounts: {/models: /srv/models}
    overlay_delivery: host
    memory_mb: 98304
    host_ram_gib: 256
    gate: engine
    gate_tool_dir: /opt/sm12x-bundle/tool
"""

# The allocator gate with artifact delivery: the gate fetches the overlay files too.
ALLOCATOR_GATED_JOB = """\
  - name: allocator-gated-job
    model: /models/MiMo-V2.5-Flash
    target: vllm-openai-v0.21.0
    tensor_parallel_size: 2
    gpus: 2
    gpu_allocation: shared
    gpu_ids: ["4", "5"]
    node_constraints: {"${meta.gpu_pool}": rtx-pro-6000-tp2-b}
    gpu_memory_utilization: 0.70
    non_cumem_gib: 22
    peer_residue_gib: 4.8
    port: 8004
    overlay_delivery: artifact
    artifact_base_url: https://overlays.example.internal/sm12x/
    gate: allocator
"""


def parse(text: str) -> config_mod.Config:
    return config_mod.parse(text, "cfg.yaml", Path("/base"))


def jobs_config(*jobs: str) -> config_mod.Config:
    return parse(TARGETS + "jobs:\n" + "".join(jobs))


# The fingerprint a golden gate requires: a stand-in, so that the golden files do not change
# with every edit of the tool (``sm12x-bundle nomad`` renders the tool's own, fingerprint.py).
TOOL = "0.0.0/sha256:" + "0" * 64


def render(*jobs: str, m: dict | None = None) -> dict[str, bytes]:
    return nomad.render_jobs(jobs_config(*jobs), {"vllm-openai-v0.21.0": m or manifest()}, TOOL)


# Golden job name -> its rendered files ({name}.nomad.hcl and {name}.nomad.json).
GOLDEN: dict[str, Callable[[], dict[str, bytes]]] = {
    "host-job": lambda: render(HOST_JOB),
    "artifact-job": lambda: render(ARTIFACT_JOB),
    "gated-job": lambda: render(GATED_JOB),
    "allocator-gated-job": lambda: render(ALLOCATOR_GATED_JOB),
}
