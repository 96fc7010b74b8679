"""The one choke point for external commands.

Every subprocess the tool starts goes through :func:`run` (a command that runs to its
end) or :func:`start` (a child the tool talks to while it runs: a peer engine, a process
that holds GPU memory). Both echo ``+ cmd`` to stderr (so an operator can rerun it by
hand); :func:`run` raises :class:`CommandError` with the command's own output when it
fails. Unit tests patch these functions.
Under ``-q`` (:func:`echo_commands` off) nothing is echoed; a failure still carries the
command line and its output in the error.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from .errors import CommandError

# Whether run() echoes ``+ cmd``: one switch for the whole command, so that ``-q`` also
# silences the commands started deep inside a step (the host compile of the overlays).
_echo_on = True


@contextlib.contextmanager
def echo_commands(on: bool) -> Iterator[None]:
    """Echo (or not) every command run inside the block."""
    global _echo_on
    before, _echo_on = _echo_on, on
    try:
        yield
    finally:
        _echo_on = before


def run(
    argv: Sequence[str | os.PathLike[str]],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    echo: bool = True,
    capture: bool = True,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv``; return the completed process or raise CommandError."""
    args = [os.fspath(a) for a in argv]
    if echo and _echo_on:
        print("+ " + shlex.join(args), file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(
            args,
            cwd=cwd,
            env=None if env is None else dict(env),
            text=True,
            capture_output=capture,
            timeout=timeout,
            check=False,
        )
    except FileNotFoundError as exc:
        raise CommandError(f"{args[0]} not found: install it or put it on PATH") from exc
    except subprocess.TimeoutExpired as exc:
        raise CommandError(f"{shlex.join(args)} did not finish within {timeout} s") from exc
    if proc.returncode != 0:
        output = ((proc.stdout or "") + (proc.stderr or "")).strip()
        tail = "\n".join(output.splitlines()[-30:])
        raise CommandError(
            f"{shlex.join(args)} failed with exit code {proc.returncode}"
            + (f":\n{tail}" if tail else "")
        )
    return proc


def start(
    argv: Sequence[str | os.PathLike[str]],
    *,
    env: Mapping[str, str] | None = None,
    echo: bool = True,
    new_session: bool = False,
    stderr: int | None = None,
    stdout: int | None = subprocess.PIPE,
) -> subprocess.Popen[str]:
    """Start ``argv`` with pipes to its stdin and stdout (text, line-buffered) and return it
    running; ``new_session`` puts it and its children in a process group of their own, so
    that the caller can end them all at once."""
    args = [os.fspath(a) for a in argv]
    if echo and _echo_on:
        print("+ " + shlex.join(args), file=sys.stderr, flush=True)
    try:
        return subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=stdout, stderr=stderr, text=True, bufsize=1,
            env=None if env is None else dict(env), start_new_session=new_session,
        )
    except FileNotFoundError as exc:
        raise CommandError(f"{args[0]} not found: install it or put it on PATH") from exc
