"""Parse a quilt series of ``git format-patch`` files with DEP-3 and Sm12x headers.

Parsing is pure and strict: a patch that names a path outside the tree, uses a git
feature the applier does not implement (renames, binary), or lacks a required header
is refused with its file and line, before anything is applied.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath

from .. import inputs
from ..errors import SeriesError
from .status import STATUS_KEY, UpstreamStatus, parse_status

REQUIRED = ("Description", "Origin", "Forwarded", "Applied-Upstream", "Last-Update", "Sm12x-Kind")
KNOWN = REQUIRED + ("Bug", "Sm12x-Builds", "Sm12x-Probe", STATUS_KEY, "Author", "Reviewed-by")
KINDS = ("python", "native")

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_HEADER = re.compile(r"^([A-Z][A-Za-z0-9-]*):\s?(.*)$")
_UNSUPPORTED = ("rename from", "rename to", "copy from", "copy to", "GIT binary patch", "Binary files")


@dataclass(frozen=True)
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: tuple[tuple[str, str], ...]  # (" " | "-" | "+", text without newline)
    line_no: int  # where the hunk starts in the patch file

    @property
    def old(self) -> list[str]:
        return [t for tag, t in self.lines if tag != "+"]

    @property
    def new(self) -> list[str]:
        return [t for tag, t in self.lines if tag != "-"]

    def reversed(self) -> Hunk:
        swap = {"+": "-", "-": "+", " ": " "}
        lines = tuple((swap[tag], t) for tag, t in self.lines)
        return Hunk(self.new_start, self.new_len, self.old_start, self.old_len, lines, self.line_no)


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative, posix, validated
    hunks: tuple[Hunk, ...]
    new_file: bool = False
    deleted: bool = False
    mode: int | None = None  # new file mode, when the patch says
    old_eof_newline: bool = True
    new_eof_newline: bool = True

    def reversed(self) -> FilePatch:
        return FilePatch(
            self.path,
            tuple(h.reversed() for h in self.hunks),
            new_file=self.deleted,
            deleted=self.new_file,
            mode=self.mode,
            old_eof_newline=self.new_eof_newline,
            new_eof_newline=self.old_eof_newline,
        )


@dataclass(frozen=True)
class Probe:
    """``PATH[::QUALNAME] ~ REGEX``: recognises a fix upstream wrote in its own way."""

    path: str
    qualname: str | None
    pattern: str


@dataclass(frozen=True)
class Patch:
    file: Path
    subject: str
    headers: dict[str, str]
    files: tuple[FilePatch, ...]
    probes: tuple[Probe, ...] = ()
    text: str = field(default="", repr=False)

    @property
    def id(self) -> str:
        """The file name without its number and suffix: ``cumem-stream-aware-free``."""
        return re.sub(r"^\d+-", "", self.file.name.removesuffix(".patch"))

    @property
    def kind(self) -> str:
        return self.headers["Sm12x-Kind"]

    @property
    def builds(self) -> str | None:
        return self.headers.get("Sm12x-Builds")

    @property
    def origin(self) -> str:
        return self.headers["Origin"]

    @property
    def paths(self) -> tuple[str, ...]:
        return tuple(f.path for f in self.files)

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def upstream(self) -> UpstreamStatus | None:
        """Where the fix stands upstream and when that was checked (None: the patch does not say)."""
        return parse_status(self.headers, str(self.file))


@dataclass(frozen=True)
class Series:
    file: Path
    patches: tuple[Patch, ...]

    @cached_property
    def sha256(self) -> str:
        """One digest over the series order and every patch's bytes."""
        h = hashlib.sha256()
        for p in self.patches:
            h.update(p.file.name.encode() + b"\0" + p.text.encode() + b"\0")
        return h.hexdigest()

    @property
    def paths(self) -> tuple[str, ...]:
        """Every file the series touches, in first-touched order."""
        seen: dict[str, None] = {}
        for p in self.patches:
            for path in p.paths:
                seen.setdefault(path, None)
        return tuple(seen)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(p.id for p in self.patches)


def safe_path(raw: str, where: str) -> str:
    """Validate a path from a patch: relative, no '..', no empty or odd components."""
    if raw.startswith("/") or "\\" in raw or "\0" in raw:
        raise SeriesError(f"{where}: path {raw!r} is absolute or malformed: refused")
    parts = PurePosixPath(raw).parts
    if not parts or any(p in ("..", ".", "") for p in raw.split("/")):
        raise SeriesError(f"{where}: path {raw!r} would leave the tree: refused")
    # No file system takes a name longer than 255 bytes, nor a path beyond PATH_MAX (4096);
    # vLLM's deepest file is a dozen folders down.
    if len(parts) > MAX_PATH_DEPTH or len(raw.encode("utf-8", "surrogateescape")) > MAX_PATH_BYTES:
        raise SeriesError(f"{where}: a path {len(parts)} folders deep and {len(raw)} characters long: refused "
                          f"(at most {MAX_PATH_DEPTH} folders and {MAX_PATH_BYTES} bytes)")
    if any(len(p.encode("utf-8", "surrogateescape")) > 255 for p in parts):
        raise SeriesError(f"{where}: path {raw[:60]!r}... has a name longer than 255 bytes: refused")
    return str(PurePosixPath(*parts))


MAX_PATH_DEPTH = 64
MAX_PATH_BYTES = 1024


def _strip_prefix(raw: str, prefix: str, where: str) -> str:
    raw = raw.split("\t", 1)[0]
    if raw == "/dev/null":
        return raw
    if not raw.startswith(prefix):
        raise SeriesError(f"{where}: expected a path starting with {prefix!r}, got {raw!r}")
    return raw[len(prefix) :]


def _headers(message: list[str], where: str) -> dict[str, str]:
    headers: dict[str, str] = {}
    last = None
    for line in message:
        if line.startswith(" ") and last:
            headers[last] += "\n" + line.strip()
            continue
        m = _HEADER.match(line)
        if not m or m.group(1) not in KNOWN:
            last = None
            continue
        key, value = m.group(1), m.group(2).strip()
        if key == "Sm12x-Probe":
            headers[key] = (headers[key] + "\n" + value) if key in headers else value
        else:
            headers[key] = value
        last = key
    missing = [k for k in REQUIRED if k not in headers]
    if missing:
        raise SeriesError(f"{where}: missing header(s) {', '.join(missing)}")
    if headers["Sm12x-Kind"] not in KINDS:
        raise SeriesError(f"{where}: Sm12x-Kind must be one of {', '.join(KINDS)}")
    if headers["Sm12x-Kind"] == "native" and "Sm12x-Builds" not in headers:
        raise SeriesError(f"{where}: a native patch needs Sm12x-Builds (the artifact it changes)")
    return headers


def parse_probes(specs: str, where: str) -> tuple[Probe, ...]:
    """Sm12x-Probe values, one a line (a patch's header, or a fix's ``upstream`` file)."""
    return _probes({"Sm12x-Probe": specs}, where)


def _probes(headers: dict[str, str], where: str) -> tuple[Probe, ...]:
    out = []
    for spec in filter(None, headers.get("Sm12x-Probe", "").split("\n")):
        target, sep, pattern = spec.partition(" ~ ")
        if not sep or not pattern:
            raise SeriesError(f"{where}: probe {spec!r} is not 'PATH[::QUALNAME] ~ REGEX'")
        path, _, qualname = target.strip().partition("::")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise SeriesError(f"{where}: probe regex {pattern!r} is invalid: {exc}") from None
        out.append(Probe(safe_path(path, where), qualname or None, pattern))
    return tuple(out)


def parse_patch(text: str, file: Path) -> Patch:
    lines = text.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("diff --git ")), None)
    if start is None:
        raise SeriesError(f"{file}: no 'diff --git' section: not a git format-patch file")
    subject = next((ln[len("Subject:") :].strip() for ln in lines[:start] if ln.startswith("Subject:")), "")
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
    headers = _headers(lines[:start], str(file))
    parse_status(headers, str(file))  # refused here, before anything is applied
    files = _file_patches(lines, start, file)
    return Patch(file, subject, headers, files, _probes(headers, str(file)), text)


def _file_patches(lines: list[str], start: int, file: Path) -> tuple[FilePatch, ...]:
    files: list[FilePatch] = []
    i = start
    while i < len(lines):
        if lines[i].startswith("diff --git "):
            fp, i = _one_file(lines, i, file)
            files.append(fp)
        elif lines[i] == "-- ":  # format-patch signature
            break
        else:
            i += 1
    paths = [f.path for f in files]
    if len(set(paths)) != len(paths):
        raise SeriesError(f"{file}: a file appears twice in one patch")
    return tuple(files)


def _one_file(lines: list[str], i: int, file: Path) -> tuple[FilePatch, int]:
    where = f"{file}:{i + 1}"
    new_file = deleted = False
    mode = None
    old = new = None
    i += 1
    while i < len(lines) and not lines[i].startswith(("@@", "diff --git ")):
        line = lines[i]
        if line.startswith(_UNSUPPORTED):
            raise SeriesError(f"{file}:{i + 1}: {line.split(' ')[0]} patches are not supported")
        if line.startswith(("old mode ", "new mode ")):
            _mode(line, f"{file}:{i + 1}")  # a symlink's is refused as such, before the change itself
            raise SeriesError(f"{file}:{i + 1}: mode changes (old mode/new mode) are not supported")
        if line.startswith("new file mode "):
            new_file, mode = True, _mode(line, f"{file}:{i + 1}")
        elif line.startswith("deleted file mode "):
            deleted = True
            _mode(line, f"{file}:{i + 1}")
        elif line.startswith("index ") and len(line.split()) == 3:
            _mode(line, f"{file}:{i + 1}")  # "index a..b 100644": the mode of a file left in place
        elif line.startswith("--- "):
            old = _strip_prefix(line[4:], "a/", f"{file}:{i + 1}")
        elif line.startswith("+++ "):
            new = _strip_prefix(line[4:], "b/", f"{file}:{i + 1}")
        i += 1
    if old is None or new is None:
        raise SeriesError(f"{where}: file section without ---/+++ lines (mode-only changes are not supported)")
    if old != "/dev/null" and new != "/dev/null" and old != new:
        raise SeriesError(f"{where}: renames are not supported ({old} -> {new})")
    path = safe_path(new if new != "/dev/null" else old, where)
    hunks, i, eof = _hunks(lines, i, file)
    return FilePatch(path, hunks, new_file, deleted, mode, eof[0], eof[1]), i


# The only modes git gives a regular file; anything else is a link or a submodule, which the
# applier would write as a regular file (a symlink's 120000 as mode 0000).
REGULAR_MODES = (0o100644, 0o100755)
_MODE_WORDS = {0o120000: "a symbolic link", 0o160000: "a submodule (gitlink)", 0o040000: "a folder"}


def _mode(line: str, where: str) -> int:
    try:
        mode = int(line.split()[-1], 8)
    except ValueError:
        raise SeriesError(f"{where}: {line!r} does not end in an octal file mode") from None
    if mode not in REGULAR_MODES:
        what = _MODE_WORDS.get(mode, "not a regular file's mode")
        raise SeriesError(
            f"{where}: mode {mode:06o} ({what}) is refused: a patch may only add or change regular files "
            "(100644, 100755)"
        )
    return mode


def _hunks(lines: list[str], i: int, file: Path):
    hunks: list[Hunk] = []
    old_eof = new_eof = True
    while i < len(lines) and lines[i].startswith("@@"):
        m = _HUNK.match(lines[i])
        if not m:
            raise SeriesError(f"{file}:{i + 1}: malformed hunk header")
        o_start, o_len = int(m.group(1)), int(m.group(2) or 1)
        n_start, n_len = int(m.group(3)), int(m.group(4) or 1)
        header_line = i + 1
        body: list[tuple[str, str]] = []
        i += 1
        o_seen = n_seen = 0
        while o_seen < o_len or n_seen < n_len:
            if i >= len(lines):
                raise SeriesError(f"{file}:{header_line}: hunk ends early")
            line = lines[i]
            tag = line[:1] if line else " "
            if tag not in " -+":
                raise SeriesError(f"{file}:{i + 1}: unexpected line in hunk: {line[:40]!r}")
            body.append((tag, line[1:]))
            o_seen += tag != "+"
            n_seen += tag != "-"
            i += 1
            if i < len(lines) and lines[i].startswith("\\ No newline"):
                if tag in " -":
                    old_eof = False
                if tag in " +":
                    new_eof = False
                i += 1
        hunks.append(Hunk(o_start, o_len, n_start, n_len, tuple(body), header_line))
    return tuple(hunks), i, (old_eof, new_eof)


# A series names a few patches; the largest shipped patch is 83 KB. Files are read only up
# to these sizes (and never a FIFO or a device: inputs.read_bounded), so no series can hang.
MAX_SERIES_BYTES = inputs.MIB
MAX_PATCH_BYTES = 16 * inputs.MIB


def load_series(series_file: Path) -> Series:
    """Read a series file and every patch it names, in order (none is allowed)."""
    data = inputs.read_bounded(series_file, MAX_SERIES_BYTES, SeriesError, "series")
    entries = inputs.decode_utf8(data, SeriesError, series_file).splitlines()
    patches = []
    for n, raw in enumerate(entries, 1):
        name = raw.split("#", 1)[0].strip().split()[0] if raw.split("#", 1)[0].strip() else ""
        if not name:
            continue
        path = series_file.parent / name
        if "\0" in name or not name.endswith((".patch", ".diff")) and not os.path.lexists(path):
            # Not a patch's name, nor a file: this is no series (a key, a config, a binary);
            # what the line holds is not repeated, in case it is a secret.
            raise SeriesError(f"{series_file}:{n}: not a series: a series names one patch file a line "
                              "(a name ending in .patch), and this line names no file")
        safe_path(name, f"{series_file}:{n}")
        try:
            data = inputs.read_bounded(path, MAX_PATCH_BYTES, SeriesError, "patch")
        except SeriesError as exc:
            raise SeriesError(f"{series_file}:{n}: {exc}") from None
        patches.append(parse_patch(inputs.decode_utf8(data, SeriesError, path), path))
    # No patches is a lane that carries nothing (every fix landed, or none written yet).
    ids = [p.id for p in patches]
    if len(set(ids)) != len(ids):
        raise SeriesError(f"{series_file}: two patches share an id")
    return Series(series_file, tuple(patches))
