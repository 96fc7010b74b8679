"""Checking a loaded config: every value a later step would refuse is refused here, at load,
naming ``file:line: key``, so ``build --dry-run`` refuses what ``build`` would, before anything
is fetched or written. The jobs' rules live in jobs.py, beside the Nomad renderer's facts.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

from .. import inputs
from ..jobs import check_jobs
from ..values import (
    Where,
    absolute_problem,
    control_problem,
    digest_problem,
    folder_name_problem,
    image_problem,
    line_problem,
    number_problem,
    sha256_problem,
    shell_line_problem,
    text_problem,
    url_problem,
    version_problem,
)
from .model import Config, ImageConfig, LaneConfig, PinConfig, TargetConfig


def validate(config: Config, lines: dict[str, int]) -> None:
    """Refuse the first value that a later step would refuse, naming file:line:key."""
    at = Where(config.origin, lines)
    _check_every_value(config, at)
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
    check_jobs(config.jobs, [t.name for t in config.targets], at)


def _check_every_value(config: Config, at: Where) -> None:
    """One rule for every value of every section, before the checks of each key: no string
    (a mapping's keys too) holds a control character, and every number is one Nomad and the
    generated files can hold (values.number_problem). An env value or an extra argument only
    ever becomes a quoted HCL or JSON string, which escapes a newline or tab: those two may
    hold them (a PEM certificate, a JSON document)."""
    for key, value, is_name in _values(config, ""):
        if isinstance(value, str):
            allowed = "\n\r\t" if not is_name and _QUOTED_ONLY.fullmatch(key) else ""
            at.check(key, control_problem(value, allowed))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            at.check(key, number_problem(key, value))


# jobs[N].env.NAME's value (not its name) and jobs[N].extra_args[I].
_QUOTED_ONLY = re.compile(r"jobs\[\d+\]\.(env\..*|extra_args\[\d+\])")


def _values(node: object, key: str) -> Iterator[tuple[str, object, bool]]:
    """(key path as reading.py names it, value, whether it is a mapping's key) for every leaf
    and every mapping's key."""
    if dataclasses.is_dataclass(node):
        for f in dataclasses.fields(node):
            if f.name not in ("origin", "base_dir"):
                yield from _values(getattr(node, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(node, tuple):
        for i, item in enumerate(node):
            yield from _values(item, f"{key}[{i}]")
    elif isinstance(node, dict):
        for name, item in node.items():
            yield f"{key}.{name}", name, True
            yield from _values(item, f"{key}.{name}")
    else:
        yield key, node, False


def _check_lanes(config: Config, at: Where) -> None:
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
    from ..series.lane import nearest_at_or_below

    lanes = [lane.version for lane in config.lanes]
    if nearest_at_or_below(lanes, version) is None:
        return f"{version} is below every lane ({', '.join(lanes)}): no lane's series is written for it"
    return None


def _check_series_file(config: Config, lane: LaneConfig, key: str, at: Where) -> None:
    from ..series.lane import shipped_lanes

    path = config.series_path(lane)
    if path is None:
        shipped = ", ".join(shipped_lanes()) or "none"
        where = "series" if key.startswith("pin") else key.replace("version", "series")
        at.fail(key, f"no series is shipped for vLLM {lane.version} (shipped lanes: {shipped}); give {where!r}")
    problem = inputs.file_problem(path)
    if problem:
        at.fail(key, f"the series file {str(path)!r} {problem}")


def _check_pin(pin: PinConfig, at: Where) -> None:
    at.check("pin.version", version_problem(pin.version))
    if pin.sha256 is not None:
        at.check("pin.sha256", sha256_problem(pin.sha256))
    if pin.index_url is not None:
        at.check("pin.index_url", url_problem(pin.index_url))
    if pin.source is not None:
        at.check("pin.source", text_problem(pin.source))


def _check_targets(targets: tuple[TargetConfig, ...], lanes: tuple[LaneConfig, ...], at: Where) -> None:
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


def _check_image(image: ImageConfig, at: Where) -> None:
    at.check("image.base", image_problem(image.base))
    if image.base_digest is not None:
        at.check("image.base_digest", digest_problem(image.base_digest))
    at.check("image.tag", image_problem(image.tag, digest_allowed=False))
    if image.root is not None:
        at.check("image.root", absolute_problem(image.root))
    at.check("image.source_url", line_problem(image.source_url) or url_problem(image.source_url, ("http", "https")))
    if image.revision is not None:
        at.check("image.revision", line_problem(image.revision))
    if image.builder_setup is not None:
        at.check("image.builder_setup", shell_line_problem(image.builder_setup))
    if image.builder_base is not None:
        at.check("image.builder_base", image_problem(image.builder_base))
    at.check("image.cuda_home", absolute_problem(image.cuda_home))
