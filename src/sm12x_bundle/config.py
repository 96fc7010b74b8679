"""Configuration: one YAML document resolved once into frozen dataclasses.

Resolution order (later wins, whole document, never merged key by key):
the embedded default (``data/default.yaml``) -> ``sm12x-bundle.yaml`` in the working
directory -> ``--config FILE``. Unknown keys are rejected with the nearest valid key
suggested, every value is checked when the document is loaded (ranges, names, versions,
references between jobs and targets), and every error names the file, the line and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import posixpath
import re
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from . import inputs
from .errors import ConfigError
from .jobs import GATE_TOOL_MOUNT, MANAGED_FLAGS, check_budget, check_host_ram, gate_env, managed_env, node_groups

LOCAL_CONFIG = "sm12x-bundle.yaml"


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
        from .series.lane import shipped_series

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
        raise ConfigError(f"{self.origin}: no target named {name!r}{_did_you_mean(name, known)}")


def _shipped_lanes() -> tuple[LaneConfig, ...]:
    """One lane per shipped series (patches/<version>/series), pinned by data/releases.json."""
    from .series.lane import shipped_lanes

    return tuple(LaneConfig(version) for version in shipped_lanes())


def _lane_of_pin(pin: PinConfig, series: str | None) -> LaneConfig:
    return LaneConfig(pin.version, pin.sha256, series, pin.source, pin.index_url)


# --- loading -----------------------------------------------------------------


class _Node:
    """A YAML value with the line it was written on."""

    __slots__ = ("value", "line", "lines")

    def __init__(self, value: Any, line: int, lines: dict[str, int] | None = None):
        self.value = value
        self.line = line
        self.lines = lines or {}


# A config is a few KiB and nests 4 levels (jobs: [{env: {...}}]); these bounds are far above
# that and far below what could exhaust the machine.
MAX_BYTES = inputs.MIB
MAX_DEPTH = 32


def _compose(text: str, origin: str) -> _Node:
    try:
        loader = _BoundedLoader(text, origin)  # its reader refuses a control character here
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{origin}:{_error_line(exc, text)}: not valid YAML: {_problem(exc)}") from None
    if root is None or root.tag.endswith(":null") or isinstance(root, yaml.MappingNode) and not root.value:
        raise ConfigError(
            f"{origin}:1: the file holds no settings (it is empty, only comments, or {{}}): a config file "
            "replaces the embedded default whole; write the settings, or leave the file out to use the default"
        )
    return _plain(root, origin)


def _error_line(exc: yaml.YAMLError, text: str) -> int:
    """The line a YAML error is on: its mark's, or (a reader error) its character position's."""
    mark = getattr(exc, "problem_mark", None)
    if mark is not None:
        return mark.line + 1
    position = getattr(exc, "position", None)
    return text[:position].count("\n") + 1 if isinstance(position, int) else 1


def _problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.reader.ReaderError):
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"the character #x{char:04x} is not allowed in YAML (a control character or a NUL byte)"
    return " ".join(str(getattr(exc, "problem", None) or exc).split())


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader's composer, refusing before each node is built what could make a few lines
    cost gigabytes or overflow the stack: anchors and aliases (seven lines, each a list that
    names the line before it nine times, expand to 4.8 million values), and nesting beyond
    MAX_DEPTH (the composer recurses once per level)."""

    def __init__(self, text: str, origin: str):
        super().__init__(text)
        self.origin = origin
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise ConfigError(
                f"{self.origin}:{line}: anchors and aliases are not allowed in a config "
                f"(found {sign}{event.anchor}): write each value where it is used"
            )
        nests = isinstance(event, yaml.CollectionStartEvent)  # a mapping or a list: one level more
        if nests and self.depth == MAX_DEPTH:
            raise ConfigError(f"{self.origin}:{line}: nested more than {MAX_DEPTH} levels deep: refused")
        self.depth += nests
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= nests


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
    return _Node(_scalar(node, f"{origin}:{line}"), line)


def _scalar(node: yaml.Node, where: str) -> Any:
    # SafeLoader's own constructor, so "0.70" is a float and "0.21.0" a string
    # exactly as yaml.safe_load would read them.
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    except ValueError:  # Python reads at most 4300 digits into an int (sys.int_info)
        raise ConfigError(f"{where}: not valid YAML: a number of {len(node.value)} digits, too long to read") from None
    finally:
        loader.dispose()


def _did_you_mean(word: str, choices: typing.Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _convert(tp: Any, node: _Node, where: str, origin: str, lines: dict[str, int]) -> Any:
    """Turn a located YAML value into the annotated type, or raise a located error.

    ``lines`` collects the line of every key and list item, so the checks that run
    after the whole document is read can still name file:line:key."""
    at = f"{origin}:{node.line}: {where}"
    origin_tp = typing.get_origin(tp)
    if origin_tp in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if node.value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, node, where, origin, lines)
    if dataclasses.is_dataclass(tp):
        return _build(tp, node, where, origin, lines)
    if origin_tp is tuple:
        if not isinstance(node.value, list):
            raise ConfigError(f"{at} must be a list")
        inner = typing.get_args(tp)[0]
        items = []
        for i, v in enumerate(node.value):
            lines[f"{where}[{i}]"] = v.line
            items.append(_convert(inner, v, f"{where}[{i}]", origin, lines))
        return tuple(items)
    if origin_tp is dict:
        if not isinstance(node.value, dict):
            raise ConfigError(f"{at} must be a mapping")
        lines.update({f"{where}.{k}": node.lines.get(k, node.line) for k in node.value})
        return {k: _convert(str, v, f"{where}.{k}", origin, lines) for k, v in node.value.items()}
    value = node.value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        raise ConfigError(f"{at} must be a string: quote it ({value!r} was read as a number)")
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ConfigError(f"{at} must be {tp.__name__}, not {type(value).__name__}")
    return value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # slow; a list of 1,000 jobs would ask it 1,000 times


def _build(cls: type, node: _Node, where: str, origin: str, lines: dict[str, int]) -> Any:
    if not isinstance(node.value, dict):
        raise ConfigError(f"{origin}:{node.line}: {where or 'the document'} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("origin", "base_dir")}
    hints = _hints(cls)
    kwargs = {}
    for key, value in node.value.items():
        name = f"{where}.{key}" if where else key
        if key not in fields:
            line = node.lines.get(key, node.line)
            raise ConfigError(f"{origin}:{line}: unknown key {name!r}{_did_you_mean(key, fields)}")
        lines[name] = node.lines.get(key, node.line)
        kwargs[key] = _convert(hints[key], value, name, origin, lines)
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
    """Parse one YAML document into a Config and check every value (file access: only
    whether each lane's series file is a regular file)."""
    lines: dict[str, int] = {}
    config = _build(Config, _compose(text, origin), "", origin, lines)
    config = dataclasses.replace(config, origin=origin, base_dir=str(base_dir))
    if not {"lanes", "pin", "series"} & lines.keys():  # no lane named: every lane the tool ships
        config = dataclasses.replace(config, lanes=_shipped_lanes())
        lines.update({"lanes": 1, **{f"lanes[{i}]": 1 for i in range(len(config.lanes))}})
    validate(config, lines)
    if "lanes" in lines:  # the one-lane names repeat the first lane for one-lane callers
        first = config.lanes[0]
        pin = PinConfig(first.version, first.sha256, first.index_url, first.source)
        config = dataclasses.replace(config, pin=pin, series=first.series)
    return config


# --- checking values ---------------------------------------------------------
#
# Every value is checked here, at load, so `build --dry-run` refuses what `build` would
# refuse, before anything is fetched or written. The value checks are shared with the
# command line (arguments.py), so `--vllm ''` and `pin.version: ''` get the same sentence.

_VERSION = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?(\+[A-Za-z0-9.]+)?")
_SHA256 = re.compile(r"[0-9a-f]{64}")
# One path component that is not '.' or '..': it names a folder.
_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# A job name names a Nomad job, its service (a DNS label) and its files.
_JOB_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Docker's reference grammar (distribution/reference), without the rarely used corners.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
# A registry host is told apart from a path the way Docker does: it has a '.', a port, or is localhost.
_DOMAIN = r"(?:(?:localhost|[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+|[A-Za-z0-9-]+(?=:[0-9]+/))(?::[0-9]+)?/)?"
_TAG = r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?"
_IMAGE_TAG = re.compile(rf"{_DOMAIN}{_COMPONENT}(?:/{_COMPONENT})*{_TAG}")
_IMAGE_REF = re.compile(rf"{_DOMAIN}{_COMPONENT}(?:/{_COMPONENT})*{_TAG}(?:@sha256:[0-9a-f]{{64}})?")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")

DELIVERIES = ("host", "artifact")
ALLOCATIONS = ("device", "shared")
PROVIDERS = ("nomad", "consul")
GATES = ("none", "engine", "allocator")


def version_problem(value: str) -> str | None:
    if not _VERSION.fullmatch(value):
        return f"must be a vLLM release version such as 0.21.0, not {value!r}"
    return None


def sha256_problem(value: str) -> str | None:
    if not _SHA256.fullmatch(value):
        return f"must be 64 lowercase hex digits (a sha256), not {value!r}"
    return None


def digest_problem(value: str) -> str | None:
    if not _DIGEST.fullmatch(value):
        return f"must be a registry digest 'sha256:' + 64 lowercase hex digits, not {value!r}"
    return None


def image_problem(value: str, digest_allowed: bool = True) -> str | None:
    pattern = _IMAGE_REF if digest_allowed else _IMAGE_TAG
    if not pattern.fullmatch(value):
        return f"must be an image reference such as vllm/vllm-openai:v0.21.0, not {value!r}"
    return None


def url_problem(value: str, schemes: tuple[str, ...] = ("http", "https", "file")) -> str | None:
    parts = urlsplit(value)
    if parts.scheme not in schemes or (parts.scheme != "file" and not parts.netloc):
        return f"must be a URL starting with {' or '.join(s + '://' for s in schemes)}, not {value!r}"
    return None


def folder_name_problem(value: str) -> str | None:
    if not _FOLDER_NAME.fullmatch(value):
        return (
            "must be letters, digits, '.', '_' or '-', starting with a letter or digit "
            f"(it names a folder), not {value!r}"
        )
    return None


def absolute_problem(value: str) -> str | None:
    if not value.startswith("/") or posixpath.normpath(value) != value:
        return f"must be a normalised absolute path, not {value!r}"
    return None


def text_problem(value: str) -> str | None:
    return "must not be empty" if not value.strip() else None


def line_problem(value: str) -> str | None:
    """A value that lands on one line (a Dockerfile label, a RUN line)."""
    if "\n" in value or "\r" in value:
        return f"must be one line, not {value!r}"
    return text_problem(value)


class _Where:
    """Turns a key path (``jobs[1].port``) into ``file:line: key``: the key's own line
    when the file wrote it, else the nearest enclosing key's."""

    def __init__(self, origin: str, lines: dict[str, int]):
        self.origin = origin
        self.lines = lines

    def line(self, key: str) -> int:
        while key:
            if key in self.lines:
                return self.lines[key]
            parent = re.fullmatch(r"(.*)(\.[^.\[]*|\[\d+\])", key)
            key = parent.group(1) if parent else ""
        return 1

    def fail(self, key: str, problem: str) -> typing.NoReturn:
        raise ConfigError(f"{self.origin}:{self.line(key)}: {key}: {problem}")

    def check(self, key: str, problem: str | None) -> None:
        if problem:
            self.fail(key, problem)


def validate(config: Config, lines: dict[str, int]) -> None:
    """Refuse the first value that a later step would refuse, naming file:line:key."""
    at = _Where(config.origin, lines)
    if "lanes" in lines:
        _check_lanes(config, at)
    else:
        _check_pin(config.pin, at)
        if config.series is not None:
            at.check("series", text_problem(config.series))
        _check_series_file(config, config.lanes[0], "series" if config.series else "pin.version", at)
    for i, v in enumerate(config.check.versions):
        at.check(f"check.versions[{i}]", version_problem(v))
        at.check(f"check.versions[{i}]", _below_every_lane(config, v))
    if config.check.fuzz < 0:
        at.fail("check.fuzz", f"must be 0 or more (context lines a hunk may ignore), not {config.check.fuzz}")
    at.check("output.dir", text_problem(config.output.dir))
    at.check("output.overlays", text_problem(config.output.overlays))
    _check_targets(config.targets, config.lanes, at)
    _check_image(config.image, at)
    _check_jobs(config, at)


def _check_lanes(config: Config, at: _Where) -> None:
    for other in ("pin", "series"):
        if other in at.lines:
            at.fail(other, f"'{other}:' is the one-lane form; with 'lanes:' give each lane's version, sha256 and series there")
    if "lanes[0]" not in at.lines:  # an empty list: __post_init__ already filled in the pin's lane
        at.fail("lanes", "must list at least one lane (version, sha256, and optionally series and source)")
    seen: set[str] = set()
    for i, lane in enumerate(config.lanes):
        key = f"lanes[{i}]"
        at.check(f"{key}.version", version_problem(lane.version))
        if lane.version in seen:
            at.fail(f"{key}.version", f"lane versions must be unique: {lane.version!r} is already a lane")
        seen.add(lane.version)
        if lane.sha256 is not None:
            at.check(f"{key}.sha256", sha256_problem(lane.sha256))
        for name in ("series", "source"):
            if getattr(lane, name) is not None:
                at.check(f"{key}.{name}", text_problem(getattr(lane, name)))
        if lane.index_url is not None:
            at.check(f"{key}.index_url", url_problem(lane.index_url))
        _check_series_file(config, lane, f"{key}.series" if lane.series else f"{key}.version", at)


def _below_every_lane(config: Config, version: str) -> str | None:
    from .series.lane import nearest_at_or_below

    lanes = [lane.version for lane in config.lanes]
    if nearest_at_or_below(lanes, version) is None:
        return f"{version} is below every lane ({', '.join(lanes)}): no lane's series is written for it"
    return None


def _check_series_file(config: Config, lane: LaneConfig, key: str, at: _Where) -> None:
    from .series.lane import shipped_lanes

    path = config.series_path(lane)
    if path is None:
        shipped = ", ".join(shipped_lanes()) or "none"
        where = "series" if key.startswith("pin") else key.replace("version", "series")
        at.fail(key, f"no series is shipped for vLLM {lane.version} (shipped lanes: {shipped}); give {where!r}")
    problem = inputs.file_problem(path)
    if problem:
        at.fail(key, f"the series file {str(path)!r} {problem}")


def _check_pin(pin: PinConfig, at: _Where) -> None:
    at.check("pin.version", version_problem(pin.version))
    if pin.sha256 is not None:
        at.check("pin.sha256", sha256_problem(pin.sha256))
    if pin.index_url is not None:
        at.check("pin.index_url", url_problem(pin.index_url))
    if pin.source is not None:
        at.check("pin.source", text_problem(pin.source))


def _check_targets(targets: tuple[TargetConfig, ...], lanes: tuple[LaneConfig, ...], at: _Where) -> None:
    seen: set[str] = set()
    for i, t in enumerate(targets):
        key = f"targets[{i}]"
        at.check(f"{key}.name", folder_name_problem(t.name))
        if t.name in seen:
            at.fail(f"{key}.name", f"target names must be unique: {t.name!r} is already a target")
        seen.add(t.name)
        at.check(f"{key}.image", image_problem(t.image))
        if t.root is not None:
            at.check(f"{key}.root", absolute_problem(t.root))
        if t.vllm is not None and t.vllm not in [lane.version for lane in lanes]:
            names = ", ".join(lane.version for lane in lanes)
            at.fail(f"{key}.vllm", f"target {t.name!r} names vLLM {t.vllm!r}, which is not a lane (lanes: {names})")


def _check_image(image: ImageConfig, at: _Where) -> None:
    at.check("image.base", image_problem(image.base))
    if image.base_digest is not None:
        at.check("image.base_digest", digest_problem(image.base_digest))
    at.check("image.tag", image_problem(image.tag, digest_allowed=False))
    if image.root is not None:
        at.check("image.root", absolute_problem(image.root))
    at.check("image.source_url", line_problem(image.source_url) or url_problem(image.source_url, ("http", "https")))
    for key in ("revision", "builder_setup"):
        if getattr(image, key) is not None:
            at.check(f"image.{key}", line_problem(getattr(image, key)))
    if image.builder_base is not None:
        at.check("image.builder_base", image_problem(image.builder_base))
    at.check("image.cuda_home", absolute_problem(image.cuda_home))


def _check_jobs(config: Config, at: _Where) -> None:
    known = [t.name for t in config.targets]
    seen: set[str] = set()
    for i, job in enumerate(config.jobs):
        key = f"jobs[{i}]"
        if not _JOB_NAME.fullmatch(job.name):
            at.fail(
                f"{key}.name",
                "a job name is letters, digits and dashes, at most 63 (it names the service and the files), "
                f"not {job.name!r}",
            )
        if job.name in seen:
            at.fail(f"{key}.name", f"job names must be unique: {job.name!r} is already a job")
        seen.add(job.name)
        if job.target not in known:
            hint = _did_you_mean(job.target, known)
            at.fail(f"{key}.target", f"job {job.name!r} names target {job.target!r}, which is not in targets{hint}")
        for check in _JOB_CHECKS:
            check(job, key, at)
    _check_peer_ports(config, at)
    _check_host_ram(config, at)


def _job_text(job: JobConfig, key: str, at: _Where) -> None:
    at.check(f"{key}.model", text_problem(job.model))
    if job.served_model_name is not None:
        at.check(f"{key}.served_model_name", text_problem(job.served_model_name))
    for i, dc in enumerate(job.datacenters):
        at.check(f"{key}.datacenters[{i}]", text_problem(dc))
    if not job.datacenters:
        at.fail(f"{key}.datacenters", "must name at least one datacenter")
    for attribute, value in sorted(job.node_constraints.items()):
        at.check(f"{key}.node_constraints.{attribute}", text_problem(attribute) or text_problem(value))


def _job_choices(job: JobConfig, key: str, at: _Where) -> None:
    for name, value, choices in (
        ("overlay_delivery", job.overlay_delivery, DELIVERIES),
        ("gpu_allocation", job.gpu_allocation, ALLOCATIONS),
        ("service_provider", job.service_provider, PROVIDERS),
        ("gate", job.gate, GATES),
    ):
        if value not in choices:
            at.fail(f"{key}.{name}", f"unknown {name} {value!r}: choose one of {', '.join(choices)}")


def _job_gpus(job: JobConfig, key: str, at: _Where) -> None:
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


def _job_gpu_model(job: JobConfig, key: str, at: _Where) -> None:
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


def _job_memory(job: JobConfig, key: str, at: _Where) -> None:
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


def _job_sizes(job: JobConfig, key: str, at: _Where) -> None:
    for name in ("cpu_mhz", "memory_mb", "shm_size_mb", "disk_mb", "load_time_s", "kill_timeout_s"):
        if getattr(job, name) <= 0:
            at.fail(f"{key}.{name}", f"must be positive, not {getattr(job, name)}")
    if job.max_model_len is not None and job.max_model_len <= 0:
        at.fail(f"{key}.max_model_len", f"must be positive, not {job.max_model_len}")
    if not 0 < job.port < 65536:
        at.fail(f"{key}.port", f"port must be in 1-65535, not {job.port}")


def _job_timing(job: JobConfig, key: str, at: _Where) -> None:
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


def _job_delivery(job: JobConfig, key: str, at: _Where) -> None:
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


def _job_container(job: JobConfig, key: str, at: _Where) -> None:
    if not job.entrypoint or not all(job.entrypoint):
        at.fail(f"{key}.entrypoint", "entrypoint must not be empty (it replaces the image's ENTRYPOINT)")
    for i, arg in enumerate(job.extra_args):
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            at.fail(f"{key}.extra_args[{i}]", f"extra_args sets {flag}, which comes from the job's own keys; use those")
    managed = managed_env(job)
    for name in sorted(job.env):
        if not _ENV_KEY.fullmatch(name):
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


def _job_gate(job: JobConfig, key: str, at: _Where) -> None:
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


def _job_gate_time(job: JobConfig, key: str, at: _Where) -> None:
    if job.gate_time_s <= 0:
        at.fail(f"{key}.gate_time_s", f"must be positive, not {job.gate_time_s}")
    if job.healthy_deadline_s <= job.load_time_s + job.gate_time_s:
        at.fail(
            f"{key}.healthy_deadline_s",
            f"healthy_deadline_s ({job.healthy_deadline_s}) must exceed load_time_s ({job.load_time_s}) + gate_time_s "
            f"({job.gate_time_s}): the gate runs inside the allocation before the model loads",
        )


_JOB_CHECKS = (
    _job_text, _job_choices, _job_gpus, _job_memory, _job_sizes, _job_timing, _job_delivery, _job_container, _job_gate,
)


def _check_peer_ports(config: Config, at: _Where) -> None:
    """Peers pinned to the same node cannot share a static port."""
    seen: dict[tuple, str] = {}
    for i, job in enumerate(config.jobs):
        if job.gpu_allocation != "shared":
            continue
        node = (job.port, tuple(sorted(job.node_constraints.items())))
        if node in seen:
            peers = f"jobs {seen[node]!r} and {job.name!r}"
            at.fail(f"jobs[{i}].port", f"{peers} share a node and both use port {job.port}")
        seen[node] = job.name


def _check_host_ram(config: Config, at: _Where) -> None:
    """The jobs that share a node fit in its RAM: named at the first job of the node that gives host_ram_gib."""
    for group in node_groups(config.jobs):
        given = [i for i in group if config.jobs[i].host_ram_gib is not None]
        if given:
            key = f"jobs[{given[0]}].host_ram_gib"
            check_host_ram([config.jobs[i] for i in group], f"{at.origin}:{at.line(key)}: {key}")


def default_text() -> str:
    return resources.files("sm12x_bundle").joinpath("data/default.yaml").read_text("utf-8")


def load(path: Path | None = None, cwd: Path | None = None) -> Config:
    """Load ``path``, else ``sm12x-bundle.yaml`` in ``cwd``, else the embedded default."""
    cwd = cwd or Path.cwd()
    if path is None and (cwd / LOCAL_CONFIG).is_file():
        path = cwd / LOCAL_CONFIG
    if path is None:
        return parse(default_text(), "<embedded default>", cwd)
    data = inputs.read_bounded(path, MAX_BYTES, ConfigError, "config")
    return parse(inputs.decode_utf8(data, ConfigError, path), str(path), path.resolve().parent)
