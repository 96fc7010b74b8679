"""Where a fix stands upstream, and when that was last checked.

Two headers of a fix's ``upstream`` file (copied into each lane's patch) say it:

``Applied-Upstream`` (DEP-3): ``no``, or the first vLLM release that carries the fix, with
``, partly: <what is still missing>`` when upstream made only part of it, or made it in
another form::

    Applied-Upstream: 0.26.0, partly: the free callback synchronizes; sleep() still unmaps

``Sm12x-Upstream-Status``: the fix's state (merged, partly, open, closed unmerged) and the
date it was checked, then one continuation line for every upstream reference the fix names
(Origin, Bug, Forwarded), each with that reference's own state::

    Sm12x-Upstream-Status: partly, checked 2026-11-27
     #43020 merged, in 0.26.0 and 0.33.0

The two must agree: a release in Applied-Upstream exactly when the state is merged or
partly, and ", partly:" exactly when it is partly. The README's patch table prints the state,
the release and the date (``checks/report.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import SeriesError

STATUS_KEY = "Sm12x-Upstream-Status"
STATES = ("merged", "partly", "open", "closed unmerged")
REF_STATES = ("merged", "open", "closed unmerged")
_APPLIED = re.compile(r"(?P<release>\d+(?:\.\d+)+)(?:, partly: (?P<missing>\S.*))?")
_HEAD = re.compile(rf"(?P<state>{'|'.join(STATES)}), checked (?P<checked>\d{{4}}-\d{{2}}-\d{{2}})")
_REF = re.compile(rf"#(?P<number>\d+) (?P<state>{'|'.join(REF_STATES)})(?:, (?P<words>\S.*))?")
_NUMBER = re.compile(r"github\.com/[\w.-]+/[\w.-]+/(?:pull|issues)/(\d+)")


@dataclass(frozen=True)
class Applied:
    """``Applied-Upstream``: the first release that carries the fix (None: ``no``)."""

    release: str | None
    missing: str | None = None  # what upstream has not made, when only part landed

    @property
    def partly(self) -> bool:
        return self.missing is not None


def applied(value: str, where: str) -> Applied:
    value = " ".join(value.split())
    if value.lower() == "no":
        return Applied(None)
    m = _APPLIED.fullmatch(value)
    if not m:
        raise SeriesError(f"{where}: Applied-Upstream {value!r} is neither 'no' nor a vLLM release "
                          "(optionally followed by ', partly: <what is still missing>')")
    return Applied(m["release"], m["missing"])


@dataclass(frozen=True)
class UpstreamStatus:
    state: str  # one of STATES
    checked: str  # YYYY-MM-DD
    applied: Applied
    refs: tuple[tuple[str, str], ...]  # ("#43020", "merged, in 0.26.0 and 0.33.0")

    def cell(self) -> str:
        """The README table's status: ``partly: landed in 0.26.0 (checked 2026-11-27)``."""
        landed = f": landed in {self.applied.release}" if self.applied.release else ""
        return f"{self.state}{landed} (checked {self.checked})"


def parse_status(headers: dict[str, str], where: str) -> UpstreamStatus | None:
    """The fix's status from its headers (None when it has no Sm12x-Upstream-Status), checked
    against Applied-Upstream and the references that Origin, Bug and Forwarded name."""
    found = applied(headers.get("Applied-Upstream", "no"), where)  # refused malformed, with or without a status
    if STATUS_KEY not in headers:
        return None
    head, *lines = [line.strip() for line in headers[STATUS_KEY].split("\n") if line.strip()]
    m = _HEAD.fullmatch(head)
    if not m:
        raise SeriesError(f"{where}: {STATUS_KEY} {head!r} is not '<{' | '.join(STATES)}>, checked YYYY-MM-DD'")
    refs = tuple(_ref(line, where) for line in lines)
    status = UpstreamStatus(m["state"], m["checked"], found, refs)
    _agree(status, headers, where)
    return status


def _ref(line: str, where: str) -> tuple[str, str]:
    m = _REF.fullmatch(line)
    if not m:
        raise SeriesError(f"{where}: {STATUS_KEY} line {line!r} is not '#<number> <{' | '.join(REF_STATES)}>[, words]'")
    return f"#{m['number']}", line.split(" ", 1)[1]


def _agree(status: UpstreamStatus, headers: dict[str, str], where: str) -> None:
    landed = status.state in ("merged", "partly")
    if landed != (status.applied.release is not None) or (status.state == "partly") != status.applied.partly:
        raise SeriesError(
            f"{where}: {STATUS_KEY} says {status.state!r} but Applied-Upstream says "
            f"{headers.get('Applied-Upstream', 'no')!r}: a release exactly when merged or partly, "
            "', partly:' exactly when partly"
        )
    named = {f"#{n}" for key in ("Origin", "Bug", "Forwarded") for n in _NUMBER.findall(headers.get(key, ""))}
    missing = sorted(named - {ref for ref, _ in status.refs}, key=lambda r: int(r[1:]))
    if missing:
        raise SeriesError(f"{where}: {STATUS_KEY} has no line for {', '.join(missing)} (every reference "
                          "Origin, Bug and Forwarded name needs its state)")
