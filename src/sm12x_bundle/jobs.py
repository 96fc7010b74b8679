"""What a job of the config asks of its node, in the words both the config check and the
Nomad renderer use: the GPU memory budget, the vllm serve flags and the environment the job
spec sets itself (so a config that repeats one is refused before anything is rendered).

Below config and outputs/nomad: each imports it, it imports neither.
"""

from __future__ import annotations

import math
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


def number(x: float) -> str:
    return f"{round(x, 2):g}"
