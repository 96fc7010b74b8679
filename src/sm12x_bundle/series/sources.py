"""What a fix keeps once, for every lane, and the parts of each lane's patch derived from it.

A lane's patch ``patches/<version>/NNNN-<fix>.patch`` draws on ``patches/fixes/<fix>/``:

- ``new/``: every file under it is a file the fix adds, at the same path relative to the
  folder; the patch carries it as a ``new file`` section in the form ``git format-patch``
  writes. ``regenerate`` rewrites those sections from it and leaves every other section
  (the hunks into upstream files) and the order as they are.
- ``upstream``: the fix's upstream metadata, the DEP-3 lines Origin, Bug, Forwarded,
  Applied-Upstream and the Sm12x-Probe lines. ``with_upstream`` writes them into the
  patch's header (after Description; the probes last) and leaves Description, Last-Update,
  Sm12x-Kind and Sm12x-Builds, which say what that lane's patch changes, as they are.

The series stays a plain quilt / ``git am`` series. ``bin/regenerate`` runs both on every
lane's patch; ``tests/test_generated.py`` fails while a patch and its fix's folder or file differ.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import SeriesError
from .status import STATUS_KEY, parse_status

_DIFF = "diff --git a/"
_SIGNATURE = "-- \n"
_LINE = re.compile(r"[^\n]*\n|[^\n]+\Z")


def _lines(text: str) -> list[str]:
    """Lines with their ends, split at newlines only (str.splitlines also splits at form feeds)."""
    return _LINE.findall(text)


def fix_id(patch: Path) -> str:
    """``0004-triton-sparse-mla-fallback.patch`` -> ``triton-sparse-mla-fallback``."""
    return re.sub(r"^\d+-", "", patch.name.removesuffix(".patch"))


def fix_folder(patch: Path) -> Path:
    """``patches/fixes/<fix>/`` of a lane's patch ``patches/<version>/NNNN-<fix>.patch``."""
    return patch.parent.parent / "fixes" / fix_id(patch)


def source_folder(patch: Path) -> Path | None:
    """The folder of new files the fix of ``patch`` adds, kept as source, if it has one.

    A lane's patch lives in ``patches/<version>/``; the files it adds live once, in
    ``patches/fixes/<fix>/new/``, shared by every lane that carries the fix.
    """
    folder = fix_folder(patch) / "new"
    return folder if folder.is_dir() else None


def source_files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder``, by its path in the tree, in sorted order."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in files}


def new_file_section(path: str, data: bytes) -> str:
    """The section ``git format-patch`` writes for a new file ``path`` holding ``data``."""
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()[:7]
    head = [f"diff --git a/{path} b/{path}\n", "new file mode 100644\n", f"index 0000000..{blob}\n"]
    if not data:
        return "".join(head)
    lines = _lines(data.decode())
    body = ["+" + line for line in lines]
    if not body[-1].endswith("\n"):
        body[-1] += "\n\\ No newline at end of file\n"
    return "".join(head + ["--- /dev/null\n", f"+++ b/{path}\n", f"@@ -0,0 +{_range(len(lines))} @@\n"] + body)


def _range(count: int) -> str:
    return "1" if count == 1 else f"1,{count}"  # as diff writes a one-line range


@dataclass
class _Mail:
    head: str  # the mail up to the first section
    sections: list[tuple[str, str]]  # (path, text) in the patch's order
    tail: str  # the signature, if any

    @classmethod
    def parse(cls, text: str) -> _Mail:
        lines = _lines(text)
        end = _signature_at(lines)
        starts = [i for i in range(end) if lines[i].startswith(_DIFF)]
        bounds = starts + [end]
        sections = [(_path(lines[a]), "".join(lines[a:b])) for a, b in zip(bounds, bounds[1:])]
        return cls("".join(lines[:bounds[0]]), sections, "".join(lines[end:]))

    def replace(self, path: str, section: str) -> None:
        paths = [p for p, _ in self.sections]
        if path not in paths:
            at = next((i for i, p in enumerate(paths) if p > path), len(paths))
            self.sections.insert(at, (path, section))
        elif _lines(self.sections[paths.index(path)][1])[1:2] == ["new file mode 100644\n"]:
            self.sections[paths.index(path)] = (path, section)
        else:
            raise SeriesError(f"{path} is kept as source beside the patch, but the patch changes it "
                              "instead of adding it")

    def render(self) -> str:
        return self.head + "".join(text for _, text in self.sections) + self.tail


def _signature_at(lines: list[str]) -> int:
    """Where the mail's signature ("-- " and git's version) starts, or the end."""
    at = max((i for i, line in enumerate(lines) if line == _SIGNATURE), default=len(lines))
    hunk_line = tuple(" +-@\\")  # then "-- " was a hunk's removed "- " line
    return len(lines) if any(line.startswith(hunk_line) for line in lines[at + 1:]) else at


def _path(diff_line: str) -> str:
    return diff_line[len(_DIFF):].rstrip("\n").split(" b/", 1)[0]


def regenerate(patch_text: str, files: dict[str, bytes]) -> str:
    """``patch_text`` with the section of each of ``files`` rewritten from its bytes.

    A section already in the patch is replaced where it stands; a file the patch does
    not carry yet is inserted before the first section whose path sorts after it. A file
    the patch modifies rather than adds is refused (SeriesError).
    """
    mail = _Mail.parse(patch_text)
    for path, data in files.items():
        mail.replace(path, new_file_section(path, data))
    return mail.render()


# --- upstream metadata ---------------------------------------------------------

UPSTREAM_KEYS = ("Origin", "Bug", "Forwarded", "Applied-Upstream", STATUS_KEY, "Sm12x-Probe")
_FIELD = re.compile(r"([A-Z][A-Za-z0-9-]*):")


def upstream_file(patch: Path) -> Path:
    """``patches/fixes/<fix>/upstream``: the fix's upstream metadata, kept once."""
    return fix_folder(patch) / "upstream"


def _fields(lines: list[str], where: str) -> list[tuple[str, list[str]]]:
    """DEP-3 fields: (key, the field's lines with its continuation lines)."""
    fields: list[tuple[str, list[str]]] = []
    for n, line in enumerate(lines, 1):
        key = _FIELD.match(line)
        if key:
            fields.append((key.group(1), [line]))
        elif line.startswith(" ") and fields:
            fields[-1][1].append(line)
        else:
            raise SeriesError(f"{where}:{n}: expected a 'Key: value' line or a continuation line, not {line!r}")
    return fields


def read_upstream(path: Path) -> list[tuple[str, list[str]]]:
    """The fields of a fix's ``upstream`` file: only the upstream keys, Origin and Forwarded required."""
    try:
        text = path.read_bytes().decode()
    except OSError as exc:
        raise SeriesError(f"cannot read {path}: {exc.strerror}") from None
    fields = _fields(_lines(text), str(path))
    keys = [k for k, _ in fields]
    stray = [k for k in keys if k not in UPSTREAM_KEYS]
    if stray:
        raise SeriesError(f"{path}: {stray[0]} is not upstream metadata (only {', '.join(UPSTREAM_KEYS)})")
    missing = [k for k in ("Origin", "Forwarded", "Applied-Upstream", STATUS_KEY) if k not in keys]
    if missing:
        raise SeriesError(f"{path}: missing {', '.join(missing)}")
    parse_status(_as_headers(fields), str(path))  # the status agrees with Applied-Upstream and names every reference
    return fields


def _as_headers(fields: list[tuple[str, list[str]]]) -> dict[str, str]:
    """The fields as a patch's headers hold them: continuation lines joined by newlines."""
    return {key: "\n".join(line.partition(":")[2].strip() if i == 0 else line.strip() for i, line in enumerate(lines))
            for key, lines in fields}


def with_upstream(patch_text: str, upstream: list[tuple[str, list[str]]], where: str = "patch") -> str:
    """``patch_text`` with its upstream header lines replaced by ``upstream``'s.

    The header block runs from the line after the mail's first blank line to ``---``. The
    upstream fields other than the probes go right after Description, the probes last."""
    lines = _lines(patch_text)
    start = lines.index("\n") + 1
    end = lines.index("---\n", start)
    kept = [(k, v) for k, v in _fields(lines[start:end], where) if k not in UPSTREAM_KEYS]
    probes = [(k, v) for k, v in upstream if k == "Sm12x-Probe"]
    others = [(k, v) for k, v in upstream if k != "Sm12x-Probe"]
    after = next((i + 1 for i, (k, _) in enumerate(kept) if k == "Description"), 0)
    block = kept[:after] + others + kept[after:] + probes
    return "".join(lines[:start] + [line for _, v in block for line in v] + lines[end:])


def _with_fix(patch: Path, text: str) -> str:
    """``text`` with every part the patch draws from ``patches/fixes/<fix>/`` rewritten."""
    folder = source_folder(patch)
    if folder is not None:
        text = regenerate(text, source_files(folder))
    upstream = upstream_file(patch)
    if upstream.is_file():
        text = with_upstream(text, read_upstream(upstream), str(patch))
    return text


def refreshed(patch: Path) -> bytes:
    """``patch``'s bytes in step with its fix's ``new/`` folder and ``upstream`` file."""
    return _with_fix(patch, patch.read_bytes().decode()).encode()


def refresh(patch: Path, check: bool = False) -> bool:
    """Bring ``patch`` in step with its fix's ``new/`` folder and ``upstream`` file; True
    when it already was.

    With ``check``, only compare. The patch is rewritten only when its bytes change.
    """
    new = refreshed(patch)
    if new == patch.read_bytes():
        return True
    if not check:
        patch.write_bytes(new)
    return False
