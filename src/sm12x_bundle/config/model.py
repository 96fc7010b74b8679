"""The configuration's shape: one frozen dataclass per section, with each key's default and
what it means. Reading a file into these is reading.py's work; checking them, rules.py's
and (for jobs) jobs.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from ..values import did_you_mean


@dataclass(frozen=True)
class PinConfig:
    """The vLLM source the series is written for."""

    version: str = "0.21.0"
    # None: the sha256 recorded in data/releases.json (or, for a release not listed there,
    # the index's own hash).
    sha256: str | None = None
    # None follows pip's configured index (PIP_INDEX_URL, pip.conf), then PyPI.
    index_url: str | None = None
    # A local vLLM source tree or sdist to use instead of a download.
    source: str | None = None


@dataclass(frozen=True)
class LaneConfig:
    """One lane: a pinned vLLM release and the series written for it."""

    version: str
    # None: the sha256 in data/releases.json (or the index's own, for an unlisted release).
    sha256: str | None = None
    # None: the shipped series of this release, patches/<version>/series.
    series: str | None = None
    # A local vLLM source tree or sdist to use instead of a download.
    source: str | None = None
    # None follows pip's configured index (PIP_INDEX_URL, pip.conf), then PyPI.
    index_url: str | None = None


@dataclass(frozen=True)
class CheckConfig:
    """The CI patch-apply check."""

    # Extra vLLM releases checked beside the pin (same as repeating --vllm).
    versions: tuple[str, ...] = ()
    fuzz: int = 0


@dataclass(frozen=True)
class OutputConfig:
    """Where outputs go, relative to the working directory."""

    dir: str = "build"
    overlays: str = "overlays"


@dataclass(frozen=True)
class TargetConfig:
    """An image whose vLLM files get overlays."""

    name: str
    image: str
    # vLLM install root inside the image; None asks the image's own Python.
    root: str | None = None
    # The image carries the pinned release unchanged: read pre-images from the
    # pinned tree when no Docker daemon is available.
    pinned: bool = False
    # The vLLM release the image carries (one of lanes[].version). Without a daemon a pinned
    # target stands in with that lane's tree (None: the first lane's); with one, the image's
    # own version selects the lane and must agree.
    vllm: str | None = None


@dataclass(frozen=True)
class ImageConfig:
    """The bundle image."""

    # The base vLLM image, by tag; with base_digest (sha256:...) the build uses
    # exactly that registry digest and refuses a local image that lacks it.
    base: str = "vllm/vllm-openai:v0.21.0"
    base_digest: str | None = None
    tag: str = "sm12x-bundle:0.21.0"
    # vLLM install root inside the base; None asks the base's own Python.
    root: str | None = None
    source_url: str = "https://example.invalid/sm12x-bundle"
    # org.opencontainers.image.revision; None: the series sha256 (the patches' content).
    revision: str | None = None
    # The image the cumem extension is built in; None: the base itself (its own
    # Python and CUDA headers, so the extension matches the image it lands in).
    builder_base: str | None = None
    # A shell line run in the builder before compiling, for a base without a
    # compiler (e.g. "apt-get update && apt-get install -y --no-install-recommends g++").
    builder_setup: str | None = None
    # CUDA toolkit inside the builder: include/cuda.h and the stub libcuda.so.
    cuda_home: str = "/usr/local/cuda"
    build: bool = False
    push: bool = False


@dataclass(frozen=True)
class JobConfig:
    """One Nomad job: a vLLM server, possibly one peer of a sleep rotation."""

    name: str
    model: str
    target: str
    served_model_name: str | None = None
    tensor_parallel_size: int = 1
    gpus: int = 1
    # "device": the Nomad device plugin reserves the GPUs. Nomad hands each GPU to one
    # task only, so sleep-rotation peers on the same GPUs use "shared": no reservation,
    # NVIDIA_VISIBLE_DEVICES = gpu_ids, and node_constraints pin the node.
    gpu_allocation: str = "device"
    gpu_ids: tuple[str, ...] = ()
    # A regular expression matched against the device plugin's ${device.model}.
    gpu_model: str | None = None
    # The memory-budget preflight: utilization x capacity + non-cumem + peer residue
    # must fit in capacity.
    gpu_capacity_gib: float = 95.0
    gpu_memory_utilization: float = 0.9
    non_cumem_gib: float = 0.0
    peer_residue_gib: float = 0.0
    # Placement constraints: attribute (e.g. "${meta.gpu_pool}") -> value.
    node_constraints: dict[str, str] = field(default_factory=dict)
    port: int = 8000
    # Where the /health-checked service registers: "nomad" (built in) or "consul".
    service_provider: str = "nomad"
    sleep_mode: bool = True
    max_model_len: int | None = None
    entrypoint: tuple[str, ...] = ("python3", "-m", "vllm.entrypoints.cli.main", "serve")
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # Read-only host folders (model weights): container path -> host path.
    host_mounts: dict[str, str] = field(default_factory=dict)
    # What the operator means although it is refused by default (docs/configuration.md,
    # "Dangerous job values"): host paths of host_mounts (or gate_tool_dir) inside, or above,
    # the host's system folders and Docker's socket; container paths of host_mounts over the
    # container's system folders; env names that pick GPUs or change what is loaded.
    allow_host_mounts: tuple[str, ...] = ()
    allow_mount_targets: tuple[str, ...] = ()
    allow_env: tuple[str, ...] = ()
    # "host": bind-mount the overlay files from overlay_host_dir on the client;
    # "artifact": fetch them from artifact_base_url with a checksum, then bind-mount.
    overlay_delivery: str = "host"
    overlay_host_dir: str = "/opt/sm12x-bundle/overlays"
    artifact_base_url: str | None = None
    datacenters: tuple[str, ...] = ("dc1",)
    cpu_mhz: int = 16000
    # Sleeping weights live in pinned host memory, inside this limit (with the backup pool,
    # awake too: the pool pins them from the model load on).
    memory_mb: int = 65536
    # The node's RAM: the jobs that share a node must fit their memory_mb and a margin in it
    # (None: not checked).
    host_ram_gib: float | None = None
    shm_size_mb: int = 16384
    disk_mb: int = 20480
    readonly_rootfs: bool = True
    # Worst-case model load (weights, compile, graph capture, JIT) measured on the fleet.
    load_time_s: int = 900
    min_healthy_time_s: int = 60
    healthy_deadline_s: int = 1800
    progress_deadline_s: int = 2400
    kill_timeout_s: int = 300
    # The rollout gate, a prestart task in the target image with the same overlays, before
    # vLLM starts: "none"; "engine" (engine-check --installed --quick); "allocator" (selftest
    # --installed, the scenarios that leave the GPUs' other users alone). A failing gate
    # fails the allocation. Needs gpu_allocation "shared" (see nomad/README.md).
    gate: str = "none"
    # A checkout of sm12x-bundle on every client (src/ and patches/: the embedded default's
    # lanes need their series), bind-mounted read-only into the gate: the image lacks the tool.
    gate_tool_dir: str = "/opt/sm12x-bundle/tool"
    # The longest the gate may take; it runs inside healthy_deadline_s, before the load.
    # Measured: `engine-check --installed --quick --tp 2` took 179 s on two H200s with a warm
    # torch.compile cache; a cold `vllm serve` start alone took over 180 s (docs/results.md).
    gate_time_s: int = 600


@dataclass(frozen=True)
class Config:
    """The whole configuration, and where it came from."""

    # The one-lane form (pin + series). A file that gives `lanes:` may not give these; after
    # loading they repeat the first lane, for callers that know one lane only.
    pin: PinConfig = PinConfig()
    # Path of a series file; None uses the series shipped with the tool for pin.version.
    series: str | None = None
    # Every lane, in the file's order; a one-lane config (pin + series) fills it with one.
    lanes: tuple[LaneConfig, ...] = ()
    check: CheckConfig = CheckConfig()
    output: OutputConfig = OutputConfig()
    targets: tuple[TargetConfig, ...] = ()
    image: ImageConfig = ImageConfig()
    jobs: tuple[JobConfig, ...] = ()
    origin: str = "<embedded default>"
    base_dir: str = "."

    def __post_init__(self) -> None:
        if not self.lanes:  # the one-lane form, also when built in code
            object.__setattr__(self, "lanes", (_lane_of_pin(self.pin, self.series),))

    def series_path(self, lane: LaneConfig) -> Path | None:
        """The lane's series file: its own, else the shipped one for its release (None: none shipped)."""
        if lane.series:
            return self.resolve(lane.series)
        from ..series.lane import shipped_series

        return shipped_series(lane.version)

    def resolve(self, path: str) -> Path:
        """A path from the config, relative to the config file's directory."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    def target(self, name: str) -> TargetConfig:
        for t in self.targets:
            if t.name == name:
                return t
        known = [t.name for t in self.targets]
        raise ConfigError(f"{self.origin}: no target named {name!r}{did_you_mean(name, known)}")


def _shipped_lanes() -> tuple[LaneConfig, ...]:
    """One lane per shipped series (patches/<version>/series), pinned by data/releases.json."""
    from ..series.lane import shipped_lanes

    return tuple(LaneConfig(version) for version in shipped_lanes())


def _lane_of_pin(pin: PinConfig, series: str | None) -> LaneConfig:
    return LaneConfig(pin.version, pin.sha256, series, pin.source, pin.index_url)
