"""Every bad input gets one sentence and its documented exit code, before anything is
written, and never a traceback.

Each row is a command line (and, for config rows, one edit of a valid config); the
expected exit code; a fragment of the sentence (config rows: ``cfg.yaml:LINE: KEY``
too). Every row checks that stderr has no "Traceback" and that the working directory
and the cache are exactly as they were. Rows run in-process through ``cli.main``; a few
also run as real ``python3 -m sm12x_bundle`` processes.
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from sm12x_bundle import cli
from sm12x_bundle.checks import report as checks_report

CONFIG = "cfg.yaml"

# A valid config: the embedded default's shape, one target and one job.
BASE = """\
pin:
  version: "0.21.0"
  sha256: 05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058
check:
  versions: []
  fuzz: 0
output:
  dir: build
  overlays: overlays
targets:
  - name: vllm-openai-v0.21.0
    image: vllm/vllm-openai:v0.21.0
    root: /usr/local/lib/python3.12/dist-packages/vllm
    pinned: true
image:
  base: vllm/vllm-openai:v0.21.0
  tag: sm12x-bundle:0.21.0
  source_url: https://example.invalid/sm12x-bundle
  cuda_home: /usr/local/cuda
jobs:
  - name: dsv4-flash
    model: /models/DeepSeek-V4-Flash
    target: vllm-openai-v0.21.0
    tensor_parallel_size: 4
    gpus: 4
    gpu_allocation: shared
    gpu_ids: ["0", "1", "2", "3"]
    gpu_memory_utilization: 0.70
    non_cumem_gib: 22
    peer_residue_gib: 4.8
    port: 8001
    extra_args: ["--max-num-seqs", "12"]
    env:
      HF_HUB_OFFLINE: "1"
    host_mounts:
      /models: /srv/models
    overlay_delivery: host
    overlay_host_dir: /opt/sm12x-bundle/overlays
    load_time_s: 1200
    min_healthy_time_s: 60
    healthy_deadline_s: 1800
    progress_deadline_s: 2400
"""

PIN = """\
pin:
  version: "0.21.0"
  sha256: 05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058
"""
LANES = """\
lanes:
  - version: "0.21.0"
    sha256: 05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058
  - version: "0.33.0"
    sha256: f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
"""

PEER = """\
  - name: mimo-flash
    model: /models/MiMo-V2.5-Flash
    target: vllm-openai-v0.21.0
    tensor_parallel_size: 4
    gpus: 4
    gpu_allocation: shared
    gpu_ids: ["0", "1", "2", "3"]
    gpu_memory_utilization: 0.70
    non_cumem_gib: 22
    peer_residue_gib: 4.8
    port: 8001
    load_time_s: 1200
"""


@dataclass(frozen=True)
class Config:
    """A config row: BASE with ``old`` replaced by ``new``; the error names ``key`` on
    the line where ``at`` (default: the first line of ``new``) is written."""

    key: str
    old: str
    new: str
    at: str = ""
    gate: bool = False  # the job also asks for the engine gate, with room for it in its deadline

    def text(self) -> str:
        assert BASE.count(self.old) == 1, self.old
        text = BASE.replace(self.old, self.new)
        if self.gate:
            text = text.replace(GATE_AT, GATE_AT + "    gate: engine\n    gate_time_s: 300\n", 1)
        return text

    def line(self) -> int:
        """The line of ``at``; its last occurrence, where a row repeats a name."""
        at = (self.at or self.new.splitlines()[0]).strip()
        return [i for i, line in enumerate(self.text().splitlines(), 1) if line.strip() == at][-1]


def cfg(key: str, old: str, new: str, at: str = "") -> Config:
    return Config(key, old, new, at)


GATE_AT = "    load_time_s: 1200\n"


def gated(key: str, old: str, new: str, at: str = "") -> Config:
    return Config(key, old, new, at, gate=True)


DRY = ["build", "--dry-run"]

# (id, argv, config edit or None, exit code, fragment of the sentence)
ROWS = [
    # --- config values, refused at load, so `build --dry-run` refuses them too
    ("port-too-big", DRY, cfg("jobs[0].port", "port: 8001", "port: 99999"), 3, "port must be in 1-65535, not 99999"),
    ("port-zero", ["nomad"], cfg("jobs[0].port", "port: 8001", "port: 0"), 3, "port must be in 1-65535, not 0"),
    ("utilization-zero", DRY, cfg("jobs[0].gpu_memory_utilization", "gpu_memory_utilization: 0.70", "gpu_memory_utilization: 0"), 3, "must be in (0, 1], not 0"),
    ("utilization-above-one", DRY, cfg("jobs[0].gpu_memory_utilization", "gpu_memory_utilization: 0.70", "gpu_memory_utilization: 1.5"), 3, "must be in (0, 1], not 1.5"),
    ("budget-does-not-fit", DRY, cfg("jobs[0].gpu_memory_utilization", "gpu_memory_utilization: 0.70", "gpu_memory_utilization: 0.85"), 3, "the largest gpu_memory_utilization that fits is 0.71"),
    ("capacity-zero", DRY, cfg("jobs[0].gpu_capacity_gib", "    port: 8001\n", "    port: 8001\n    gpu_capacity_gib: 0\n", "    gpu_capacity_gib: 0"), 3, "must be positive, not 0"),
    ("non-cumem-negative", DRY, cfg("jobs[0].non_cumem_gib", "non_cumem_gib: 22", "non_cumem_gib: -1"), 3, "must be 0 or more, not -1"),
    ("tp-not-gpus", DRY, cfg("jobs[0].tensor_parallel_size", "tensor_parallel_size: 4", "tensor_parallel_size: 2"), 3, "tensor_parallel_size 2 needs as many GPUs, but gpus is 4"),
    ("gpus-zero", DRY, cfg("jobs[0].gpus", "gpus: 4", "gpus: 0"), 3, "must be 1 or more, not 0"),
    ("gpu-ids-count", DRY, cfg("jobs[0].gpu_ids", 'gpu_ids: ["0", "1", "2", "3"]', 'gpu_ids: ["0", "1"]'), 3, "needs gpu_ids listing the 4 GPUs"),
    ("gpu-model-with-shared", DRY, cfg("jobs[0].gpu_model", "    port: 8001\n", "    port: 8001\n    gpu_model: RTX\n", "    gpu_model: RTX"), 3, "only gpu_allocation 'device' has"),
    ("load-beyond-healthy-deadline", DRY, cfg("jobs[0].healthy_deadline_s", "load_time_s: 1200", "load_time_s: 2000", "    healthy_deadline_s: 1800"), 3, "healthy_deadline_s (1800) must exceed load_time_s (2000)"),
    ("progress-before-healthy", DRY, cfg("jobs[0].progress_deadline_s", "progress_deadline_s: 2400", "progress_deadline_s: 1000"), 3, "progress_deadline_s (1000) must exceed healthy_deadline_s (1800)"),
    ("min-healthy-negative", DRY, cfg("jobs[0].min_healthy_time_s", "min_healthy_time_s: 60", "min_healthy_time_s: -1"), 3, "must be at least 0"),
    ("memory-zero", DRY, cfg("jobs[0].memory_mb", "    port: 8001\n", "    port: 8001\n    memory_mb: 0\n", "    memory_mb: 0"), 3, "must be positive, not 0"),
    ("max-model-len-zero", DRY, cfg("jobs[0].max_model_len", "    port: 8001\n", "    port: 8001\n    max_model_len: 0\n", "    max_model_len: 0"), 3, "must be positive, not 0"),
    ("job-name-unsafe", DRY, cfg("jobs[0].name", "  - name: dsv4-flash", "  - name: dsv4_flash!"), 3, "a job name is letters, digits and dashes"),
    ("job-names-unique", DRY, cfg("jobs[1].name", "    progress_deadline_s: 2400\n", "    progress_deadline_s: 2400\n" + PEER.replace("mimo-flash", "dsv4-flash").replace("port: 8001", "port: 8002"), "- name: dsv4-flash"), 3, "job names must be unique"),
    ("job-unknown-target", DRY, cfg("jobs[0].target", "    target: vllm-openai-v0.21.0", "    target: vllm-openai-v0.21"), 3, "names target 'vllm-openai-v0.21', which is not in targets (did you mean 'vllm-openai-v0.21.0'?)"),
    ("peers-share-a-port", DRY, cfg("jobs[1].port", "    progress_deadline_s: 2400\n", "    progress_deadline_s: 2400\n" + PEER, "port: 8001"), 3, "jobs 'dsv4-flash' and 'mimo-flash' share a node and both use port 8001"),
    ("allocation-unknown", DRY, cfg("jobs[0].gpu_allocation", "gpu_allocation: shared", "gpu_allocation: mig"), 3, "unknown gpu_allocation 'mig': choose one of device, shared"),
    ("delivery-unknown", DRY, cfg("jobs[0].overlay_delivery", "overlay_delivery: host", "overlay_delivery: rsync"), 3, "unknown overlay_delivery 'rsync'"),
    ("artifact-without-url", DRY, cfg("jobs[0].artifact_base_url", "overlay_delivery: host", "overlay_delivery: artifact", "  - name: dsv4-flash"), 3, "overlay_delivery 'artifact' needs artifact_base_url"),
    ("artifact-url-not-http", DRY, cfg("jobs[0].artifact_base_url", "    overlay_delivery: host\n", "    overlay_delivery: artifact\n    artifact_base_url: ftp://x/overlays\n", "    artifact_base_url: ftp://x/overlays"), 3, "must be a plain http(s) URL, not 'ftp://x/overlays'"),
    ("overlay-host-dir-relative", DRY, cfg("jobs[0].overlay_host_dir", "overlay_host_dir: /opt/sm12x-bundle/overlays", "overlay_host_dir: opt/overlays"), 3, "must be a normalised absolute path, not 'opt/overlays'"),
    ("provider-unknown", DRY, cfg("jobs[0].service_provider", "    port: 8001\n", "    port: 8001\n    service_provider: etcd\n", "    service_provider: etcd"), 3, "unknown service_provider 'etcd'"),
    ("extra-args-managed-flag", DRY, cfg("jobs[0].extra_args[0]", 'extra_args: ["--max-num-seqs", "12"]', 'extra_args: ["--port=9000"]'), 3, "extra_args sets --port"),
    ("env-managed", DRY, cfg("jobs[0].env.PYTHONPYCACHEPREFIX", 'HF_HUB_OFFLINE: "1"', 'PYTHONPYCACHEPREFIX: "/tmp"'), 3, "env PYTHONPYCACHEPREFIX is set by sm12x-bundle"),
    ("env-key-invalid", DRY, cfg("jobs[0].env.1BAD", 'HF_HUB_OFFLINE: "1"', '1BAD: "1"'), 3, "env key '1BAD' is not a valid variable name"),
    ("host-mount-relative", DRY, cfg("jobs[0].host_mounts.models", "/models: /srv/models", "models: /srv/models"), 3, "must be a normalised absolute path, not 'models'"),
    ("datacenters-empty", DRY, cfg("jobs[0].datacenters", "    port: 8001\n", "    port: 8001\n    datacenters: []\n", "    datacenters: []"), 3, "must name at least one datacenter"),
    ("entrypoint-empty", DRY, cfg("jobs[0].entrypoint", "    port: 8001\n", "    port: 8001\n    entrypoint: []\n", "    entrypoint: []"), 3, "entrypoint must not be empty"),
    ("port-is-a-string", DRY, cfg("jobs[0].port", "port: 8001", 'port: "8001"'), 3, "must be int, not str"),
    ("unknown-job-key", DRY, cfg("jobs[0].prot", "port: 8001", "prot: 8001"), 3, "unknown key 'jobs[0].prot' (did you mean 'port'?)"),
    # the rollout gate (nomad/README.md)
    ("gate-unknown", DRY, cfg("jobs[0].gate", "    port: 8001\n", "    port: 8001\n    gate: smoke\n", "    gate: smoke"), 3, "unknown gate 'smoke': choose one of none, engine, allocator"),
    ("gate-with-device-gpus", DRY, cfg("jobs[0].gate", '    gpu_allocation: shared\n    gpu_ids: ["0", "1", "2", "3"]\n', "    gpu_allocation: device\n    gate: engine\n", "    gate: engine"), 3, "a gate needs gpu_allocation 'shared': with 'device', Nomad reserves GPUs for each task on its own"),
    ("gate-tool-dir-relative", DRY, cfg("jobs[0].gate_tool_dir", "    port: 8001\n", "    port: 8001\n    gate: engine\n    gate_time_s: 300\n    gate_tool_dir: opt/tool\n", "    gate_tool_dir: opt/tool"), 3, "must be a normalised absolute path, not 'opt/tool'"),
    ("gate-tool-dir-not-normalised", DRY, cfg("jobs[0].gate_tool_dir", "    port: 8001\n", "    port: 8001\n    gate: engine\n    gate_time_s: 300\n    gate_tool_dir: /opt/../tool\n", "    gate_tool_dir: /opt/../tool"), 3, "must be a normalised absolute path, not '/opt/../tool'"),
    ("gate-beyond-healthy-deadline", DRY, cfg("jobs[0].healthy_deadline_s", "    port: 8001\n", "    port: 8001\n    gate: engine\n", "    healthy_deadline_s: 1800"), 3, "healthy_deadline_s (1800) must exceed load_time_s (1200) + gate_time_s (600)"),
    ("gate-time-zero", DRY, cfg("jobs[0].gate_time_s", "    port: 8001\n", "    port: 8001\n    gate: allocator\n    gate_time_s: 0\n", "    gate_time_s: 0"), 3, "must be positive, not 0"),
    ("gate-env-pythonpath", DRY, gated("jobs[0].env.PYTHONPATH", '      HF_HUB_OFFLINE: "1"\n', '      PYTHONPATH: /x\n', "      PYTHONPATH: /x"), 3, "env PYTHONPATH is set by sm12x-bundle in the gate ('/opt/sm12x-bundle/src')"),
    ("gate-entrypoint-without-python", DRY, gated("jobs[0].entrypoint", "    port: 8001\n", "    port: 8001\n    entrypoint: [vllm, serve]\n", "    entrypoint: [vllm, serve]"), 3, "the gate runs sm12x-bundle with the entrypoint's Python"),
    ("gate-mount-taken", DRY, gated("jobs[0].host_mounts./opt/sm12x-bundle", "      /models: /srv/models\n", "      /models: /srv/models\n      /opt/sm12x-bundle: /srv/tool\n", "      /opt/sm12x-bundle: /srv/tool"), 3, "/opt/sm12x-bundle is where the gate mounts gate_tool_dir"),
    # the host-RAM preflight
    ("host-ram-zero", DRY, cfg("jobs[0].host_ram_gib", "    port: 8001\n", "    port: 8001\n    host_ram_gib: 0\n", "    host_ram_gib: 0"), 3, "must be positive, not 0"),
    ("host-ram-does-not-fit", ["nomad"], cfg("jobs[0].host_ram_gib", "    progress_deadline_s: 2400\n", "    progress_deadline_s: 2400\n    host_ram_gib: 128\n" + PEER.replace("port: 8001", "port: 8002"), "    host_ram_gib: 128"), 3, "the host RAM budget does not fit: 64 GiB dsv4-flash + 64 GiB mimo-flash + 8 GiB margin = 136 GiB > 128 GiB host_ram_gib"),
    ("host-ram-disagrees", DRY, cfg("jobs[0].host_ram_gib", "    progress_deadline_s: 2400\n", "    progress_deadline_s: 2400\n    host_ram_gib: 256\n" + PEER.replace("port: 8001", "port: 8002") + "    host_ram_gib: 512\n", "    host_ram_gib: 256"), 3, "jobs that share a node give different host_ram_gib ('dsv4-flash' 256 GiB, 'mimo-flash' 512 GiB)"),
    ("pin-version-empty", DRY, cfg("pin.version", 'version: "0.21.0"', 'version: ""'), 3, "must be a vLLM release version such as 0.21.0, not ''"),
    ("pin-version-word", ["series"], cfg("pin.version", 'version: "0.21.0"', 'version: "latest"'), 3, "not 'latest'"),
    ("pin-sha256-short", DRY, cfg("pin.sha256", "  sha256: 05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058", "  sha256: 05ff89c3"), 3, "must be 64 lowercase hex digits"),
    ("pin-index-url-no-scheme", ["fetch"], cfg("pin.index_url", "  sha256: 05ff", "  index_url: pypi.org/simple\n  sha256: 05ff", "  index_url: pypi.org/simple"), 3, "must be a URL starting with http:// or https:// or file://"),
    ("cfg-check-fuzz-negative", ["check"], cfg("check.fuzz", "fuzz: 0", "fuzz: -1"), 3, "must be 0 or more"),
    ("check-version-empty", ["check"], cfg("check.versions[0]", "versions: []", 'versions: [""]'), 3, "must be a vLLM release version"),
    ("output-dir-empty", DRY, cfg("output.dir", "dir: build", 'dir: ""'), 3, "must not be empty"),
    ("target-name-escapes", DRY, cfg("targets[0].name", "  - name: vllm-openai-v0.21.0", "  - name: ../escape"), 3, "it names a folder"),
    ("target-names-unique", DRY, cfg("targets[1].name", "    pinned: true\n", "    pinned: true\n  - name: vllm-openai-v0.21.0\n    image: vllm/vllm-openai:v0.21.0\n", "- name: vllm-openai-v0.21.0"), 3, "target names must be unique"),
    ("target-image-malformed", DRY, cfg("targets[0].image", "    image: vllm/vllm-openai:v0.21.0", "    image: Not An Image!"), 3, "must be an image reference"),
    ("target-root-relative", DRY, cfg("targets[0].root", "root: /usr/local/lib/python3.12/dist-packages/vllm", "root: usr/lib/vllm"), 3, "must be a normalised absolute path"),
    ("cfg-image-digest-malformed", DRY, cfg("image.base_digest", "  tag: sm12x-bundle:0.21.0\n", "  tag: sm12x-bundle:0.21.0\n  base_digest: sha256:abc\n", "  base_digest: sha256:abc"), 3, "must be a registry digest"),
    ("cfg-image-tag-malformed", DRY, cfg("image.tag", "  tag: sm12x-bundle:0.21.0", "  tag: sm12x bundle"), 3, "must be an image reference"),
    ("image-source-url-no-scheme", DRY, cfg("image.source_url", "source_url: https://example.invalid/sm12x-bundle", "source_url: example.invalid/sm12x-bundle"), 3, "must be a URL starting with http:// or https://"),
    ("image-revision-two-lines", DRY, cfg("image.revision", "  cuda_home: /usr/local/cuda\n", '  cuda_home: /usr/local/cuda\n  revision: "a\\nb"\n', '  revision: "a\\nb"'), 3, "must not hold a control or invisible formatting character ('\\n' at position 1)"),
    ("image-cuda-home-relative", DRY, cfg("image.cuda_home", "cuda_home: /usr/local/cuda", "cuda_home: cuda"), 3, "must be a normalised absolute path"),
    ("lanes-with-pin", DRY, cfg("pin", "check:\n", LANES + "check:\n", "pin:"), 3, "'pin:' is the one-lane form"),
    ("lanes-duplicate", DRY, cfg("lanes[1].version", PIN, LANES.replace('"0.33.0"', '"0.21.0"'), '- version: "0.21.0"'), 3, "lane versions must be unique"),
    ("lane-sha256-short", DRY, cfg("lanes[1].sha256", PIN, LANES.replace("sha256: f4c3", "sha256: 0f4c3"), "sha256: 0f4c3" + LANES.split("sha256: f4c3")[1].split("\n")[0]), 3, "must be 64 lowercase hex digits"),
    ("lane-series-absent", DRY, cfg("lanes[1].series", PIN, LANES + "    series: absent/series\n", "series: absent/series"), 3, "does not exist"),
    ("lane-series-is-a-device", DRY, cfg("lanes[1].series", PIN, LANES + "    series: /dev/zero\n", "series: /dev/zero"), 3, "the series file '/dev/zero' is a character device, not a regular file"),
    ("series-is-a-device", ["series"], cfg("series", "check:\n", "series: /dev/null\ncheck:\n", "series: /dev/null"), 3, "the series file '/dev/null' is a character device, not a regular file"),
    ("series-is-a-folder", DRY, cfg("series", "check:\n", "series: .\ncheck:\n", "series: ."), 3, "is a folder, not a regular file"),
    ("lane-without-shipped-series", DRY, cfg("lanes[1].version", PIN, LANES.replace('"0.33.0"', '"0.26.0"'), '- version: "0.26.0"'), 3, "no series is shipped for vLLM 0.26.0"),
    ("check-version-below-every-lane", ["check"], cfg("check.versions[0]", "versions: []", 'versions: ["0.20.0"]'), 3, "0.20.0 is below every lane (0.21.0)"),
    # --- command-line values: argparse's exit 2, before the config is even read
    ("check-fuzz-negative", ["check", "--fuzz", "-1"], None, 2, "argument --fuzz: must be 0 or more, not -1"),
    ("check-fuzz-word", ["check", "--fuzz", "x"], None, 2, "argument --fuzz: must be a whole number, not 'x'"),
    ("check-junit-folder", ["check", "--junit", "."], None, 2, "argument --junit: '.' is a folder"),
    ("check-junit-empty", ["check", "--junit", ""], None, 2, "argument --junit: must name a file"),
    ("check-junit-under-a-file", ["check", "--junit", f"{CONFIG}/report.xml"], None, 2, "is a file, not a folder"),
    ("check-vllm-empty", ["check", "--vllm", ""], None, 2, "argument --vllm: must be a vLLM release version such as 0.21.0, not ''"),
    ("check-vllm-word", ["check", "--vllm", "latest"], None, 2, "not 'latest'"),
    ("fetch-vllm-empty", ["fetch", "--vllm", ""], None, 2, "argument --vllm: must be a vLLM release version"),
    ("apply-needs-out", ["apply"], None, 2, "the following arguments are required: --out"),
    ("unknown-command", ["frobnicate"], None, 2, "invalid choice: 'frobnicate'"),
    ("unknown-option", ["build", "--dry-run", "--bogus"], None, 2, "unrecognized arguments: --bogus"),
    ("overlay-root-without-image", ["overlay", "--root", "/opt/vllm"], None, 2, "--root needs --image"),
    ("overlay-root-relative", ["overlay", "--image", "glm:nvfp4", "--root", "opt/vllm"], None, 2, "argument --root: must be a normalised absolute path"),
    ("overlay-image-malformed", ["overlay", "--image", "Bad Image"], None, 2, "argument --image: must be an image reference"),
    ("overlay-target-unsafe", ["overlay", "--target", "../x"], None, 2, "argument --target: must be letters, digits"),
    ("overlay-target-and-image", ["overlay", "--target", "a", "--image", "glm:nvfp4"], None, 2, "give either --target NAME or --image REF, not both"),
    ("overlay-manifest-missing", ["overlay", "--verify", "--manifest", "absent.json"], None, 2, "argument --manifest: 'absent.json' does not exist"),
    ("overlay-manifest-without-verify", ["overlay", "--manifest", CONFIG], None, 2, "--manifest is for --verify"),
    ("image-digest-malformed", ["image", "--dry-run", "--base-digest", "abc"], None, 2, "argument --base-digest: must be a registry digest"),
    ("image-tag-malformed", ["image", "--dry-run", "--tag", "bad tag"], None, 2, "argument --tag: must be an image reference"),
    ("image-revision-empty", ["image", "--dry-run", "--revision", " "], None, 2, "argument --revision: must not be empty"),
    ("image-builder-setup-two-lines", ["image", "--dry-run", "--builder-setup", "apt-get update\nrm -rf /"], None, 2, "argument --builder-setup: must be one line"),
    ("nomad-manifest-missing", ["nomad", "--manifest", "absent.json"], None, 2, "argument --manifest: 'absent.json' does not exist"),
    ("selftest-cycles-zero", ["selftest", "--installed", "--cycles", "0"], None, 2, "argument --cycles: must be 1 or more, not 0"),
    ("selftest-speed-target", ["selftest", "--installed", "--speed-target", "1.5"], None, 2, "argument --speed-target: must be in (0, 1], not 1.5"),
    ("selftest-size-zero", ["selftest", "--installed", "--size-gib", "0"], None, 2, "argument --size-gib: must be a positive number, not 0"),
    ("selftest-wake-after-negative", ["selftest", "--installed", "--wake-after", "-1"], None, 2, "argument --wake-after: must be 0 or more, not -1"),
    ("selftest-timeout-nan", ["selftest", "--installed", "--timeout", "nan"], None, 2, "argument --timeout: must be a positive number, not nan"),
    ("selftest-scenario-typo", ["selftest", "--installed", "--scenario", "sped"], None, 2, "(did you mean 'speed'?)"),
    ("selftest-compare-one-tree", ["selftest", "--compare", "."], None, 2, "--compare takes two trees (PRISTINE PATCHED) or none, not 1"),
    ("selftest-tree-missing", ["selftest", "--tree", "absent"], None, 2, "argument --tree: 'absent' does not exist"),
    ("selftest-json-out-folder", ["selftest", "--installed", "--json-out", "."], None, 2, "argument --json-out: '.' is a folder"),
    ("selftest-work-is-a-file", ["selftest", "--installed", "--work", CONFIG], None, 2, f"argument --work: '{CONFIG}' is a file, not a folder"),
    # --- the config file itself
    # --- lanes named on the command line: checked against the config, before anything is fetched
    ("check-vllm-below-every-lane", ["check", "--vllm", "0.20.0"], None, 2, "--vllm 0.20.0 is below every lane (the lanes: 0.21.0)"),
    ("check-lane-unknown", ["check", "--lane", "0.33.0"], None, 2, "--lane 0.33.0: the configuration has no such lane (its lanes: 0.21.0)"),
    ("apply-lane-unknown", ["apply", "--lane", "0.33.0", "--out", "tree"], None, 2, "--lane 0.33.0: the configuration has no such lane"),
    ("config-missing", ["series", "--config", "absent.yaml"], None, 3, "cannot read config absent.yaml"),
    ("config-is-a-folder", ["series", "--config", "."], None, 3, "cannot read config .: it is a folder, not a regular file"),
    ("config-is-a-device", ["series", "--config", "/dev/null"], None, 3, "cannot read config /dev/null: it is a character device, not a regular file"),
]


# --- the config file itself: what it holds, how big it is, what it is --------------------

# Seven lines, each a list naming the line before it nine times: 9**7 = 4.8 million values.
BOMB = "a0: &a0 [" + ", ".join(['"lol"'] * 9) + "]\n" + "".join(
    f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]\n" for i in range(1, 7)
)
# (id, what cfg.yaml holds, the sentence's start after "sm12x-bundle: error: ")
FILES = [
    ("alias-bomb", BOMB.encode(), f"{CONFIG}:1: anchors and aliases are not allowed in a config (found &a0): "
     "write each value where it is used"),
    ("an-alias", BASE.replace('    env:\n      HF_HUB_OFFLINE: "1"\n', "    env: *env\n").encode(),
     f"{CONFIG}:33: anchors and aliases are not allowed in a config (found *env)"),
    ("nested-50000-deep", b"[" * 50000 + b"]" * 50000 + b"\n", f"{CONFIG}:1: nested more than 32 levels deep: refused"),
    ("not-utf8", BASE.replace("DeepSeek", "Deep\xe9Seek").encode("latin-1"),
     f"{CONFIG} is not UTF-8 text (line 22, byte "),
    ("empty", b"", f"{CONFIG}:1: the file holds no settings (it is empty, only comments, or {{}})"),
    ("only-comments", b"# one day\n\n# maybe\n", f"{CONFIG}:1: the file holds no settings"),
    ("empty-mapping", b"{}\n", f"{CONFIG}:1: the file holds no settings"),
    ("null-document", b"---\n~\n", f"{CONFIG}:1: the file holds no settings"),
    ("over-1-mib", BASE.encode() + b"# padding\n" * 110_000, f"config {CONFIG} is larger than 1 MiB: refused"),
]


@pytest.mark.parametrize("name, data, start", FILES, ids=[r[0] for r in FILES])
def test_a_config_file_that_cannot_be_a_config_is_one_sentence(workdir, name, data, start):
    """As a real process, with a time and memory bound: the bomb took 31 s and 916 MB
    before it was refused, 50,000 levels overflowed the stack (exit 2, a bug)."""
    cwd, cache = workdir
    (cwd / CONFIG).write_bytes(data)
    before = snapshot(cwd, cache)
    proc = run_bounded(["series", "-q", "--config", CONFIG])
    assert (proc.returncode, proc.stderr[: len("sm12x-bundle: error: " + start)]) == (3, "sm12x-bundle: error: " + start)
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert snapshot(cwd, cache) == before


def run_bounded(argv: list[str], timeout: float = 20) -> subprocess.CompletedProcess:
    """``python3 -m sm12x_bundle ARGV`` with at most 2 GiB of address space and ``timeout``
    seconds (a config that hangs fails the test instead of hanging it)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run([sys.executable, "-m", "sm12x_bundle", *argv], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=limit)


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))


@pytest.mark.parametrize("make, what", [(_fifo, "a FIFO (named pipe)"), (_socket, "a socket"), (Path.mkdir, "a folder")],
                         ids=["fifo", "socket", "folder"])
def test_a_config_or_series_that_is_not_a_regular_file_is_named_and_never_read(workdir, make, what):
    """Looked at before it is opened: a FIFO with no writer would block the read forever."""
    cwd, cache = workdir
    make(cwd / "odd")
    before = snapshot(cwd, cache)
    proc = run_bounded(["series", "-q", "--config", "odd"])
    assert (proc.returncode, proc.stderr) == (3, f"sm12x-bundle: error: cannot read config odd: it is {what}, not a regular file\n")
    (cwd / CONFIG).write_text(BASE.replace("check:\n", "series: odd\ncheck:\n"))
    proc = run_bounded(["series", "-q", "--config", CONFIG])
    line = BASE.replace("check:\n", "series: odd\ncheck:\n").splitlines().index("series: odd") + 1
    assert (proc.returncode, proc.stderr) == (
        3, f"sm12x-bundle: error: {CONFIG}:{line}: series: the series file '{cwd / 'odd'}' is {what}, not a regular file\n")
    assert snapshot(cwd, cache) == {**before, str(cwd / CONFIG): snapshot(cwd)[str(cwd / CONFIG)]}


def test_dev_zero_as_the_config_ends_at_once(workdir):
    proc = run_bounded(["series", "-q", "--config", "/dev/zero"], timeout=10)
    assert (proc.returncode, proc.stderr) == (
        3, "sm12x-bundle: error: cannot read config /dev/zero: it is a character device, not a regular file\n")


def snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under the folders, with size and mtime: 'nothing written' is equality."""
    seen = {}
    for folder in folders:
        for p in sorted(folder.rglob("*")):
            st = p.lstat()
            seen[str(p)] = (st.st_size, st.st_mtime_ns)
    return seen


@pytest.fixture
def workdir(tmp_path, tmp_path_factory, monkeypatch):
    """An empty working directory holding only cfg.yaml (the valid BASE), and an empty cache."""
    monkeypatch.chdir(tmp_path)
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(cache))
    (tmp_path / CONFIG).write_text(BASE)
    return tmp_path, cache


def run_main(argv: list[str]) -> int:
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors, as a console script sees them
        return exc.code


def argv_of(argv: list[str], config: Config | None) -> list[str]:
    # Every command gets -q, and the config (the valid BASE unless the row edits it).
    with_config = [] if "--config" in argv else ["--config", CONFIG]
    return [argv[0], "-q", *with_config, *argv[1:]] if argv[0] != "frobnicate" else argv


@pytest.mark.parametrize("name, argv, config, code, fragment", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_one_sentence_and_nothing_is_written(workdir, capsys, name, argv, config, code, fragment):
    cwd, cache = workdir
    if config is not None:
        (cwd / CONFIG).write_text(config.text())
    before = snapshot(cwd, cache)
    assert run_main(argv_of(argv, config)) == code
    err = capsys.readouterr().err
    assert fragment in err
    if config is not None:
        assert err.startswith(f"sm12x-bundle: error: {CONFIG}:{config.line()}: ") and config.key in err
    assert "Traceback" not in err
    assert snapshot(cwd, cache) == before, "a refused input must leave the working directory and cache untouched"


def test_the_local_config_file_is_located_too(workdir, capsys):
    """No --config: ./sm12x-bundle.yaml replaces the default, and its errors name it."""
    cwd, cache = workdir
    bad = cfg("jobs[0].port", "port: 8001", "port: 99999")
    (cwd / "sm12x-bundle.yaml").write_text(bad.text())
    before = snapshot(cwd, cache)
    assert cli.main(["build", "-q", "--dry-run"]) == 3
    err = capsys.readouterr().err
    assert f"sm12x-bundle.yaml:{bad.line()}: jobs[0].port: port must be in 1-65535, not 99999" in err
    assert snapshot(cwd, cache) == before


def test_there_are_at_least_forty_rows():
    assert len(ROWS) >= 40 and len({r[0] for r in ROWS}) == len(ROWS)


def test_the_valid_base_passes_the_same_commands(workdir, capsys):
    """The rows fail because of their one edit: the base itself plans a build."""
    cwd, cache = workdir
    before = snapshot(cwd, cache)
    assert cli.main(["build", "-q", "--config", CONFIG, "--dry-run"]) == 0
    assert "nomad" in capsys.readouterr().out
    assert snapshot(cwd, cache) == before


# --- a bug in the tool: one sentence, the trace in a file -----------------------------


@pytest.fixture
def a_bug(monkeypatch, tmp_path):
    """``series`` fails the way a bug would; the trace goes to a folder of the test's own."""
    def broken(lanes):
        raise RuntimeError("boom")

    monkeypatch.setattr(checks_report, "series_table", broken)  # what `series` calls
    traces = tmp_path / "traces"
    traces.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(traces))
    monkeypatch.delenv("SM12X_DEBUG", raising=False)
    return traces


def test_an_unexpected_failure_is_one_sentence_and_a_trace_file(a_bug, capsys):
    assert cli.main(["series", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sm12x-bundle: error: unexpected failure, a bug in sm12x-bundle: RuntimeError: boom at ")
    assert "Traceback" not in err and len(err.splitlines()) == 1
    [trace] = a_bug.iterdir()
    assert f"the full trace is written to {trace}" in err
    assert "Traceback" in trace.read_text() and "RuntimeError: boom" in trace.read_text()


def test_sm12x_debug_prints_the_trace_instead(a_bug, capsys, monkeypatch):
    monkeypatch.setenv("SM12X_DEBUG", "1")
    assert cli.main(["series", "-q"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "the full trace is printed above" in err
    assert list(a_bug.iterdir()) == []


def test_a_bug_with_a_multi_line_message_is_still_one_line(a_bug, capsys, monkeypatch):
    def broken(lanes):
        raise ValueError("first line\n  second line")

    monkeypatch.setattr(checks_report, "series_table", broken)
    assert cli.main(["series", "-q"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "ValueError: first line second line at " in err


def test_a_bug_whose_trace_cannot_be_saved_is_still_one_sentence(a_bug, capsys, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(a_bug / "absent"))
    assert cli.main(["series", "-q"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert "the full trace is not saved (No such file or directory); SM12X_DEBUG=1 prints it here" in err


# --- the same, as a user runs it --------------------------------------------------------

@pytest.mark.parametrize("name", ["check-fuzz-negative", "check-junit-folder", "check-vllm-empty", "port-too-big",
                                  "selftest-cycles-zero", "pin-index-url-no-scheme"])
def test_a_real_process_prints_no_traceback(workdir, name):
    cwd, cache = workdir
    [(_, argv, config, code, fragment)] = [r for r in ROWS if r[0] == name]
    if config is not None:
        (cwd / CONFIG).write_text(config.text())
    before = snapshot(cwd, cache)
    proc = subprocess.run([sys.executable, "-m", "sm12x_bundle", *argv_of(argv, config)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == code
    assert fragment in proc.stderr and "Traceback" not in proc.stderr
    assert snapshot(cwd, cache) == before


def test_a_bug_in_a_real_process_prints_no_traceback(workdir, tmp_path):
    traces = tmp_path / "traces"
    traces.mkdir()
    program = (
        "import sys; from sm12x_bundle import cli\n"
        "from sm12x_bundle.checks import report\n"
        "def broken(lanes): raise KeyError('boom')\n"
        "report.series_table = broken\n"
        "sys.exit(cli.main(['series', '-q']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SM12X_DEBUG"} | {"TMPDIR": str(traces)}
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert "unexpected failure, a bug in sm12x-bundle: KeyError: 'boom'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(list(traces.iterdir())) == 1
