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

The native artifact (``vllm/cumem_allocator.abi3.so``) is rebuilt on the host, never in a
container: it uses only Python's stable ABI and the CUDA driver API, so the host's compiler
and CUDA headers build it for any image whose Python is >= 3.8 and whose CUDA major matches
the headers (checked), and ``verify`` loads it in the image's own Python. That works without
a Docker daemon, which the default target needs on a fresh machine, and gives the same bytes
on every run; :func:`build_native` is the whole recipe, for any other output that ships it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import posixpath
import re
import shutil
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import cmd, native
from ..checks.check import Conflict, Outcome, classify
from ..config import Config, TargetConfig
from ..errors import ApplyError, CommandError, ConfigError, EngineError, SeriesError, VerifyError
from ..fsutil import replace_dir, write_file
from ..progress import Progress
from ..series.apply import VirtualTree
from ..series.patch import Series
from ..source import cache as cache_mod
from ..source.pin import SourceTree

SCHEMA = 1
VERSION_KEYS = ("vllm", "torch", "triton", "flashinfer", "deep_gemm")
# Overlaid files get mtimes in the first 194 days of 2000 (before vLLM existed), derived
# from their content: never the image original's mtime, and never the mtime of another
# version of the same overlay (a persistent PYTHONPYCACHEPREFIX keeps bytecode keyed on
# mtime and size, so two versions of one size must differ in mtime).
MTIME_BASE = 946684800
# What each native artifact is built from, alone (tree paths; missing inputs are skipped).
NATIVE_RECIPES = {
    f"vllm/{native.ARTIFACT}": (str(native.SOURCE), "csrc/cumem_allocator_compat.h"),
}
# Where verify puts what it needs inside the container.
_PYCACHE = "/tmp/sm12x-verify-pycache"
_LIBDIR = "/sm12x-verify/lib"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*\Z")


# --- what the series overlays (pure) -------------------------------------------------


@dataclass(frozen=True)
class NativeBuild:
    artifact: str  # tree path of the built file, e.g. vllm/cumem_allocator.abi3.so
    inputs: tuple[str, ...]  # tree paths it is built from
    patches: tuple[str, ...]  # the native patches that change it


@dataclass(frozen=True)
class OverlayPlan:
    files: tuple[str, ...]  # vllm/ paths patched in place, in first-touched order
    native: tuple[NativeBuild, ...]
    skipped: tuple[str, ...]  # paths no image holds (tests/, docs/): not overlaid


def plan_series(series: Series) -> OverlayPlan:
    """Which files the series overlays: vllm/ files in place, csrc/ through their artifact."""
    files: dict[str, None] = {}
    skipped: dict[str, None] = {}
    builds: dict[str, list[str]] = {}
    for patch in series.patches:
        if patch.kind == "native":
            builds.setdefault(_recipe_of(patch.builds, patch.file), []).append(patch.id)
        inputs = NATIVE_RECIPES.get(patch.builds or "", ())
        for fp in patch.files:
            if fp.path.startswith("vllm/"):
                if fp.deleted:
                    raise SeriesError(f"{patch.file}: deletes {fp.path}: a bind-mount overlay cannot delete a file")
                files.setdefault(fp.path)
            elif patch.kind == "native" and fp.path not in inputs:
                raise SeriesError(f"{patch.file}: changes {fp.path}, which {patch.builds} is not built from")
            elif patch.kind != "native":
                skipped.setdefault(fp.path)
    native_builds = tuple(NativeBuild(a, NATIVE_RECIPES[a], tuple(ids)) for a, ids in builds.items())
    return OverlayPlan(tuple(files), native_builds, tuple(skipped))


def _recipe_of(artifact: str | None, where: Path) -> str:
    if artifact not in NATIVE_RECIPES:
        known = ", ".join(NATIVE_RECIPES)
        raise SeriesError(f"{where}: Sm12x-Builds {artifact!r} cannot be built alone (known: {known})")
    return artifact


def container_path(root: str, tree_path: str) -> str:
    """``vllm/x/y.py`` -> ``<root>/x/y.py``: the root is the image's ``vllm`` package folder."""
    assert tree_path.startswith("vllm/"), tree_path
    return posixpath.join(root, tree_path[len("vllm/") :])


def normal_root(root: str, where: str) -> str:
    norm = posixpath.normpath(root)
    if not norm.startswith("/") or norm == "/":
        raise ConfigError(f"{where}: root {root!r} must be an absolute path to the vllm package folder")
    return norm


# --- applying the series to an image's own files (pure but for a temp folder) --------


@dataclass(frozen=True)
class Applied:
    data: bytes
    mode: int
    patches: tuple[str, ...]


def apply_subseries(
    series: Series, tree: VirtualTree, paths: set[str], where: str, shown: Callable[[str], str] = str
) -> tuple[dict[str, list[str]], list[str]]:
    """Apply, in series order, only the file patches touching ``paths`` (fuzz 0).

    Uses the same classification as ``check``: a patch already in the file is skipped,
    one that conflicts raises ApplyError naming ``where``, the file and the hunk.
    Returns {path: patch ids applied} and the ids found already there.
    """
    applied: dict[str, list[str]] = {}
    landed: list[str] = []
    for patch in series.patches:
        files = tuple(fp for fp in patch.files if fp.path in paths)
        if not files:
            continue
        result = classify(tree, dataclasses.replace(patch, files=files), 0)
        if result.outcome is Outcome.CONFLICT:
            assert result.conflict is not None
            raise _conflict(where, patch.id, result.conflict, shown)
        if result.outcome is Outcome.LANDED:
            landed.append(patch.id)
            continue
        for fp in files:
            applied.setdefault(fp.path, []).append(patch.id)
    return applied, landed


def _conflict(where: str, patch_id: str, c: Conflict, shown: Callable[[str], str]) -> ApplyError:
    return ApplyError(
        f"{where}: patch {patch_id} does not apply to {shown(c.path)}: hunk #{c.hunk} (line {c.hunk_line}) "
        "differs (fuzz 0; an overlay never swaps in a whole file from another vLLM version):\n  "
        + "\n  ".join(c.differs)
    )


def patch_image_files(
    series: Series, originals: dict[str, bytes | None], where: str, shown: Callable[[str], str] = str
) -> tuple[dict[str, Applied], list[str]]:
    """Patch the image's own copies (tree path -> bytes, None: absent) surgically."""
    with tempfile.TemporaryDirectory(prefix="sm12x-overlay-") as tmp:
        for path, data in originals.items():
            if data is not None:
                dest = Path(tmp) / path
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(data)
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
    read: Callable[[list[str]], dict[str, bytes | None]] = field(repr=False)

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
    known: dict[str, bytes | None] = {}  # tree path -> bytes, read by the probe
    if facts is None:
        probe = probe_vllm(engine, target.image, given, list(paths))
        facts, known = {"root": probe.root, "versions": probe.versions}, dict(probe.files)
        if store:
            found = normal_root(probe.root, f"image {target.image}")
            store.save_files({container_path(found, p): data for p, data in known.items()})
            store.save_facts(given, facts)
    root = normal_root(facts["root"], f"image {target.image}")
    versions = dict.fromkeys(VERSION_KEYS) | facts["versions"]

    def read(wanted: list[str]) -> dict[str, bytes | None]:
        rest = [container_path(root, p) for p in wanted if p not in known]
        got = _read_image(engine, target.image, rest, store)
        return {p: known[p] if p in known else got[container_path(root, p)] for p in wanted}

    return ImageSide(target.image, image_id, root, versions, read)


def _read_image(engine: Any, ref: str, paths: list[str], store: ImageCache | None) -> dict[str, bytes | None]:
    if not paths:
        return {}
    return store.read(engine, ref, paths) if store else engine.read_files(ref, paths)


def wanted_paths(plan: OverlayPlan) -> list[str]:
    """Every tree path an overlay reads from the image: the package marker and the originals."""
    return list(dict.fromkeys(["vllm/__init__.py", *plan.files, *(b.artifact for b in plan.native)]))


@dataclass(frozen=True)
class ImageCache:
    """What was read out of one image (by id): the probe's answers and file contents."""

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

    def save_files(self, files: dict[str, bytes | None]) -> None:
        for path, data in files.items():
            write_file(self.folder / ("files" if data is not None else "absent") / path.lstrip("/"), data or b"")

    def read(self, engine: Any, ref: str, paths: list[str]) -> dict[str, bytes | None]:
        known: dict[str, bytes | None] = {}
        for path in paths:
            blob, absent = self.folder / "files" / path.lstrip("/"), self.folder / "absent" / path.lstrip("/")
            if blob.is_file():
                known[path] = blob.read_bytes()
            elif absent.is_file():
                known[path] = None
        missing = [p for p in paths if p not in known]
        if missing:
            got = engine.read_files(ref, missing)
            self.save_files(got)
            known.update(got)
        return known


def pinned_side(target: TargetConfig, source: SourceTree) -> ImageSide:
    """The pinned tree as the image's stand-in: the target says it carries that release unchanged."""
    if not target.root:
        raise ConfigError(f"target {target.name} is pinned but has no root: without Docker it must say where vLLM is")
    root = normal_root(target.root, f"target {target.name}")

    def read(paths: list[str]) -> dict[str, bytes | None]:
        return {p: _read_or_none(source.root / p) for p in paths}

    versions = dict.fromkeys(VERSION_KEYS) | {"vllm": source.version}
    return ImageSide(target.image, None, root, versions, read)


def _read_or_none(path: Path) -> bytes | None:
    return path.read_bytes() if path.is_file() and not path.is_symlink() else None


# --- the native artifact, built alone on the host ------------------------------------


@dataclass(frozen=True)
class NativeArtifact:
    artifact: str
    data: bytes
    patches: tuple[str, ...]
    record: dict[str, Any]  # how it was built, for the manifest


def build_native(series: Series, build: NativeBuild, source: SourceTree, work: Path) -> NativeArtifact | None:
    """Patch ``build``'s inputs in ``source`` and compile them alone; None when nothing changes.

    Compiled from a fixed relative path in a fresh folder, so the bytes depend only on the
    patched source, the compiler and the CUDA headers, never on where the work happens.
    """
    tree = VirtualTree(source.root)
    where = f"vLLM {source.version} source ({source.origin})"
    applied, _landed = apply_subseries(series, tree, set(build.inputs), where)
    if not applied:
        return None
    src = work / "src"
    for rel in build.inputs:
        text = tree.read(rel)
        if text is not None:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(text.to_bytes())
    data, record = compile_cumem(src, work)
    patches = tuple(dict.fromkeys(i for ids in applied.values() for i in ids))
    record["built_from"] = {
        "vllm": source.version,
        "sdist_sha256": source.sha256,
        "files": sorted(p for p in build.inputs if (src / p).is_file()),
        "patches": list(patches),
    }
    return NativeArtifact(build.artifact, data, patches, record)


def compile_cumem(src: Path, work: Path) -> tuple[bytes, dict[str, Any]]:
    """Build ``src``/csrc/cumem_allocator.cpp with native.py's command, against a generated
    stand-in for libcuda.so.1 (no driver here, and toolkits do not always ship the stub)."""
    cuda_home = native.find_cuda_home()
    stub = work / "libcuda"
    write_libcuda_stub(stub, ())  # empty: only to learn which driver calls the build makes
    first = _compile(src, work / "probe", cuda_home, stub)
    calls = driver_calls(first)
    write_libcuda_stub(stub, calls)
    built = _compile(src, work / "out", cuda_home, stub)
    links = _needed(built)
    if "libcuda.so.1" not in links:
        raise CommandError(f"{built} does not link libcuda.so.1 (it links {', '.join(links)}): the build is unusable")
    record = {
        "built_on": "host",
        "compiler": _compiler_version(),
        "cuda_headers": cuda_headers_version(cuda_home),
        "py_limited_api": "3.8",
        "python_headers": sysconfig.get_python_version(),
        "links": links,
        "requires": _symbol_versions(built),
    }
    return built.read_bytes(), record


def _compile(src: Path, out: Path, cuda_home: Path, libcuda: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    argv = native.cumem_build_argv(Path("."), out.resolve(), cuda_home=cuda_home, libcuda=libcuda.resolve())
    cmd.run(argv, cwd=src)
    return out / native.ARTIFACT


def write_libcuda_stub(folder: Path, calls: Sequence[str]) -> Path:
    """A libcuda.so (soname libcuda.so.1) defining ``calls``: enough to link and to load."""
    folder.mkdir(parents=True, exist_ok=True)
    body = "".join(f"void {name}(void) {{}}\n" for name in sorted(calls)) or "void sm12x_stub(void) {}\n"
    (folder / "stub.c").write_text("/* generated by sm12x-bundle: a stand-in for the CUDA driver */\n" + body)
    argv = ["g++", "-x", "c", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "stub.c", "-o", "libcuda.so"]
    cmd.run(argv, cwd=folder)
    shutil.copyfile(folder / "libcuda.so", folder / "libcuda.so.1")
    return folder


def driver_calls(so: Path) -> list[str]:
    out = cmd.run(["nm", "-D", "--undefined-only", str(so)], echo=False).stdout
    names = {line.split()[-1].split("@")[0] for line in out.splitlines() if line.strip()}
    return sorted(n for n in names if re.fullmatch(r"cu[A-Z]\w*", n))


def _symbol_versions(so: Path) -> list[str]:
    out = cmd.run(["nm", "-D", "--undefined-only", str(so)], echo=False).stdout
    return sorted({m.group(1) for m in re.finditer(r"@+(GLIBC\w*_[\d.]+)", out)})


def _needed(so: Path) -> list[str]:
    out = cmd.run(["readelf", "-d", str(so)], echo=False).stdout
    return sorted(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out))


def _compiler_version() -> str:
    return cmd.run(["g++", "--version"], echo=False).stdout.splitlines()[0].strip()


def cuda_headers_version(cuda_home: Path) -> str | None:
    text = (cuda_home / "include" / "cuda.h").read_text("utf-8", "replace")
    m = re.search(r"^#define\s+CUDA_VERSION\s+(\d+)", text, re.MULTILINE)
    return f"{int(m.group(1)) // 1000}.{int(m.group(1)) % 1000 // 10}" if m else None


def image_cuda(versions: dict[str, str | None]) -> str | None:
    """The CUDA an image's torch was built for (``2.9.0+cu130`` -> ``13.0``), when it says."""
    m = re.search(r"\+cu(\d+)(\d)$", versions.get("torch") or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def check_cuda_match(side: ImageSide, headers: str | None) -> None:
    wanted = image_cuda(side.versions)
    if wanted and headers and wanted.split(".")[0] != headers.split(".")[0]:
        raise ConfigError(
            f"{side.label} runs CUDA {wanted} (torch {side.versions['torch']}) but the CUDA headers here are "
            f"{headers}: point CUDA_HOME at a CUDA {wanted.split('.')[0]} toolkit to build its cumem extension"
        )


# --- one overlay ---------------------------------------------------------------------


@dataclass(frozen=True)
class OverlayFile:
    container_path: str
    data: bytes = field(repr=False)
    pre_image_sha256: str | None
    patches: tuple[str, ...]
    mode: int

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def source(self) -> str:
        return "files/" + self.container_path.lstrip("/")

    @property
    def mtime(self) -> int:
        return overlay_mtime(self.data)

    def entry(self) -> dict[str, Any]:
        return {
            "container_path": self.container_path,
            "source": self.source,
            "pre_image_sha256": self.pre_image_sha256,
            "sha256": self.sha256,
            "patches": list(self.patches),
            "mode": f"{self.mode:04o}",
        }


def overlay_mtime(data: bytes) -> int:
    return MTIME_BASE + int.from_bytes(hashlib.sha256(data).digest()[:3], "big")


def content_hash(files: Sequence[OverlayFile]) -> str:
    """First 16 hex digits of sha256 over the sorted ``container_path \\0 sha256 \\0 mode``
    lines, joined by newlines (the bundle image's manifest hashes the same way)."""
    lines = sorted(f"{f.container_path}\0{f.sha256}\0{f.mode:04o}" for f in files)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Overlay:
    target: str
    image: str
    image_id: str | None
    vllm_root: str
    versions: dict[str, str | None]
    pin: dict[str, str | None]
    series_sha256: str
    files: tuple[OverlayFile, ...]
    native: dict[str, dict[str, Any]] = field(default_factory=dict)  # container path -> build record

    @property
    def content_hash(self) -> str:
        return content_hash(self.files)

    def manifest(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "target": self.target,
            "image": self.image,
            "image_id": self.image_id,
            "vllm_root": self.vllm_root,
            "versions": self.versions,
            "pin": self.pin,
            "series_sha256": self.series_sha256,
            "content_hash": self.content_hash,
            "files": [f.entry() for f in sorted(self.files, key=lambda f: f.container_path)],
            "native": self.native,
        }

    def manifest_bytes(self) -> bytes:
        return (json.dumps(self.manifest(), sort_keys=True, indent=2) + "\n").encode()


SourceFor = Callable[[str | None], SourceTree]  # None: the pin; else that release's sdist


def make_overlay(
    target: TargetConfig,
    series: Series,
    plan: OverlayPlan,
    side: ImageSide,
    sources: SourceFor,
    pin: dict[str, str | None],
    progress: Progress,
) -> Overlay:
    """Everything one target's overlay holds, in memory (nothing is written)."""
    originals = side.read(wanted_paths(plan))
    if originals["vllm/__init__.py"] is None:
        raise ConfigError(
            f"{side.label} holds no vLLM at {side.root} ({side.root}/__init__.py is missing): fix the target's root"
        )
    files = _patched_files(series, plan, side, originals, progress)
    native_files, records = _native_files(series, plan, side, originals, sources)
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
    series: Series, plan: OverlayPlan, side: ImageSide, originals: dict[str, bytes | None], progress: Progress
) -> list[OverlayFile]:
    mine = {p: originals[p] for p in plan.files}
    patched, landed = patch_image_files(series, mine, side.label, side.shown)
    for patch_id in landed:
        progress.say(f"overlay {side.ref}: patch {patch_id} is already in the image's files: not applied")
    return [
        OverlayFile(container_path(side.root, p), a.data, _sha(mine[p]), a.patches, a.mode)
        for p, a in sorted(patched.items())
    ]


def _native_files(
    series: Series, plan: OverlayPlan, side: ImageSide, originals: dict[str, bytes | None], sources: SourceFor
) -> tuple[list[OverlayFile], dict[str, dict[str, Any]]]:
    if not plan.native:
        return [], {}
    source = sources(_source_version(side))
    headers = cuda_headers_version(native.find_cuda_home())
    check_cuda_match(side, headers)
    files, records = [], {}
    with tempfile.TemporaryDirectory(prefix="sm12x-native-") as tmp:
        for n, build in enumerate(plan.native):
            art = build_native(series, build, source, Path(tmp) / str(n))
            if art is None:
                continue
            path = container_path(side.root, build.artifact)
            files.append(OverlayFile(path, art.data, _sha(originals[build.artifact]), art.patches, 0o755))
            records[path] = art.record
    return files, records


def _source_version(side: ImageSide) -> str:
    """The release whose csrc the image's extension was built from (its public version)."""
    version = side.versions.get("vllm")
    if not version:
        raise ApplyError(
            f"{side.label}: its vLLM version is unknown, so its cumem extension cannot be rebuilt "
            "from the matching source: install vLLM with its metadata or its _version.py"
        )
    return version.split("+", 1)[0]


def _sha(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


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
        os.utime(dest, (f.mtime, f.mtime))
    manifest = folder / "manifest.json"
    manifest.write_bytes(overlay.manifest_bytes())
    os.chmod(manifest, 0o644)
    os.utime(manifest, (MTIME_BASE, MTIME_BASE))


def is_written(folder: Path, overlay: Overlay) -> bool:
    """The folder already holds exactly this overlay (so it is left alone, inodes and all)."""
    try:
        if (folder / "manifest.json").read_bytes() != overlay.manifest_bytes():
            return False
        return all((folder / f.source).read_bytes() == f.data for f in overlay.files)
    except OSError:
        return False


Verifier = Callable[[Overlay, Path], None]


def write_overlays(overlays: Sequence[Overlay], out: Path, verify: Verifier | None = None) -> list[Path]:
    """Stage every overlay, verify each if asked, then move them all into place.

    On any error nothing is written: staging folders are removed and current.json files
    keep pointing at what they pointed at.
    """
    folders = []
    with contextlib.ExitStack() as stack:
        for overlay in overlays:
            dest = overlay_folder(out, overlay)
            folder = dest
            if not is_written(dest, overlay):
                folder = stack.enter_context(replace_dir(dest))
                stage(overlay, folder)
            if verify is not None:
                verify(overlay, folder)
            folders.append(dest)
    for overlay in overlays:
        current = out / overlay.target / "current.json"
        write_file(current, overlay.manifest_bytes())
        os.utime(current, (MTIME_BASE, MTIME_BASE))
    return folders


# --- verify inside the image ---------------------------------------------------------


@dataclass
class Verified:
    image: str
    ok: list[str]
    notes: list[str]


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
    report = parse_verify(ref, manifest, code, out)
    report.ok[:0] = originals
    return report


def check_pre_images(engine: Any, ref: str, manifest: dict[str, Any]) -> list[str]:
    """Refuse an image whose originals are not the ones the overlay was made from."""
    paths = [f["container_path"] for f in manifest["files"]]
    found = engine.read_files(ref, paths)
    problems = []
    for f in manifest["files"]:
        got, want = _sha(found.get(f["container_path"])), f["pre_image_sha256"]
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
        if _sha(_read_or_none(path)) != f["sha256"]:
            raise VerifyError(f"{path} is missing or differs from its manifest (sha256 {f['sha256']})")


def verify_plan(folder: Path, manifest: dict[str, Any], tmp: Path) -> tuple[list[Any], dict[str, Any]]:
    """The mounts and the in-container script's input for one overlay."""
    from ..engine import Mount

    root = manifest["vllm_root"]
    mounts = [Mount((folder / f["source"]).resolve(), f["container_path"]) for f in manifest["files"]]
    spec: dict[str, Any] = {"root": root, "files": [], "native": [], "modules": [], "libdir": _LIBDIR}
    for f in manifest["files"]:
        path = f["container_path"]
        spec["files"].append({"path": path, "sha256": f["sha256"]})
        if path in manifest["native"]:
            spec["native"].append({"path": path, "module": module_name(root, path)})
        elif path.endswith(".py"):
            spec["modules"].append(module_name(root, path))
    if spec["native"]:
        calls = sorted({c for n in spec["native"] for c in driver_calls(folder / _source_of(manifest, n["path"]))})
        mounts.append(Mount(write_libcuda_stub(tmp / "lib", calls).resolve(), _LIBDIR))
    return mounts, spec


def _source_of(manifest: dict[str, Any], container: str) -> str:
    return next(f["source"] for f in manifest["files"] if f["container_path"] == container)


def module_name(root: str, path: str) -> str:
    """``<root>/device_allocator/cumem.py`` -> ``vllm.device_allocator.cumem``."""
    rel = posixpath.relpath(path, root)
    stem = rel.split(".", 1)[0]
    parts = ["vllm", *stem.split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse_verify(ref: str, manifest: dict[str, Any], code: int, out: str) -> Verified:
    lines = [line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("sm12x-verify ")]
    fails = [text for kind, text in lines if kind == "fail"]
    done = any(kind == "done" for kind, _ in lines)
    if fails or not done or code != 0:
        detail = fails or out.strip().splitlines()[-20:] or [f"exit code {code}, no output"]
        raise VerifyError(
            f"overlay {manifest['target']}/{manifest['content_hash']} failed its check in image {ref}:\n  "
            + "\n  ".join(detail)
        )
    return Verified(ref, [t for k, t in lines if k == "ok"], [t for k, t in lines if k == "note"])


# Runs inside the target image with the overlay mounted; stdlib only, Python >= 3.8.
VERIFY_SCRIPT = r'''
import hashlib, importlib, importlib.util, json, os, py_compile, subprocess, sys, tempfile, traceback

spec = json.loads(sys.argv[1])
mounted = {f["path"] for f in spec["files"]}


def say(kind, text):
    print("sm12x-verify %s %s" % (kind, text), flush=True)


def check_hash(f):
    try:
        with open(f["path"], "rb") as fh:
            got = hashlib.sha256(fh.read()).hexdigest()
    except OSError as exc:
        return say("fail", "%s: cannot read it: %s" % (f["path"], exc))
    if got != f["sha256"]:
        return say("fail", "%s: sha256 %s, expected %s" % (f["path"], got, f["sha256"]))
    say("ok", "%s: sha256 %s" % (f["path"], got[:12]))


def check_compiles(path, tmp):
    try:
        cfile = os.path.join(tmp, hashlib.sha1(path.encode()).hexdigest() + ".pyc")
        py_compile.compile(path, cfile=cfile, doraise=True)
        say("ok", "%s: compiles" % path)
    except py_compile.PyCompileError as exc:
        say("fail", "%s: does not compile: %s" % (path, exc.msg.strip()))


def check_stale_bytecode(path):
    # The image's own __pycache__ (PYTHONPYCACHEPREFIX hides it; check as if unset).
    folder, name = os.path.split(path)
    pyc = os.path.join(folder, "__pycache__", "%s.%s.pyc" % (name[:-3], sys.implementation.cache_tag))
    try:
        with open(pyc, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return
    if len(head) < 16 or head[:4] != importlib.util.MAGIC_NUMBER:
        return
    flags = int.from_bytes(head[4:8], "little")
    st = os.stat(path)
    if flags == 0:
        mtime, size = int.from_bytes(head[8:12], "little"), int.from_bytes(head[12:16], "little")
        if mtime == int(st.st_mtime) & 0xFFFFFFFF and size == st.st_size & 0xFFFFFFFF:
            say("fail", "%s: the image's %s has the overlay's mtime and size: Python would run the old code"
                % (path, pyc))
        else:
            say("ok", "%s: the image's bytecode is stale by mtime/size, so Python recompiles" % path)
    elif flags & 1 and not flags & 2:
        say("note", "%s: the image ships unchecked hash-based bytecode (%s): the overlay runs only with "
            "PYTHONPYCACHEPREFIX set, as the Nomad spec sets it" % (path, pyc))


def frames_in_overlay(exc):
    files = [fr.filename for fr in traceback.extract_tb(exc.__traceback__)]
    if isinstance(exc, SyntaxError) and exc.filename:
        files.append(exc.filename)
    return [f for f in files if f in mounted]


def check_imports(modules):
    if not modules:
        return
    if importlib.util.find_spec("torch") is None:
        return say("note", "imports not checked: the image has no torch, so vLLM cannot be imported in it")
    sys.path.insert(0, os.path.dirname(spec["root"]))
    try:
        import vllm  # noqa: F401
    except BaseException as exc:
        if frames_in_overlay(exc):
            return say("fail", "import vllm fails in an overlaid file: %s: %s" % (type(exc).__name__, exc))
        return say("note", "imports not checked: vLLM does not import in this image here (%s: %s)"
                   % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else ""))
    for name in modules:
        try:
            importlib.import_module(name)
            say("ok", "%s: imports" % name)
        except BaseException as exc:
            say("fail", "%s: import fails: %s: %s" % (name, type(exc).__name__, exc))


LOAD = ("import importlib.util, sys\n"
        "s = importlib.util.spec_from_file_location(sys.argv[1], sys.argv[2])\n"
        "m = importlib.util.module_from_spec(s)\n"
        "s.loader.exec_module(m)\n")


def check_native(n):
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (spec["libdir"], env.get("LD_LIBRARY_PATH")) if p)
    r = subprocess.run([sys.executable, "-c", LOAD, n["module"], n["path"]], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=120)
    if r.returncode:
        say("fail", "%s: does not load as %s: %s" % (n["path"], n["module"], r.stdout.strip().splitlines()[-1:]))
    else:
        say("ok", "%s: loads as %s in Python %d.%d" % (n["path"], n["module"], *sys.version_info[:2]))


with tempfile.TemporaryDirectory() as tmp:
    for f in spec["files"]:
        check_hash(f)
        if f["path"].endswith(".py"):
            check_compiles(f["path"], tmp)
            check_stale_bytecode(f["path"])
check_imports(spec["modules"])
for n in spec["native"]:
    check_native(n)
say("done", "")
'''


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
    if not targets:
        raise ConfigError(f"{config.origin}: no targets: add 'targets:' to the config or give --image REF")
    for t in targets:
        if not _NAME.match(t.name):
            raise ConfigError(f"target name {t.name!r} must be letters, digits, '.', '_' or '-' (it names a folder)")
    return targets


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
    p.add_argument("--target", action="append", metavar="NAME", help="a config target (repeatable; default: all)")
    p.add_argument("--image", metavar="REF", help="an ad hoc target: this image, not in the config")
    p.add_argument("--root", metavar="PATH", help="with --image: vLLM's package folder in it (default: ask the image)")
    p.add_argument("--verify", action="store_true", help="check each overlay inside its image before keeping it")
    p.add_argument("--manifest", type=Path, metavar="FILE", help="with --verify: check this existing overlay instead")
    p.add_argument("--out", type=Path, metavar="DIR", help="where overlays go (default: output.overlays, 'overlays')")


def make_overlays(ctx: Any, targets: Sequence[TargetConfig], engine: Any | None, need_image: bool) -> list[Overlay]:
    """Every target's overlay, in memory: any error here leaves nothing written."""
    sources = _sources(ctx)
    plan = plan_series(ctx.series)
    for path in plan.skipped:
        ctx.progress.say(f"overlay: {path} is in no image: not overlaid")
    pin = {"version": ctx.pin.version, "sha256": ctx.pin.sha256}
    overlays = []
    for t in targets:
        side = side_for(engine, t, sources, need_image, ctx.progress, wanted_paths(plan), image_cache_dir(ctx))
        overlays.append(make_overlay(t, ctx.series, plan, side, sources, pin, ctx.progress))
    return overlays


def run(ctx: Any, args: Any) -> int:
    if args.manifest is not None:
        return _verify_existing(ctx, args)
    targets = select_targets(ctx.config, args.target, args.image, args.root)
    engine = connect(args.verify or any(not t.pinned for t in targets), ctx.progress)
    overlays = make_overlays(ctx, targets, engine, args.verify)
    out = args.out or Path(ctx.config.output.overlays)
    reports: list[Verified] = []
    verify = (lambda ov, folder: reports.append(verify_overlay(engine, folder))) if args.verify else None
    folders = write_overlays(overlays, out, verify)
    for overlay, folder in zip(overlays, folders):
        origin = f"image {overlay.image}" if overlay.image_id else f"the pinned vLLM {ctx.pin.version} tree"
        print(f"{overlay.target}: {folder} ({len(overlay.files)} files, from {origin})")
    for report in reports:
        _print_verified(ctx.progress, report)
    return 0


def _verify_existing(ctx: Any, args: Any) -> int:
    if not args.verify:
        raise ConfigError("--manifest is for --verify: it checks an existing overlay")
    engine = connect(True, ctx.progress)
    report = verify_overlay(engine, args.manifest, args.image)
    _print_verified(ctx.progress, report)
    return 0


def _print_verified(progress: Progress, report: Verified) -> None:
    for line in report.ok:
        progress.say(f"verify {report.image}: ok: {line}")
    for note in report.notes:
        progress.say(f"verify {report.image}: note: {note}")
    print(f"verified in {report.image}: {len(report.ok)} checks passed, {len(report.notes)} notes")


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
