"""Configuration: one YAML document resolved once into frozen dataclasses.

Resolution order (later wins, whole document, never merged key by key):
the embedded default (``data/default.yaml``) -> ``sm12x-bundle.yaml`` in the working
directory -> ``--config FILE``. Unknown keys are rejected with the nearest valid key
suggested, every value is checked when the document is loaded (ranges, names, versions,
references between jobs and targets), and every error names the file, the line and the key.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .. import inputs
from ..errors import ConfigError
from .model import (
    CheckConfig,
    Config,
    ImageConfig,
    JobConfig,
    LaneConfig,
    OutputConfig,
    PinConfig,
    TargetConfig,
)
from .reading import parse, parse_located
from .rules import validate

__all__ = [
    "EMBEDDED", "LOCAL_CONFIG", "MAX_BYTES", "CheckConfig", "Config", "ImageConfig", "JobConfig", "LaneConfig",
    "OutputConfig", "PinConfig", "TargetConfig", "default_text", "load", "load_located", "parse", "validate",
]


LOCAL_CONFIG = "sm12x-bundle.yaml"
EMBEDDED = "<embedded default>"  # a Config's origin when no file was read


# A config is a few KiB and nests 4 levels (jobs: [{env: {...}}]); these bounds are far above
# that and far below what could exhaust the machine.
MAX_BYTES = inputs.MIB


def default_text() -> str:
    return resources.files("sm12x_bundle").joinpath("data/default.yaml").read_text("utf-8")


def load(path: Path | None = None, cwd: Path | None = None) -> Config:
    """Load ``path``, else ``sm12x-bundle.yaml`` in ``cwd``, else the embedded default."""
    return load_located(path, cwd)[0]


def load_located(path: Path | None = None, cwd: Path | None = None) -> tuple[Config, dict[str, int]]:
    """``load``, and the line of every key the document wrote (``reading.parse_located``)."""
    cwd = cwd or Path.cwd()
    if path is None and (cwd / LOCAL_CONFIG).is_file():
        path = cwd / LOCAL_CONFIG
    if path is None:
        return parse_located(default_text(), EMBEDDED, cwd)
    data = inputs.read_bounded(path, MAX_BYTES, ConfigError, "config")
    return parse_located(inputs.decode_utf8(data, ConfigError, path), str(path), path.resolve().parent)
