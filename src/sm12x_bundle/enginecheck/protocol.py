"""The JSON lines a session (or the holder) and the parent speak: one object per line.

The child's first line says it is ready (``{"event": "ready", ...facts}``) or that it could
not start (``{"event": "failed", "error": ...}``). Then each request
``{"cmd": NAME, "args": {...}}`` gets exactly one reply: ``{"ok": true, "seconds": S, ...}``
or ``{"ok": false, "seconds": S, "error": SENTENCE}``. A child writes nothing else on its
stdout (vLLM's logs go to stderr). Pure functions; both sides use them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable

# What a session answers (session.py); the holder answers hold and exit.
COMMANDS = ("generate", "sleep", "wake", "inject", "uninject", "reload", "reset", "state", "kill_rank", "perturb",
            "gc", "maps", "hold", "exit")
ERROR_LIMIT = 600  # characters of an error kept in a reply


class ProtocolError(Exception):
    """A line that is not one of the protocol's messages."""


def encode(doc: dict) -> str:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")) + "\n"


def decode(line: str) -> dict:
    try:
        doc = json.loads(line)
    except ValueError:
        raise ProtocolError(f"not a JSON line: {line.strip()[:120]!r}") from None
    if not isinstance(doc, dict):
        raise ProtocolError(f"not a JSON object: {line.strip()[:120]!r}")
    return doc


def request(cmd: str, **args) -> str:
    if cmd not in COMMANDS:
        raise ProtocolError(f"unknown command {cmd!r}")
    return encode({"cmd": cmd, "args": args})


def parse_request(line: str) -> tuple[str, dict]:
    doc = decode(line)
    cmd, args = doc.get("cmd"), doc.get("args", {})
    if cmd not in COMMANDS or not isinstance(args, dict):
        raise ProtocolError(f"not a request: {line.strip()[:120]!r}")
    return cmd, args


def sentence(exc: BaseException | str) -> str:
    """An error as one line: the lines joined, cut at ERROR_LIMIT characters."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = " ".join(line.strip() for line in str(text).splitlines() if line.strip())
    return text if len(text) <= ERROR_LIMIT else text[: ERROR_LIMIT - 3] + "..."


def ok(seconds: float, **data) -> dict:
    return {"ok": True, "seconds": seconds, **data}


def failed_reply(seconds: float, exc: BaseException | str, **data) -> dict:
    return {"ok": False, "seconds": seconds, "error": sentence(exc), **data}


def ready(**facts) -> dict:
    return {"event": "ready", **facts}


def failed_start(exc: BaseException | str, **facts) -> dict:
    return {"event": "failed", "error": sentence(exc), **facts}


def speak(start: Callable[[], tuple[object, dict]], answer: Callable[[object, str], tuple[str | None, dict]]) -> None:
    """A child's whole life on the protocol (a session, the serve session): replies go to the
    real stdout, everything else printed to stderr (vLLM logs to stdout too); ``start``
    returns the engine and the facts the ready line carries, or raises (a failed start);
    each request line gets ``answer``'s reply until ``exit``. The process then ends at once:
    the check ends its process group, the engine's own processes with it."""
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    began = time.perf_counter()
    try:
        engine, facts = start()
        first = ready(seconds=time.perf_counter() - began, **facts)
    except Exception as exc:  # noqa: BLE001  (reported to the parent, which records it)
        first, engine = failed_start(exc, seconds=time.perf_counter() - began), None
    replies.write(encode(first))
    replies.flush()
    for line in sys.stdin if engine is not None else ():
        name, reply = answer(engine, line)
        replies.write(encode(reply))
        replies.flush()
        if name == "exit":
            break
    sys.stderr.flush()
    os._exit(0)
