"""Per-file overlays: the patched copies of exactly the files the series changes, ready to
bind-mount read-only over the same files inside a running vLLM container.

Three steps, each testable alone:

* **plan** (pure): which tree paths the series overlays (:func:`plan_series`), and for one
  image the patched bytes of each (:func:`patch_image_files`), computed from the image's
  *own* copies with fuzz 0. A file the series does not apply to cleanly is an ApplyError
  naming the image, the file and the hunk: an overlay never swaps in a whole file from
  another vLLM version (that is how full-file swaps broke FlashInfer imports in production).
* **write**: ``<out>/<target>/<content hash>/{manifest.json, files/...}`` staged and renamed
  into place, plus ``<out>/<target>/current.json``. Same inputs give the same bytes and the
  same mtimes; a new version is a new path.
* **verify**: the overlay mounted read-only in the target image (no network): hashes,
  compile, import where the image can import vLLM, the native extension loads, the image's
  own bytecode cannot shadow an overlaid file, and the image's originals are the recorded
  pre-images (otherwise refused).

The native artifact (``vllm/cumem_allocator.abi3.so``) is built the one way both outputs
build it (native_build.py): in a builder container from docker/Dockerfile.builder started
from the target image when the overlay is read from an image, on the host only for a target
made from the pinned tree without one. ``verify`` loads it in the image's own Python.
The plan, the paths and the manifest are shared with the bundle image (manifest.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Config, TargetConfig
from ..engine import ImageFile
from ..errors import ApplyError, ConfigError, EngineError, VerifyError
from .. import arguments, fsutil
from ..fsutil import replace_dir, write_file
from ..progress import Progress
from ..series.apply import VirtualTree
from ..series.patch import Series
from ..source import cache as cache_mod
from ..source.pin import SourceTree
from . import native_build
from .manifest import (
    SCHEMA,
    VERIFY_SCRIPT,
    VERSION_KEYS,
    InstalledFile,
    SeriesPlan,
    Verified,
    apply_subseries,
    container_path,
    content_hash,
    manifest_bytes,
)
from .manifest import manifest as manifest_document
from .manifest import (
    normal_root,
    parse_verify,
    plan_series,
    sha256_of,
    verify_spec,
)
# Overlaid files get mtimes in the first 194 days of 2000 (before vLLM existed), derived
# from their content: never the image original's mtime, and never the mtime of another
# version of the same overlay (a persistent PYTHONPYCACHEPREFIX keeps bytecode keyed on
# mtime and size, so two versions of one size must differ in mtime).
MTIME_BASE = 946684800
# Where verify puts what it needs inside the container.
_PYCACHE = "/tmp/sm12x-verify-pycache"
_LIBDIR = "/sm12x-verify/lib"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


# --- applying the series to an image's own files (pure but for a temp folder) --------


@dataclass(frozen=True)
class Applied:
    data: bytes
    mode: int
    patches: tuple[str, ...]


def patch_image_files(
    series: Series, originals: dict[str, ImageFile | None], where: str, shown: Callable[[str], str] = str
) -> tuple[dict[str, Applied], list[str]]:
    """Patch the image's own copies (tree path -> bytes and mode, None: absent) surgically.

    A patched file keeps the mode the image gives it (the tree reads it back from disk);
    a file the series creates takes the mode its patch names."""
    with tempfile.TemporaryDirectory(prefix="sm12x-overlay-") as tmp:
        for path, original in originals.items():
            if original is not None:
                dest = Path(tmp) / path
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(original.data)
                dest.chmod(original.mode)
        tree = VirtualTree(Path(tmp))
        applied, landed = apply_subseries(series, tree, set(originals), where, shown)
        out = {}
        for path, ids in applied.items():
            text = tree.edits[path]
            assert text is not None  # deletions are refused by plan_series
            out[path] = Applied(text.to_bytes(), text.mode, tuple(ids))
    return out, landed


# --- where the originals come from ---------------------------------------------------


@dataclass(frozen=True)
class ImageSide:
    """The originals of one target: read out of the image, or from the pinned tree standing in for it."""

    ref: str
    image_id: str | None  # None: the pinned tree
    root: str
    versions: dict[str, str | None]
    read: Callable[[list[str]], dict[str, ImageFile | None]] = field(repr=False)
    engine: Any = field(default=None, repr=False)  # what it was read through (None: the pinned tree)

    @property
    def label(self) -> str:
        return f"image {self.ref}" if self.image_id else f"the pinned tree standing in for image {self.ref}"

    def shown(self, tree_path: str) -> str:
        return container_path(self.root, tree_path) if tree_path.startswith("vllm/") else tree_path


def image_side(
    engine: Any, target: TargetConfig, paths: Sequence[str] = (), cache: Path | None = None
) -> ImageSide:
    """Ask the image: its id, its vLLM root (unless the target says), versions, and the
    files at ``paths`` (tree paths), all in one container.

    With ``cache``, answers and files are kept by image id: an id names the image's
    content, so what was read from it once never goes stale.
    """
    from ..engine import probe_vllm

    image_id = engine.image_id(target.image)
    given = normal_root(target.root, f"target {target.name}") if target.root else None
    store = ImageCache(cache / image_id.replace(":", "-")) if cache else None
    facts = store.facts(given) if store else None
    known: dict[str, ImageFile | None] = {}  # tree path -> what the probe read
    if facts is None:
        probe = probe_vllm(engine, target.image, given, list(paths))
        facts = {"root": probe.root, "versions": probe.versions}
        known = {p: None if b is None else ImageFile(b, probe.modes[p]) for p, b in probe.files.items()}
        if store:
            found = normal_root(probe.root, f"image {target.image}")
            store.save_files({container_path(found, p): data for p, data in known.items()})
            store.save_facts(given, facts)
    root = normal_root(facts["root"], f"image {target.image}")
    versions = dict.fromkeys(VERSION_KEYS) | facts["versions"]

    def read(wanted: list[str]) -> dict[str, ImageFile | None]:
        rest = [container_path(root, p) for p in wanted if p not in known]
        got = _read_image(engine, target.image, rest, store)
        return {p: known[p] if p in known else got[container_path(root, p)] for p in wanted}

    return ImageSide(target.image, image_id, root, versions, read, engine)


def _read_image(engine: Any, ref: str, paths: list[str], store: ImageCache | None) -> dict[str, ImageFile | None]:
    if not paths:
        return {}
    return store.read(engine, ref, paths) if store else engine.read_entries(ref, paths)


def wanted_paths(plan: SeriesPlan) -> list[str]:
    """Every tree path an overlay reads from the image: the package marker and the originals."""
    return list(dict.fromkeys(["vllm/__init__.py", *plan.files, *(b.artifact for b in plan.native)]))


@dataclass(frozen=True)
class ImageCache:
    """What was read out of one image (by id): the probe's answers, file contents and modes.

    A kept file carries the image's mode on disk. (Files kept before modes were kept,
    under ``files/``, all read 0644, so this cache keeps its files under ``entries/``.)"""

    folder: Path

    def _facts_file(self, root: str | None) -> Path:
        return self.folder / f"probe-{hashlib.sha256((root or '').encode()).hexdigest()[:16]}.json"

    def facts(self, root: str | None) -> dict[str, Any] | None:
        try:
            return json.loads(self._facts_file(root).read_text("utf-8"))
        except (OSError, ValueError):
            return None

    def save_facts(self, root: str | None, facts: dict[str, Any]) -> None:
        write_file(self._facts_file(root), json.dumps(facts, sort_keys=True).encode())

    def save_files(self, files: dict[str, ImageFile | None]) -> None:
        for path, f in files.items():
            if f is None:
                write_file(self.folder / "absent" / path.lstrip("/"), b"")
            else:
                write_file(self.folder / "entries" / path.lstrip("/"), f.data, f.mode)

    def read(self, engine: Any, ref: str, paths: list[str]) -> dict[str, ImageFile | None]:
        known: dict[str, ImageFile | None] = {}
        for path in paths:
            blob, absent = self.folder / "entries" / path.lstrip("/"), self.folder / "absent" / path.lstrip("/")
            if blob.is_file():
                known[path] = ImageFile(blob.read_bytes(), blob.stat().st_mode & 0o777)
            elif absent.is_file():
                known[path] = None
        missing = [p for p in paths if p not in known]
        if missing:
            got = engine.read_entries(ref, missing)
            self.save_files(got)
            known.update(got)
        return known


def pinned_side(target: TargetConfig, source: SourceTree) -> ImageSide:
    """The pinned tree as the image's stand-in: the target says it carries that release unchanged."""
    if not target.root:
        raise ConfigError(f"target {target.name} is pinned but has no root: without Docker it must say where vLLM is")
    root = normal_root(target.root, f"target {target.name}")

    def read(paths: list[str]) -> dict[str, ImageFile | None]:
        return {p: _entry_or_none(source.root / p) for p in paths}

    versions = dict.fromkeys(VERSION_KEYS) | {"vllm": source.version}
    return ImageSide(target.image, None, root, versions, read)


def _read_or_none(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() and not path.is_symlink() else None


def _entry_or_none(path: Path) -> ImageFile | None:
    """A file of the pinned tree with its mode on disk (the sdist's, kept by extraction)."""
    data = _read_or_none(path)
    return None if data is None else ImageFile(data, path.stat().st_mode & 0o777)


# --- one overlay ---------------------------------------------------------------------


def overlay_mtime(data: bytes) -> int:
    return MTIME_BASE + int.from_bytes(hashlib.sha256(data).digest()[:3], "big")


@dataclass(frozen=True)
class Overlay:
    target: str
    image: str
    image_id: str | None
    vllm_root: str
    versions: dict[str, str | None]
    pin: dict[str, str | None]
    series_sha256: str
    files: tuple[InstalledFile, ...]
    native: dict[str, dict[str, Any]] = field(default_factory=dict)  # container path -> build record

    @property
    def content_hash(self) -> str:
        return content_hash(self.files)

    def manifest(self) -> dict[str, Any]:
        return manifest_document(
            target=self.target,
            image=self.image,
            image_id=self.image_id,
            vllm_root=self.vllm_root,
            versions=self.versions,
            pin=self.pin,
            series_sha256=self.series_sha256,
            files=self.files,
            native=self.native,
        )

    def manifest_bytes(self) -> bytes:
        return manifest_bytes(self.manifest())


SourceFor = Callable[[str | None], SourceTree]  # None: the pin; else that release's sdist


def make_overlay(
    target: TargetConfig,
    series: Series,
    plan: SeriesPlan,
    side: ImageSide,
    sources: SourceFor,
    pin: dict[str, str | None],
    progress: Progress,
    builder_setup: str | None = None,
    cuda_home: str = native_build.DEFAULT_CUDA_HOME,
) -> Overlay:
    """Everything one target's overlay holds, in memory (nothing is written)."""
    originals = side.read(wanted_paths(plan))
    if originals["vllm/__init__.py"] is None:
        raise ConfigError(
            f"{side.label} holds no vLLM at {side.root} ({side.root}/__init__.py is missing): fix the target's root"
        )
    files = _patched_files(series, plan, side, originals, progress)
    native_files, records = _native_files(series, plan, side, originals, sources, progress, builder_setup, cuda_home)
    return Overlay(
        target.name,
        side.ref,
        side.image_id,
        side.root,
        side.versions,
        pin,
        series.sha256,
        tuple(sorted(files + native_files, key=lambda f: f.container_path)),
        records,
    )


def _patched_files(
    series: Series, plan: SeriesPlan, side: ImageSide, originals: dict[str, ImageFile | None], progress: Progress
) -> list[InstalledFile]:
    mine = {p: originals[p] for p in plan.files}
    patched, landed = patch_image_files(series, mine, side.label, side.shown)
    for patch_id in landed:
        progress.say(f"overlay {side.ref}: patch {patch_id} is already in the image's files: not applied")
    return [
        InstalledFile(p, container_path(side.root, p), a.data, a.mode, a.patches, sha256_of(_data(mine[p])))
        for p, a in sorted(patched.items())
    ]


def _native_files(
    series: Series,
    plan: SeriesPlan,
    side: ImageSide,
    originals: dict[str, ImageFile | None],
    sources: SourceFor,
    progress: Progress,
    builder_setup: str | None,
    cuda_home: str,
) -> tuple[list[InstalledFile], dict[str, dict[str, Any]]]:
    """The rebuilt extensions: in a builder from the image itself when it was read from one,
    on the host for the pinned tree (native_build.py decides)."""
    if not plan.native:
        return [], {}
    source = sources(_source_version(side))
    files, records = [], {}
    with tempfile.TemporaryDirectory(prefix="sm12x-native-") as tmp:
        for n, build in enumerate(plan.native):
            todo = native_build.plan_native(
                series, build, source, side.image_id, setup=builder_setup, cuda_home=cuda_home
            )
            if todo is None:
                continue
            art = native_build.build_native(todo, side.engine, side.versions, side.label, Path(tmp) / str(n), progress)
            path = container_path(side.root, build.artifact)
            original = originals[build.artifact]
            pre = sha256_of(_data(original))
            mode = original.mode if original else 0o755  # the image's own, else what a built .so has
            files.append(InstalledFile(build.artifact, path, art.data, mode, art.patches, pre))
            records[path] = art.record
    return files, records


def _data(f: ImageFile | None) -> bytes | None:
    return None if f is None else f.data


def _source_version(side: ImageSide) -> str:
    """The release whose csrc the image's extension was built from (its public version)."""
    version = side.versions.get("vllm")
    if not version:
        raise ApplyError(
            f"{side.label}: its vLLM version is unknown, so its cumem extension cannot be rebuilt "
            "from the matching source: install vLLM with its metadata or its _version.py"
        )
    return version.split("+", 1)[0]


# --- writing, atomically -------------------------------------------------------------


def overlay_folder(out: Path, overlay: Overlay) -> Path:
    return out / overlay.target / overlay.content_hash


def stage(overlay: Overlay, folder: Path) -> None:
    """Write one overlay's files and manifest into ``folder`` (fixed modes and mtimes)."""
    for f in overlay.files:
        dest = folder / f.source
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(f.data)
        os.chmod(dest, f.mode)
        mtime = overlay_mtime(f.data)
        os.utime(dest, (mtime, mtime))
    manifest = folder / "manifest.json"
    manifest.write_bytes(overlay.manifest_bytes())
    os.chmod(manifest, 0o644)
    os.utime(manifest, (MTIME_BASE, MTIME_BASE))
    # Every folder 0755, as vLLM's own are in an image; the content folder itself
    # starts as a private (0700) staging folder and must be readable by the container's user.
    for sub in [folder, *(p for p in folder.rglob("*") if p.is_dir())]:
        os.chmod(sub, 0o755)


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def is_written(folder: Path, overlay: Overlay) -> bool:
    """The folder already holds exactly this overlay, modes included (so it is left alone,
    inodes and all; a folder an older version left 0700 is written again)."""
    try:
        if (folder / "manifest.json").read_bytes() != overlay.manifest_bytes() or _mode(folder) != 0o755:
            return False
        return all(
            (folder / f.source).read_bytes() == f.data and _mode(folder / f.source) == f.mode for f in overlay.files
        )
    except OSError:
        return False


Verifier = Callable[[Overlay, Path], None]


def check_target_folder(folder: Path, force: bool = False) -> None:
    """``<out>/<target>`` must be absent, empty or ours (marked, or an overlay folder
    written before folders were marked), unless ``force``: it is written into."""
    if not force and folder.is_dir() and not fsutil.is_ours(folder) and _previous_overlays(folder):
        return
    fsutil.check_replaceable(folder, force, "overlay folder")


def _previous_overlays(folder: Path) -> bool:
    """Only current.json and <content hash>/manifest.json folders: what this tool wrote
    before it marked its folders."""
    entries = list(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else []
    return bool(entries) and all(
        p.name == "current.json" and p.is_file()
        or re.fullmatch(r"[0-9a-f]{16}", p.name) is not None and (p / "manifest.json").is_file()
        for p in entries
    )


def _holds_files(folder: Path) -> bool:
    return folder.is_dir() and any(folder.iterdir())


def check_output(overlays: Sequence[Overlay], out: Path, force: bool = False) -> None:
    """Refuse, before anything is written, any folder the overlays would replace or write into."""
    fsutil.refuse_protected(out, "overlays folder")
    fsutil.check_parent(out / "x", "overlays folder")
    for overlay in overlays:
        check_target_folder(out / overlay.target, force)
        if not is_written(overlay_folder(out, overlay), overlay):
            fsutil.check_replaceable(overlay_folder(out, overlay), force, "overlay folder")


def overlays_root(ctx: Any, out: Path | None) -> Path:
    """``--out``, else output.overlays; '' and the like are refused, never taken as '.'."""
    return fsutil.refuse_protected(ctx.config.output.overlays if out is None else out, "overlays folder")


def check_targets_output(out: Path, targets: Sequence[TargetConfig], force: bool = False) -> None:
    """What can be checked before the overlays are made: the root and each target's folder."""
    fsutil.check_parent(out / "x", "overlays folder")
    for t in targets:
        check_target_folder(out / t.name, force)


def write_overlays(
    overlays: Sequence[Overlay], out: Path, verify: Verifier | None = None, force: bool = False
) -> list[Path]:
    """Stage every overlay, verify each if asked, then move them all into place.

    On any error nothing is written: staging folders are removed and current.json files
    keep pointing at what they pointed at. Folders this tool did not write are refused
    (OutputError) unless ``force``.
    """
    check_output(overlays, out, force)
    # Marked once written: absent, empty or written before folders were marked.
    claimed = [t for t in {out / o.target for o in overlays} if _previous_overlays(t) or not _holds_files(t)]
    folders = []
    with contextlib.ExitStack() as stack:
        for overlay in overlays:
            dest = overlay_folder(out, overlay)
            folder = dest
            if not is_written(dest, overlay):
                folder = stack.enter_context(replace_dir(dest, force, "overlay folder"))
                stage(overlay, folder)
            if verify is not None:
                verify(overlay, folder)
            folders.append(dest)
    for target in claimed:
        fsutil.mark(target)
    for overlay in overlays:
        current = out / overlay.target / "current.json"
        write_file(current, overlay.manifest_bytes())
        os.utime(current, (MTIME_BASE, MTIME_BASE))
    return folders


# --- verify inside the image ---------------------------------------------------------


def load_manifest(path: Path) -> tuple[Path, dict[str, Any]]:
    """The overlay folder and its manifest, from the folder, its manifest.json or current.json."""
    path = path / "manifest.json" if path.is_dir() else path
    try:
        manifest = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise VerifyError(f"cannot read overlay manifest {path}: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        raise VerifyError(f"{path} is not an overlay manifest of schema {SCHEMA}")
    folder = path.parent if path.name == "manifest.json" else path.parent / manifest["content_hash"]
    return folder, manifest


def verify_overlay(engine: Any, folder: Path, image: str | None = None) -> Verified:
    """Check the overlay in ``folder`` against ``image`` (default: the one it was made for)."""
    folder, manifest = load_manifest(folder)
    ref = image or manifest["image"]
    engine.image_id(ref)
    originals = check_pre_images(engine, ref, manifest)
    check_host_copies(folder, manifest)
    with tempfile.TemporaryDirectory(prefix="sm12x-verify-") as tmp:
        mounts, spec = verify_plan(folder, manifest, Path(tmp))
        env = {"PYTHONPYCACHEPREFIX": _PYCACHE}
        code, out = engine.run(
            ref, ["python3", "-c", VERIFY_SCRIPT, json.dumps(spec)], mounts=mounts, env=env, network=False
        )
    report = parse_verify(f"overlay {manifest['target']}/{manifest['content_hash']}", ref, code, out)
    report.ok[:0] = originals
    return report


def check_pre_images(engine: Any, ref: str, manifest: dict[str, Any]) -> list[str]:
    """Refuse an image whose originals are not the ones the overlay was made from."""
    paths = [f["container_path"] for f in manifest["files"]]
    found = engine.read_files(ref, paths)
    problems = []
    for f in manifest["files"]:
        got, want = sha256_of(found.get(f["container_path"])), f["pre_image_sha256"]
        unrecorded = manifest["image_id"] is None and f["container_path"] in manifest["native"]
        if want is None and got is not None and unrecorded:
            problems.append(
                f"{f['container_path']}: the pre-image of this built file was not recorded (the overlay was made "
                f"from the pinned tree without Docker; run 'sm12x-bundle overlay' with a daemon), found {got}"
            )
        elif got != want:
            problems.append(f"{f['container_path']}: expected {want or 'no file'}, found {got or 'no file'}")
    if problems:
        raise VerifyError(
            f"image {ref} is not what overlay {manifest['target']}/{manifest['content_hash']} was made for "
            "(mounting over a different version is how full-file swaps broke production): refused:\n  "
            + "\n  ".join(problems)
        )
    return [f"{f['container_path']}: the image's original is the recorded pre-image" for f in manifest["files"]]


def check_host_copies(folder: Path, manifest: dict[str, Any]) -> None:
    for f in manifest["files"]:
        path = folder / f["source"]
        if sha256_of(_read_or_none(path)) != f["sha256"]:
            raise VerifyError(f"{path} is missing or differs from its manifest (sha256 {f['sha256']})")


def verify_plan(folder: Path, manifest: dict[str, Any], tmp: Path) -> tuple[list[Any], dict[str, Any]]:
    """The mounts and the in-container script's input for one overlay."""
    from ..engine import Mount

    mounts = [Mount((folder / f["source"]).resolve(), f["container_path"]) for f in manifest["files"]]
    spec = verify_spec(manifest, libdir=_LIBDIR)
    if spec["native"]:
        built = [folder / _source_of(manifest, n["path"]) for n in spec["native"]]
        calls = sorted({c for so in built for c in native_build.driver_calls(so)})
        mounts.append(Mount(native_build.write_libcuda_stub(tmp / "lib", calls).resolve(), _LIBDIR))
    return mounts, spec


def _source_of(manifest: dict[str, Any], container: str) -> str:
    return next(f["source"] for f in manifest["files"] if f["container_path"] == container)


# --- the command ---------------------------------------------------------------------


def select_targets(
    config: Config, names: Sequence[str] | None, image: str | None, root: str | None
) -> list[TargetConfig]:
    if root and not image:
        raise ConfigError("--root needs --image (a config target says its root in the config)")
    if image:
        if names:
            raise ConfigError("give either --target NAME or --image REF, not both")
        targets = [TargetConfig(name=target_name_for(image), image=image, root=root)]
    elif names:
        targets = [config.target(n) for n in dict.fromkeys(names)]
    else:
        targets = list(config.targets)
    return checked_targets(config, targets)


def checked_targets(config: Config, targets: Sequence[TargetConfig]) -> list[TargetConfig]:
    if not targets:
        raise ConfigError(f"{config.origin}: no targets: add 'targets:' to the config or give --image REF")
    for t in targets:
        if not _NAME.match(t.name):
            raise ConfigError(f"target name {t.name!r} must be letters, digits, '.', '_' or '-' (it names a folder)")
    return list(targets)


def target_name_for(image: str) -> str:
    """An ad hoc target's name: the image reference made into one path component."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", image).strip("-._") or "image"


def connect(need: bool, progress: Progress) -> Any | None:
    """The Docker engine, or None when no daemon answers and none is needed."""
    from ..engine import daemon_address, docker_engine

    engine = docker_engine()
    try:
        engine.ping()
    except EngineError:
        if need:
            raise
        progress.say(f"overlay: no Docker daemon answers at {daemon_address()}: pinned targets use the pinned tree")
        return None
    return engine


def side_for(
    engine: Any | None,
    target: TargetConfig,
    sources: SourceFor,
    need_image: bool,
    progress: Progress,
    paths: Sequence[str] = (),
    cache: Path | None = None,
) -> ImageSide:
    """The image when it is there; the pinned tree for a pinned target when it is not."""
    if engine is not None:
        try:
            engine.image_id(target.image)
        except EngineError as exc:
            if need_image or not target.pinned:
                raise
            progress.say(f"overlay {target.name}: {exc}; using the pinned tree it carries")
        else:
            return image_side(engine, target, paths, cache)
    if not target.pinned:
        raise EngineError(f"target {target.name}: reading image {target.image} needs a Docker daemon")
    return pinned_side(target, sources(None))


def image_cache_dir(ctx: Any) -> Path:
    """Where files read out of images are kept, by image id (beside the sdists)."""
    return (ctx.cache_dir or cache_mod.cache_dir()) / "images"


def _sources(ctx: Any) -> SourceFor:
    pin = ctx.config.pin.version

    def source(version: str | None) -> SourceTree:
        return ctx.source(None if version in (None, pin) else version)

    return source


def add_arguments(p: Any) -> None:
    p.add_argument("--target", action="append", type=arguments.folder_name, metavar="NAME",
                   help="a config target (repeatable; default: all)")
    p.add_argument("--image", type=arguments.image_ref, metavar="REF", help="an ad hoc target: this image, not in the config")
    p.add_argument("--root", type=arguments.absolute_path, metavar="PATH",
                   help="with --image: vLLM's package folder in it (default: ask the image)")
    p.add_argument("--verify", action="store_true", help="check each overlay inside its image before keeping it")
    p.add_argument("--manifest", type=arguments.existing_file, metavar="FILE",
                   help="with --verify: check this existing overlay instead")
    p.add_argument("--out", type=Path, metavar="DIR", help="where overlays go (default: output.overlays, 'overlays')")
    fsutil.add_force_argument(p, "write DIR/<target> even if it holds files this tool did not write")
    p.set_defaults(check_args=_check_args)


def _check_args(args: Any) -> str | None:
    """Options that depend on each other, refused while parsing (exit 2)."""
    if args.root and not args.image:
        return "--root needs --image (a config target says its root in the config)"
    if args.image and args.target:
        return "give either --target NAME or --image REF, not both"
    if args.manifest is not None and not args.verify:
        return "--manifest is for --verify: it checks an existing overlay"
    return None


def make_overlays(ctx: Any, targets: Sequence[TargetConfig], engine: Any | None, need_image: bool) -> list[Overlay]:
    """Every target's overlay, in memory: any error here leaves nothing written."""
    sources = _sources(ctx)
    plan = plan_series(ctx.series)
    for path in plan.skipped:
        ctx.progress.say(f"overlay: {path} is in no image: not overlaid")
    pin = {"version": ctx.pin.version, "sha256": ctx.pin.sha256}
    image_cfg = ctx.config.image  # its builder settings apply to every builder container
    overlays = []
    for t in targets:
        side = side_for(engine, t, sources, need_image, ctx.progress, wanted_paths(plan), image_cache_dir(ctx))
        overlays.append(
            make_overlay(
                t, ctx.series, plan, side, sources, pin, ctx.progress, image_cfg.builder_setup, image_cfg.cuda_home
            )
        )
    return overlays


def make_and_write(
    ctx: Any,
    targets: list[TargetConfig] | None = None,
    *,
    verify: bool | None = None,
    out: Path | None = None,
    force: bool = False,
) -> list[tuple[Overlay, Path]]:
    """Make every target's overlay and write them under ``out`` (default: output.overlays,
    relative to the working directory); what ``overlay`` and ``build`` both run.

    ``targets`` None: the config's. ``verify`` None: check each overlay read from an image in
    that image when a daemon answers (a pinned target made from the pinned tree is not);
    True: a daemon and every target's image are required. A target that is not pinned
    needs a daemon either way (EngineError). Nothing is written when anything fails.
    """
    written, reports = _make_and_write(ctx, targets, verify, out, force)
    for report in reports:
        _say_verified(ctx.progress, report)
    return written


def _make_and_write(
    ctx: Any, targets: Sequence[TargetConfig] | None, verify: bool | None, out: Path | None, force: bool = False
) -> tuple[list[tuple[Overlay, Path]], list[Verified]]:
    targets = checked_targets(ctx.config, list(ctx.config.targets) if targets is None else targets)
    out = overlays_root(ctx, out)
    check_targets_output(out, targets, force)  # before any image is read or anything built
    engine = connect(bool(verify) or any(not t.pinned for t in targets), ctx.progress)
    overlays = make_overlays(ctx, targets, engine, bool(verify))
    reports: list[Verified] = []

    def check(overlay: Overlay, folder: Path) -> None:
        if overlay.image_id is not None or verify:
            reports.append(verify_overlay(engine, folder))

    checking = verify or (verify is None and engine is not None)
    folders = write_overlays(overlays, out, check if checking else None, force)
    return list(zip(overlays, folders)), reports


def run(ctx: Any, args: Any) -> int:
    if args.manifest is not None:
        return _verify_existing(ctx, args)
    targets = select_targets(ctx.config, args.target, args.image, args.root)
    written, reports = _make_and_write(ctx, targets, args.verify, args.out, args.force)
    for overlay, folder in written:
        origin = f"image {overlay.image}" if overlay.image_id else f"the pinned vLLM {ctx.pin.version} tree"
        print(f"{overlay.target}: {folder} ({len(overlay.files)} files, from {origin})")
    for report in reports:
        _print_verified(ctx.progress, report)
    return 0


def _say_verified(progress: Progress, report: Verified) -> None:
    for line in report.ok:
        progress.say(f"verify {report.image}: ok: {line}")
    for note in report.notes:
        progress.say(f"verify {report.image}: note: {note}")


def _verify_existing(ctx: Any, args: Any) -> int:
    if not args.verify:
        raise ConfigError("--manifest is for --verify: it checks an existing overlay")
    engine = connect(True, ctx.progress)
    report = verify_overlay(engine, args.manifest, args.image)
    _print_verified(ctx.progress, report)
    return 0


def _print_verified(progress: Progress, report: Verified) -> None:
    _say_verified(progress, report)
    print(f"verified in {report.image}: {len(report.ok)} checks passed, {len(report.notes)} notes")


EXIT_CODES = {"overlay": {4: None, 5: None, 6: None, 7: None, 8: None, 9: None, 11: None}}

COMMANDS = {
    "overlay": (
        "per-file overlays: the image's own files, patched, to bind-mount read-only",
        "example: sm12x-bundle overlay --verify --target vllm-openai-v0.21.0\n"
        "         sm12x-bundle overlay --image glm:nvfp4 --root /opt/vllm/vllm\n"
        "         sm12x-bundle overlay --verify --manifest overlays/vllm-openai-v0.21.0/current.json",
        add_arguments,
        run,
    ),
}
