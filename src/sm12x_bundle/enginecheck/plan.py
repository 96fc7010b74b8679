"""What an engine check runs, decided before any engine starts.

The scenarios, which of them run on which vLLM, and how big each engine
is: pure functions over the options, the GPU's free memory (read through NVML) and the
host's available memory, tested without a GPU. A size that cannot fit is refused here,
with a sentence, before anything runs.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from .model import GiB, ModelShape, plan_model

MiB = 1 << 20
# What an engine takes on the GPU besides weights and KV cache: activations of the profile
# run (max_num_batched_tokens tokens), the CUDA context, and vLLM's non-torch memory.
HEADROOM = 3 * GiB
# What an engine keeps on the GPU while it sleeps (context, memory outside the cumem pools).
ASLEEP_RESIDUE = 2 * GiB
MARGIN = 512 * MiB
# PyTorch's pinned host allocator rounds each backup up to a power of two: up to twice the
# bytes offloaded (FIELD-NOTES); the backup pool takes them once.
HOST_BACKUP_FACTOR = 2
DEFAULT_SINGLE = int(24.25 * GiB)  # Llama-2 13B's shape: a 24.2 GiB engine, as the seeds' first sleep
DEFAULT_PAIR = int(12.55 * GiB)  # Llama-2 7B's shape: two engines rotating on one GPU
QUICK = 1 * GiB


@dataclass(frozen=True)
class Scenario:
    key: str  # a, b, c, d1, d2, e, f, g: the letters --scenario takes
    name: str
    title: str
    engines: str  # "single": one engine of the single size; "pair": two of the pair size
    what: str


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("a", "cycles", "sleep/wake cycles", "single",
             "three sleep(1)/wake cycles; tokens after each wake equal those before the first sleep; "
             "and one gc.collect() in every worker, timed"),
    Scenario("b", "level2", "level 2", "single",
             "sleep(2), wake, reload the weights; tokens equal those before the sleep"),
    Scenario("c", "rotation", "rotation", "pair",
             "two engines on one GPU, B starts while A sleeps, then swaps; tokens after every wake"),
    Scenario("d1", "failing-sleep", "sleep fails part-way", "single",
             "host memory for the backups runs out half-way through a sleep (injected in the engine core); "
             "then serve, sleep and wake again"),
    Scenario("d2", "held-wake", "wake meets held memory", "single",
             "asleep; another process takes the GPU memory; wake fails; it lets go; wake retried"),
    Scenario("e", "cross-image", "cross-image", "pair",
             "A asleep; an engine of the install as it is (pristine) starts, generates, exits; A wakes"),
    Scenario("f", "killed-worker", "a worker killed while asleep", "single",
             "asleep; the last rank's worker is killed (SIGKILL); the engine must say so within the call "
             "timeout (health fails, calls fail), never hang"),
    Scenario("g", "weight-changed", "a weight changed in place while awake", "single",
             "sleep/wake; a weight changed in place on every rank; sleep/wake twice; tokens after each wake are "
             "those of the changed weight (patched, a sleep skips what is unchanged unless VLLM_CUMEM_SKIP_UNCHANGED=0)"),
)
BY_NAME = {s.name: s for s in SCENARIOS}

# The patched allocator's switches, which the engines inherit from the check's environment.
# Unset, each is at the tree's default (patched: the skip, its fill, merged runs and the
# backup pool on); pristine reads none of them.
ALLOCATOR_SWITCHES = ("VLLM_CUMEM_SKIP_UNCHANGED", "VLLM_CUMEM_BACKGROUND_FILL",
                      "VLLM_CUMEM_MERGE_RUNS", "VLLM_SM12X_BACKUP_POOL")


def allocator_switches() -> dict[str, str]:
    """The switches this environment sets (for the record); the others are at their default."""
    return {name: os.environ[name] for name in ALLOCATOR_SWITCHES if name in os.environ}


QUICK_SCENARIOS = ("a",)


def select(names: Sequence[str] | None, quick: bool = False) -> tuple[Scenario, ...]:
    """The scenarios named (by letter or name, comma lists too), in their fixed order;
    all when none (--quick: cycles alone)."""
    if not names:
        return tuple(s for s in SCENARIOS if s.key in QUICK_SCENARIOS) if quick else SCENARIOS
    chosen = {lookup(n).key for raw in names for n in raw.split(",") if n.strip()}
    return tuple(s for s in SCENARIOS if s.key in chosen)


def lookup(name: str) -> Scenario:
    name = name.strip()
    for s in SCENARIOS:
        if name in (s.key, s.name):
            return s
    close = difflib.get_close_matches(name, [*BY_NAME, *(s.key for s in SCENARIOS)], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    choices = ", ".join(f"{s.key} {s.name}" for s in SCENARIOS)
    raise ConfigError(f"unknown scenario '{name}'{hint}: choose from {choices}")


DRIVERS = ("serve", "api")


@dataclass(frozen=True)
class Parallel:
    """How each engine runs: through ``vllm serve`` over HTTP (the operators' way) or the
    Python API; its tensor- and pipeline-parallel sizes; CUDA graphs (vLLM's default) or
    eager; and the operator's own vLLM flags (for the API, ``LLM(...)`` keywords:
    releases.api_keywords), minus those the check sets."""

    driver: str = "serve"
    tp: int = 1
    pp: int = 1
    eager: bool = False
    vllm_args: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()  # --vllm-arg tokens the check sets itself

    def _sets_compilation(self) -> bool:
        from .releases import flag_name

        return any(flag_name(a) == "compilation-config" or a.startswith("-O") for a in self.vllm_args)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    def settings(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "eager": self.eager, "vllm_args": list(self.vllm_args)}

    def to_dict(self) -> dict:
        graphs = ("eager (no CUDA graphs)" if self.eager
                  else "CUDA graphs, compilation as the operator's flags set it" if self._sets_compilation()
                  else "CUDA graphs and torch.compile at the release's defaults")
        return {**self.settings(), "driver": self.driver, "gpus": self.gpus, "graphs": graphs,
                "left_out_vllm_args": list(self.left_out)}


def parallel(driver: str, tp: int | None, pp: int | None, eager: bool, vllm_args: Sequence[str]) -> Parallel:
    """The engines' settings from the options: a size not given is read from the vLLM flags
    (``--pipeline-parallel-size 2`` in a job's own flags), else 1; --enforce-eager there means eager."""
    from .releases import api_keywords, flag_name, parallel_from, split_vllm_args

    args = list(vllm_args)
    kept, left_out = split_vllm_args(args)
    if driver != "serve":
        try:  # the API takes them as LLM(...) keywords: refused now, before anything runs
            api_keywords(kept)
        except ValueError as exc:
            raise ConfigError(f"--vllm-arg {exc}") from None
    tp = tp or parallel_from(args, "tensor-parallel-size") or 1
    pp = pp or parallel_from(args, "pipeline-parallel-size") or 1
    eager = eager or any(flag_name(a) == "enforce-eager" and not a.startswith("--no") for a in args)
    return Parallel(driver, tp, pp, eager, tuple(kept), tuple(left_out))


@dataclass(frozen=True)
class Tree:
    """A vLLM to run: its label, the folder holding its ``vllm`` package, and every folder
    that goes on the engine's PYTHONPATH (the copy first, then the install for its deps)."""

    label: str  # "installed", "pristine" or "patched"
    root: Path
    path: tuple[Path, ...]


def runs(trees: Sequence[Tree], scenarios: Sequence[Scenario]) -> list[tuple[Scenario, Tree]]:
    """Scenario by scenario, each on every tree: both columns of a scenario come together."""
    return [(s, t) for s in scenarios for t in trees]


@dataclass(frozen=True)
class EngineSize:
    shape: ModelShape
    kv_cache_bytes: int  # per GPU, as vLLM's kv_cache_memory_bytes means it
    gpu_memory_utilization: float  # vLLM refuses to start unless this share of each GPU is free
    gpus: int = 1  # the engine's weights and KV cache are spread over this many GPUs (TP x PP)

    @property
    def weight_bytes(self) -> int:
        return self.shape.weight_bytes()

    def settings(self, model: Path, max_model_len: int = 1024) -> dict:
        """What a session starts its engine with (releases.engine_kwargs)."""
        return {"model": str(model), "gpu_memory_utilization": self.gpu_memory_utilization,
                "kv_cache_bytes": self.kv_cache_bytes, "max_model_len": max_model_len,
                "max_num_seqs": 8, "max_num_batched_tokens": max_model_len}

    def to_dict(self) -> dict:
        return {"shape": self.shape.to_dict(), "weight_bytes": self.weight_bytes,
                "kv_cache_bytes": self.kv_cache_bytes, "gpu_memory_utilization": self.gpu_memory_utilization,
                "gpus": self.gpus}


def engine_size(weight_target: int, total_bytes: int, gpus: int = 1) -> EngineSize:
    """An engine of about ``weight_target`` bf16 weight bytes and a KV cache of half that,
    spread over ``gpus`` GPUs of ``total_bytes`` each."""
    shape = plan_model(weight_target)
    kv = max(256 * MiB, shape.weight_bytes() // 2 // gpus // MiB * MiB)
    util = math.ceil((shape.weight_bytes() / gpus + kv + HEADROOM) / total_bytes * 100) / 100
    return EngineSize(shape, kv, util, gpus)


@dataclass(frozen=True)
class Sizes:
    single: EngineSize | None  # None: no scenario needs it
    pair: EngineSize | None
    prompts: int
    prompt_len: int
    max_tokens: int
    cycles: int  # sleep/wake cycles with fresh prompts and the reference ones
    fixed_cycles: int  # then cycles with one fixed prompt
    swaps: int
    ceiling_bytes: int | None  # None: no ceilings (--quick)

    def to_dict(self) -> dict:
        out = dict(self.__dict__)
        out["single"] = self.single.to_dict() if self.single else None
        out["pair"] = self.pair.to_dict() if self.pair else None
        return out


def plan_sizes(
    scenarios: Sequence[Scenario],
    free_bytes: int,
    total_bytes: int,
    host_available: int,
    *,
    model_gib: float | None = None,
    quick: bool = False,
    swaps: int = 6,
    gpus: int = 1,
) -> Sizes:
    """Each engine's size from the GPU's free memory, unless ``--model-gib`` gives its weights.

    One engine: 24.25 GiB of weights (Llama-2 13B's shape; --quick: 1 GiB), at most a third
    of the free memory. Two rotating engines: 12.55 GiB each (7B's shape), at most a sixth. Each
    gets a KV cache of half its weights. With ``gpus`` > 1 (TP x PP) each is spread over that
    many GPUs, and ``free_bytes``/``total_bytes`` are one GPU's (the least free of them).
    Refused when it cannot fit: the engine awake, the other one's residue asleep, and the
    host memory its backups may take."""
    if swaps < 4:
        raise ConfigError(f"--swaps must be at least 4 (the first swap and three steady ones), not {swaps}")
    given = None if model_gib is None else int(model_gib * GiB)
    kinds = {s.engines for s in scenarios}
    single = pair = None
    if "single" in kinds:
        single = engine_size(given or min(QUICK if quick else DEFAULT_SINGLE, gpus * free_bytes // 3), total_bytes, gpus)
        _check_fit("one engine", single, 1, free_bytes, total_bytes, host_available, given is not None)
    if "pair" in kinds:
        pair = engine_size(given or min(DEFAULT_PAIR, gpus * free_bytes // 6), total_bytes, gpus)
        _check_fit("two engines", pair, 2, free_bytes, total_bytes, host_available, given is not None)
    return Sizes(single, pair, prompts=2 if quick else 4, prompt_len=16 if quick else 32,
                 max_tokens=8 if quick else 32, cycles=3 if quick else 10, fixed_cycles=0 if quick else 20,
                 swaps=swaps,
                 ceiling_bytes=None if quick else min(4 * GiB, max(GiB, free_bytes // 16)))


def _check_fit(what: str, size: EngineSize, engines: int, free: int, total: int, host: int, given: bool) -> None:
    need = math.ceil(size.gpu_memory_utilization * total) + (engines - 1) * ASLEEP_RESIDUE + MARGIN
    fix = "give a smaller --model-gib" if given else "free GPU memory (stop what runs on it) or give --model-gib"
    weights = f"{size.weight_bytes / GiB:.2f} GiB of weights and {size.kv_cache_bytes / GiB:.2f} GiB of KV cache"
    if need > free:
        raise ConfigError(
            f"too little free GPU memory: {what} of {weights} need {need / GiB:.1f} GiB, and the GPU has "
            f"{free / GiB:.1f} GiB free of {total / GiB:.1f}: {fix}"
        )
    host_need = engines * HOST_BACKUP_FACTOR * size.weight_bytes
    if host_need > host:
        raise ConfigError(
            f"too little host memory: the backups of {what} of {weights} may take {host_need / GiB:.1f} GiB, and "
            f"the host has {host / GiB:.1f} GiB available: {fix}"
        )


def host_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable in bytes (0 when /proc/meminfo does not say)."""
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0
