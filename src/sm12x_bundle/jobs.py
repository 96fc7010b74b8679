"""The rules of a Nomad job, in the words both the config check and the Nomad renderer use:
what a job asks of its node (the GPU memory budget, the host-RAM budget of the jobs that
share a node), the environment the job spec sets itself (the vllm serve flags it manages are
serve_flags.py's), where the rollout gate finds sm12x-bundle, the mounts and env that would
hand a job the node unless an allow_* key says the operator means it, and the checks of every
job value, run when the config is loaded so that ``--dry-run`` refuses what a render would.

Below config and outputs/nomad: each imports it, it imports neither.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from . import serve_flags
from .errors import ConfigError
from .values import (
    ENV_KEY,
    JOB_NAME,
    Where,
    absolute_problem,
    did_you_mean,
    text_problem,
    url_problem,
)

if TYPE_CHECKING:  # annotations only: config imports this module
    from .config import JobConfig

# Inside a docker task, the task's local/ folder is /local (NOMAD_TASK_DIR): writable
# under readonly_rootfs.
TASK_DIR = "/local"

@dataclass(frozen=True)
class Budget:
    """What one GPU must hold while this server is awake and its peer sleeps."""

    utilization: float
    capacity_gib: float
    non_cumem_gib: float
    residue_gib: float

    @classmethod
    def of(cls, job: JobConfig) -> Budget:
        return cls(job.gpu_memory_utilization, job.gpu_capacity_gib, job.non_cumem_gib, job.peer_residue_gib)

    @property
    def cumem_gib(self) -> float:
        return self.utilization * self.capacity_gib

    @property
    def total_gib(self) -> float:
        return self.cumem_gib + self.non_cumem_gib + self.residue_gib

    def fits(self) -> bool:
        return self.total_gib <= self.capacity_gib + 1e-9

    def largest_utilization(self) -> float:
        """The largest utilization that fits, rounded down to 0.01 (0 when none does)."""
        room = (self.capacity_gib - self.non_cumem_gib - self.residue_gib) / self.capacity_gib
        return max(0.0, math.floor(round(room * 100, 6)) / 100)

    def describe(self) -> str:
        return (
            f"{number(self.utilization)} x {number(self.capacity_gib)} GiB ({number(self.cumem_gib)} GiB cumem)"
            f" + {number(self.non_cumem_gib)} GiB non-cumem + {number(self.residue_gib)} GiB sleeping-peer residue"
            f" = {number(self.total_gib)} GiB"
        )


def check_budget(job: JobConfig, where: str) -> Budget:
    """The preflight: raise ConfigError naming the numbers when the budget does not fit."""
    budget = Budget.of(job)
    if not 0 < budget.utilization <= 1:
        raise ConfigError(f"{where}: gpu_memory_utilization must be in (0, 1], not {budget.utilization}")
    if budget.fits():
        return budget
    largest = budget.largest_utilization()
    advice = (
        f"the largest gpu_memory_utilization that fits is {largest:.2f}"
        if largest > 0
        else "no utilization fits: the non-cumem footprint and peer residue alone fill the GPU"
    )
    raise ConfigError(
        f"{where}: the GPU memory budget does not fit: {budget.describe()}"
        f" > {number(budget.capacity_gib)} GiB; {advice}"
    )


def managed_env(job: JobConfig) -> dict[str, str]:
    env = {
        # The stale-bytecode guard: Python reads and writes .pyc only under this task
        # folder, so an overlaid .py never runs as the image's old .pyc (which a same-size,
        # same-mtime overlay would otherwise match). The sticky disk carries the folder to
        # the next allocation; bytecode of an older overlay is refused there because each
        # overlay version has its own mtime (overlay.MTIME_BASE).
        "PYTHONPYCACHEPREFIX": f"{TASK_DIR}/pycache",
        # readonly_rootfs: every cache and temporary file goes to the task directory.
        "TMPDIR": TASK_DIR,
        "TRITON_CACHE_DIR": f"{TASK_DIR}/cache/triton",
        "VLLM_CACHE_ROOT": f"{TASK_DIR}/cache/vllm",
        "TORCHINDUCTOR_CACHE_DIR": f"{TASK_DIR}/cache/torchinductor",
        "VLLM_NO_USAGE_STATS": "1",
    }
    if job.sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep, /wake_up and /is_sleeping exist only then
    if job.gpu_allocation == "shared":
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(job.gpu_ids)
        env["NVIDIA_DRIVER_CAPABILITIES"] = "compute,utility"
    return env


# --- the rollout gate -------------------------------------------------------------
#
# The target image does not carry sm12x-bundle: the gate task mounts the client's
# gate_tool_dir (a checkout: src/ and patches/, which the embedded default's lanes need)
# read-only here and puts src/ on PYTHONPATH. The config refuses a host mount on this path
# and an env that sets what gate_env sets.
GATE_TOOL_MOUNT = "/opt/sm12x-bundle"


def gate_env() -> dict[str, str]:
    """What the gate adds to the main task's env: where sm12x-bundle is."""
    return {"PYTHONPATH": f"{GATE_TOOL_MOUNT}/src"}


# --- the host-RAM budget ----------------------------------------------------------
#
# The backup pool (patch cumem-backup-pool) pins each engine's weights in host memory from
# the model load on, awake or asleep: a node of two rotation peers holds both peers' weights
# at once (engine core RSS 25.57 GiB awake and asleep for 24.24 GiB of weights, H100,
# docs/records/engine-check-0.21.0-cycles-level2-h100-2026-11-25.json). Each job's memory_mb
# must hold its own share; the node's RAM must hold every job's that runs there.

# What a node keeps for itself besides the jobs (the OS, the Nomad client, Docker): a chosen
# allowance, not a measurement; a client `reserved { memory = 8192 }` states the same to Nomad.
HOST_RAM_MARGIN_GIB = 8.0


@dataclass(frozen=True)
class HostRam:
    """What one node's RAM must hold: the memory_mb of every job placed there, and a margin."""

    node_gib: float
    jobs: tuple[tuple[str, float], ...]  # (job name, its memory_mb in GiB), in the config's order
    margin_gib: float = HOST_RAM_MARGIN_GIB

    @property
    def total_gib(self) -> float:
        return sum(gib for _, gib in self.jobs) + self.margin_gib

    def fits(self) -> bool:
        return self.total_gib <= self.node_gib + 1e-9

    def describe(self) -> str:
        parts = [f"{number(gib)} GiB {name}" for name, gib in self.jobs]
        return " + ".join([*parts, f"{number(self.margin_gib)} GiB margin"]) + f" = {number(self.total_gib)} GiB"


def node_of(job: JobConfig) -> tuple | None:
    """The node a job shares with others: rotation peers (gpu_allocation 'shared') pinned by the
    same node_constraints, as the peer-port check groups them. None: a node of the device
    plugin's choosing, which the config cannot name."""
    if job.gpu_allocation != "shared":
        return None
    return tuple(sorted(job.node_constraints.items()))


def node_groups(jobs: Sequence[JobConfig]) -> list[list[int]]:
    """The indices of the jobs on each node, in the config's order (a job of no shared node alone)."""
    groups: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        node = node_of(job)
        groups.setdefault(("alone", i) if node is None else ("node", node), []).append(i)
    return list(groups.values())


def node_peers(jobs: Sequence[JobConfig], job: JobConfig) -> list[JobConfig]:
    """The jobs that share ``job``'s node, itself included, in the config's order."""
    node = node_of(job)
    return [job] if node is None else [j for j in jobs if node_of(j) == node]


def check_host_ram(peers: Sequence[JobConfig], where: str) -> HostRam | None:
    """The host-RAM preflight of one node's jobs (None: none of them gives host_ram_gib);
    raise ConfigError naming the numbers and the jobs when they do not fit."""
    given = {j.name: j.host_ram_gib for j in peers if j.host_ram_gib is not None}
    if not given:
        return None
    if len(set(given.values())) > 1:
        each = ", ".join(f"{name!r} {number(gib)} GiB" for name, gib in given.items())
        raise ConfigError(f"{where}: jobs that share a node give different host_ram_gib ({each}): give the node's RAM once")
    budget = HostRam(next(iter(given.values())), tuple((j.name, j.memory_mb / 1024) for j in peers))
    if budget.fits():
        return budget
    raise ConfigError(
        f"{where}: the host RAM budget does not fit: {budget.describe()} > {number(budget.node_gib)} GiB host_ram_gib"
        " (each job's memory_mb holds its engine's weights, pinned by the backup pool awake or asleep):"
        " lower memory_mb, or place the jobs on a node with more RAM"
    )


def number(x: float) -> str:
    return f"{round(x, 2):g}"


# --- checking a job's values ------------------------------------------------------


DELIVERIES = ("host", "artifact")


ALLOCATIONS = ("device", "shared")


PROVIDERS = ("nomad", "consul")
GATES = ("none", "engine", "allocator")


def check_jobs(jobs: tuple[JobConfig, ...], targets: list[str], at: Where) -> None:
    """Refuse the first job value a render would refuse, naming file:line:key."""
    known = targets
    seen: set[str] = set()
    for i, job in enumerate(jobs):
        key = f"jobs[{i}]"
        if not JOB_NAME.fullmatch(job.name):
            at.fail(
                f"{key}.name",
                "a job name is letters, digits and dashes, at most 63 (it names the service and the files), "
                f"not {job.name!r}",
            )
        if job.name in seen:
            at.fail(f"{key}.name", f"job names must be unique: {job.name!r} is already a job")
        seen.add(job.name)
        if job.target not in known:
            hint = did_you_mean(job.target, known)
            at.fail(f"{key}.target", f"job {job.name!r} names target {job.target!r}, which is not in targets{hint}")
        for check in _JOB_CHECKS:
            check(job, key, at)
    _check_peer_ports(jobs, at)
    _check_host_ram(jobs, at)


def _job_text(job: JobConfig, key: str, at: Where) -> None:
    at.check(f"{key}.model", text_problem(job.model))
    if job.served_model_name is not None:
        at.check(f"{key}.served_model_name", text_problem(job.served_model_name))
    for i, dc in enumerate(job.datacenters):
        at.check(f"{key}.datacenters[{i}]", text_problem(dc))
    if not job.datacenters:
        at.fail(f"{key}.datacenters", "must name at least one datacenter")
    for attribute, value in sorted(job.node_constraints.items()):
        at.check(f"{key}.node_constraints.{attribute}", text_problem(attribute) or text_problem(value))


def _job_choices(job: JobConfig, key: str, at: Where) -> None:
    for name, value, choices in (
        ("overlay_delivery", job.overlay_delivery, DELIVERIES),
        ("gpu_allocation", job.gpu_allocation, ALLOCATIONS),
        ("service_provider", job.service_provider, PROVIDERS),
        ("gate", job.gate, GATES),
    ):
        if value not in choices:
            at.fail(f"{key}.{name}", f"unknown {name} {value!r}: choose one of {', '.join(choices)}")


def _job_gpus(job: JobConfig, key: str, at: Where) -> None:
    if job.gpus < 1:
        at.fail(f"{key}.gpus", f"must be 1 or more, not {job.gpus}")
    if job.tensor_parallel_size != job.gpus:
        at.fail(
            f"{key}.tensor_parallel_size",
            f"tensor_parallel_size {job.tensor_parallel_size} needs as many GPUs, "
            f"but gpus is {job.gpus}: set both to the same number",
        )
    if job.gpu_allocation == "shared" and len(job.gpu_ids) != job.gpus:
        at.fail(f"{key}.gpu_ids", f"gpu_allocation 'shared' needs gpu_ids listing the {job.gpus} GPUs it shares")
    if len(set(job.gpu_ids)) != len(job.gpu_ids) or not all(g.strip() for g in job.gpu_ids):
        at.fail(f"{key}.gpu_ids", "must name each GPU once, none empty")
    if job.gpu_allocation == "device" and job.gpu_ids:
        at.fail(f"{key}.gpu_ids", "gpu_ids apply to gpu_allocation 'shared'; the device plugin picks the GPUs")
    if job.gpu_model is not None:
        _job_gpu_model(job, key, at)


def _job_gpu_model(job: JobConfig, key: str, at: Where) -> None:
    if job.gpu_allocation == "shared":
        at.fail(
            f"{key}.gpu_model",
            "gpu_model constrains ${device.model}, which only gpu_allocation 'device' has; "
            "pin shared GPUs with node_constraints",
        )
    try:
        re.compile(job.gpu_model or "")
    except re.error as exc:
        at.fail(f"{key}.gpu_model", f"is not a regular expression: {exc}")


def _job_memory(job: JobConfig, key: str, at: Where) -> None:
    if job.gpu_capacity_gib <= 0:
        at.fail(f"{key}.gpu_capacity_gib", f"must be positive, not {job.gpu_capacity_gib:g}")
    if not 0 < job.gpu_memory_utilization <= 1:
        at.fail(f"{key}.gpu_memory_utilization", f"must be in (0, 1], not {job.gpu_memory_utilization:g}")
    for name in ("non_cumem_gib", "peer_residue_gib"):
        if getattr(job, name) < 0:
            at.fail(f"{key}.{name}", f"must be 0 or more, not {getattr(job, name):g}")
    if job.host_ram_gib is not None and job.host_ram_gib <= 0:
        at.fail(f"{key}.host_ram_gib", f"must be positive, not {job.host_ram_gib:g}")
    util = f"{key}.gpu_memory_utilization"
    check_budget(job, f"{at.origin}:{at.line(util)}: {util}")


def _job_sizes(job: JobConfig, key: str, at: Where) -> None:
    for name in ("cpu_mhz", "memory_mb", "shm_size_mb", "disk_mb", "load_time_s", "kill_timeout_s"):
        if getattr(job, name) <= 0:
            at.fail(f"{key}.{name}", f"must be positive, not {getattr(job, name)}")
    if job.max_model_len is not None and job.max_model_len <= 0:
        at.fail(f"{key}.max_model_len", f"must be positive, not {job.max_model_len}")
    if not 0 < job.port < 65536:
        at.fail(f"{key}.port", f"port must be in 1-65535, not {job.port}")


def _job_timing(job: JobConfig, key: str, at: Where) -> None:
    if job.healthy_deadline_s <= job.load_time_s:
        at.fail(
            f"{key}.healthy_deadline_s",
            f"healthy_deadline_s ({job.healthy_deadline_s}) must exceed load_time_s ({job.load_time_s}), "
            "or every deployment fails while the model loads",
        )
    if job.progress_deadline_s <= job.healthy_deadline_s:
        at.fail(
            f"{key}.progress_deadline_s",
            f"progress_deadline_s ({job.progress_deadline_s}) must exceed healthy_deadline_s "
            f"({job.healthy_deadline_s}) (Nomad refuses the update block otherwise)",
        )
    if not 0 <= job.min_healthy_time_s < job.healthy_deadline_s:
        at.fail(f"{key}.min_healthy_time_s", "min_healthy_time_s must be at least 0 and less than healthy_deadline_s")


def _job_delivery(job: JobConfig, key: str, at: Where) -> None:
    if job.overlay_delivery == "host":
        at.check(f"{key}.overlay_host_dir", absolute_problem(job.overlay_host_dir))
        return
    url = job.artifact_base_url
    if not url:
        needs = "overlay_delivery 'artifact' needs artifact_base_url (where overlays/ is served)"
        at.fail(f"{key}.artifact_base_url", needs)
    parts = urlsplit(url)
    if url_problem(url, ("http", "https")) or parts.query or parts.fragment:
        at.fail(f"{key}.artifact_base_url", f"artifact_base_url must be a plain http(s) URL, not {url!r}")


def _job_container(job: JobConfig, key: str, at: Where) -> None:
    if not job.entrypoint or not all(job.entrypoint):
        at.fail(f"{key}.entrypoint", "entrypoint must not be empty (it replaces the image's ENTRYPOINT)")
    for i, arg in enumerate(job.extra_args):
        flag = serve_flags.managed_flag(arg)
        if flag is not None:
            spelled = "" if arg == flag.flag else f" ({arg!r}, as vLLM's parser reads it)"
            at.fail(f"{key}.extra_args[{i}]", f"extra_args sets {flag.flag}{spelled}, which {flag.instead}")
    managed = managed_env(job)
    for name in sorted(job.env):
        if not ENV_KEY.fullmatch(name):
            at.fail(f"{key}.env.{name}", f"env key {name!r} is not a valid variable name")
        if name in managed:
            at.fail(f"{key}.env.{name}", f"env {name} is set by sm12x-bundle ({managed[name]!r}); remove it from env")
    for container, host in sorted(job.host_mounts.items()):
        at.check(f"{key}.host_mounts.{container}", absolute_problem(container) or absolute_problem(host))


# A gate with gpu_allocation 'device': Nomad's scheduler reserves device instances for each task of
# a group on its own (scheduler/rank.go, BinPackIterator), and its docs do not say a finished
# prestart task hands them to the main task (hashicorp/nomad#9725 is open for that).
_GATE_NEEDS_SHARED = (
    "a gate needs gpu_allocation 'shared': with 'device', Nomad reserves GPUs for each task on its own, "
    "so the gate would get GPUs beside vLLM's, not vLLM's, and Nomad's docs do not promise that a finished "
    "prestart task's GPUs go to the main task (hashicorp/nomad#9725; nomad/README.md)"
)


def _job_gate(job: JobConfig, key: str, at: Where) -> None:
    """A gate runs the check with the main task's interpreter, env and GPUs, before vLLM loads."""
    if job.gate == "none":
        return
    if job.gpu_allocation != "shared":
        at.fail(f"{key}.gate", _GATE_NEEDS_SHARED)
    at.check(f"{key}.gate_tool_dir", absolute_problem(job.gate_tool_dir))
    if job.entrypoint[1:2] != ("-m",):
        at.fail(
            f"{key}.entrypoint",
            f"the gate runs sm12x-bundle with the entrypoint's Python ('PYTHON -m ...'), and {list(job.entrypoint)} "
            "names none: write it as [python3, -m, vllm.entrypoints.cli.main, serve]",
        )
    for name in sorted(gate_env().keys() & job.env.keys()):
        at.fail(f"{key}.env.{name}", f"env {name} is set by sm12x-bundle in the gate ({gate_env()[name]!r}); remove it from env")
    if GATE_TOOL_MOUNT in job.host_mounts:
        at.fail(f"{key}.host_mounts.{GATE_TOOL_MOUNT}", f"{GATE_TOOL_MOUNT} is where the gate mounts gate_tool_dir; mount elsewhere")
    _job_gate_time(job, key, at)


def _job_gate_time(job: JobConfig, key: str, at: Where) -> None:
    if job.gate_time_s <= 0:
        at.fail(f"{key}.gate_time_s", f"must be positive, not {job.gate_time_s}")
    if job.healthy_deadline_s <= job.load_time_s + job.gate_time_s:
        at.fail(
            f"{key}.healthy_deadline_s",
            f"healthy_deadline_s ({job.healthy_deadline_s}) must exceed load_time_s ({job.load_time_s}) + gate_time_s "
            f"({job.gate_time_s}): the gate runs inside the allocation before the model loads",
        )


# --- dangerous values: refused unless an allow_* key of the job names them ---------
#
# A job spec runs on every client that can place it; what follows would hand the job the node
# itself. Each is refused at config load unless the operator lists it in the job's allow_* key
# (docs/configuration.md, "Dangerous job values", gives each reason).

# Host paths a bind mount must not reach: the path, a folder inside it, or a folder above it
# (which holds it: /var holds /var/run/docker.sock).
HOST_DANGERS: tuple[tuple[str, str], ...] = (
    ("/var/run/docker.sock", "Docker's socket: whoever reaches it controls every container on the node, and the host"),
    ("/run/docker.sock", "Docker's socket: whoever reaches it controls every container on the node, and the host"),
    ("/var/lib/docker", "Docker's state: every container's and image's files on the node"),
    ("/proc", "the host's kernel view (every process, its environment and memory maps)"),
    ("/sys", "the host's kernel and device settings"),
    ("/dev", "the host's devices (disks, GPUs outside the job's own)"),
    ("/etc", "the host's configuration and secrets (shadow passwords, keys, the Nomad client's settings)"),
    ("/root", "the host's root user's files (keys, credentials)"),
    ("/home", "the host's users' files (keys, credentials)"),
)

# Container paths a mount must not cover (the path, inside it, or above it: / covers them all):
# the image's own system folders, which would hide its Python, CUDA and loader, and Nomad's
# task folders, where the job spec keeps the caches and bytecode.
CONTAINER_SYSTEM = (
    "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/root", "/run", "/sbin", "/sys", "/usr",
    "/var", "/alloc", "/local", "/secrets",
)

# Env names that choose the GPUs a job sees: the device plugin (gpu_allocation 'device') or
# gpu_ids (gpu_allocation 'shared') decide that, and the memory budget assumes it.
GPU_ENV = ("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
# Env names that change what the dynamic loader (LD_*) or Python loads before vLLM's code:
# code beside the overlays, or instead of them, would run in the engine.
LOADER_ENV = ("PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PYTHONPLATLIBDIR")


def _covers(a: str, b: str) -> bool:
    """Whether folder a is b, holds b, or lies inside b (normalised absolute paths)."""
    return a == b or b.startswith(a.rstrip("/") + "/") or a.startswith(b.rstrip("/") + "/")


def host_danger(path: str) -> str | None:
    """Why a host path must not be bind-mounted into a job (None: it may)."""
    for danger, why in HOST_DANGERS:
        if _covers(path, danger):
            return why if path == danger or path.startswith(danger + "/") else f"it holds {danger}, {why}"
    return None


def env_danger(name: str, job: JobConfig) -> str | None:
    """Why an env name must not be set for a job (None: it may)."""
    if name in GPU_ENV:
        owner = "the device plugin" if job.gpu_allocation == "device" else "gpu_ids"
        return f"chooses the GPUs the job sees, which {owner} decides: the job could reach GPUs it does not hold"
    if name.startswith("LD_") or name in LOADER_ENV:
        return "changes what the loader or Python loads: code beside the overlays, or instead of them, would run in vLLM"
    return None


def _job_dangers(job: JobConfig, key: str, at: Where) -> None:
    for container, host in sorted(job.host_mounts.items()):
        why = host_danger(host)
        if why and host not in job.allow_host_mounts:
            at.fail(f"{key}.host_mounts.{container}", f"mounts the host's {host}: {why}; if you mean it, list {host} in allow_host_mounts")
        if any(_covers(container, system) for system in CONTAINER_SYSTEM) and container not in job.allow_mount_targets:
            at.fail(
                f"{key}.host_mounts.{container}",
                f"mounts over the container's {container}, which would hide the image's own system files (its Python, "
                f"CUDA and loader) or Nomad's task folders; if you mean it, list {container} in allow_mount_targets",
            )
    why = host_danger(job.gate_tool_dir) if job.gate != "none" else None
    if why and job.gate_tool_dir not in job.allow_host_mounts:
        at.fail(f"{key}.gate_tool_dir", f"mounts the host's {job.gate_tool_dir} into the gate: {why}")
    for name in sorted(job.env):
        why = env_danger(name, job)
        if why and name not in job.allow_env:
            at.fail(f"{key}.env.{name}", f"env {name} {why}; if you mean it, list {name} in allow_env")
    _job_allowances(job, key, at)


def _job_allowances(job: JobConfig, key: str, at: Where) -> None:
    """An allow_* entry names something the job has: a stale or misspelt one allows nothing."""
    gate_dir = (job.gate_tool_dir,) if job.gate != "none" else ()
    for name, allowed, present, what in (
        ("allow_host_mounts", job.allow_host_mounts, (*job.host_mounts.values(), *gate_dir), "host path of host_mounts"),
        ("allow_mount_targets", job.allow_mount_targets, tuple(job.host_mounts), "container path of host_mounts"),
        ("allow_env", job.allow_env, tuple(job.env), "name of env"),
    ):
        for i, value in enumerate(allowed):
            if value not in present:
                at.fail(f"{key}.{name}[{i}]", f"{value!r} is no {what}{did_you_mean(value, list(present))}")


# The gate's own checks run before the dangers, so a gated job's env PYTHONPATH is named as the
# gate's (which sets it) rather than as a loader variable.
_JOB_CHECKS = (
    _job_text, _job_choices, _job_gpus, _job_memory, _job_sizes, _job_timing, _job_delivery, _job_container, _job_gate,
    _job_dangers,
)


def _check_peer_ports(jobs: tuple[JobConfig, ...], at: Where) -> None:
    """Peers pinned to the same node cannot share a static port."""
    seen: dict[tuple, str] = {}
    for i, job in enumerate(jobs):
        if job.gpu_allocation != "shared":
            continue
        node = (job.port, tuple(sorted(job.node_constraints.items())))
        if node in seen:
            peers = f"jobs {seen[node]!r} and {job.name!r}"
            at.fail(f"jobs[{i}].port", f"{peers} share a node and both use port {job.port}")
        seen[node] = job.name


def _check_host_ram(jobs: tuple[JobConfig, ...], at: Where) -> None:
    """The jobs that share a node fit in its RAM: named at the first job of the node that gives host_ram_gib."""
    for group in node_groups(jobs):
        given = [i for i in group if jobs[i].host_ram_gib is not None]
        if given:
            key = f"jobs[{given[0]}].host_ram_gib"
            check_host_ram([jobs[i] for i in group], f"{at.origin}:{at.line(key)}: {key}")
