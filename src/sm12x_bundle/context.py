"""What every command starts from: the resolved config, its lanes, their pinned sources."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from .config import Config, LaneConfig
from .errors import BundleError, SeriesError
from .progress import Progress
from .series.lane import Lane, nearest_at_or_below
from .series.lane import shipped_series as shipped_lane_series
from .series.patch import load_series
from .source.cache import cache_dir
from .source.pin import Pin, SourceTree, resolve_source


def shipped_series(version: str = "0.21.0") -> Path:
    """The series shipped with the tool for one lane (packaged in a wheel, or a checkout's)."""
    path = shipped_lane_series(version)
    if path is None:
        raise SeriesError(f"no patch series is shipped for vLLM {version}: give the lane's series in the config")
    return path


def _pin_of(lane: LaneConfig) -> Pin:
    """The lane's sdist pin: its own sha256, else the one data/releases.json records."""
    return Pin(lane.version, lane.sha256) if lane.sha256 else Pin.for_version(lane.version)


@dataclass
class Context:
    config: Config
    progress: Progress = field(default_factory=Progress.stderr)
    cache_dir: Path | None = None
    _sources: dict[str, SourceTree] = field(default_factory=dict, init=False, repr=False)

    @cached_property
    def lanes(self) -> tuple[Lane, ...]:
        """Every lane of the config, in its order; each series parsed (and refused if unsafe)."""
        return tuple(self._lane(c) for c in self.config.lanes)

    def _lane(self, lane: LaneConfig) -> Lane:
        path = self.config.series_path(lane)
        if path is None:
            raise SeriesError(f"no patch series is shipped for vLLM {lane.version}: give the lane's series")
        return Lane(lane.version, _pin_of(lane), load_series(path))

    def lane(self, version: str) -> Lane | None:
        """The lane pinned to exactly this release, if there is one."""
        return next((lane for lane in self.lanes if lane.version == version), None)

    def lane_for(self, version: str) -> Lane | None:
        """The lane whose pin is nearest at or below ``version``; None below every lane."""
        nearest = nearest_at_or_below([c.version for c in self.config.lanes], version)
        return None if nearest is None else self.lane(nearest)

    @property
    def lane_versions(self) -> str:
        """The lanes' versions for a sentence: '0.21.0, 0.33.0'."""
        return ", ".join(c.version for c in self.config.lanes)

    def named_lane(self, version: str | None) -> Lane:
        """The lane ``--lane VERSION`` names (None: the config's first lane); refused (exit 2,
        nothing fetched) when the config has no such lane."""
        if version is None:
            return self.lanes[0]
        lane = self.lane(version)
        if lane is None:
            raise BundleError(f"--lane {version}: the configuration has no such lane (its lanes: {self.lane_versions})")
        return lane

    def inputs(self) -> list[tuple[str, Path | None]]:
        """The folders and files every run of this config reads (the cache, each lane's local
        source and series folder), each named for a sentence: no output may lie inside one,
        nor one inside an output (fsutil.refuse_overlap)."""
        found: list[tuple[str, Path | None]] = [("cache folder", self.cache_dir or cache_dir())]
        for lane in self.config.lanes:
            if lane.source:
                found.append(("pin source", self.config.resolve(lane.source)))
            series = self.config.series_path(lane)
            found.append(("series folder", series.parent if series is not None else None))
        return found

    def source(self, version: str | None = None) -> SourceTree:
        """A lane's pinned tree (None: the first lane's), or any other release fetched the
        same way (from the index of the lane nearest below it).

        Verified (sdist hash, tree record) on the first call for a release in this run;
        later calls give the same tree without reading it again.
        """
        version = version or self.config.lanes[0].version
        if version not in self._sources:
            self._sources[version] = self._resolve(version)
        return self._sources[version]

    def _resolve(self, version: str) -> SourceTree:
        own = next((c for c in self.config.lanes if c.version == version), None)
        if own is not None:
            local = self.config.resolve(own.source) if own.source else None
            return resolve_source(
                _pin_of(own), index_url=own.index_url, local=local, cache_dir=self.cache_dir, progress=self.progress
            )
        return resolve_source(
            Pin.for_version(version), index_url=self._index_for(version), cache_dir=self.cache_dir,
            progress=self.progress,
        )

    def _index_for(self, version: str) -> str | None:
        nearest = nearest_at_or_below([c.version for c in self.config.lanes], version)
        lane = next((c for c in self.config.lanes if c.version == nearest), self.config.lanes[0])
        return lane.index_url
