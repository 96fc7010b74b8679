"""Nomad job specs: one service job per configured vLLM server, as HCL2 and as API JSON.

Plan, then write. ``plan_job`` turns one job of the config and its target's overlay
manifest into a :class:`JobSpec` (pure: no files, no clock). ``render_jobs`` renders
every job as ``<job>.nomad.hcl`` (for people) and ``<job>.nomad.json`` (``{"Job": ...}``
with the API's field names, for ``nomad job run -json`` and ``POST /v1/jobs``), reads both
back and refuses unless they describe the same job field by field (jobview.py), and only
then returns; ``write_jobs`` writes the files atomically.
The same config and manifests give the same bytes.

Field names follow Nomad's ``api`` package (api/jobs.go, api/tasks.go, api/services.go,
api/resources.go, api/constraint.go) and the docker driver's task config spec
(drivers/docker/config.go). Durations in the API JSON are nanoseconds. The rollout gate's
``Tasks[].Lifecycle`` (``Hook``, ``Sidecar``) and ``Tasks[].RestartPolicy`` (``Attempts``,
``Mode``) are api.TaskLifecycle and api.RestartPolicy, as the client generated from that
package spells them (hashicorp/nomad-openapi clients/go/v1/model_task.go,
model_task_lifecycle.go, model_restart_policy.go).
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from ..config import Config, JobConfig
from .. import inputs
from ..errors import ConfigError, EnvironmentProblem, VerifyError
from ..fingerprint import tool_fingerprint
from ..fsutil import Destination, write_files
from ..jobs import (
    GATE_TOOL_MOUNT,
    Budget,
    HostRam,
    check_budget,
    check_host_ram,
    gate_env,
    managed_env,
    node_peers,
    number,
)
from ..values import absolute_problem, version_problem
from . import hcl, jobview

GROUP = "vllm"
TASK = "vllm"
PORT_LABEL = "http"

# FlashInfer JIT (and anything else keyed on $HOME) writes under /root/.cache. A relative
# bind source resolves in the task directory; this one is the allocation's data folder,
# which always exists and, being inside the allocation, needs no client setting.
ROOT_CACHE = "/root/.cache"
ROOT_CACHE_SOURCE = "../alloc/data"
# alloc/data and local/ start empty in every new allocation, so every update would
# rebuild the JIT, Triton and vLLM caches (minutes at each model load). A sticky disk
# moves both folders to the replacement allocation on the same client; migrate copies
# them from another client, best effort (Nomad's ephemeral_disk docs: meant for data that
# can be recreated, such as caches). Chosen over a host volume: no client setting, and
# each job keeps its own caches.
STICKY_DISK = {"sticky": True, "migrate": True}
OVERLAY_DEST = "local/overlay"

# The rollout gate: a prestart task of the same group (sm12x-bundle reaches it through
# jobs.GATE_TOOL_MOUNT).
GATE_TASK = "gate"
# The allocator scenarios a gate runs (selftest/plan.py): each stays in its own process and
# takes at most 2 GiB of the GPU (failing-sleep: 8 x 256 MiB, and as much pinned host memory),
# so a rotation peer on the same GPUs does not feel them. Left out: partial-wake and
# moe-churn fill the GPU, foreign-process and ranks take memory in another process (ranks
# also uses every GPU), speed, first-sleep and rotation size themselves by the free memory
# (up to 32 GiB, GPU and pinned host), stress and fault-stress run 1,000 and 10,000 cycles.
GATE_ALLOCATOR_SCENARIOS = ("inflight-free", "stale-error", "double-wake", "failing-sleep")

_HEX64 = re.compile(r"[0-9a-f]{64}")
_HASH16 = re.compile(r"[0-9a-f]{16}")
_NS = 1_000_000_000





# --- validating a job -----------------------------------------------------------
#
# Every job value is checked when the config is loaded (config/ and jobs.py), so --dry-run
# refuses what a render would; only what needs the overlay manifest is checked here.


def _absolute(path: str, what: str) -> None:
    problem = absolute_problem(path)  # a control character too: the path reaches both files
    if problem:
        raise ConfigError(f"{what} {problem}")


# --- overlay manifests ----------------------------------------------------------


def load_manifest(path: Path) -> dict:
    """Read and check one overlay manifest (the schema in docs/design.md)."""
    data = inputs.read_json(path, 64 * inputs.MIB, ConfigError, "the overlay manifest")
    check_manifest(data, str(path))
    return data


def find_manifests(config: Config, paths: Iterable[Path] = ()) -> dict[str, dict]:
    """The manifest of every target a job uses: given ones first, else <overlays>/<target>/current.json."""
    manifests: dict[str, dict] = {}
    for path in paths:
        manifest = load_manifest(path)
        if manifest["target"] in manifests:
            raise ConfigError(f"{path}: a second manifest for target {manifest['target']!r}")
        manifests[manifest["target"]] = manifest
    root = Path(config.output.overlays)
    for target in sorted({job.target for job in config.jobs} - manifests.keys()):
        path = root / target / "current.json"
        if not path.is_file():
            raise EnvironmentProblem(
                f"no overlay manifest for target {target!r} at {path}: run 'sm12x-bundle overlay' "
                "(with the same --config) first, or give --manifest FILE"
            )
        manifests[target] = load_manifest(path)
    return manifests


def check_manifest(manifest: object, origin: str) -> None:
    """Check the fields the job specs use; a bad path or hash would reach every node."""
    where = f"{origin}: overlay manifest"
    if not isinstance(manifest, dict) or manifest.get("schema") != 1:
        raise ConfigError(f"{where}: not a schema 1 manifest")
    for key in ("target", "image"):
        if not isinstance(manifest.get(key), str) or not manifest[key]:
            raise ConfigError(f"{where}: {key} must be a non-empty string")
    if not _HASH16.fullmatch(str(manifest.get("content_hash"))):
        raise ConfigError(f"{where}: content_hash must be 16 lowercase hex digits")
    files = manifest.get("files")
    if not isinstance(files, list):
        raise ConfigError(f"{where}: files must be a list")
    for i, entry in enumerate(files):
        _check_manifest_file(entry, f"{where}: files[{i}]")


def _check_manifest_file(entry: object, where: str) -> None:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be an object")
    _absolute(str(entry.get("container_path")), f"{where}.container_path")
    source = str(entry.get("source"))
    if not source.startswith("files/") or posixpath.normpath(source) != source:
        raise ConfigError(f"{where}.source must be a normalised path under files/, not {source!r}")
    if not _HEX64.fullmatch(str(entry.get("sha256"))):
        raise ConfigError(f"{where}.sha256 must be 64 lowercase hex digits")


# --- the plan: one JobSpec per job ----------------------------------------------


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    readonly: bool = True


@dataclass(frozen=True)
class Artifact:
    source: str
    destination: str
    checksum: str


@dataclass(frozen=True)
class Constraint:
    attribute: str
    operator: str
    value: str


@dataclass(frozen=True)
class Gate:
    """The prestart task that checks the patched vLLM in the target image before vLLM starts:
    the main task's image, overlays, env and GPUs, plus sm12x-bundle mounted read-only."""

    kind: str  # "engine" or "allocator"
    entrypoint: tuple[str, ...]
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    mounts: tuple[Mount, ...]


@dataclass(frozen=True)
class JobSpec:
    """Everything both renderers need, resolved once."""

    job: JobConfig
    image: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    mounts: tuple[Mount, ...]
    artifacts: tuple[Artifact, ...]
    constraints: tuple[Constraint, ...]
    device_constraints: tuple[Constraint, ...]
    meta: tuple[tuple[str, str], ...]
    notes: tuple[str, ...] = ()
    gate: Gate | None = None

    @property
    def shared_gpus(self) -> bool:
        return self.job.gpu_allocation == "shared"


def plan_job(config: Config, job: JobConfig, manifest: Mapping, tool: str | None = None) -> JobSpec:
    """Resolve one job against its target and overlay manifest; raise before anything is written.
    ``tool``: the fingerprint a gate requires (None: this sm12x-bundle's own)."""
    where = f"{config.origin}: job {job.name!r}"
    budget = check_budget(job, where)
    check_manifest(manifest, f"{where}: target {job.target!r}")
    image = config.target(job.target).image
    if manifest["image"] != image:
        raise ConfigError(
            f"{where}: the overlay manifest for {job.target!r} was made for {manifest['image']}, "
            f"but the target's image is {image}: run 'sm12x-bundle overlay' again"
        )
    files = sorted(manifest["files"], key=lambda f: f["container_path"])
    mounts, artifacts = _overlay(job, manifest, files)
    mounts = sorted(mounts + _cache_and_host_mounts(job), key=lambda m: m.target)
    _check_unique_targets(mounts, where)
    env = tuple(sorted({**job.env, **managed_env(job)}.items()))
    gate = plan_gate(job, manifest, env, mounts, where, tool)
    host_ram = check_host_ram(node_peers(config.jobs, job), where)
    return JobSpec(
        job=job,
        image=image,
        args=vllm_args(job),
        env=env,
        mounts=tuple(mounts),
        artifacts=tuple(artifacts),
        constraints=tuple(Constraint(a, "=", v) for a, v in sorted(job.node_constraints.items())),
        device_constraints=_device_constraints(job),
        meta=(
            ("sm12x_overlay_delivery", job.overlay_delivery),
            ("sm12x_overlay_hash", manifest["content_hash"]),
            ("sm12x_target", job.target),
        ),
        notes=_notes(job, manifest, budget, host_ram, gate),
        gate=gate,
    )


def plan_gate(job: JobConfig, manifest: Mapping, env: tuple, mounts: list[Mount], where: str,
              tool: str | None = None) -> Gate | None:
    """The rollout gate of a job that asks for one: the check runs with the main task's
    interpreter (entrypoint[0], the Python whose vLLM the overlays patch), env and mounts, and
    only with the sm12x-bundle that rendered the job (``tool``, None: this one's fingerprint)."""
    if job.gate == "none":
        return None
    gate_mounts = sorted([*mounts, Mount(job.gate_tool_dir, GATE_TOOL_MOUNT)], key=lambda m: m.target)
    _check_unique_targets(gate_mounts, f"{where}: gate")
    return Gate(
        kind=job.gate,
        entrypoint=(job.entrypoint[0], "-m", "sm12x_bundle"),
        args=("--require-tool", tool or tool_fingerprint(), *gate_args(job, manifest, where)),
        env=tuple(sorted({**dict(env), **gate_env()}.items())),
        mounts=tuple(gate_mounts),
    )


def gate_args(job: JobConfig, manifest: Mapping, where: str) -> tuple[str, ...]:
    """The check's command line (after the global options). The engine check is held to the
    release the overlay was made for (--lane): an image of another release fails the gate instead
    of testing the wrong code; it gets the job's tensor_parallel_size and each of its extra_args
    (--vllm-arg=ARG, one token each), and decides which it can pass to its own small model."""
    if job.gate == "allocator":
        return ("selftest", "--installed", "--scenario", ",".join(GATE_ALLOCATOR_SCENARIOS))
    lane = ("--lane", _overlay_release(manifest, where), "--tp", str(job.tensor_parallel_size))
    return ("engine-check", "--installed", "--quick", *lane, *(f"--vllm-arg={arg}" for arg in job.extra_args))


def _overlay_release(manifest: Mapping, where: str) -> str:
    pin = manifest.get("pin")
    release = pin.get("version") if isinstance(pin, dict) else None
    if not isinstance(release, str) or version_problem(release):
        raise ConfigError(
            f"{where}: the overlay manifest for {manifest['target']!r} names no pinned release (pin.version), "
            "which the engine gate holds the image to: run 'sm12x-bundle overlay' again"
        )
    return release


def vllm_args(job: JobConfig) -> tuple[str, ...]:
    """The arguments after the entrypoint: the model, then the flags the config owns."""
    args = [job.model, "--host", "0.0.0.0", "--port", str(job.port)]
    args += ["--tensor-parallel-size", str(job.tensor_parallel_size)]
    args += ["--gpu-memory-utilization", f"{job.gpu_memory_utilization:g}"]
    if job.served_model_name:
        args += ["--served-model-name", job.served_model_name]
    if job.max_model_len is not None:
        args += ["--max-model-len", str(job.max_model_len)]
    if job.sleep_mode:
        args.append("--enable-sleep-mode")
    return tuple(args + list(job.extra_args))





def _overlay(job: JobConfig, manifest: Mapping, files: list[dict]) -> tuple[list[Mount], list[Artifact]]:
    if job.overlay_delivery == "host":
        base = posixpath.join(job.overlay_host_dir, job.target, manifest["content_hash"])
        return [Mount(posixpath.join(base, f["source"]), f["container_path"]) for f in files], []
    assert job.artifact_base_url is not None
    url = "/".join([job.artifact_base_url.rstrip("/"), quote(job.target, safe=""), manifest["content_hash"]])
    mounts, artifacts = [], []
    for f in files:
        dest = posixpath.join(OVERLAY_DEST, f["source"])
        artifacts.append(Artifact(f"{url}/{quote(f['source'])}", dest, f"sha256:{f['sha256']}"))
        mounts.append(Mount(dest, f["container_path"]))
    return mounts, artifacts


def _cache_and_host_mounts(job: JobConfig) -> list[Mount]:
    mounts = [Mount(ROOT_CACHE_SOURCE, ROOT_CACHE, readonly=False)]
    return mounts + [Mount(host, container) for container, host in sorted(job.host_mounts.items())]


def _check_unique_targets(mounts: list[Mount], where: str) -> None:
    targets = [m.target for m in mounts]
    dupes = sorted({t for t in targets if targets.count(t) > 1})
    if dupes:
        raise ConfigError(f"{where}: two mounts on the same path: {', '.join(dupes)}")


def _device_constraints(job: JobConfig) -> tuple[Constraint, ...]:
    if job.gpu_allocation != "device":
        return ()
    # The budget assumes gpu_capacity_gib: never place the job on a smaller GPU.
    memory = Constraint("${device.attr.memory}", ">=", f"{math.ceil(job.gpu_capacity_gib * 1024)} MiB")
    if job.gpu_model is None:
        return (memory,)
    return (Constraint("${device.model}", "regexp", job.gpu_model), memory)


def _notes(job: JobConfig, manifest: Mapping, budget: Budget, host_ram: HostRam | None, gate: Gate | None) -> tuple[str, ...]:
    n = len(manifest["files"])
    notes = [
        f'Generated by sm12x-bundle from job "{job.name}" of the config: edit the config, not this file.',
        f"Overlay {manifest['content_hash']} of target {job.target}: {n} file{'s' * (n != 1)}, "
        f"{job.overlay_delivery} delivery.",
        f"GPU memory budget: {budget.describe()} of {number(budget.capacity_gib)} GiB.",
        _host_ram_note(host_ram),
        *_gate_notes(gate),
        "Nomad deploys this job alone: nothing orders it against its rotation peer. Walk the rotation:",
        f"  nomad job run this file, wait until 'nomad job status {job.name}' (or GET /v1/job/{job.name}/deployment)",
        "  shows its latest deployment successful, POST /sleep to it, then the same for the next job.",
        "Client settings this job needs:",
        f'  client {{ max_kill_timeout = "{job.kill_timeout_s}s" }} or more (the default 30s cuts kill_timeout short)',
    ]
    if job.overlay_delivery == "host" or job.host_mounts or gate:
        notes.append('  plugin "docker" { config { volumes { enabled = true } } } (host-path bind mounts)')
    if job.gpu_allocation == "shared":
        notes.append('  the "nvidia" docker runtime, and these GPUs in the nvidia plugin\'s ignored_gpu_ids')
    if gate:
        notes.append(f"  a checkout of the sm12x-bundle that rendered this job (src/ and patches/) at {job.gate_tool_dir}, for the gate")
    return tuple(notes)


def _host_ram_note(host_ram: HostRam | None) -> str:
    if host_ram is None:
        return "Host RAM budget: not checked (no host_ram_gib for this job's node)."
    return f"Host RAM budget of this job's node: {host_ram.describe()} of {number(host_ram.node_gib)} GiB."


def _gate_notes(gate: Gate | None) -> list[str]:
    if gate is None:
        return []
    return [
        f"Rollout gate: task \"{GATE_TASK}\" runs 'sm12x-bundle {' '.join(gate.args[2:])}' before vLLM starts;",
        "  if it fails, the allocation fails, and auto_revert goes back to the last stable version (nomad/README.md).",
        f"  It runs only with the sm12x-bundle that rendered this job ({gate.args[1]}): another exits 13.",
    ]


# --- API JSON -------------------------------------------------------------------


def api_job(spec: JobSpec) -> dict:
    """The job in Nomad's API JSON form (without the {"Job": ...} wrapper)."""
    job = spec.job
    return {
        "ID": job.name,
        "Name": job.name,
        "Type": "service",
        "Datacenters": list(job.datacenters),
        "Meta": dict(spec.meta),
        "TaskGroups": [_api_group(spec)],
    }


def _api_group(spec: JobSpec) -> dict:
    job = spec.job
    group = {
        "Name": GROUP,
        "Count": 1,
        "Networks": [{"ReservedPorts": [{"Label": PORT_LABEL, "Value": job.port, "To": job.port}]}],
        "EphemeralDisk": {"SizeMB": job.disk_mb, "Sticky": STICKY_DISK["sticky"], "Migrate": STICKY_DISK["migrate"]},
        "Update": {
            "MaxParallel": 1,
            "Canary": 0,
            "HealthCheck": "checks",
            "MinHealthyTime": job.min_healthy_time_s * _NS,
            "HealthyDeadline": job.healthy_deadline_s * _NS,
            "ProgressDeadline": job.progress_deadline_s * _NS,
            "AutoRevert": True,
        },
        "Services": [_api_service(job)],
        "Tasks": [_api_gate_task(spec), _api_task(spec)] if spec.gate else [_api_task(spec)],
    }
    if spec.constraints:
        group["Constraints"] = [_api_constraint(c) for c in spec.constraints]
    return group


def _api_service(job: JobConfig) -> dict:
    check = {
        "Name": "vllm-health",
        "Type": "http",
        "Path": "/health",
        "Interval": 15 * _NS,
        "Timeout": 5 * _NS,
        # A dead engine answers 503; restart it, but never while the model still loads.
        "CheckRestart": {"Limit": 3, "Grace": job.load_time_s * _NS, "IgnoreWarnings": False},
    }
    return {"Name": job.name, "Provider": job.service_provider, "PortLabel": PORT_LABEL, "Checks": [check]}


def _api_task(spec: JobSpec) -> dict:
    job = spec.job
    task = {
        "Name": TASK,
        "Driver": "docker",
        "Config": _docker_config(spec),
        "Env": dict(spec.env),
        "Resources": {"CPU": job.cpu_mhz, "MemoryMB": job.memory_mb},
        "KillTimeout": job.kill_timeout_s * _NS,
    }
    if spec.artifacts:
        task["Artifacts"] = _api_artifacts(spec.artifacts)
    if not spec.shared_gpus:
        device = {"Name": "nvidia/gpu", "Count": job.gpus}
        device["Constraints"] = [_api_constraint(c) for c in spec.device_constraints]
        task["Resources"]["Devices"] = [device]
    return task


def _api_gate_task(spec: JobSpec) -> dict:
    """The gate: a prestart task that must exit 0 before vLLM's task starts. No restart: a
    check that failed once is an answer, not a glitch to retry."""
    gate, job = spec.gate, spec.job
    assert gate is not None
    task = {
        "Name": GATE_TASK,
        "Driver": "docker",
        "Lifecycle": {"Hook": "prestart", "Sidecar": False},
        "Config": _container_config(spec, gate.entrypoint, gate.args, gate.mounts, ports=False),
        "Env": dict(gate.env),
        # The same as vLLM's task: the gate adds nothing if Nomad sizes the allocation for the
        # larger of a non-sidecar prestart task and the main tasks, as nomad#9725 describes.
        "Resources": {"CPU": job.cpu_mhz, "MemoryMB": job.memory_mb},
        "RestartPolicy": {"Attempts": 0, "Mode": "fail"},
    }
    if spec.artifacts:  # a relative mount source resolves in the gate's own task directory
        task["Artifacts"] = _api_artifacts(spec.artifacts)
    return task


def _api_artifacts(artifacts: tuple[Artifact, ...]) -> list[dict]:
    return [
        {"GetterSource": a.source, "GetterMode": "file", "GetterOptions": {"checksum": a.checksum}, "RelativeDest": a.destination}
        for a in artifacts
    ]


def _docker_config(spec: JobSpec) -> dict:
    return _container_config(spec, spec.job.entrypoint, spec.args, spec.mounts, ports=True)


def _container_config(spec: JobSpec, entrypoint: Sequence[str], args: Sequence[str], mounts: Sequence[Mount], ports: bool) -> dict:
    config = {
        "image": spec.image,
        "entrypoint": list(entrypoint),
        "args": list(args),
        "readonly_rootfs": spec.job.readonly_rootfs,
        "shm_size": spec.job.shm_size_mb * 1024 * 1024,
        "mount": [{"type": "bind", "source": m.source, "target": m.target, "readonly": m.readonly} for m in mounts],
    }
    if ports:
        config["ports"] = [PORT_LABEL]
    if spec.shared_gpus:
        config["runtime"] = "nvidia"
    return config


def _api_constraint(c: Constraint) -> dict:
    return {"LTarget": c.attribute, "Operand": c.operator, "RTarget": c.value}


def api_json_text(spec: JobSpec) -> str:
    return json.dumps({"Job": api_job(spec)}, indent=2, sort_keys=True) + "\n"


# --- HCL2 -----------------------------------------------------------------------


def hcl_text(spec: JobSpec) -> str:
    """The job as HCL2 that `nomad fmt` would leave alone (attributes aligned)."""
    header = [hcl.comment(line) for line in spec.notes]
    return "\n".join(header + hcl.text(_hcl_job(spec))) + "\n"


def _hcl_job(spec: JobSpec) -> hcl.Block:
    job = spec.job
    body = [("type", "service"), ("datacenters", list(job.datacenters)), hcl.Block("meta", body=list(spec.meta))]
    return hcl.Block("job", (job.name,), body + [_hcl_group(spec)])


def _hcl_group(spec: JobSpec) -> hcl.Block:
    job = spec.job
    port = hcl.Block("port", (PORT_LABEL,), [("static", job.port), ("to", job.port)])
    body: list = [("count", 1)]
    body += [_hcl_constraint(c) for c in spec.constraints]
    body += [
        hcl.Block("network", body=[port]),
        hcl.Comment("Caches in alloc/data and local/ survive an update, best effort: moved within a client, else copied."),
        hcl.Block("ephemeral_disk", body=[("size", job.disk_mb), *STICKY_DISK.items()]),
        hcl.Comment("This job's own update: Nomad replaces its one allocation and calls the deployment successful"),
        hcl.Comment("once /health has passed for min_healthy_time (max_parallel 1 is Nomad's default, written out)."),
        hcl.Comment("auto_revert goes back to the last version that deployed successfully: a first deployment has"),
        hcl.Comment("none. The rotation peer is another job: Nomad does not order the two."),
        hcl.Block(
            "update",
            body=[
                ("max_parallel", 1),
                ("canary", 0),
                ("health_check", "checks"),
                ("min_healthy_time", f"{job.min_healthy_time_s}s"),
                ("healthy_deadline", f"{job.healthy_deadline_s}s"),
                ("progress_deadline", f"{job.progress_deadline_s}s"),
                ("auto_revert", True),
            ],
        ),
        _hcl_service(job),
        *([_hcl_gate_task(spec)] if spec.gate else []),
        _hcl_task(spec),
    ]
    return hcl.Block("group", (GROUP,), body)


def _hcl_service(job: JobConfig) -> hcl.Block:
    restart = hcl.Block("check_restart", body=[("limit", 3), ("grace", f"{job.load_time_s}s"), ("ignore_warnings", False)])
    check = hcl.Block(
        "check",
        body=[
            ("name", "vllm-health"),
            ("type", "http"),
            ("path", "/health"),
            ("interval", "15s"),
            ("timeout", "5s"),
            hcl.Comment("A dead engine answers 503; restart it, but never while the model still loads."),
            restart,
        ],
    )
    return hcl.Block("service", body=[("name", job.name), ("provider", job.service_provider), ("port", PORT_LABEL), check])


def _hcl_task(spec: JobSpec) -> hcl.Block:
    job = spec.job
    body: list = [("driver", "docker"), ("kill_timeout", f"{job.kill_timeout_s}s"), _hcl_config(spec)]
    body.append(hcl.Block("env", body=list(spec.env)))
    body += [_hcl_artifact(a) for a in spec.artifacts]
    resources: list = [("cpu", job.cpu_mhz), ("memory", job.memory_mb)]
    if not spec.shared_gpus:
        constraints = [_hcl_constraint(c) for c in spec.device_constraints]
        resources.append(hcl.Block("device", ("nvidia/gpu",), [("count", job.gpus), *constraints]))
    body.append(hcl.Block("resources", body=resources))
    return hcl.Block("task", (TASK,), body)


def _hcl_gate_task(spec: JobSpec) -> hcl.Block:
    gate, job = spec.gate, spec.job
    assert gate is not None
    body: list = [
        hcl.Comment("The rollout gate: vLLM's task starts only once this exits 0, in the same image with the same"),
        hcl.Comment("overlays, env and GPUs. A failure fails the allocation; no restart (a failed check is an answer)."),
        hcl.Block("lifecycle", body=[("hook", "prestart"), ("sidecar", False)]),
        ("driver", "docker"),
        hcl.Block("restart", body=[("attempts", 0), ("mode", "fail")]),
        _hcl_container(spec, gate.entrypoint, gate.args, gate.mounts, ports=False),
        hcl.Block("env", body=list(gate.env)),
        *[_hcl_artifact(a) for a in spec.artifacts],
        hcl.Comment("The same as vLLM's task: it adds nothing if Nomad sizes the allocation for the larger"),
        hcl.Comment("of the two, as nomad#9725 describes (Nomad's docs do not say)."),
        hcl.Block("resources", body=[("cpu", job.cpu_mhz), ("memory", job.memory_mb)]),
    ]
    return hcl.Block("task", (GATE_TASK,), body)


def _hcl_config(spec: JobSpec) -> hcl.Block:
    return _hcl_container(spec, spec.job.entrypoint, spec.args, spec.mounts, ports=True)


def _hcl_container(spec: JobSpec, entrypoint: Sequence[str], args: Sequence[str], mounts: Sequence[Mount], ports: bool) -> hcl.Block:
    job = spec.job
    body: list = [("image", spec.image), ("entrypoint", list(entrypoint)), ("args", list(args))]
    if ports:
        body.append(("ports", [PORT_LABEL]))
    body += [("readonly_rootfs", job.readonly_rootfs), ("shm_size", job.shm_size_mb * 1024 * 1024)]
    if spec.shared_gpus:
        body.append(("runtime", "nvidia"))
    if any(m.source.startswith("/") for m in mounts):
        body.append(hcl.Comment('Absolute sources need plugin "docker" { config { volumes { enabled = true } } }.'))
    for m in mounts:
        mount = [("type", "bind"), ("source", m.source), ("target", m.target), ("readonly", m.readonly)]
        body.append(hcl.Block("mount", body=mount))
    return hcl.Block("config", body=body)


def _hcl_artifact(a: Artifact) -> hcl.Block:
    options = hcl.Block("options", body=[("checksum", a.checksum)])
    return hcl.Block("artifact", body=[("source", a.source), ("destination", a.destination), ("mode", "file"), options])


def _hcl_constraint(c: Constraint) -> hcl.Block:
    return hcl.Block("constraint", body=[("attribute", c.attribute), ("operator", c.operator), ("value", c.value)])


# --- render and write -----------------------------------------------------------


def render_jobs(config: Config, manifests: Mapping[str, Mapping], tool: str | None = None) -> dict[str, bytes]:
    """Every job of the config as {file name: bytes}. Pure; raises before anything is written.
    ``tool``: the fingerprint the gates require (None: this sm12x-bundle's own)."""
    files: dict[str, bytes] = {}
    for job in config.jobs:
        if job.target not in manifests:
            raise EnvironmentProblem(
                f"{config.origin}: job {job.name!r}: no overlay manifest for target {job.target!r}: "
                "run 'sm12x-bundle overlay' first"
            )
        spec = plan_job(config, job, manifests[job.target], tool)
        hcl_name, api_name = spec_names([job])
        hcl_file, api_file = hcl_text(spec), api_json_text(spec)
        jobview.same_job(hcl_name, hcl_file, api_file)  # both read back, field by field
        files[hcl_name], files[api_name] = hcl_file.encode(), api_file.encode()
    return dict(sorted(files.items()))


def spec_names(jobs: Iterable[JobConfig]) -> tuple[str, ...]:
    """The file names ``render_jobs`` gives the jobs' specs."""
    return tuple(f"{job.name}.nomad.{ext}" for job in jobs for ext in ("hcl", "json"))


def destinations(out: Path, jobs: Iterable[JobConfig]) -> list[Destination]:
    """The spec files, written into a folder that is never replaced whole."""
    return [Destination(out, "files", "Nomad folder", spec_names(jobs))]


def write_jobs(files: Mapping[str, bytes], out: Path, force: bool = False) -> list[tuple[Path, bool]]:
    """Write each rendered file atomically; return (path, changed) pairs. A file with
    other bytes in a folder this tool did not write is refused unless ``force``."""
    return write_files(out, files, force, "Nomad folder")
