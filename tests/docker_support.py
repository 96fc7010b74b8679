"""Shared helpers for the daemon tests: the skip-or-fail rule and stand-in vLLM images.

Import the fixtures into a test module (``from docker_support import daemon,
standin_official, ...``) and mark its tests ``@pytest.mark.docker``.

No registry can be reached, so the tests build their own stand-ins of the vLLM
images, once per session, and remove them at its end (below); the base's rootfs tarball
stays in the sm12x cache, so a later session imports it instead of running debootstrap:

- the base: Debian bookworm from ``debootstrap --variant=minbase`` with python3,
  Python.h and g++, trimmed (no docs, locales, LTO, sanitizers or static libraries:
  the test daemon's vfs storage copies the whole image for every container). It
  carries Python 3.11 where the official image has 3.12: enough to find, read,
  compile and check vLLM's Python files, which do not import without torch anyway.
  It stands in for a CUDA image too: the host's CUDA headers (the closure of cuda.h
  and cuda_runtime_api.h) under /usr/local/cuda/include and, as
  /usr/local/cuda/lib64/stubs/libcuda.so, an empty library with the soname
  libcuda.so.1. The rootfs tarball is cached in the sm12x cache (``standin/``), so a
  fresh daemon imports it instead of running debootstrap again.
- vLLM stand-ins: the base plus the real ``vllm/`` package of an sdist fetched and
  verified by the tool itself, at the official install root (with a .pth so the
  image's python3 finds it, and dist-info metadata as pip leaves it), at
  /opt/vllm/vllm (nothing on sys.path: found by searching), the second lane's release
  (0.33.0) at the official root, or a release no lane is for (0.26.0) at the official
  root. The bare base is the image without vLLM. The
  official-root stand-ins carry bytecode of vllm/device_allocator/, so the bundle's
  stale-bytecode step is exercised. Every vLLM stand-in replaces the empty driver stub
  with one that, like NVIDIA's, defines every driver API function cuda.h declares:
  Debian's g++ links with --as-needed, so only a stub that defines the calls makes a
  linked extension record DT_NEEDED libcuda.so.1 (the builder's check insists on it).

Daemon tests skip, with the reason, when no daemon answers, unless
SM12X_REQUIRE_DOCKER=1 (CI sets it): then they fail.

Nothing stays behind: the stand-in base carries the label TEST_LABEL, so every image the
tests build from it (the vLLM stand-ins, the builder and bundle images the tool builds from
those, the tags the tests add) carries it too, and the ``daemon`` fixture's finalizer removes,
at the end of the session, the stopped containers and the images that carry it (about 6 GB
on the test daemon's vfs storage), and on the private daemon of scripts/test its build cache.
SM12X_KEEP_TEST_IMAGES=1 keeps them, for a quicker next session. Images that lack the label,
the operator's own among them, are never touched.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import docker
import pytest

from sm12x_bundle import cmd
from sm12x_bundle.containers import OFFICIAL_VLLM_ROOT, DockerEngine, docker_engine
from sm12x_bundle.errors import EngineError
from sm12x_bundle.progress import Progress
from sm12x_bundle.source.cache import cache_dir, locked
from sm12x_bundle.source.pin import SourceTree

SUITE = "bookworm"
MIRROR = os.environ.get("SM12X_DEBIAN_MIRROR", "http://deb.debian.org/debian")
PACKAGES = ("python3", "libpython3-dev", "g++")
TRIM = (
    "usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "usr/share/lintian",
    "var/cache/apt/archives/*.deb", "var/lib/apt/lists/*", "var/log/*",
    "usr/lib/gcc/*/*/lto1", "usr/lib/gcc/*/*/cc1",
    "usr/bin/*-lto-dump-*", "usr/lib/gcc/*/*/*san*", "usr/lib/*/lib*san.so*",
    "usr/lib/gcc/*/*/libstdc++.a", "usr/lib/*/libc.a", "usr/lib/python3*/config-*/*.a",
    "usr/lib/python3*/test", "usr/lib/python3*/idlelib", "usr/lib/python3*/tkinter",
)
CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
CUDA_HEADERS = ("cuda.h", "cuda_runtime_api.h")
# Bump when the recipe changes in a way its inputs do not show.
RECIPE = "2"
# The same for the vLLM stand-ins alone (a change here does not rebuild the base).
VLLM_RECIPE = "2"
REQUIRE = os.environ.get("SM12X_REQUIRE_DOCKER") == "1"
# On the stand-in base, and so on every image built from it: what the session's end removes.
TEST_LABEL = "org.sm12x-bundle.test-image"


@dataclass(frozen=True)
class StandIn:
    """A stand-in vLLM image."""

    ref: str  # its tag
    root: str | None  # the vLLM package folder inside; None: no vLLM
    version: str | None  # the release its vllm/ came from


# --- the skip-or-fail rule -------------------------------------------------------------


def unavailable(reason: str) -> None:
    """Skip the test, or fail it when CI said a daemon must be there."""
    if REQUIRE:
        pytest.fail(f"SM12X_REQUIRE_DOCKER=1, but {reason}")
    pytest.skip(reason)


def engine_or_skip() -> DockerEngine:
    engine = docker_engine()
    try:
        engine.ping()
    except EngineError as exc:
        if os.environ.get("DOCKER_HOST"):
            pytest.fail(f"DOCKER_HOST is set but {exc}")
        unavailable(f"no Docker daemon: {exc}")
    return engine


def _has_image(engine: DockerEngine, ref: str) -> bool:
    try:
        engine.image_id(ref)
        return True
    except EngineError:
        return False


# --- the base ------------------------------------------------------------------------


def _cuda_headers() -> list[Path]:
    """cuda.h, cuda_runtime_api.h and every header they pull in from the toolkit."""
    include = CUDA_HOME / "include"
    missing = [h for h in CUDA_HEADERS if not (include / h).is_file()]
    if missing:
        unavailable(f"the stand-in needs the host's CUDA headers: {include}/{missing[0]} is missing")
    probe = "".join(f"#include <{h}>\n" for h in CUDA_HEADERS)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "probe.c").write_text(probe)
        deps = cmd.run(["gcc", "-M", f"-I{include}", str(Path(tmp) / "probe.c")], echo=False).stdout
    words = deps.replace("\\\n", " ").split()
    return sorted({Path(w) for w in words if w.startswith(str(include) + "/")})


def base_key() -> str:
    h = hashlib.sha256(f"{RECIPE}\0{SUITE}\0{PACKAGES}\0{TRIM}".encode())
    for header in _cuda_headers():
        h.update(str(header).encode() + b"\0" + header.read_bytes())
    return h.hexdigest()[:12]


def _debootstrap(rootfs: Path) -> None:
    if os.geteuid() != 0 or not shutil.which("debootstrap"):
        unavailable("building the stand-in base needs root and debootstrap (apt-get install debootstrap)")
    cmd.run(
        ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, rootfs, MIRROR],
        capture=True,
        timeout=1800,
    )


def _trim(rootfs: Path) -> None:
    for pattern in TRIM:
        for path in rootfs.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()


def _add_cuda(rootfs: Path) -> None:
    """The host's CUDA headers and an empty stub libcuda.so (soname libcuda.so.1)."""
    include = CUDA_HOME / "include"
    for header in _cuda_headers():
        dest = rootfs / "usr/local/cuda/include" / header.relative_to(include)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(header, dest)
    stubs = rootfs / "usr/local/cuda/lib64/stubs"
    stubs.mkdir(parents=True, exist_ok=True)
    empty = stubs / "stub.c"
    empty.write_text("/* stand-in for NVIDIA's driver stub: symbols resolve at run time */\n")
    cmd.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", stubs / "libcuda.so", empty])
    empty.unlink()


def base_tarball(key: str) -> Path:
    """The trimmed rootfs as a tarball in the cache: made once per machine."""
    cache = cache_dir() / "standin"
    tarball = cache / f"base-{SUITE}-{key}.tar"
    if tarball.is_file():
        return tarball
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix="rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _debootstrap(rootfs)
        _trim(rootfs)
        _add_cuda(rootfs)
        part = Path(tmp) / "base.tar"
        cmd.run(["tar", "--numeric-owner", "--sort=name", "-C", rootfs, "-cf", part, "."])
        os.replace(part, tarball)
    return tarball


def ensure_base(engine: DockerEngine) -> str:
    """The stand-in base image's tag: imported from the cached tarball when missing."""
    key = base_key()
    tag = f"sm12x-standin/base:{SUITE}-{key}"
    with locked(cache_dir(), f"standin-base-{key}"):
        if not _has_image(engine, tag) or TEST_LABEL not in engine.image_labels(tag):
            tarball = base_tarball(key)
            repo, _, version = tag.partition(":")
            engine.client.api.import_image(src=str(tarball), repository=repo, tag=version,
                                           changes=[f"LABEL {TEST_LABEL}=1"])
    return tag


def remove_test_images(engine: DockerEngine, build_cache: bool = REQUIRE) -> list[str]:
    """Remove the stopped containers and the images that carry TEST_LABEL, tagged or not;
    with ``build_cache`` (the private daemon of scripts/test), the daemon's build cache too.
    Returns the ids of the images removed."""
    api = engine.client.api
    only_ours = {"label": TEST_LABEL}
    api.prune_containers(filters=only_ours)  # a container holds its image: first
    removed = api.prune_images(filters={**only_ours, "dangling": False}).get("ImagesDeleted") or []
    if build_cache:
        try:
            api.prune_builds()
        except docker.errors.APIError:  # a daemon too old for the builder API holds no build cache
            pass
    return [entry["Deleted"] for entry in removed if "Deleted" in entry]


# --- vLLM stand-ins -------------------------------------------------------------------

LAYOUTS = {
    "official": OFFICIAL_VLLM_ROOT,
    "opt": "/opt/vllm/vllm",
}


def _driver_stub(dest: Path) -> None:
    """A libcuda.so (soname libcuda.so.1) defining every driver API function cuda.h declares."""
    text = (CUDA_HOME / "include" / "cuda.h").read_text("utf-8", "replace")
    names = set(re.findall(r"CUDAAPI\s+(cu[A-Z]\w*)\s*\(", text))
    names |= set(re.findall(r"^#\s*define\s+cu[A-Z]\w*\s+(cu[A-Z]\w*)\s*$", text, re.M))
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "stub.c"
        src.write_text("".join(f"void {n}(void) {{}}\n" for n in sorted(names)))
        cmd.run(["gcc", "-shared", "-fPIC", "-nostdlib", "-Wl,-soname,libcuda.so.1", "-o", dest, src], echo=False)


def _standin_context(ctx: Path, base_id: str, source: SourceTree, root: str, on_path: bool) -> None:
    steps = [f"FROM {base_id}", "COPY root/ /"]
    if on_path:
        # Cached bytecode beside the files the series patches, as an installer leaves it.
        steps.append(f"RUN python3 -m compileall -q {root}/device_allocator")
    (ctx / "Dockerfile").write_text("\n".join(steps) + "\n")
    dest = ctx / "root" / root.lstrip("/")
    shutil.copytree(source.root / "vllm", dest, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    _driver_stub(ctx / "root/usr/local/cuda/lib64/stubs/libcuda.so")
    if on_path:
        site = os.path.dirname(root)
        pth = ctx / "root/usr/lib/python3/dist-packages/sm12x-standin-vllm.pth"
        pth.parent.mkdir(parents=True, exist_ok=True)
        pth.write_text(site + "\n")
        meta = ctx / "root" / site.lstrip("/") / f"vllm-{source.version}.dist-info"
        meta.mkdir(parents=True)
        (meta / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {source.version}\n")


def ensure_vllm_standin(engine: DockerEngine, base: str, source: SourceTree, layout: str) -> StandIn:
    """``base`` plus ``source``'s vllm/ package at the layout's install root."""
    root = LAYOUTS[layout]
    base_id = engine.image_id(base)
    key = hashlib.sha256(f"{RECIPE}\0{VLLM_RECIPE}\0{base_id}\0{source.root}\0{source.sha256}\0{layout}".encode()).hexdigest()[:12]
    tag = f"sm12x-standin/vllm:{source.version}-{layout}-{key}"
    with locked(cache_dir(), f"standin-{key}"):
        if not _has_image(engine, tag):
            with tempfile.TemporaryDirectory(prefix="standin-ctx-") as tmp:
                _standin_context(Path(tmp), base_id, source, root, on_path=layout == "official")
                engine.build(Path(tmp), "Dockerfile", tag, {}, Progress.quiet())
    return StandIn(tag, root, source.version)


# --- fixtures -------------------------------------------------------------------------


@pytest.fixture(scope="session")
def daemon() -> Iterator[DockerEngine]:
    """The Docker engine (DOCKER_HOST honoured); skips or fails when none answers. At the
    session's end, every image the tests built goes (``remove_test_images``)."""
    engine = engine_or_skip()
    yield engine
    if os.environ.get("SM12X_KEEP_TEST_IMAGES") != "1":
        remove_test_images(engine)


@pytest.fixture(scope="session")
def standin_base(daemon) -> str:
    return ensure_base(daemon)


@pytest.fixture(scope="session")
def standin_novllm(daemon, standin_base) -> StandIn:
    """An image without vLLM (python3, no vllm package anywhere)."""
    return StandIn(standin_base, None, None)


@pytest.fixture(scope="session")
def standin_official(daemon, standin_base, pinned_source) -> StandIn:
    """The pinned vLLM at the official image's install root, found by the image's python3."""
    return ensure_vllm_standin(daemon, standin_base, pinned_source, "official")


@pytest.fixture(scope="session")
def standin_opt(daemon, standin_base, pinned_source) -> StandIn:
    """The pinned vLLM at /opt/vllm/vllm, not on sys.path (found by searching)."""
    return ensure_vllm_standin(daemon, standin_base, pinned_source, "opt")


SKEW_VERSION = "0.26.0"  # a release between the lanes: no lane is for it
LANE2_VERSION = "0.33.0"


@pytest.fixture(scope="session")
def standin_skew(daemon, standin_base, default_context) -> StandIn:
    """Another release (0.26.0) at the official root: no lane is for it."""
    return ensure_vllm_standin(daemon, standin_base, default_context.source(SKEW_VERSION), "official")


@pytest.fixture(scope="session")
def standin_lane2(daemon, standin_base, default_context) -> StandIn:
    """The second lane's release (0.33.0) at the official root, as its official image has it."""
    return ensure_vllm_standin(daemon, standin_base, default_context.source(LANE2_VERSION), "official")
