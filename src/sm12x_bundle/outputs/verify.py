"""The in-image check of what a manifest lists, for overlays and the bundle image alike.

One script (:data:`VERIFY_SCRIPT`, stdlib only) runs inside the image with the files in
place (bind-mounted read-only, or installed): sha256, mode, compile, the image's own
bytecode, imports where the image can import vLLM, and that a rebuilt extension loads.
For an overlay, :func:`verify_overlay` first refuses an image whose originals are not the
recorded pre-images, and host copies that differ from the manifest.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import fsutil
from ..containers import Engine, Mount
from ..errors import VerifyError
from ..plan.files import module_name, read_or_none, sha256_of
from . import native_build
from .manifest import load_manifest

# Where verify puts what it needs inside the container.
_PYCACHE = "/tmp/sm12x-verify-pycache"
_LIBDIR = "/sm12x-verify/lib"


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


# --- an overlay in its image --------------------------------------------------


def verify_overlay(engine: Engine, folder: Path, image: str | None = None) -> Verified:
    """Check the overlay in ``folder`` against ``image`` (default: the one it was made for)."""
    folder, manifest = load_manifest(folder)
    ref = image or manifest["image"]
    engine.image_id(ref)
    originals = check_pre_images(engine, ref, manifest)
    check_host_copies(folder, manifest)
    with fsutil.temp_folder("sm12x-verify-") as tmp:
        mounts, spec = verify_plan(folder, manifest, Path(tmp))
        env = {"PYTHONPYCACHEPREFIX": _PYCACHE}
        code, out = engine.run(
            ref, ["python3", "-c", VERIFY_SCRIPT, json.dumps(spec)], mounts=mounts, env=env, network=False
        )
    report = parse_verify(f"overlay {manifest['target']}/{manifest['content_hash']}", ref, code, out)
    report.ok[:0] = originals
    return report


def check_pre_images(engine: Engine, ref: str, manifest: dict[str, Any]) -> list[str]:
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
        if sha256_of(read_or_none(path)) != f["sha256"]:
            raise VerifyError(f"{path} is missing or differs from its manifest (sha256 {f['sha256']})")


def verify_plan(folder: Path, manifest: dict[str, Any], tmp: Path) -> tuple[list[Mount], dict[str, Any]]:
    """The mounts and the in-container script's input for one overlay."""
    mounts = [Mount((folder / f["source"]).resolve(), f["container_path"]) for f in manifest["files"]]
    spec = verify_spec(manifest, libdir=_LIBDIR)
    if spec["native"]:
        built = [folder / _source_of(manifest, n["path"]) for n in spec["native"]]
        calls = sorted({c for so in built for c in native_build.driver_calls(so)})
        mounts.append(Mount(native_build.write_libcuda_stub(tmp / "lib", calls).resolve(), _LIBDIR))
    return mounts, spec


def _source_of(manifest: dict[str, Any], container: str) -> str:
    return next(f["source"] for f in manifest["files"] if f["container_path"] == container)
