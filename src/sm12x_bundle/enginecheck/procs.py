"""The check's long-lived children, each in a process group of its own, and their ending.

Why ``cmd.start`` and not ``cmd.run``: run runs a command to its end, and a session is
spoken to while it lives (a JSON line in, a JSON line out, many times).

Every child starts a new session (``start_new_session``), so the engine core process that
vLLM forks or spawns below it, and any process it starts in turn, share the child's process
group; :class:`Groups` ends every group it started (SIGKILL to the group) when its block
ends: on success, on an error, on a timeout and on Ctrl-C (SIGTERM is turned into the
same path). A child's stderr (vLLM's logs) goes to a log file, read back for its last words.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from .. import cmd
from . import protocol

_EOF = object()


class Child:
    """A child process speaking the protocol; replies come through a reader thread."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], log: Path, label: str, echo: bool = True) -> None:
        self.label, self.log = label, log
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as err:
            self.proc = cmd.start(argv, env=env, echo=echo, new_session=True, stderr=err)
        self.pid = self.proc.pid
        self.killed = False
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"enginecheck-{label}").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(_EOF)

    def _next_line(self, timeout: float):
        """The next line, _EOF, or None after ``timeout``. A child that has exited counts as
        ended even while its pipe stays open: a forked engine core keeps a copy of it."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if self.exit_code() is not None:
                    try:  # what the reader may still have in hand
                        return self.lines.get(timeout=1.0)
                    except queue.Empty:
                        return _EOF
                if time.monotonic() >= deadline:
                    return None

    def next_message(self, timeout: float) -> dict:
        """The child's next line; a dict with ``timed_out`` or ``died`` when there is none."""
        line = self._next_line(timeout)
        if line is None:
            return {"ok": False, "timed_out": True, "error": f"{self.label}: no answer within {timeout:.0f} s"}
        if line is _EOF:
            code = self.exit_code(wait=5)
            return {"ok": False, "died": True, "error": f"{self.label} exited (code {code}): {self.last_words()}"}
        try:
            return protocol.decode(line)
        except protocol.ProtocolError as exc:
            return {"ok": False, "error": f"{self.label}: {exc}"}

    def ask(self, cmd: str, timeout: float, **args) -> dict:
        """Send one request and wait for its reply; a child that does not answer in time is
        ended (it is unusable) and the reply says ``timed_out``."""
        if not self.alive():
            return {"ok": False, "died": True, "error": f"{self.label} had exited (code {self.exit_code()})"}
        start = time.monotonic()
        try:
            self.proc.stdin.write(protocol.request(cmd, **args))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the reader sees the end and reports the exit
        reply = self.next_message(timeout)
        reply.setdefault("seconds", time.monotonic() - start)
        if reply.get("timed_out"):
            self.kill()
        return reply

    def last_words(self, lines: int = 3) -> str:
        try:
            text = self.log.read_text("utf-8", "replace")
        except OSError:
            return "(no log)"
        tail = [line.strip() for line in text.strip().splitlines()[-lines:]]
        return " | ".join(tail) or "(nothing logged)"

    def exit_code(self, wait: float = 0.0) -> int | None:
        """The child's exit code once it has ended (None: still running), read without
        reaping it: until :meth:`kill` reaps it, its pid cannot be reused, so the group
        it names is still this child's."""
        deadline = time.monotonic() + wait
        while True:
            if self.killed:
                return self.proc.returncode
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def alive(self) -> bool:
        return self.exit_code() is None

    def kill(self) -> None:
        """SIGKILL to the child's whole process group (the engine core with it), then reap
        the child; once only, so a reaped pid is never signalled."""
        if self.killed:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.killed = True
        try:  # stdout is left to the reader thread, which ends when the group is gone
            self.proc.stdin.close()
        except OSError:
            pass


class Groups:
    """Every child started in a block; all their process groups are ended when it ends."""

    def __init__(self) -> None:
        self.children: list[Child] = []
        self.started = 0

    def start(self, argv: Sequence[str], env: Mapping[str, str], log: Path, label: str, echo: bool = True) -> Child:
        child = Child(argv, env, log, label, echo)
        self.children.append(child)
        self.started += 1
        return child

    def end_all(self) -> int:
        """Kill every group started here (the dead ones too: an orphan may live on in one)."""
        for child in self.children:
            child.kill()
        ended, self.children = len(self.children), []
        return ended


@contextmanager
def groups() -> Iterator[Groups]:
    """A :class:`Groups` whose children all end with the block, however it ends; SIGTERM
    ends it as Ctrl-C does (KeyboardInterrupt)."""
    started = Groups()
    previous = _on_sigterm()
    try:
        yield started
    finally:
        started.end_all()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _on_sigterm():
    if threading.current_thread() is not threading.main_thread():
        return None  # only the main thread may set handlers
    return signal.signal(signal.SIGTERM, _interrupt)
