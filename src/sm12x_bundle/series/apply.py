"""Apply unified-diff hunks in memory, the way ``patch -p1 -F0`` would.

Working in memory lets ``check`` classify every patch without copying a tree, lets
``apply`` fail before it writes anything, and gives conflict reports the exact lines
that differ. Nothing here touches the disk except reading the pristine tree.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import inputs
from ..errors import SeriesError
from .patch import FilePatch, Hunk


@dataclass
class FileText:
    lines: list[str]
    eof_newline: bool = True
    mode: int = 0o644

    @classmethod
    def parse(cls, data: bytes, mode: int) -> FileText:
        text = data.decode("utf-8", "surrogateescape")
        eof = text.endswith("\n") or text == ""
        lines = text.split("\n")
        if eof:
            lines.pop()
        return cls(lines, eof, mode)

    def to_bytes(self) -> bytes:
        text = "\n".join(self.lines) + ("\n" if self.eof_newline and self.lines else "")
        return text.encode("utf-8", "surrogateescape")


@dataclass(frozen=True)
class HunkResult:
    index: int  # 1-based, as patch numbers hunks
    offset: int
    fuzz: int


class HunkFailure(Exception):
    """A hunk whose old side is not in the file: carries what differs, for the report."""

    def __init__(self, path: str, index: int, hunk: Hunk, expected: list[str], found: list[str], at: int):
        self.path, self.index, self.hunk = path, index, hunk
        self.expected, self.found, self.at = expected, found, at
        super().__init__(f"{path}: hunk #{index} (line {hunk.old_start}) does not apply")

    def diff_lines(self, limit: int = 24) -> list[str]:
        """What the hunk expects against the closest text in the file, as a small diff."""
        if not self.found:
            return ["(the file ends before the hunk's place)"]
        if len(self.found) == 1 and self.found[0].startswith("<") and self.found[0].endswith(">"):
            return [self.found[0][1:-1]]  # no text to compare: a file missing, or one in the way
        diff = difflib.unified_diff(
            self.expected, self.found, "expected (patch)", "found (tree)", n=1, lineterm=""
        )
        lines = [line for line in diff if not line.startswith("@@")]
        return lines[:limit] + (["..."] if len(lines) > limit else [])


def _matches(lines: list[str], pos: int, want: list[str]) -> bool:
    return pos >= 0 and pos + len(want) <= len(lines) and lines[pos : pos + len(want)] == want


def _find(lines: list[str], want: list[str], guess: int) -> int | None:
    """Nearest position to ``guess`` where ``want`` occurs, searching both ways."""
    # A hunk header may claim any line number; outside the file the search order is the
    # same from the nearest end, so start there instead of counting up to the claim.
    guess = min(max(guess, 0), len(lines))
    limit = max(guess, len(lines) - guess) + 1
    for delta in range(limit):
        for pos in (guess - delta, guess + delta) if delta else (guess,):
            if _matches(lines, pos, want):
                return pos
    return None


def _trim(hunk: Hunk, fuzz: int) -> tuple[list[tuple[str, str]], int]:
    """Drop up to ``fuzz`` context lines from each end; return body and lines dropped at top."""
    body = list(hunk.lines)
    top = 0
    for _ in range(fuzz):
        if body and body[0][0] == " ":
            body.pop(0)
            top += 1
        if body and body[-1][0] == " ":
            body.pop()
    return body, top


def _closest(lines: list[str], want: list[str], guess: int) -> tuple[int, list[str]]:
    """Where the hunk most nearly matches (most equal lines), for the conflict report."""
    best, best_score = max(0, min(guess, len(lines) - 1)), -1
    for pos in range(max(0, guess - 200), min(len(lines), guess + 200) + 1):
        score = sum(1 for n, w in enumerate(want) if pos + n < len(lines) and lines[pos + n] == w)
        if score > best_score:
            best, best_score = pos, score
    # A little more than the hunk, so an insertion upstream shows as one line, not a shift.
    return best, lines[best : best + len(want) + 3]


def apply_hunks(path: str, lines: list[str], fp: FilePatch, fuzz: int = 0) -> tuple[list[str], list[HunkResult]]:
    """Apply every hunk of ``fp`` to ``lines``; raise HunkFailure at the first that fails."""
    out = list(lines)
    results: list[HunkResult] = []
    shift = 0  # how far earlier hunks moved the text
    last_end = 0
    for index, hunk in enumerate(fp.hunks, 1):
        guess = max(hunk.old_start - 1, 0) + shift
        for f in range(fuzz + 1):
            body, top = _trim(hunk, f)
            want = [t for tag, t in body if tag != "+"]
            pos = _find(out, want, guess + top) if want else (guess if hunk.old_len == 0 or not out else None)
            if hunk.old_len == 0 and not out:
                pos = 0
            if pos is not None and pos >= last_end:
                break
            pos = None
        if pos is None:
            full = hunk.old
            at, found = _closest(out, full, guess)
            raise HunkFailure(path, index, hunk, full, found, at)
        replacement = [t for tag, t in body if tag != "-"]
        out[pos : pos + len(want)] = replacement
        results.append(HunkResult(index, pos - top - guess, f))
        shift += len(replacement) - len(want)
        last_end = pos + len(replacement)
    return out, results


@dataclass
class VirtualTree:
    """A pristine tree on disk plus the in-memory edits made to it so far."""

    root: Path
    edits: dict[str, FileText | None] = field(default_factory=dict)  # None: deleted

    def _checked(self, path: str) -> Path:
        # Refuse a path that reaches outside the tree through a symlink in the tree.
        real_root = self.root.resolve()
        target = (self.root / path).resolve()
        if target != real_root and real_root not in target.parents:
            raise SeriesError(f"{path} resolves outside the tree (through a symlink): refused")
        return self.root / path

    def read(self, path: str) -> FileText | None:
        if path in self.edits:
            return self.edits[path]
        try:
            return self._read_disk(path)
        except (OSError, RuntimeError) as exc:  # RuntimeError: pathlib's word for a symlink loop
            raise SeriesError(f"{path} cannot be read in the tree: {exc}") from None

    def _read_disk(self, path: str) -> FileText | None:
        disk = self._checked(path)
        if disk.is_symlink():
            raise SeriesError(f"{path} is a symlink in the tree: patching it is refused")
        if not disk.is_file():
            return None
        return FileText.parse(disk.read_bytes(), os.stat(disk).st_mode & 0o777)

    def changed(self) -> dict[str, FileText | None]:
        return dict(self.edits)

    def obstacle(self, path: str) -> str | None:
        """What stands where ``path`` would be written as a regular file, with the edits so
        far: a file (or anything but a folder) where one of its folders must be, or a folder
        (or anything but a regular file) at the path itself. None: nothing."""
        parts = path.split("/")
        for n in range(1, len(parts)):
            above = "/".join(parts[:n])
            what = self._what_is(above)
            if what not in (None, "a folder"):
                return f"{above} is {what}"
        what = self._what_is(path)
        return f"{path} is {what}" if what not in (None, "a regular file") else None

    def _what_is(self, path: str) -> str | None:
        """What the tree holds at ``path`` after the edits, in words; None: nothing."""
        if path in self.edits:
            return None if self.edits[path] is None else "a regular file"
        if any(p.startswith(path + "/") and text is not None for p, text in self.edits.items()):
            return "a folder"
        full = self._checked(path)  # a link to a folder inside the tree is a folder
        try:
            return inputs.kind(os.stat(full).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return "a symbolic link that leads nowhere" if os.path.lexists(full) else None
        except (OSError, RuntimeError) as exc:
            raise SeriesError(f"{path} cannot be looked at in the tree: {exc}") from None


_NO_HUNK = Hunk(0, 0, 0, 0, (), 0)  # stands in, in a conflict report, for a file patch without hunks


def apply_file_patch(tree: VirtualTree, fp: FilePatch, fuzz: int = 0) -> list[HunkResult]:
    """Apply one file's hunks to the virtual tree, or raise (the tree is unchanged then)."""
    current = tree.read(fp.path)
    first, last = (fp.hunks[0], fp.hunks[-1]) if fp.hunks else (_NO_HUNK, _NO_HUNK)
    expected = ["<no file>"] if fp.new_file else first.old
    blocked = tree.obstacle(fp.path) if current is None else None
    if blocked:  # a file where the patch needs a folder, or a folder where it needs a file
        raise HunkFailure(fp.path, 1, first, expected, [f"<{blocked}>"], 0)
    if fp.new_file:
        if current is not None:
            raise HunkFailure(fp.path, 1, first, expected, ["<file exists>"], 0)
        current = FileText([], True, fp.mode & 0o777 if fp.mode else 0o644)
    elif current is None:
        raise HunkFailure(fp.path, 1, first, expected, ["<file missing>"], 0)
    lines, results = apply_hunks(fp.path, current.lines, fp, fuzz)
    if fp.deleted:
        if lines:
            raise HunkFailure(fp.path, max(len(fp.hunks), 1), last, [], lines[:5], len(lines))
        tree.edits[fp.path] = None
    else:
        eof = fp.new_eof_newline if fp.hunks else current.eof_newline
        tree.edits[fp.path] = FileText(lines, eof, current.mode)
    return results
