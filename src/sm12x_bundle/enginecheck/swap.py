"""A swap between two vLLM servers of a rotation pool, over their HTTP endpoints: put the
awake one (A) to sleep, wake the sleeping one (B), check that B serves. If B does not take
over (its wake fails, or it does not answer a completion), B is put back to sleep (a
failed wake may have left part of it awake) and A is woken again and checked: the pool
keeps serving. Every stage is timed as the operator's client sees it (HTTP round trip).

The check that a server serves is one greedy completion of a short token-id prompt (no
tokenizer needed) for the model the server lists first under /v1/models.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .endpoints import HttpError, Server

CHECK_PROMPT = [[101, 102, 103, 104]]


@dataclass
class Swap:
    """What one swap did: each stage's seconds and outcome, and where the pool stands."""

    stages: list[dict] = field(default_factory=list)
    swapped: bool = False
    rolled_back: bool | None = None  # None: no rollback was needed
    error: str | None = None

    def stage(self, name: str, run) -> bool:
        start = time.perf_counter()
        try:
            run()
        except HttpError as exc:
            self.stages.append({"stage": name, "ok": False, "seconds": time.perf_counter() - start, "error": str(exc)})
            self.error = self.error or f"{name}: {exc}"
            return False
        self.stages.append({"stage": name, "ok": True, "seconds": time.perf_counter() - start})
        return True

    def seconds(self, name: str) -> float | None:
        return next((s["seconds"] for s in self.stages if s["stage"] == name), None)

    def to_dict(self) -> dict:
        return {"swapped": self.swapped, "rolled_back": self.rolled_back, "error": self.error, "stages": self.stages,
                "swap_s": sum(s["seconds"] for s in self.stages if s["stage"] in ("sleep A", "wake B"))}


def served_model(server: Server, timeout: float) -> str:
    models = server.json("GET", "/v1/models", timeout) or {}
    data = models.get("data") or []
    if not data:
        raise HttpError("GET /v1/models: the server lists no model")
    return data[0]["id"]


def serves(server: Server, timeout: float) -> None:
    """One completion must come back (raises HttpError otherwise)."""
    model = server.model or served_model(server, timeout)
    Server(server.base, model).complete(CHECK_PROMPT, 1, timeout)


def rotate(a: Server, b: Server, timeout: float, check: bool = True) -> Swap:
    """Sleep ``a``, wake ``b``, check ``b``; on failure, give the pool ``a`` back."""
    swap = Swap()
    if not swap.stage("sleep A", lambda: a.sleep(1, timeout)):
        # vLLM pauses A's scheduler before its sleep and leaves it paused when the sleep
        # fails: wake_up resumes it (and maps back whatever the sleep had released).
        swap.rolled_back = give_back(swap, a, timeout)
        return swap
    took_over = swap.stage("wake B", lambda: b.wake_up(timeout))
    if took_over and check:
        took_over = swap.stage("B serves", lambda: serves(b, timeout))
    if took_over:
        swap.swapped = True
        return swap
    swap.stage("sleep B again", lambda: b.sleep(1, timeout))
    swap.rolled_back = give_back(swap, a, timeout)
    return swap


def give_back(swap: Swap, a: Server, timeout: float) -> bool:
    return swap.stage("wake A again", lambda: a.wake_up(timeout)) and swap.stage("A serves", lambda: serves(a, timeout))
