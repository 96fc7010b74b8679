"""The offline vLLM payload for a GPU machine that has no network.

Such a machine receives files only inside the repository's working tree, at most
64 MiB a call (docs/gpu-machine.md). ``build`` fetches the wheels pinned in
data/gpu-payload.json into the cache (each verified by sha256 on the way in and on
every use), leaves out of vLLM's wheel what a dense Llama engine never loads, lays
every wheel out as one site folder, and packs that as a tar.xz whose bytes depend on
nothing but the wheels (sorted names, fixed mtimes, owners and modes), split into
parts that each fit one call. ``unpack`` runs there with the standard library alone:
it checks every part and the whole against the manifest before it writes anything,
then unpacks the site folder with the rules the tool applies to sdists
(source/extract.py).
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import re
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata, resources
from pathlib import Path

from .. import fsutil
from ..errors import ConfigError, FetchError, VerifyError
from ..progress import Progress
from ..source import extract, fetch
from ..source import index as index_mod

DATA = "data/gpu-payload.json"
MANIFEST = "manifest.json"
FORMAT = "sm12x-bundle gpu payload 1"
TOP = "site"  # the one top-level folder of the archive; unpack makes DEST of it
PART_MIB = 50  # 64 MiB a call, less the repository (~2.5 MB) and some room
_CHUNK = 1 << 20
# A wheel's file name: {distribution}-{version}(-{build})?-{python}-{abi}-{platform}.whl
_WHEEL = re.compile(r"^(?P<dist>[A-Za-z0-9_.]+)-(?P<version>[^-]+)(-\d[^-]*)?-[^-]+-[^-]+-[^-]+\.whl$")


def project_name(name: str) -> str:
    """PEP 503's normal form: the project's name on the index."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Wheel:
    filename: str
    sha256: str

    @property
    def project(self) -> str:
        return project_name(_WHEEL.match(self.filename)["dist"])

    @property
    def version(self) -> str:
        return _WHEEL.match(self.filename)["version"]


@dataclass(frozen=True)
class Drop:
    """A file of vLLM's wheel (or a folder, written with a trailing '/') left out, and why."""

    path: str
    why: str

    def covers(self, path: str) -> bool:
        return path.startswith(self.path) if self.path.endswith("/") else path == self.path


@dataclass(frozen=True)
class Pins:
    """data/gpu-payload.json, checked."""

    index: str
    vllm: Wheel
    dependencies: tuple[Wheel, ...]
    drops: tuple[Drop, ...]
    device_packages: frozenset[str]
    left_out: Mapping[str, str] = field(default_factory=dict)
    overridden: Mapping[str, str] = field(default_factory=dict)

    @property
    def wheels(self) -> tuple[Wheel, ...]:
        return (self.vllm, *self.dependencies)

    @property
    def name(self) -> str:
        return f"vllm-{self.vllm.version}-gpu-payload"


def load_pins(text: str | None = None, origin: str = DATA) -> Pins:
    """The shipped pins (or ``text``), each entry checked; a bad one is a ConfigError naming it."""
    if text is None:
        text = resources.files("sm12x_bundle").joinpath(DATA).read_text("utf-8")
    try:
        doc = json.loads(text)
        wheels = [_wheel(doc["vllm"], f"{origin}: vllm")]
        wheels += [_wheel(w, f"{origin}: dependencies[{n}]") for n, w in enumerate(doc["dependencies"])]
        drops = tuple(Drop(d["path"], d["why"]) for d in doc["drop"])
        pins = Pins(doc["index"], wheels[0], tuple(wheels[1:]), drops,
                    frozenset(project_name(p) for p in doc["device_packages"]),
                    {project_name(k): v for k, v in doc.get("left_out", {}).items()},
                    {project_name(k): v for k, v in doc.get("overridden", {}).items()})
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{origin}: malformed ({type(exc).__name__}: {exc})") from None
    twice = sorted({w.project for w in wheels if [v.project for v in wheels].count(w.project) > 1})
    if twice:
        raise ConfigError(f"{origin}: {', '.join(twice)} pinned more than once")
    return pins


def _wheel(entry: Mapping, where: str) -> Wheel:
    filename, sha = entry["filename"], entry["sha256"]
    if not _WHEEL.match(filename):
        raise ConfigError(f"{where}: filename {filename!r} is not a wheel's file name")
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise ConfigError(f"{where}: sha256 of {filename} is not 64 hex digits")
    return Wheel(filename, sha)


# --- fetching ---------------------------------------------------------------------------


def fetch_wheel(cache: Path, wheel: Wheel, index: str, progress: Progress | None = None) -> Path:
    """The wheel from the cache (``<cache>/wheels/<sha256>/``), else from the index; the
    bytes must match the pin either way."""
    found = fetch.cached_file(cache, wheel.sha256, wheel.filename, folder="wheels", progress=progress)
    if found is not None:
        return found
    url, listed = index_mod.find_file(index, wheel.project, wheel.filename)
    if listed and listed != wheel.sha256:
        raise FetchError(f"the index lists sha256 {listed} for {wheel.filename}, but {DATA} pins "
                         f"{wheel.sha256}: refusing to download")
    return fetch.download(url, wheel.sha256, cache, wheel.filename, progress=progress, folder="wheels")


# --- the site folder: which wheel member goes where -------------------------------------


@dataclass(frozen=True)
class Entry:
    """One file of the archive: its path under the top folder, and where its bytes are (a
    wheel's member, a file on disk, or bytes in memory: a patched file)."""

    path: str
    size: int
    executable: bool
    source: Path | None = None  # the wheel (with member) or the file
    member: str | None = None
    data: bytes | None = None

    def open(self, wheels: dict[Path, zipfile.ZipFile]):
        if self.data is not None:
            return io.BytesIO(self.data)
        if self.member is None:
            return open(self.source, "rb")
        zf = wheels.get(self.source) or wheels.setdefault(self.source, zipfile.ZipFile(self.source))
        return zf.open(self.member)


@dataclass
class Left:
    """What a rule kept out of the site folder: how many files, how many bytes."""

    path: str
    why: str
    files: int = 0
    bytes: int = 0

    def to_dict(self) -> dict:
        return {"path": self.path, "files": self.files, "bytes": self.bytes, "why": self.why}


_DATA_KEPT = ("purelib", "platlib")  # a wheel's .data folders that belong in site-packages


def site_path(member: str) -> str | None:
    """Where a wheel member goes in the site folder (None: not installed there, e.g. scripts)."""
    first, _, rest = member.partition("/")
    if not first.endswith(".data"):
        return member
    scheme, _, inner = rest.partition("/")
    return inner if scheme in _DATA_KEPT and inner else None


def _unsafe_member(info: zipfile.ZipInfo) -> bool:
    """An absolute path, a '..', a backslash, or a symlink (a zip stores its mode in external_attr)."""
    name = info.filename
    link = (info.external_attr >> 16) & 0o170000 == 0o120000
    return link or name.startswith("/") or "\\" in name or ".." in name.split("/")


def plan_site(pins: Pins, wheels: Mapping[str, Path]) -> tuple[list[Entry], list[Left]]:
    """Every file of the site folder, sorted, and what was left out (the drops, then the
    wheels' scripts and data)."""
    drops = [Left(d.path, d.why) for d in pins.drops]
    scripts = Left("<wheel>.data/{scripts,headers,data}/", "not importable: a site folder on PYTHONPATH has no use for them")
    files: dict[str, Entry] = {}
    for wheel in pins.wheels:
        for info in _members(wheels[wheel.filename]):
            path = site_path(info.filename)
            rule = scripts if path is None else _dropped_by(pins, wheel, path, drops)
            if rule is not None:
                rule.files, rule.bytes = rule.files + 1, rule.bytes + info.file_size
            elif path in files:
                raise VerifyError(f"{wheel.filename} and {files[path].source.name} both hold {path}: the payload would depend on their order")
            else:
                executable = bool((info.external_attr >> 16) & 0o111)
                files[path] = Entry(path, info.file_size, executable, wheels[wheel.filename], info.filename)
    unmatched = [d.path for d in drops if not d.files]
    if unmatched:
        raise ConfigError(f"{DATA}: drop {unmatched[0]!r} matches nothing in {pins.vllm.filename}")
    return [files[p] for p in sorted(files)], drops + ([scripts] if scripts.files else [])


def _dropped_by(pins: Pins, wheel: Wheel, path: str, drops: list[Left]) -> Left | None:
    """The drop rule that keeps ``path`` out (drops apply to vLLM's wheel only)."""
    if wheel is not pins.vllm:
        return None
    return next((left for left, drop in zip(drops, pins.drops) if drop.covers(path)), None)


def _members(path: Path) -> list[zipfile.ZipInfo]:
    try:
        with zipfile.ZipFile(path) as zf:
            infos = [i for i in zf.infolist() if not i.is_dir()]
    except (zipfile.BadZipFile, OSError) as exc:
        raise VerifyError(f"{path.name} is not a readable wheel: {exc}") from None
    bad = [i.filename for i in infos if _unsafe_member(i)]
    if bad:
        raise VerifyError(f"{path.name}: member {bad[0]!r} is a link or has an absolute path, a '..' or a '\\': refusing it")
    return infos


# --- packing: a deterministic tar.xz, written straight into parts -----------------------


@dataclass(frozen=True)
class Part:
    name: str
    size: int
    sha256: str

    def to_dict(self) -> dict:
        return {"name": self.name, "size": self.size, "sha256": self.sha256}


class PartWriter:
    """A file-like sink that cuts what it is given into files of ``limit`` bytes each,
    hashing every part and the whole on the way."""

    def __init__(self, folder: Path, name: str, limit: int):
        self.folder, self.name, self.limit = folder, name, limit
        self.parts: list[Part] = []
        self.whole = hashlib.sha256()
        self.size = 0
        self._fh = None
        self._hash = hashlib.sha256()
        self._filled = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        while view:
            if self._fh is None:
                self._open()
            take = min(len(view), self.limit - self._filled)
            chunk = view[:take]
            self._fh.write(chunk)
            self._hash.update(chunk)
            self.whole.update(chunk)
            self._filled += take
            self.size += take
            view = view[take:]
            if self._filled == self.limit:
                self._close()
        return len(data)

    def _open(self) -> None:
        self._fh = open(self.folder / f"{self.name}.{len(self.parts) + 1:02d}", "wb")
        self._hash, self._filled = hashlib.sha256(), 0

    def _close(self) -> None:
        self._fh.close()
        self.parts.append(Part(Path(self._fh.name).name, self._filled, self._hash.hexdigest()))
        self._fh = None

    def close(self) -> None:
        if self._fh is not None:
            self._close()

    def flush(self) -> None:
        pass


def _tarinfo(name: str, size: int = 0, executable: bool = False, folder: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE if folder else tarfile.REGTYPE
    info.size = 0 if folder else size
    info.mode = 0o755 if folder or executable else 0o644
    info.mtime = fsutil.MARKER_MTIME
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _folders(files: Iterable[Entry]) -> list[str]:
    """Every folder that holds a file."""
    found = set()
    for f in files:
        parts = f.path.split("/")[:-1]
        found.update("/".join(parts[: n + 1]) for n in range(len(parts)))
    return sorted(found)


def pack(files: list[Entry], top: str, writer: PartWriter, progress: Progress) -> None:
    """Write ``top``/ and every folder and file under it, sorted by name, as a tar.xz (xz -9)
    into ``writer``."""
    task = progress.task(f"packing {top}/ (xz -9)", sum(f.size for f in files))
    entries = sorted([(folder, None) for folder in _folders(files)] + [(f.path, f) for f in files])
    opened: dict[Path, zipfile.ZipFile] = {}
    try:
        with lzma.LZMAFile(writer, "wb", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9) as xz, \
                tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
            tar.addfile(_tarinfo(top, folder=True))
            for name, f in entries:
                if f is None:
                    tar.addfile(_tarinfo(f"{top}/{name}", folder=True))
                    continue
                with f.open(opened) as src:
                    tar.addfile(_tarinfo(f"{top}/{name}", f.size, f.executable), src)
                task.advance(f.size)
    finally:
        for zf in opened.values():
            zf.close()
    writer.close()
    task.done()


def write_parts(out: Path, name: str, top: str, files: list[Entry], part_mib: int, progress: Progress,
                about: Mapping, force: bool = False) -> dict:
    """Pack ``files`` into ``out`` (replaced whole) as parts of ``name``.tar.xz, with
    manifest.json: the parts, the whole, and ``about`` (what the archive holds)."""
    with fsutil.replace_dir(out, force, "payload folder") as staging:
        writer = PartWriter(staging, f"{name}.tar.xz", part_mib << 20)
        pack(files, top, writer, progress)
        manifest = {
            "format": FORMAT,
            "name": name,
            "top": top,
            "archive": {"name": f"{name}.tar.xz", "size": writer.size, "sha256": writer.whole.hexdigest()},
            "parts": [p.to_dict() for p in writer.parts],
            "content": {"files": len(files), "bytes": sum(f.size for f in files)},
            **about,
        }
        fsutil.write_file(staging / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return manifest


# --- build ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    manifest: dict
    out: Path


def build(out: Path, cache: Path, *, part_mib: int = PART_MIB, pins: Pins | None = None,
          index: str | None = None, progress: Progress | None = None, force: bool = False) -> Built:
    """Fetch, slim, pack and split; ``out`` holds the parts and manifest.json afterwards."""
    progress = progress or Progress.stderr()
    pins = pins or load_pins()
    fsutil.check_replaceable(out, force, "payload folder")
    index = index or index_mod.index_url(pins.index)
    wheels = {w.filename: fetch_wheel(cache, w, index, progress) for w in pins.wheels}
    files, left = plan_site(pins, wheels)
    about = {
        "wheels": [{"filename": w.filename, "sha256": w.sha256, "size": wheels[w.filename].stat().st_size}
                   for w in pins.wheels],
        "left_out": [x.to_dict() for x in left],
    }
    return Built(write_parts(out, pins.name, TOP, files, part_mib, progress, about, force), out)


def figures(manifest: Mapping) -> list[str]:
    """The sizes, for the operator: each wheel, what was left out, the site, the parts."""
    mb = lambda n: f"{n / 1e6:,.1f} MB"  # noqa: E731
    lines = [f"  {w['filename']}: {mb(w['size'])}" for w in manifest.get("wheels", [])]
    if "wheels" in manifest:
        lines.append(f"wheels together: {mb(sum(w['size'] for w in manifest['wheels']))}")
    lines += [f"left out: {x['path']}: {x['files']} files, {mb(x['bytes'])}" for x in manifest.get("left_out", [])]
    lines.append(f"{manifest['top']}/: {manifest['content']['files']} files, {mb(manifest['content']['bytes'])}")
    lines.append(f"packed (tar | xz -9): {mb(manifest['archive']['size'])}, sha256 {manifest['archive']['sha256']}")
    lines += [f"  {p['name']}: {mb(p['size'])} ({p['size'] / (1 << 20):.1f} MiB)" for p in manifest["parts"]]
    lines.append(f"parts: {len(manifest['parts'])}")
    return lines


# --- unpack (standard library only: runs on the GPU machine) ----------------------------


def read_manifest(parts_dir: Path) -> dict:
    path = parts_dir / MANIFEST
    try:
        manifest = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        raise VerifyError(f"{path} is missing: {parts_dir} is not a folder that 'gpu-payload build' wrote") from None
    except (OSError, ValueError) as exc:
        raise VerifyError(f"{path} cannot be read as a payload manifest: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise VerifyError(f"{path} is not a payload manifest of this tool ({FORMAT!r})")
    try:
        archive, parts = manifest["archive"], manifest["parts"]
        shape_ok = (isinstance(manifest["top"], str) and isinstance(manifest["content"], dict)
                    and all(isinstance(archive[k], t) for k, t in (("name", str), ("size", int), ("sha256", str)))
                    and parts and all(isinstance(p["name"], str) and "/" not in p["name"] and isinstance(p["size"], int)
                                      and isinstance(p["sha256"], str) for p in parts))
    except (KeyError, TypeError):
        shape_ok = False
    if not shape_ok:
        raise VerifyError(f"{path} lacks a field a payload manifest has (top, content, archive, parts): "
                          "write it again with 'gpu-payload build' or 'gpu-payload trees'")
    return manifest


def join_parts(parts_dir: Path, manifest: Mapping, into, progress: Progress) -> None:
    """Copy the parts, in order, into the open file ``into``, checking each part's size and
    sha256 and the whole's; the first missing or differing part raises VerifyError."""
    missing = [p["name"] for p in manifest["parts"] if not (parts_dir / p["name"]).is_file()]
    if missing:
        raise VerifyError(f"part {missing[0]} is missing from {parts_dir} ({len(missing)} of "
                          f"{len(manifest['parts'])} missing): send every part, then unpack; nothing was unpacked")
    whole = hashlib.sha256()
    task = progress.task("checking the parts", manifest["archive"]["size"])
    for part in manifest["parts"]:
        got = _copy_hashed(parts_dir / part["name"], into, whole, task)
        if got != (part["size"], part["sha256"]):
            raise VerifyError(f"part {part['name']} has {got[0]} bytes with sha256 {got[1]}, not the manifest's "
                              f"{part['size']} bytes with sha256 {part['sha256']}: nothing was unpacked")
    if whole.hexdigest() != manifest["archive"]["sha256"]:
        raise VerifyError(f"the joined parts have sha256 {whole.hexdigest()}, not the manifest's "
                          f"{manifest['archive']['sha256']}: nothing was unpacked")
    task.done()


def _copy_hashed(path: Path, into, whole, task) -> tuple[int, str]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            h.update(block)
            whole.update(block)
            into.write(block)
            size += len(block)
            task.advance(len(block))
    return size, h.hexdigest()


def unpack(parts_dir: Path, dest: Path, *, progress: Progress | None = None, force: bool = False) -> dict:
    """Check every part, then unpack the site folder as ``dest``; return the manifest."""
    progress = progress or Progress.stderr()
    manifest = read_manifest(parts_dir)
    fsutil.check_replaceable(dest, force, "payload folder")
    with tempfile.TemporaryDirectory(prefix="gpu-payload-") as tmp:
        archive = Path(tmp) / manifest["archive"]["name"]
        with open(archive, "wb") as into:
            join_parts(parts_dir, manifest, into, progress)
        with fsutil.replace_dir(dest, force, "payload folder") as staging:
            _extract(archive, manifest.get("top", TOP), staging, progress)
    return manifest


def _extract(archive: Path, top: str, staging: Path, progress: Progress) -> None:
    """Unpack ``archive`` (its bytes already checked) and move its top folder's content up."""
    try:
        with tarfile.open(archive, "r:xz") as tar:
            members = extract.check_members(tar, archive.name)
            odd = [m.name for m in members if not (m.isfile() or m.isdir())]
            if odd or members[0].name != top:
                raise VerifyError(f"{archive.name} holds {odd[0] if odd else members[0].name!r}: "
                                  f"a payload holds only files and folders under {top}/; nothing was unpacked")
            task = progress.task("unpacking", len(members))
            for member in members:
                extract.extract_member(tar, member, staging)
                task.advance(1)
            task.done()
    except FetchError as exc:
        raise VerifyError(f"{exc}; nothing was unpacked") from None
    except (tarfile.TarError, lzma.LZMAError, EOFError) as exc:
        raise VerifyError(f"{archive.name} is not a readable tar.xz ({exc}); nothing was unpacked") from None
    for child in (staging / top).iterdir():
        os.replace(child, staging / child.name)
    (staging / top).rmdir()


# --- requirements: is every Requires-Dist met by the payload, the machine, or a reason? --

# The GPU machine's interpreter, for evaluating Requires-Dist markers (PEP 508).
TARGET_ENV = {
    "python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "platform_machine": "x86_64", "platform_system": "Linux",
    "sys_platform": "linux", "os_name": "posix", "extra": "",
}


@dataclass(frozen=True)
class Unmet:
    wheel: str
    requirement: str
    why: str

    def __str__(self) -> str:
        return f"{self.wheel}: {self.requirement}: {self.why}"


def requires_dist(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        text = zf.read(name).decode("utf-8")
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def unmet_requirements(pins: Pins, requirements: Mapping[str, list[str]],
                       installed: Mapping[str, str] | None = None) -> list[Unmet]:
    """Each requirement (wheel file name -> its Requires-Dist) that applies on the GPU
    machine and is met neither by a payload wheel, nor by a package the machine holds
    (``installed``: name -> version; None: the names in device_packages, any version),
    nor by a reason in left_out (or, for a version the payload pins differently, overridden)."""
    from packaging.requirements import Requirement  # only where wheels are checked, never on unpack

    payload = {w.project: w.version for w in pins.wheels}
    unmet = []
    for wheel, lines in requirements.items():
        for line in lines:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(TARGET_ENV):
                continue
            why = _unmet(project_name(req.name), req.specifier, pins, payload, installed)
            if why:
                unmet.append(Unmet(wheel, line, why))
    return unmet


def _unmet(name: str, spec, pins: Pins, payload: Mapping[str, str], installed: Mapping[str, str] | None) -> str | None:
    if name in payload:
        fits = spec.contains(payload[name], prereleases=True) or name in pins.overridden
        return None if fits else f"the payload pins {name} {payload[name]}"
    if name in pins.left_out:
        return None
    if installed is None:
        return None if name in pins.device_packages else "neither in the payload nor on the GPU machine, and no reason in left_out"
    if name not in installed:
        return "not installed here"
    return None if spec.contains(installed[name], prereleases=True) else f"{name} {installed[name]} is installed here"


def installed_versions(site: Path) -> dict[str, str]:
    """name -> version of every distribution this Python finds with ``site`` first."""
    found: dict[str, str] = {}
    for dist in metadata.distributions(path=[str(site), *sys.path]):
        found.setdefault(project_name(dist.metadata["Name"] or ""), dist.version)
    return found


def site_requirements(site: Path) -> dict[str, list[str]]:
    """dist-info folder name -> its Requires-Dist, for every distribution unpacked in ``site``."""
    out = {}
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        lines = meta.read_text("utf-8").splitlines()
        out[meta.parent.name] = [x.split(":", 1)[1].strip() for x in lines if x.startswith("Requires-Dist:")]
    return out
