"""The container engine: an interface the outputs use, and its Docker SDK implementation.

Overlays and the bundle image only ever talk to :class:`Engine`, so unit tests pass a
fake and need no daemon. :func:`docker_engine` gives the real one (DOCKER_HOST is
honoured). Every SDK or connection failure becomes an :class:`EngineError` naming the
image or the daemon; a failing build step becomes a :class:`CommandError` with the
step's output.

What every caller asks of a vLLM image lives here too, as one function over any
engine (:func:`probe_vllm`): where vLLM is installed, which versions of vLLM and its
kernels the image carries, whether ``import vllm`` works there, and the bytes of the
files asked for, all from one container.
"""

from __future__ import annotations

import base64
import io
import json
import os
import posixpath
import re
import tarfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .errors import CommandError, EngineError
from .progress import Progress

# Every container the tool starts is named with this prefix, so leftovers are easy to find.
NAME_PREFIX = "sm12x-bundle-"
# Read-only containers never run the image's entrypoint (vLLM's is `vllm serve`).
_NEVER_RUN = ["/sm12x-bundle-never-started"]
_SYMLINK_HOPS = 8
# The classic builder colours a step's stderr; logs want plain text.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class Mount:
    """A host path bind-mounted into a container (read-only unless told otherwise)."""

    source: Path
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class ImageFile:
    """A file as an image holds it: its bytes and its permission bits."""

    data: bytes
    mode: int


class Engine(Protocol):
    def ping(self) -> None: ...

    def image_id(self, ref: str) -> str: ...

    def image_labels(self, ref: str) -> dict[str, str]: ...

    def repo_digests(self, ref: str) -> list[str]: ...

    def tag(self, ref: str, repository: str, tag: str) -> None: ...

    def read_files(self, ref: str, paths: list[str]) -> dict[str, bytes | None]: ...

    def read_entries(self, ref: str, paths: list[str]) -> dict[str, ImageFile | None]: ...

    def run(
        self,
        ref: str,
        argv: list[str],
        *,
        mounts: Sequence[Mount] = (),
        env: Mapping[str, str] | None = None,
        network: bool = False,
        timeout: float = 600,
    ) -> tuple[int, str]: ...

    def build(
        self, context: Path, dockerfile: str, tag: str, buildargs: dict[str, str], progress: Progress
    ) -> str: ...

    def push(self, ref: str, progress: Progress) -> None: ...


def _name(purpose: str) -> str:
    return f"{NAME_PREFIX}{purpose}-{os.urandom(4).hex()}"


def daemon_address() -> str:
    """Where the SDK will look for the daemon, for messages."""
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock (the default; DOCKER_HOST is unset)"


def _unreachable(exc: Exception) -> EngineError:
    return EngineError(
        f"the Docker daemon at {daemon_address()} does not answer ({_reason(exc)}): "
        "start Docker Engine (as root: 'systemctl start docker', or run 'dockerd'), or set DOCKER_HOST "
        "to the socket of a daemon that runs (rootless Docker: unix:///run/user/<uid>/docker.sock)"
    )


def _reason(exc: Exception) -> str:
    text = getattr(exc, "explanation", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())[:300]


class DockerEngine:
    """The Docker SDK implementation. The client is made on first use, never at import."""

    def __init__(self, client: Any = None):
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            import docker  # the SDK is imported only when a daemon is really wanted

            try:
                self._client = docker.from_env()
            except docker.errors.DockerException as exc:
                raise _unreachable(exc) from None
        return self._client

    def _call(self, what: str, fn, *args, **kwargs):
        """Run one SDK call; turn its failures into EngineError naming ``what``."""
        import docker
        import requests

        try:
            return fn(*args, **kwargs)
        except docker.errors.ImageNotFound:
            raise EngineError(
                f"{what} not found in the daemon at {daemon_address()}: build, load or pull it first"
            ) from None
        except (requests.exceptions.ConnectionError, docker.errors.DockerException) as exc:
            if isinstance(exc, docker.errors.APIError):
                raise EngineError(f"{what}: the daemon refused: {_reason(exc)}") from None
            raise _unreachable(exc) from None

    def ping(self) -> None:
        self._call("ping", self.client.ping)

    def _image(self, ref: str) -> Any:
        return self._call(f"image {ref}", self.client.images.get, ref)

    def image_id(self, ref: str) -> str:
        return self._image(ref).id

    def image_labels(self, ref: str) -> dict[str, str]:
        return dict(self._image(ref).labels or {})

    def repo_digests(self, ref: str) -> list[str]:
        """``name@sha256:...`` per repository the image was pulled from or pushed to (none: built here)."""
        return list(self._image(ref).attrs.get("RepoDigests") or [])

    def tag(self, ref: str, repository: str, tag: str) -> None:
        self._call(f"image {ref}", self.client.api.tag, ref, repository, tag)

    def read_files(self, ref: str, paths: list[str]) -> dict[str, bytes | None]:
        return {p: None if f is None else f.data for p, f in self.read_entries(ref, paths).items()}

    def read_entries(self, ref: str, paths: list[str]) -> dict[str, ImageFile | None]:
        """Read files (bytes and mode) out of an image through one created (never started) container."""
        self._image(ref)
        container = self._call(
            f"image {ref}",
            self.client.containers.create,
            ref,
            entrypoint=_NEVER_RUN,
            command=[],
            network_disabled=True,
            name=_name("read"),
        )
        try:
            return {p: self._read_one(container, ref, p) for p in paths}
        finally:
            self._call(f"image {ref}", container.remove, force=True)

    def _read_one(self, container: Any, ref: str, path: str) -> ImageFile | None:
        import docker

        for _ in range(_SYMLINK_HOPS):
            try:
                stream, _stat = container.get_archive(path)
            except docker.errors.NotFound:
                return None
            except docker.errors.APIError as exc:
                raise EngineError(f"image {ref}: cannot read {path}: {_reason(exc)}") from None
            member, data = _single_member(b"".join(stream))
            if member.issym():
                path = posixpath.normpath(posixpath.join(posixpath.dirname(path), member.linkname))
                continue
            # The archive's header carries the file's mode as the image holds it.
            return ImageFile(data, member.mode & 0o777) if member.isfile() and data is not None else None
        raise EngineError(f"image {ref}: {path} is a chain of more than {_SYMLINK_HOPS} symlinks")

    def run(
        self,
        ref: str,
        argv: list[str],
        *,
        mounts: Sequence[Mount] = (),
        env: Mapping[str, str] | None = None,
        network: bool = False,
        timeout: float = 600,
    ) -> tuple[int, str]:
        """Run ``argv`` (not the image's entrypoint) in a throwaway container."""
        import docker
        import requests

        self._image(ref)
        container = self._call(
            f"image {ref}",
            self.client.containers.create,
            ref,
            entrypoint=argv[:1],
            command=argv[1:],
            name=_name("run"),
            environment=dict(env or {}),
            network_mode=None if network else "none",
            mounts=[
                docker.types.Mount(m.target, str(m.source), type="bind", read_only=m.read_only) for m in mounts
            ],
        )
        try:
            self._call(f"image {ref}: starting {argv[0]}", container.start)
            try:
                status = container.wait(timeout=timeout)
            except requests.exceptions.ReadTimeout:
                raise EngineError(f"image {ref}: {' '.join(argv)} did not finish within {timeout} s") from None
            output = self._call(f"image {ref}", container.logs, stdout=True, stderr=True)
            return int(status.get("StatusCode", -1)), output.decode("utf-8", "replace")
        finally:
            self._call(f"image {ref}", container.remove, force=True)

    def build(
        self, context: Path, dockerfile: str, tag: str, buildargs: dict[str, str], progress: Progress
    ) -> str:
        """Build with the classic builder, streaming its output; return the image id."""
        stream = self._call(
            f"build of {tag}",
            self.client.api.build,
            path=str(context),
            dockerfile=dockerfile,
            tag=tag,
            buildargs=dict(buildargs),
            rm=True,
            forcerm=True,
            pull=False,
            decode=True,
        )
        return self._call(f"build of {tag}", _follow_build, stream, tag, progress)

    def push(self, ref: str, progress: Progress) -> None:
        repo, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
        stream = self._call(f"push of {ref}", self.client.api.push, repo, tag=tag, stream=True, decode=True)
        for chunk in self._call(f"push of {ref}", list, stream):
            if "error" in chunk:
                raise EngineError(f"push of {ref} failed: {chunk['error']}")
            if chunk.get("status") and not chunk.get("progressDetail"):
                progress.say(f"push: {chunk['status']}" + (f" {chunk['id']}" if chunk.get("id") else ""))


def _single_member(archive: bytes) -> tuple[tarfile.TarInfo, bytes | None]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        member = tar.next()
        assert member is not None, "get_archive returned an empty archive"
        fh = tar.extractfile(member) if member.isfile() else None
        return member, fh.read() if fh else None


def _follow_build(stream: Iterator[dict], tag: str, progress: Progress) -> str:
    """Print the builder's output as it comes; return the built image id."""
    image_id = None
    tail: list[str] = []
    for chunk in stream:
        if "error" in chunk:
            raise CommandError(f"docker build of {tag} failed: {chunk['error'].strip()}\n" + "\n".join(tail[-20:]))
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = chunk["aux"]["ID"]
        for line in _ANSI.sub("", chunk.get("stream", "")).splitlines():
            if line.strip():
                tail.append(line)
                progress.say(f"build: {line}")
    if image_id is None:
        raise EngineError(f"docker build of {tag} ended without an image id")
    return image_id


def docker_engine() -> DockerEngine:
    """The Docker SDK engine (DOCKER_HOST honoured). Connects on first use."""
    return DockerEngine()


# --- what every caller asks of a vLLM image ------------------------------------------

# The official image (docker/Dockerfile, stage vllm-base) installs vLLM here.
OFFICIAL_VLLM_ROOT = "/usr/local/lib/python3.12/dist-packages/vllm"

# One run of the image's own Python answers every question. It asks where vllm lives
# without importing it (importing the real vLLM needs torch and may fail), falls back to
# a search for vllm/__init__.py, reads the versions from package metadata (vLLM's own
# _version.py when there is none), reads the files asked for (and lists their cached
# bytecode), and only then tries the import, to learn whether patched modules can be
# import-checked in this image.
_PROBE = r"""
import base64, glob, importlib.metadata as md, importlib.util, json, os, re, sys
root, wanted = sys.argv[1], json.loads(sys.argv[2])
found = []
if not root:
    spec = importlib.util.find_spec("vllm")
    root = os.path.dirname(spec.origin) if spec and spec.origin else ""
if not root:
    for top in sys.argv[3:]:
        for d, subs, files in os.walk(top):
            subs[:] = [s for s in subs if s not in ("tests", "__pycache__", "proc", "sys")]
            if os.path.basename(d) == "vllm" and "__init__.py" in files:
                found.append(d)
                subs[:] = []
    root = found[0] if len(found) == 1 else ""
versions = {}
for dist in ("vllm", "torch", "triton", "flashinfer-python", "deep_gemm"):
    try:
        versions[dist] = md.version(dist)
    except Exception:
        versions[dist] = None
if root and versions["vllm"] is None:
    try:
        text = open(os.path.join(root, "_version.py")).read()
        m = re.search(r"^__version__ = (?:version = )?.([^'\"]+)", text, re.M)
        versions["vllm"] = m.group(1) if m else None
    except OSError:
        pass
files, modes, bytecode = {}, {}, {}
for path in wanted if root else ():
    inside = root + path[len("vllm"):]
    try:
        with open(inside, "rb") as fh:
            files[path] = base64.b64encode(fh.read()).decode()
            modes[path] = os.fstat(fh.fileno()).st_mode & 0o777
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        files[path] = None
    folder, name = os.path.split(inside)
    bytecode[path] = sorted(glob.glob(os.path.join(folder, "__pycache__", name.rsplit(".", 1)[0] + ".*.pyc")))
error = "vllm not found"
if root:
    sys.path.insert(0, os.path.dirname(root))
    try:
        import vllm
        error = None if os.path.dirname(os.path.abspath(vllm.__file__)) == root else "another vllm imports first"
    except BaseException as exc:
        error = f"{type(exc).__name__}: {exc}"
answer = {"root": root, "found": found, "versions": versions, "import_error": error, "files": files, "modes": modes, "bytecode": bytecode}
print("SM12X-PROBE " + json.dumps(answer))
"""
_SEARCH_ROOTS = ("/usr/local/lib", "/usr/lib", "/opt", "/app", "/workspace", "/vllm-workspace", "/root", "/home")
VERSION_KEYS = {"vllm": "vllm", "torch": "torch", "triton": "triton", "flashinfer-python": "flashinfer", "deep_gemm": "deep_gemm"}


@dataclass(frozen=True)
class VllmProbe:
    """What an image's own Python says about its vLLM."""

    root: str
    versions: dict[str, str | None]  # keys: vllm, torch, triton, flashinfer, deep_gemm
    import_error: str | None  # None: `import vllm` works in this image
    files: dict[str, bytes | None] = field(default_factory=dict)  # vllm/... path -> bytes (None: absent)
    bytecode: dict[str, list[str]] = field(default_factory=dict)  # vllm/... path -> its cached .pyc files
    modes: dict[str, int] = field(default_factory=dict)  # vllm/... path -> permission bits (files read)

    @property
    def importable(self) -> bool:
        return self.import_error is None


def probe_vllm(engine: Engine, ref: str, root: str | None = None, paths: Sequence[str] = ()) -> VllmProbe:
    """Ask ``ref``'s python3 (one container, no network) where vLLM is and what it carries.

    ``root`` (from the config) skips the search. ``paths`` (``vllm/...``) are read in the
    same container, which saves a second one where every container is a full copy of
    the image (vfs storage). Raises EngineError when the image has no python3, holds no
    vLLM, or holds several and its Python finds none.
    """
    argv = ["python3", "-c", _PROBE, root or "", json.dumps(list(paths)), *_SEARCH_ROOTS]
    code, out = engine.run(ref, argv, timeout=600)
    lines = [line for line in out.splitlines() if line.startswith("SM12X-PROBE ")]
    if code != 0 or not lines:
        tail = " ".join(out.strip().splitlines()[-3:])[:300]
        raise EngineError(f"image {ref}: its python3 could not be asked where vLLM is (exit code {code}: {tail})")
    answer = json.loads(lines[-1].split(" ", 1)[1])
    if not answer["root"]:
        if len(answer["found"]) > 1:
            raise EngineError(
                f"image {ref} holds several vLLM packages ({', '.join(answer['found'])}) and its python3 "
                "imports none of them: say which in the config (root:)"
            )
        raise EngineError(f"image {ref} holds no vLLM: neither its python3 nor a search found vllm/__init__.py")
    versions = {key: answer["versions"].get(dist) for dist, key in VERSION_KEYS.items()}
    files = {p: None if b is None else base64.b64decode(b) for p, b in answer["files"].items()}
    modes = {p: int(m) for p, m in answer.get("modes", {}).items()}
    return VllmProbe(answer["root"], versions, answer["import_error"], files, answer["bytecode"], modes)

