"""What a job of the config asks of its node, in the words both the config check and the
Nomad renderer use: the GPU memory budget, the host-RAM budget of the jobs that share a node,
the vllm serve flags and the environment the job spec sets itself, and where the rollout gate
finds sm12x-bundle (so a config that repeats or collides with one is refused before anything
is rendered).

Below config and outputs/nomad: each imports it, it imports neither.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:  # annotations only: config imports this module
    from .config import JobConfig

# Inside a docker task, the task's local/ folder is /local (NOMAD_TASK_DIR): writable
# under readonly_rootfs.
TASK_DIR = "/local"

# vllm serve flags the job spec writes from the config's keys; extra_args must not repeat them.
MANAGED_FLAGS = (
    "--host",
    "--port",
    "--tensor-parallel-size",
    "-tp",
    "--gpu-memory-utilization",
    "--enable-sleep-mode",
    "--served-model-name",
    "--max-model-len",
)


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
