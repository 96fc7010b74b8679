"""Configuration: one YAML document resolved once into frozen dataclasses.

Resolution order (later wins, whole document, never merged key by key):
the embedded default (``data/default.yaml``) -> ``sm12x-bundle.yaml`` in the working
directory -> ``--config FILE``. Unknown keys are rejected with the nearest valid key
suggested, and every error names the file, the line and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

LOCAL_CONFIG = "sm12x-bundle.yaml"


@dataclass(frozen=True)
class PinConfig:
    """The vLLM source the series is written for."""

    version: str = "0.21.0"
    sha256: str = "05ff89c3e926b88b77d7878e317a659ffba678afc21c1d48952037aa5457f058"
    # None follows pip's configured index (PIP_INDEX_URL, pip.conf), then PyPI.
    index_url: str | None = None
    # A local vLLM source tree or sdist to use instead of a download.
    source: str | None = None


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
    # "host": bind-mount the overlay files from overlay_host_dir on the client;
    # "artifact": fetch them from artifact_base_url with a checksum, then bind-mount.
    overlay_delivery: str = "host"
    overlay_host_dir: str = "/opt/sm12x-bundle/overlays"
    artifact_base_url: str | None = None
    datacenters: tuple[str, ...] = ("dc1",)
    cpu_mhz: int = 16000
    # Sleeping weights live in pinned host memory, inside this limit.
    memory_mb: int = 65536
    shm_size_mb: int = 16384
    disk_mb: int = 20480
    readonly_rootfs: bool = True
    # Worst-case model load (weights, compile, graph capture, JIT) measured on the fleet.
    load_time_s: int = 900
    min_healthy_time_s: int = 60
    healthy_deadline_s: int = 1800
    progress_deadline_s: int = 2400
    kill_timeout_s: int = 300


@dataclass(frozen=True)
class Config:
    """The whole configuration, and where it came from."""

    pin: PinConfig = PinConfig()
    # Path of patches/series; None uses the series shipped with the tool.
    series: str | None = None
    check: CheckConfig = CheckConfig()
    output: OutputConfig = OutputConfig()
    targets: tuple[TargetConfig, ...] = ()
    image: ImageConfig = ImageConfig()
    jobs: tuple[JobConfig, ...] = ()
    origin: str = "<embedded default>"
    base_dir: str = "."

    def resolve(self, path: str) -> Path:
        """A path from the config, relative to the config file's directory."""
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    def target(self, name: str) -> TargetConfig:
        for t in self.targets:
            if t.name == name:
                return t
        known = [t.name for t in self.targets]
        raise ConfigError(f"{self.origin}: no target named {name!r}{_did_you_mean(name, known)}")


# --- loading -----------------------------------------------------------------


class _Node:
    """A YAML value with the line it was written on."""

    __slots__ = ("value", "line", "lines")

    def __init__(self, value: Any, line: int, lines: dict[str, int] | None = None):
        self.value = value
        self.line = line
        self.lines = lines or {}


def _compose(text: str, origin: str) -> _Node:
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{origin}:{mark.line + 1}" if mark else origin
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{where}: not valid YAML: {problem}") from None
    if root is None:
        return _Node({}, 1)
    return _plain(root, origin)


_SAFE_TAGS = {f"tag:yaml.org,2002:{t}" for t in ("map", "seq", "str", "int", "float", "bool", "null")}


def _plain(node: yaml.Node, origin: str) -> _Node:
    line = node.start_mark.line + 1
    if node.tag not in _SAFE_TAGS:
        raise ConfigError(f"{origin}:{line}: not valid YAML: the tag {node.tag} is not allowed here")
    if isinstance(node, yaml.MappingNode):
        out: dict[str, _Node] = {}
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            if not isinstance(key_node, yaml.ScalarNode) or not isinstance(key, str):
                raise ConfigError(f"{origin}:{key_node.start_mark.line + 1}: keys must be strings")
            if key in out:
                raise ConfigError(f"{origin}:{key_node.start_mark.line + 1}: duplicate key {key!r}")
            out[key] = _plain(value_node, origin)
            lines[key] = key_node.start_mark.line + 1
        return _Node(out, line, lines)
    if isinstance(node, yaml.SequenceNode):
        return _Node([_plain(v, origin) for v in node.value], line)
    return _Node(_scalar(node), line)


def _scalar(node: yaml.Node) -> Any:
    # SafeLoader's own constructor, so "0.70" is a float and "0.21.0" a string
    # exactly as yaml.safe_load would read them.
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


def _did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _convert(tp: Any, node: _Node, where: str, origin: str) -> Any:
    """Turn a located YAML value into the annotated type, or raise a located error."""
    at = f"{origin}:{node.line}: {where}"
    origin_tp = typing.get_origin(tp)
    if origin_tp in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if node.value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, node, where, origin)
    if dataclasses.is_dataclass(tp):
        return _build(tp, node, where, origin)
    if origin_tp is tuple:
        if not isinstance(node.value, list):
            raise ConfigError(f"{at} must be a list")
        inner = typing.get_args(tp)[0]
        return tuple(_convert(inner, v, f"{where}[{i}]", origin) for i, v in enumerate(node.value))
    if origin_tp is dict:
        if not isinstance(node.value, dict):
            raise ConfigError(f"{at} must be a mapping")
        return {k: _convert(str, v, f"{where}.{k}", origin) for k, v in node.value.items()}
    value = node.value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ConfigError(f"{at} must be a string: quote it ({value!r} was read as a number)")
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{at} must be {tp.__name__}, not {type(value).__name__}")
    return value


def _build(cls: type, node: _Node, where: str, origin: str) -> Any:
    if not isinstance(node.value, dict):
        raise ConfigError(f"{origin}:{node.line}: {where or 'the document'} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("origin", "base_dir")}
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for key, value in node.value.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            line = node.lines.get(key, node.line)
            raise ConfigError(f"{origin}:{line}: unknown key {name!r}{_did_you_mean(key, fields)}")
        kwargs[key] = _convert(hints[key], value, name, origin)
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{origin}:{node.line}: {where or 'the document'} needs {', '.join(missing)}")
    return cls(**kwargs)


def parse(text: str, origin: str, base_dir: Path) -> Config:
    """Parse one YAML document into a Config (pure: no file access)."""
    config = _build(Config, _compose(text, origin), "", origin)
    config = dataclasses.replace(config, origin=origin, base_dir=str(base_dir))
    _check_unique(config)
    return config


def _check_unique(config: Config) -> None:
    for kind, items in (("target", config.targets), ("job", config.jobs)):
        names = [i.name for i in items]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"{config.origin}: {kind} names must be unique: {', '.join(dupes)}")
    known = {t.name for t in config.targets}
    for job in config.jobs:
        if job.target not in known:
            raise ConfigError(
                f"{config.origin}: job {job.name!r} names target {job.target!r}, "
                f"which is not in targets{_did_you_mean(job.target, known)}"
            )


def default_text() -> str:
    return resources.files("sm12x_bundle").joinpath("data/default.yaml").read_text("utf-8")


def load(path: Path | None = None, cwd: Path | None = None) -> Config:
    """Load ``path``, else ``sm12x-bundle.yaml`` in ``cwd``, else the embedded default."""
    cwd = cwd or Path.cwd()
    if path is None and (cwd / LOCAL_CONFIG).is_file():
        path = cwd / LOCAL_CONFIG
    if path is None:
        return parse(default_text(), "<embedded default>", cwd)
    try:
        text = path.read_text("utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    return parse(text, str(path), path.resolve().parent)
