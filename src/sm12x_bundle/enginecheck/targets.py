"""The engine check's targets, judged from a run's figures (pure: the report's JSON is enough).

A target holds (True), does not (False), or was not measured (None: its scenario did not
run, or --quick measured no ceilings). Each is judged per tree; the verdict reads the tree
under test (patched, or the installed one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

FIRST_SLEEP = 0.8  # engine first sleep >= 0.8 of the device-to-host ceiling
FIRST_SWAP = 1.1  # rotation: the first swap <= 1.1x the median steady swap
STEADY_SWAP = 1.25  # rotation: every steady swap <= 1.25x its bytes' time at the ceilings


@dataclass(frozen=True)
class Target:
    key: str
    words: str
    judge: Callable[[dict[str, Any]], tuple[bool | None, str]]  # results by scenario -> (holds, value)


# A killed worker serves nothing by design: its claim is that every call says so (FAILURES).
NO_TOKENS = ("f",)
FAILURES = ("d1", "d2", "f")


def _tokens(by: dict) -> tuple[bool | None, str]:
    if not by:
        return None, "no scenario ran"
    by = {k: r for k, r in by.items() if k not in NO_TOKENS}
    if not by:
        return None, "no scenario that serves ran"
    bad = [k for k, r in by.items() if r.figures.get("tokens_identical") is not True]
    if not bad:
        return True, f"identical in {', '.join(sorted(by))}"
    return False, "not shown identical in " + ", ".join(
        f"{k} ({'they differ' if by[k].figures.get('tokens_identical') is False else 'stopped before'})"
        for k in sorted(bad))


def _figure(scenario: str, key: str, limit: float, at_most: bool, fmt: str) -> Callable:
    def judge(by: dict) -> tuple[bool | None, str]:
        r = by.get(scenario)
        value = None if r is None else r.figures.get(key)
        if value is None:
            return None, "not measured" if r is None or r.outcome == "pass" else f"not measured ({r.outcome})"
        holds = value <= limit if at_most else value >= limit
        return holds, fmt.format(value)

    return judge


def _survived(key: str, r) -> bool:
    """d1, d2: the engine serves on; f: the engine said its worker is gone (every check held)."""
    return r.outcome == "pass" if key == "f" else r.figures.get("survived") is True


def _failures(by: dict) -> tuple[bool | None, str]:
    ran = {k: by[k] for k in FAILURES if k in by}
    if not ran:
        return None, "not run"
    words = [f"{k} {'survived' if _survived(k, r) else 'not survived'}" for k, r in sorted(ran.items())]
    return all(_survived(k, r) for k, r in ran.items()), ", ".join(words)


TARGETS: tuple[Target, ...] = (
    Target("tokens", "tokens identical in every scenario", _tokens),
    Target("first-sleep", f"engine first sleep >= {FIRST_SLEEP} of the D2H ceiling",
           _figure("a", "first_sleep_ratio", FIRST_SLEEP, False, "{:.2f} of D2H")),
    Target("rotation-first", f"rotation: first swap <= {FIRST_SWAP}x the median steady swap",
           _figure("c", "first_over_steady", FIRST_SWAP, True, "{:.2f}x")),
    Target("rotation-steady", f"rotation: slowest steady swap <= {STEADY_SWAP}x its bytes' time at the ceilings",
           _figure("c", "steady_over_ideal", STEADY_SWAP, True, "{:.2f}x")),
    Target("failures", "failure scenarios survived (f: the killed worker reported, no hang)", _failures),
)
SPEED = ("first-sleep", "rotation-first", "rotation-steady")


def evaluate(results: Sequence, tree: str, quick: bool = False) -> dict[str, dict]:
    """Every target for one tree: {key: {holds, value, words}}."""
    by = {r.scenario: r for r in results if r.tree == tree}
    out = {}
    for t in TARGETS:
        holds, value = t.judge(by)
        if quick and t.key in SPEED:
            holds, value = None, f"not judged in --quick ({value})"
        out[t.key] = {"holds": holds, "value": value, "words": t.words}
    return out
