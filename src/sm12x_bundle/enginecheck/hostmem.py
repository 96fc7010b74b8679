"""Host memory of the engine's processes, read from /proc.

The backup pool pins each engine's weights in host memory from the end of the load on, so
the check reports what each engine held: resident (VmRSS), locked (VmLck) and pinned
(VmPin) memory of its engine core process, found among the session's descendants by the
name vLLM gives it (``EngineCore``), else as the largest of them.
"""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")
_FIELDS = {"VmRSS": "rss_bytes", "VmLck": "locked_bytes", "VmPin": "pinned_bytes"}


def _ppid(pid: str) -> int | None:
    try:
        stat = (PROC / pid / "stat").read_text()
    except OSError:
        return None
    # The name (field 2) is in parentheses and may hold spaces; the fields after it don't.
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents before their children."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            parent = _ppid(entry.name)
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in sorted(children.get(todo.pop(0), [])):
            found.append(child)
            todo.append(child)
    return found


def status(pid: int) -> dict[str, int] | None:
    """VmRSS, VmLck and VmPin of ``pid`` in bytes; None when it is gone."""
    try:
        lines = (PROC / str(pid) / "status").read_text().splitlines()
    except OSError:
        return None
    out = dict.fromkeys(_FIELDS.values(), 0)
    for line in lines:
        key, _, rest = line.partition(":")
        if key in _FIELDS:
            out[_FIELDS[key]] = int(rest.split()[0]) * 1024
    return out


def name(pid: int) -> str:
    """The process's title (setproctitle rewrites cmdline), else its comm."""
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").strip()
        return raw.decode("utf-8", "replace") or (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def engine_core(session_pid: int) -> dict | None:
    """{pid, name, rss_bytes, locked_bytes, pinned_bytes} of the session's engine core process."""
    rows = []
    for pid in descendants(session_pid):
        mem, title = status(pid), name(pid)
        if mem is not None:
            rows.append({"pid": pid, "name": title[:120], "is_engine_core": "EngineCore" in title, **mem})
    if not rows:
        return None
    named = [r for r in rows if r["is_engine_core"]]
    return (named or sorted(rows, key=lambda r: r["rss_bytes"]))[-1]


def workers(session_pid: int) -> list[dict]:
    """{pid, name, rss, locked, pinned} of each multiprocess worker (TP or PP above 1: vLLM
    names them ``VllmWorker``), where the backups live then instead of the engine core."""
    rows = []
    for pid in descendants(session_pid):
        mem, title = status(pid), name(pid)
        if mem is not None and "Worker" in title:
            rows.append({"pid": pid, "name": title[:120], **mem})
    return rows


def snapshot(session_pid: int) -> dict:
    """The session's own memory, its engine core's and its workers', for the report."""
    return {"session": status(session_pid), "engine_core": engine_core(session_pid), "workers": workers(session_pid)}
