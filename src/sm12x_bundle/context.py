"""What every command starts from: the resolved config, the series, the pinned source."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path

from .config import Config
from .errors import SeriesError
from .progress import Progress
from .series.patch import Series, load_series
from .source.pin import Pin, SourceTree, resolve_source


def shipped_series() -> Path:
    """The series shipped with the tool: packaged in a wheel, or patches/ of a checkout."""
    packaged = resources.files("sm12x_bundle").joinpath("_patches/0.21.0/series")
    if packaged.is_file():
        return Path(str(packaged))
    checkout = Path(__file__).resolve().parents[2] / "patches" / "0.21.0" / "series"
    if checkout.is_file():
        return checkout
    raise SeriesError("no patch series found: give 'series:' in the config")


@dataclass
class Context:
    config: Config
    progress: Progress = field(default_factory=Progress.stderr)
    cache_dir: Path | None = None
    _sources: dict[str | None, SourceTree] = field(default_factory=dict, init=False, repr=False)

    @cached_property
    def series(self) -> Series:
        path = self.config.resolve(self.config.series) if self.config.series else shipped_series()
        return load_series(path)

    @property
    def pin(self) -> Pin:
        pin = self.config.pin
        return Pin(pin.version, pin.sha256) if pin.sha256 else Pin.for_version(pin.version)

    def source(self, version: str | None = None) -> SourceTree:
        """The pinned tree, or (given ``version``) that release fetched the same way.

        Verified (sdist hash, tree record) on the first call for a release in this run;
        later calls give the same tree without reading it again.
        """
        key = None if version == self.config.pin.version else version
        if key not in self._sources:
            self._sources[key] = self._resolve(key)
        return self._sources[key]

    def _resolve(self, version: str | None) -> SourceTree:
        pin = self.config.pin
        if version is None or version == pin.version:
            local = self.config.resolve(pin.source) if pin.source else None
            return resolve_source(
                self.pin, index_url=pin.index_url, local=local, cache_dir=self.cache_dir, progress=self.progress
            )
        return resolve_source(
            Pin.for_version(version), index_url=pin.index_url, cache_dir=self.cache_dir, progress=self.progress
        )
