"""The one way overlays and the bundle image build the native artifact (the cumem extension).

The compiler line is always native.py's; only where it runs differs. The plan decides where
(plan/native.py, :func:`~sm12x_bundle.plan.native.plan_native`); this module builds it there:

* **in a builder container** (docker/Dockerfile.builder ``FROM`` the target or base image,
  by the local tag named after its id, dockerfile.py): its own Python headers, CUDA
  headers and toolchain, linking the toolkit's driver stub. This is the mechanism whenever
  a Docker daemon and a real image are involved: the overlay of an image target and the
  bundle image alike. The builder image is tagged by its context's digest, so the same
  sources on the same image build once.
* **on the host**, only for a target made from the pinned tree without an image (the
  embedded default on a fresh machine with no daemon): the host's compiler and CUDA
  headers, linking a generated stand-in for libcuda.so.1 (no driver, and toolkits do not
  always ship the stub). The extension uses only Python's stable ABI (3.8) and the CUDA
  driver API, so this fits any image whose CUDA major matches the headers.

Either way the result must link libcuda.so.1, the headers' CUDA major must match the
image's (torch's ``+cuXYZ``, when it says), and the manifest's ``native`` entry records how
it was built (``built_on``: ``"builder image <id>"`` or ``"host"``) and from what.
"""

from __future__ import annotations

import enum
import re
import shutil
import sysconfig
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import cmd, native
from ..config import TargetConfig
from ..containers import Engine
from ..context import Context
from ..errors import CommandError, ConfigError, VerifyError
from ..plan.native import BuilderPlan, NativePlan
from ..plan.originals import connect
from ..plan.target import built_on_host
from ..progress import Progress
from .dockerfile import (
    ContextFiles,
    Step,
    context_digest,
    from_reference,
    pin_locally,
    render,
    shell_word,
    write_context,
)

# Where Dockerfile.builder leaves the extension (and what readelf and nm say of it).
BUILDER_DIR = "/sm12x-build/out/"
BUILDER_OUT = BUILDER_DIR + native.ARTIFACT
# The tool's own modules the builder needs to run native.py's compiler line.
_BUILDER_LIB = ("__init__.py", "native.py", "cmd.py", "errors.py")


# --- carrying out a plan (plan/native.py) -------------------------------------------


@dataclass(frozen=True)
class NativeArtifact:
    artifact: str
    data: bytes
    patches: tuple[str, ...]
    record: dict[str, Any]  # how it was built, for the manifest's ``native`` entry


def build_native(
    plan: NativePlan,
    engine: Engine | None,
    versions: Mapping[str, str | None],
    label: str,
    work: Path,
    progress: Progress,
    force: bool = False,
) -> NativeArtifact:
    """Build ``plan`` where it says, check the result, and say how it was built. ``work``
    is replaced whole (refused if this tool did not write it, unless ``force``)."""
    if plan.builder is not None:
        if engine is None:
            raise ConfigError(f"{label}: building {plan.artifact} in the image needs a Docker daemon")
        data, record = build_in_builder(engine, plan.builder, work, progress, force)
        hint = "set image.builder_base (and image.cuda_home) to a builder with a matching CUDA toolkit"
    else:
        data, record = build_on_host(plan.sources, work)
        hint = "point CUDA_HOME at a matching CUDA toolkit"
    check_cuda_match(versions, record["cuda_headers"], label, hint)
    record["built_from"] = plan.built_from
    return NativeArtifact(plan.artifact, data, plan.patches, record)


class _Ask(enum.Enum):
    DAEMON = "ask the daemon"  # preflight's engine when the caller has not asked yet


def preflight(
    ctx: Context, targets: Sequence[TargetConfig] | None = None, engine: Engine | None | _Ask = _Ask.DAEMON
) -> None:
    """Before anything is fetched or written: when this machine will build the cumem extension
    (a pinned target with no image to build it in), everything that build needs is here, else
    EnvironmentProblem (exit 12) names what is missing and how to get it. ``build`` (and
    ``build --dry-run``) and ``overlay`` run it; ``engine`` None: no daemon answers."""
    targets = list(ctx.config.targets) if targets is None else targets
    if not any(t.pinned for t in targets):
        return
    if isinstance(engine, _Ask):
        engine = connect(False, Progress.quiet())
    on_host = built_on_host(ctx, targets, engine)
    if on_host:
        why = "no Docker daemon answers" if engine is None else "the Docker daemon does not hold the image"
        native.check_host_toolchain(f"for {', '.join(on_host)}, made from the pinned tree: {why}")


# --- in a builder container ----------------------------------------------------------


def builder_dockerfile(builder: BuilderPlan) -> str:
    setup = Step("RUN", builder.setup) if builder.setup else Step(None, "(no builder setup: the base has a compiler)")
    return render(
        "Dockerfile.builder",
        {"BUILDER_BASE": from_reference(builder.base), "BUILDER_SETUP": setup, "CUDA_HOME": shell_word(builder.cuda_home)},
    )


def builder_context(builder: BuilderPlan) -> ContextFiles:
    """Dockerfile, csrc/ (the patched extension source), lib/sm12x_bundle/ (native.py)."""
    pkg = Path(native.__file__).parent
    files: ContextFiles = {"Dockerfile": (builder_dockerfile(builder).encode(), 0o644)}
    files.update({path: (data, 0o644) for path, data in builder.sources.items()})
    files.update({f"lib/sm12x_bundle/{n}": ((pkg / n).read_bytes(), 0o644) for n in _BUILDER_LIB})
    return files


def build_in_builder(
    engine: Engine, builder: BuilderPlan, workdir: Path, progress: Progress, force: bool = False
) -> tuple[bytes, dict[str, Any]]:
    """Build the extension alone (Dockerfile.builder in ``builder.base``); return it and its record."""
    files = builder_context(builder)
    tag = f"sm12x-bundle-builder:{context_digest(files)[:16]}"
    write_context(files, workdir, 0, force)
    pin_locally(engine, builder.base)
    progress.say(f"building {native.ARTIFACT} alone in {builder.base} ({tag})")
    image_id = engine.build(workdir, "Dockerfile", tag, {}, progress)
    cuda_h = f"{builder.cuda_home.rstrip('/')}/include/cuda.h"
    readelf, nm = BUILDER_DIR + "readelf.txt", BUILDER_DIR + "nm.txt"
    got = engine.read_files(tag, [BUILDER_OUT, readelf, nm, cuda_h])
    data = got[BUILDER_OUT]
    if not data:
        raise VerifyError(f"the builder image {tag} holds no {BUILDER_OUT}")
    links = needed_libs(_text(got[readelf]))
    _require_libcuda(f"{native.ARTIFACT} built in {tag}", links)
    record = {
        "built_on": f"builder image {image_id}",
        "builder_base": builder.base,
        "cuda_headers": cuda_headers_version(_text(got[cuda_h])),
        "py_limited_api": "3.8",
        "links": links,
        "requires": glibc_versions(_text(got[nm])),
    }
    return data, record


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", "replace")


# --- on the host ---------------------------------------------------------------------


def build_on_host(sources: Mapping[str, bytes], work: Path) -> tuple[bytes, dict[str, Any]]:
    """Build the patched sources with native.py's command, against a generated stand-in for
    libcuda.so.1. Compiled from a fixed relative path in a fresh folder, so the bytes depend
    only on the patched source, the compiler and the CUDA headers."""
    src = work / "src"
    for rel, data in sources.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    cuda_home = native.find_cuda_home()
    stub = work / "libcuda"
    write_libcuda_stub(stub, ())  # empty: only to learn which driver calls the build makes
    first = _compile(src, work / "probe", cuda_home, stub)
    calls = driver_calls(first)
    write_libcuda_stub(stub, calls)
    built = _compile(src, work / "out", cuda_home, stub)
    links = needed_libs(cmd.run(["readelf", "-d", str(built)], echo=False).stdout)
    _require_libcuda(str(built), links)
    record = {
        "built_on": "host",
        "compiler": _compiler_version(),
        "cuda_headers": cuda_headers_version((cuda_home / "include" / "cuda.h").read_text("utf-8", "replace")),
        "py_limited_api": "3.8",
        "python_headers": sysconfig.get_python_version(),
        "links": links,
        "requires": glibc_versions(_undefined(built)),
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


# --- what a built extension says -----------------------------------------------------


def _undefined(so: Path) -> str:
    return cmd.run(["nm", "-D", "--undefined-only", str(so)], echo=False).stdout


def driver_calls(so: Path) -> list[str]:
    names = {line.split()[-1].split("@")[0] for line in _undefined(so).splitlines() if line.strip()}
    return sorted(n for n in names if re.fullmatch(r"cu[A-Z]\w*", n))


def glibc_versions(nm_output: str) -> list[str]:
    return sorted({m.group(1) for m in re.finditer(r"@+(GLIBC\w*_[\d.]+)", nm_output)})


def needed_libs(readelf_output: str) -> list[str]:
    return sorted(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf_output))


def _require_libcuda(what: str, links: list[str]) -> None:
    if "libcuda.so.1" not in links:
        raise CommandError(f"{what} does not link libcuda.so.1 (it links {', '.join(links)}): the build is unusable")


def _compiler_version() -> str:
    return cmd.run(["g++", "--version"], echo=False).stdout.splitlines()[0].strip()


def cuda_headers_version(cuda_h: str) -> str | None:
    """``13.0`` from cuda.h's text (None: no CUDA_VERSION in it)."""
    m = re.search(r"^#define\s+CUDA_VERSION\s+(\d+)", cuda_h, re.MULTILINE)
    return f"{int(m.group(1)) // 1000}.{int(m.group(1)) % 1000 // 10}" if m else None


def image_cuda(versions: Mapping[str, str | None]) -> str | None:
    """The CUDA an image's torch was built for (``2.9.0+cu130`` -> ``13.0``), when it says."""
    m = re.search(r"\+cu(\d+)(\d)$", versions.get("torch") or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def check_cuda_match(
    versions: Mapping[str, str | None],
    headers: str | None,
    label: str,
    hint: str = "point CUDA_HOME at a matching CUDA toolkit",
) -> None:
    wanted = image_cuda(versions)
    if wanted and headers and wanted.split(".")[0] != headers.split(".")[0]:
        raise ConfigError(
            f"{label} runs CUDA {wanted} (torch {versions['torch']}) but the extension's CUDA headers are "
            f"{headers}: {hint} (CUDA {wanted.split('.')[0]}) to build its cumem extension"
        )
