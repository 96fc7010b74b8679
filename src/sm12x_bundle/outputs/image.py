"""The bundle image: the base vLLM image with its lane's series applied, one image per release.

Plan first, then execute. The base is planned as a target (plan/target.py,
:func:`plan_target`: its vLLM version selects the lane, its own files are patched, the
native build is planned), :func:`inspect_base` asks the engine what only the bundle needs
(its id, labels and repository digest) and :func:`check_skew` refuses a base whose files
are not its lane's pinned release, before anything is built. :func:`plan_bundle` turns
that into a :class:`BundlePlan` without touching an engine; :func:`builder_context` and
:func:`bundle_context` render the two build contexts from it (``--dry-run`` prints
them). :func:`build_bundle` builds them (the cumem extension alone in
docker/Dockerfile.builder, the one native build both outputs use (native_build.py), then
docker/Dockerfile.bundle) and :func:`verify_bundle` checks the result in a container with
no network, with the same in-image check as overlays (verify.py). The manifest in the
image has the overlays' schema.
"""

from __future__ import annotations

import calendar
import dataclasses
import json
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import fsutil, native
from ..config import ImageConfig, TargetConfig
from ..context import Context
from ..containers import OFFICIAL_VLLM_ROOT, Engine
from ..errors import ConfigError, VerifyError
from ..plan.files import InstalledFile, read_or_none, sha256_of
from ..plan.native import NativePlan
from ..plan.originals import ImageSide
from ..plan.target import TargetPlan, plan_target, say_plan
from ..series.patch import Series
from ..source.pin import SourceTree
from . import native_build
from .dockerfile import (
    ContextFiles,
    Step,
    Words,
    from_reference,
    label_word,
    pin_locally,
    render,
    shell_word,
    write_context,
)
from .manifest import manifest as manifest_document
from .manifest import manifest_bytes
from .verify import VERIFY_SCRIPT, parse_verify, verify_spec

DOC_DIR = "/usr/share/doc/sm12x-bundle"
OCI = "org.opencontainers.image."
PROJECT_LABEL = "org.sm12x-bundle.bundle"
NATIVE_ARTIFACT = "vllm/" + native.ARTIFACT


# --- the base image ------------------------------------------------------------------


@dataclass(frozen=True)
class BaseImage:
    """What only the bundle asks of its base (its vLLM, files and versions are the plan's)."""

    name: str  # as configured: the tag an operator knows
    ref: str  # the id of the image that was checked (FROM names it by its pin tag, dockerfile.py)
    digest: str | None  # its manifest digest, for org.opencontainers.image.base.digest (None: omitted)
    labels: dict[str, str] = field(default_factory=dict)
    digest_note: str | None = None  # why base.digest is omitted, when it is


def _repository(ref: str) -> str:
    """``reg:5000/vllm`` of ``reg:5000/vllm:v1`` or ``reg:5000/vllm@sha256:...``."""
    name = ref.split("@", 1)[0]
    return name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name


def _reference(cfg: ImageConfig) -> str:
    """The base as the daemon should find it: by digest when the config pins one."""
    return f"{_repository(cfg.base)}@{cfg.base_digest}" if cfg.base_digest else cfg.base


def manifest_digest(cfg: ImageConfig, repo_digests: list[str]) -> tuple[str | None, str | None]:
    """The base's manifest digest (what base.digest means, not the local image id), or why there is none.

    The configured digest when there is one (the daemon found the base by it); else the
    image's repository digest (RepoDigests), the base's own repository's first.
    """
    if cfg.base_digest:
        return cfg.base_digest, None
    own = [d for d in repo_digests if d.split("@", 1)[0] == _repository(cfg.base)]
    chosen = (own or sorted(repo_digests))[:1]
    if chosen and "@" in chosen[0]:
        return chosen[0].split("@", 1)[1], None
    return None, (
        f"base image {cfg.base} has no repository digest (it was built or loaded here, never pulled from "
        "or pushed to a registry): org.opencontainers.image.base.digest is omitted; set image.base_digest "
        "to pin one"
    )


def inspect_base(engine: Engine, cfg: ImageConfig) -> BaseImage:
    """Ask the engine what the bundle needs beyond the plan: no build, no container."""
    image_id = engine.image_id(_reference(cfg))
    digest, note = manifest_digest(cfg, engine.repo_digests(image_id))
    return BaseImage(cfg.base, image_id, digest, engine.image_labels(image_id), note)


def pinned_base(cfg: ImageConfig) -> BaseImage:
    """The base as the config names it: for ``--dry-run``, which asks no daemon."""
    note = None if cfg.base_digest else "a dry run asks no daemon for the base's repository digest"
    return BaseImage(cfg.base, _reference(cfg), cfg.base_digest, {}, note)


def base_target(cfg: ImageConfig, dry_run: bool) -> TargetConfig:
    """The base as a target of the plan; a dry run stands in with the first lane's pinned tree
    at image.root, else the official image's install root."""
    root = cfg.root or (OFFICIAL_VLLM_ROOT if dry_run else None)
    return TargetConfig(name=cfg.tag, image=_reference(cfg), root=root, pinned=dry_run)


def check_skew(plan: TargetPlan, source: SourceTree) -> None:
    """Refuse a base whose files differ from its lane's pinned tree: it is not that release
    as pinned, whatever it says. The extension has no copy in the sdist; its pre-image is recorded."""
    skewed = []
    built = {n.artifact for n in plan.native}
    for f in plan.files:
        if f.path in built:
            continue
        pinned = sha256_of(read_or_none(source.root / f.path))
        if pinned != f.pre_image_sha256:
            found = f.pre_image_sha256
            skewed.append(
                f"{f.container_path} ({'absent' if found is None else 'sha256 ' + found[:12]} in the image, "
                f"{'absent' if pinned is None else 'sha256 ' + pinned[:12]} in vLLM {source.version}'s {f.path})"
            )
    if skewed:
        says = plan.side.versions.get("vllm")
        raise VerifyError(
            f"base image {plan.side.ref} is not vLLM {source.version} as pinned"
            + (f" (it says vLLM {says})" if says else "")
            + ": version skew in "
            + "; ".join(skewed)
            + ". Bundle a base of the pinned release, or pin the base's release."
        )


# --- the plan ------------------------------------------------------------------------


@dataclass(frozen=True)
class BundlePlan:
    tag: str
    base: BaseImage
    target: TargetPlan  # the base as a target: its lane, root, versions, files and native build
    files: tuple[InstalledFile, ...]
    native: NativePlan | None  # None: no native patch, nothing to build
    doc: dict[str, bytes]  # the series and each patch, by file name
    labels: dict[str, str]
    pin: dict[str, str | None]
    series_sha256: str
    created: int  # seconds since the epoch: SOURCE_DATE_EPOCH, else the newest Last-Update
    built: dict[str, dict[str, Any]] = field(default_factory=dict)  # container path -> how it was built

    @property
    def builder(self) -> native_build.BuilderPlan | None:
        return self.native.builder if self.native else None

    @property
    def side(self) -> ImageSide:
        """The base's vLLM: root, versions, whether it imports, its bytecode."""
        return self.target.side

    def with_artifact(self, path: str, data: bytes, record: dict[str, Any] | None = None) -> BundlePlan:
        files = tuple(dataclasses.replace(f, data=data) if f.path == path else f for f in self.files)
        built = dict(self.built)
        if record is not None:
            built[next(f.container_path for f in files if f.path == path)] = record
        return dataclasses.replace(self, files=files, built=built)


def created_epoch(series: Series, env: Mapping[str, str]) -> int:
    """SOURCE_DATE_EPOCH when set, else the newest Last-Update of the series: never the clock."""
    if env.get("SOURCE_DATE_EPOCH"):
        try:
            return int(env["SOURCE_DATE_EPOCH"])
        except ValueError:
            raise ConfigError(f"SOURCE_DATE_EPOCH={env['SOURCE_DATE_EPOCH']!r} is not a number of seconds") from None
    dates = [p.headers.get("Last-Update", "") for p in series.patches]
    days = [time.strptime(d, "%Y-%m-%d") for d in dates if re.fullmatch(r"\d{4}-\d{2}-\d{2}", d)]
    return calendar.timegm(max(days)) if days else 0


def bundle_labels(
    cfg: ImageConfig, series: Series, pin: Mapping[str, str | None], base: BaseImage, created: int
) -> dict[str, str]:
    """The image's labels: OCI ones of our own (never upstream's), and the project's."""
    project = {"pin": dict(pin), "patches": list(series.ids), "series_sha256": series.sha256}
    ours = {
        OCI + "source": cfg.source_url,
        OCI + "revision": cfg.revision or series.sha256,
        OCI + "version": f"{pin['version']}+sm12x.{series.sha256[:12]}",
        OCI + "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
        OCI + "base.name": base.name,
        **({OCI + "base.digest": base.digest} if base.digest else {}),
        OCI + "title": "sm12x-bundle",
        OCI + "description": f"vLLM {pin['version']} with the sm12x-bundle series ({', '.join(series.ids)})",
        PROJECT_LABEL: json.dumps(project, sort_keys=True, separators=(",", ":")),
    }
    # Any other OCI label the base carries would describe upstream's image: clear it.
    cleared = {k: "" for k in base.labels if k.startswith(OCI) and k not in ours}
    return dict(sorted({**cleared, **ours}.items()))


def plan_bundle(
    cfg: ImageConfig, target: TargetPlan, source: SourceTree, base: BaseImage, env: Mapping[str, str] | None = None
) -> BundlePlan:
    """Everything the build will do, decided before anything runs: the target's plan rendered
    as a bundle (the files and the native build are the plan's; labels, docs and the date are
    the bundle's). The pin labels name ``source``, the lane's tree as it was verified."""
    env = os.environ if env is None else env
    series = target.lane.series
    pin = {"version": source.version, "sha256": source.sha256}
    created = created_epoch(series, env)
    return BundlePlan(
        tag=cfg.tag,
        base=base,
        target=target,
        files=target.files,
        native=target.native[0] if target.native else None,
        doc={series.file.name: series.file.read_bytes(), **{p.file.name: p.text.encode() for p in series.patches}},
        labels=bundle_labels(cfg, series, pin, base, created),
        pin=pin,
        series_sha256=series.sha256,
        created=created,
    )


# --- rendering -----------------------------------------------------------------------


def _drop_stale_bytecode(plan: BundlePlan) -> Step:
    """A RUN step only when the base holds bytecode of a patched module (each one costs)."""
    if plan.side.bytecode is None:
        return Step(None, "(decided when the base is inspected: a dry run does not look)")
    stale = [shell_word(pyc) for pyc in sorted(pyc for f in plan.files for pyc in plan.side.bytecode.get(f.path, ()))]
    if not stale:
        return Step(None, "(no step: the base holds no bytecode of the patched modules)")
    return Step("RUN", Words((f"rm -f {stale[0]}", *stale[1:])))


def bundle_dockerfile(plan: BundlePlan) -> str:
    return render(
        "Dockerfile.bundle",
        {
            "BASE": from_reference(plan.base.ref),
            "BASE_NAME": plan.base.name,
            "DOC_DIR": DOC_DIR,
            "DROP_STALE_BYTECODE": _drop_stale_bytecode(plan),
            "LABELS": Words(tuple(f"{k}={label_word(v)}" for k, v in plan.labels.items())),
        },
    )


def manifest(plan: BundlePlan) -> dict[str, Any]:
    """The overlays' manifest (docs/design.md), for the files the image replaces."""
    return manifest_document(
        target=plan.tag,
        image=plan.base.name,
        image_id=plan.base.ref,
        vllm_root=plan.side.root,
        versions=plan.side.versions,
        pin=plan.pin,
        series_sha256=plan.series_sha256,
        files=plan.files,
        native=plan.built,
    )


def bundle_context(plan: BundlePlan) -> ContextFiles:
    """Dockerfile and files/: the patched files and the doc folder at their paths in the image."""
    doc = "files/" + DOC_DIR.lstrip("/")
    files: ContextFiles = {"Dockerfile": (bundle_dockerfile(plan).encode(), 0o644)}
    files.update({f.source: (f.data, f.mode) for f in plan.files})
    files.update({f"{doc}/{name}": (data, 0o644) for name, data in plan.doc.items()})
    files[f"{doc}/manifest.json"] = (manifest_bytes(manifest(plan)), 0o644)
    return dict(sorted(files.items()))


def listing(files: ContextFiles) -> str:
    """The context as `ls` would show what matters: mode, size, sha256, path."""
    rows = []
    for rel, (data, mode) in files.items():
        if data is None:
            rows.append(f"  {mode:04o} {'-':>9}  {'(built by Dockerfile.builder)':<16}  {rel}")
        else:
            rows.append(f"  {mode:04o} {len(data):>9}  {sha256_of(data)[:16]:<16}  {rel}")
    return "\n".join(rows)


# --- execution -----------------------------------------------------------------------


@dataclass(frozen=True)
class BundleResult:
    tag: str
    image_id: str
    plan: BundlePlan
    checked: int  # files whose sha256 matched inside the image
    compiled: int  # patched modules that compiled
    imported: tuple[str, ...]  # patched modules that imported ('' when the base cannot import vLLM)
    out: Path


def plan_from_base(ctx: Context, cfg: ImageConfig, engine: Engine | None) -> BundlePlan:
    """Plan the base as a target (with no engine, the first lane's pinned tree stands in) and
    refuse a base that is not its lane's release as pinned."""
    if engine is None:
        base = pinned_base(cfg)
    else:
        ctx.progress.say(f"inspecting the base image {cfg.base}")
        base = inspect_base(engine, cfg)
    target = plan_target(
        ctx, base_target(cfg, engine is None), engine, need_image=engine is not None,
        builder_base=cfg.builder_base or base.ref, setup=cfg.builder_setup, cuda_home=cfg.cuda_home,
    )
    say_plan(target, ctx.progress, "image")
    source = ctx.source(target.lane.version)
    if engine is not None:
        check_skew(target, source)
    return plan_bundle(cfg, target, source, base)


def destinations(out: Path) -> list[fsutil.Destination]:
    """The two build contexts, each replaced whole."""
    return [fsutil.Destination(out / sub, "replace", "image build context folder") for sub in ("builder", "bundle")]


def check_output(out: Path, force: bool = False) -> None:
    """Refuse, before anything is read or built, build context folders this tool did not write."""
    fsutil.refuse_protected(out, "image build context folder")
    fsutil.check_destinations(destinations(out), force)


def build_bundle(
    ctx: Context, cfg: ImageConfig, engine: Engine, out: Path, push: bool = False, force: bool = False
) -> BundleResult:
    """Check the base, build the extension, build the bundle, verify it, push it if asked."""
    check_output(out, force)
    progress = ctx.progress
    plan = plan_from_base(ctx, cfg, engine)
    if plan.native is not None:
        label = f"base image {plan.base.name}"
        art = native_build.build_native(
            plan.native, engine, plan.side.versions, label, out / "builder", progress, force=force
        )
        plan = plan.with_artifact(art.artifact, art.data, art.record)
    write_context(bundle_context(plan), out / "bundle", plan.created, force)
    pinned = pin_locally(engine, plan.base.ref)
    progress.say(f"building {plan.tag} on {plan.base.name} (as {pinned})")
    image_id = engine.build(out / "bundle", "Dockerfile", plan.tag, {}, progress)
    checked, compiled, imported = verify_bundle(engine, plan, plan.tag)
    if push:
        engine.push(plan.tag, progress)
    return BundleResult(plan.tag, image_id, plan, checked, compiled, imported, out)


def verify_bundle(engine: Engine, plan: BundlePlan, ref: str) -> tuple[int, int, tuple[str, ...]]:
    """Run the built image with no network: the overlays' in-image check of every file in
    the manifest (hash, mode, compile, the base's bytecode, import where the base imports
    vLLM) and of the doc folder's hashes; then the labels."""
    document = manifest(plan)
    docs = {f"{DOC_DIR}/{name}": sha256_of(data) for name, data in plan.doc.items()}
    docs[f"{DOC_DIR}/manifest.json"] = sha256_of(manifest_bytes(document))
    spec = verify_spec(document, modules=plan.side.import_error is None, native=False, extra=docs)
    code, out = engine.run(ref, ["python3", "-c", VERIFY_SCRIPT, json.dumps(spec)], timeout=600)
    report = parse_verify(f"bundle {plan.tag}", ref, code, out)
    labels = engine.image_labels(ref)
    wrong = [k for k, v in plan.labels.items() if labels.get(k) != v]
    if wrong:
        raise VerifyError(f"image {ref}: label(s) {', '.join(wrong)} differ from the plan")
    return report.checked, report.compiled, report.imported
