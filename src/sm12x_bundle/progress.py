"""Progress on long work, written to stderr.

On a terminal a task redraws one line; elsewhere (CI logs) it prints a line at each
tenth of the way, so logs stay short and still show that work is moving.
"""

from __future__ import annotations

import sys
from typing import TextIO

from .errors import sanitize


class Task:
    def __init__(self, stream: TextIO | None, label: str, total: int | None, tty: bool):
        self.stream, self.label, self.total, self.tty = stream, label, total, tty
        self.count = 0
        self._shown = -1

    def advance(self, n: int) -> None:
        self.count += n
        if self.stream is None:
            return
        if self.total:
            tenth = self.count * 10 // self.total
            if self.tty or tenth != self._shown:
                self._shown = tenth
                self._line(f"{self.label}: {self.count * 100 // self.total}% ({self._size()})")
        elif self.tty:
            self._line(f"{self.label}: {self._size()}")

    def done(self) -> None:
        if self.stream is not None:
            self._line(f"{self.label}: done ({self._size()})", end="\n")

    def _size(self) -> str:
        if self.total and self.total > 100_000 or self.count > 100_000:
            return f"{self.count / 1e6:.1f} MB" + (f" of {self.total / 1e6:.1f} MB" if self.total else "")
        return f"{self.count}" + (f" of {self.total}" if self.total else "")

    def _line(self, text: str, end: str = "") -> None:
        assert self.stream is not None
        text = sanitize(text)
        if self.tty:
            self.stream.write("\r\033[K" + text + end)
        elif end or text != getattr(self, "_last", None):
            self.stream.write(text + "\n")
        self._last = text
        self.stream.flush()


class Progress:
    """Factory for tasks; ``Progress.quiet()`` reports nothing."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream
        self.tty = bool(stream is not None and stream.isatty())

    @classmethod
    def stderr(cls) -> Progress:
        return cls(sys.stderr)

    @classmethod
    def quiet(cls) -> Progress:
        return cls(None)

    def task(self, label: str, total: int | None = None) -> Task:
        return Task(self.stream, label, total, self.tty)

    def say(self, text: str) -> None:
        if self.stream is not None:
            self.stream.write(sanitize(text) + "\n")
            self.stream.flush()
