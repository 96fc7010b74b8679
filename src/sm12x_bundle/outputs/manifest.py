"""What an output installs into a vLLM image, and the manifest that records it.

Overlays and the bundle image install the same things (the patched copies of the files
the series changes, and the rebuilt extension) and describe them with one manifest
schema (docs/design.md). This module holds everything both share:

* **the plan** (pure): which tree paths the series installs (:func:`plan_series`), and
  applying the file patches to an image's own copies (:func:`apply_subseries`);
* **paths**: ``vllm/x/y.py`` inside an image (:func:`container_path`), the module a
  file is imported as (:func:`module_name`);
* **the manifest**: one file's entry (:class:`InstalledFile`), the content hash, the
  document and its bytes (:func:`manifest`, :func:`manifest_bytes`);
* **the in-image check** of what a manifest lists (:data:`VERIFY_SCRIPT`,
  :func:`verify_spec`, :func:`parse_verify`): hashes, modes, compile, the image's own
  bytecode, imports where the image can import vLLM, and that a rebuilt extension loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import posixpath
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks.check import Conflict, Outcome, classify
from ..errors import ApplyError, ConfigError, SeriesError, VerifyError
from ..series.apply import VirtualTree
from ..series.patch import Series
from .. import native

SCHEMA = 1
VERSION_KEYS = ("vllm", "torch", "triton", "flashinfer", "deep_gemm")


def sha256_of(data: bytes | None) -> str | None:
    return hashlib.sha256(data).hexdigest() if data is not None else None


def read_or_none(path: Path) -> bytes | None:
    """A regular file's bytes (None: absent, or a link)."""
    return path.read_bytes() if path.is_file() and not path.is_symlink() else None


# --- what the series installs (pure) -------------------------------------------------

# What each native artifact is built from, alone (tree paths; missing inputs are skipped).
NATIVE_RECIPES = {
    f"vllm/{native.ARTIFACT}": (str(native.SOURCE), "csrc/cumem_allocator_compat.h"),
}


@dataclass(frozen=True)
class NativeBuild:
    artifact: str  # tree path of the built file, e.g. vllm/cumem_allocator.abi3.so
    inputs: tuple[str, ...]  # tree paths it is built from
    patches: tuple[str, ...]  # the native patches that change it



@dataclass(frozen=True)
class SeriesPlan:
    files: tuple[str, ...]  # vllm/ paths patched in place, in first-touched order
    native: tuple[NativeBuild, ...]
    skipped: tuple[str, ...]  # paths no image holds (tests/, docs/): not installed


def plan_series(series: Series) -> SeriesPlan:
    """Which files the series installs: vllm/ files in place, csrc/ through their artifact."""
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
                    raise SeriesError(
                        f"{patch.file}: deletes {fp.path}: an overlay or bundle image cannot delete a file"
                    )
                files.setdefault(fp.path)
            elif patch.kind == "native" and fp.path not in inputs:
                raise SeriesError(f"{patch.file}: changes {fp.path}, which {patch.builds} is not built from")
            elif patch.kind != "native":
                skipped.setdefault(fp.path)
    native_builds = tuple(NativeBuild(a, NATIVE_RECIPES[a], tuple(ids)) for a, ids in builds.items())
    return SeriesPlan(tuple(files), native_builds, tuple(skipped))


def _recipe_of(artifact: str | None, where: Path) -> str:
    if artifact not in NATIVE_RECIPES:
        known = ", ".join(NATIVE_RECIPES)
        raise SeriesError(
            f"{where}: Sm12x-Builds {artifact!r} cannot be built alone: only {known} can be rebuilt alone "
            "(see native.py)"
        )
    return artifact


def installed_paths(series: Series) -> dict[str, tuple[str, ...]]:
    """Every file an output installs (``vllm/...``) -> the ids of the patches behind it."""
    plan = plan_series(series)
    out = {path: tuple(p.id for p in series.patches if path in p.paths) for path in plan.files}
    out.update({b.artifact: b.patches for b in plan.native})
    return out


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


# --- paths ---------------------------------------------------------------------------


def container_path(root: str, tree_path: str) -> str:
    """``vllm/x/y.py`` -> ``<root>/x/y.py``: the root is the image's ``vllm`` package folder."""
    assert tree_path.startswith("vllm/"), tree_path
    return posixpath.join(root, tree_path[len("vllm/") :])


def normal_root(root: str, where: str) -> str:
    norm = posixpath.normpath(root)
    if not norm.startswith("/") or norm == "/":
        raise ConfigError(f"{where}: root {root!r} must be an absolute path to the vllm package folder")
    return norm


def module_name(root: str, path: str) -> str:
    """``<root>/device_allocator/cumem.py`` -> ``vllm.device_allocator.cumem``; an extension
    (``<root>/cumem_allocator.abi3.so``) -> ``vllm.cumem_allocator``."""
    rel = posixpath.relpath(path, root)
    stem = rel.split(".", 1)[0]
    parts = ["vllm", *stem.split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# --- the manifest --------------------------------------------------------------------


@dataclass(frozen=True)
class InstalledFile:
    """One file an output puts into an image."""

    path: str  # vllm/... in the tree
    container_path: str
    data: bytes | None = field(repr=False)  # None: not built yet
    mode: int
    patches: tuple[str, ...]
    pre_image_sha256: str | None  # None: the image has no such file

    @property
    def sha256(self) -> str | None:
        return sha256_of(self.data)

    @property
    def source(self) -> str:
        """Where the file lies under the overlay folder or the build context."""
        return "files/" + self.container_path.lstrip("/")

    def entry(self) -> dict[str, Any]:
        return {
            "container_path": self.container_path,
            "source": self.source,
            "pre_image_sha256": self.pre_image_sha256,
            "sha256": self.sha256,
            "patches": list(self.patches),
            "mode": f"{self.mode:04o}",
        }


def content_hash(files: Iterable[InstalledFile]) -> str:
    """First 16 hex digits of sha256 over the sorted ``container_path \\0 sha256 \\0 mode``
    lines, joined by newlines."""
    lines = sorted(f"{f.container_path}\0{f.sha256}\0{f.mode:04o}" for f in files)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def manifest(
    *,
    target: str,
    image: str,
    image_id: str | None,
    vllm_root: str,
    versions: Mapping[str, str | None],
    pin: Mapping[str, str | None],
    series_sha256: str,
    files: Sequence[InstalledFile],
    native: Mapping[str, dict[str, Any]],
) -> dict[str, Any]:
    """The manifest of docs/design.md (``native``: container path -> how it was built)."""
    return {
        "schema": SCHEMA,
        "target": target,
        "image": image,
        "image_id": image_id,
        "vllm_root": vllm_root,
        "versions": dict(versions),
        "pin": dict(pin),
        "series_sha256": series_sha256,
        "content_hash": content_hash(files),
        "files": [f.entry() for f in sorted(files, key=lambda f: f.container_path)],
        "native": dict(native),
    }


def manifest_bytes(document: dict[str, Any]) -> bytes:
    """Sorted keys, indent 2: the same inputs give the same bytes."""
    return (json.dumps(document, sort_keys=True, indent=2) + "\n").encode()


# --- the check inside the image ------------------------------------------------------


@dataclass
class Verified:
    image: str
    ok: list[str]
    notes: list[str]
    checked: int = 0  # files whose sha256 matched
    compiled: int = 0  # Python files that compiled
    imported: tuple[str, ...] = ()  # modules that imported


def verify_spec(
    document: dict[str, Any],
    *,
    modules: bool = True,
    native: bool = True,
    extra: Mapping[str, str | None] | None = None,
    libdir: str = "/nonexistent",
) -> dict[str, Any]:
    """The check script's input for the files ``document`` lists (at their container paths).

    ``modules``: import-check the patched modules (where the image's vLLM imports);
    ``native``: load each rebuilt extension; ``extra``: more files (path -> sha256) whose
    hash alone is checked.
    """
    root = document["vllm_root"]
    spec: dict[str, Any] = {"root": root, "files": [], "native": [], "modules": [], "libdir": libdir, "extra": []}
    for f in document["files"]:
        path = f["container_path"]
        spec["files"].append({"path": path, "sha256": f["sha256"], "mode": f["mode"]})
        if path in document.get("native", {}):
            if native:
                spec["native"].append({"path": path, "module": module_name(root, path)})
        elif path.endswith(".py") and modules:
            spec["modules"].append(module_name(root, path))
    spec["extra"] = [{"path": p, "sha256": s} for p, s in sorted((extra or {}).items())]
    return spec


def parse_verify(what: str, ref: str, code: int, out: str) -> Verified:
    """The script's report; VerifyError naming ``what`` and the image on any failure."""
    lines = [line.split(" ", 2)[1:] for line in out.splitlines() if line.startswith("sm12x-verify ")]
    lines = [(parts + [""])[:2] for parts in lines]
    fails = [text for kind, text in lines if kind == "fail"]
    done = [text for kind, text in lines if kind == "done"]
    if fails or not done or code != 0:
        detail = fails or out.strip().splitlines()[-20:] or [f"exit code {code}, no output"]
        raise VerifyError(f"{what} failed its check in image {ref}:\n  " + "\n  ".join(detail))
    counts = json.loads(done[-1] or "{}")
    return Verified(
        ref,
        [t for k, t in lines if k == "ok"],
        [t for k, t in lines if k == "note"],
        counts.get("checked", 0),
        counts.get("compiled", 0),
        tuple(counts.get("imported", ())),
    )


# Runs inside the image with the files in place (installed or bind-mounted); stdlib only,
# Python >= 3.8.
VERIFY_SCRIPT = r'''
import hashlib, importlib, importlib.util, json, os, py_compile, subprocess, sys, tempfile, traceback

spec = json.loads(sys.argv[1])
mounted = {f["path"] for f in spec["files"]}
counts = {"checked": 0, "compiled": 0, "imported": []}


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
    return True


def check_mode(f):
    mode = "%04o" % (os.stat(f["path"]).st_mode & 0o777)
    if f.get("mode") and mode != f["mode"]:
        say("fail", "%s: mode %s, expected %s" % (f["path"], mode, f["mode"]))


def check_compiles(path, tmp):
    try:
        cfile = os.path.join(tmp, hashlib.sha1(path.encode()).hexdigest() + ".pyc")
        py_compile.compile(path, cfile=cfile, doraise=True)
        say("ok", "%s: compiles" % path)
        counts["compiled"] += 1
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
            counts["imported"].append(name)
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
        if check_hash(f):
            counts["checked"] += 1
            check_mode(f)
            if f["path"].endswith(".py"):
                check_compiles(f["path"], tmp)
                check_stale_bytecode(f["path"])
for f in spec.get("extra", ()):
    check_hash(f)
check_imports(spec["modules"])
for n in spec["native"]:
    check_native(n)
say("done", json.dumps(counts))
'''
