"""Scenario g of the engine check: a weight changed in place while the engine is awake.

The unchanged-skip (patched, on unless ``VLLM_CUMEM_SKIP_UNCHANGED=0``) lets a sleep leave out the copy of an
allocation whose GPU checksum equals the one taken with its host backup, which it keeps
across wakes. What it must never do: skip an allocation that changed since, so that the next
wake restores the bytes as they were. Here the engine sleeps and wakes once (the backups
and, with the skip on, their checksums exist), then a weight is changed in place on every
rank (probe.Probe.sm12x_perturb: the lm_head rows rolled), the prefix cache is emptied and
the changed weights' tokens taken, the engine sleeps and wakes, and its tokens must be those
of the changed weights; then once more with nothing changed.
Without the skip every sleep copies everything and the scenario is a plain check.
"""

from __future__ import annotations

from .bench import Bench, Engine, Finding, Stop, first_difference, recording, summed
from .plan import Tree

STALE = "the wake restored the weights as they were before the change: stale backup"
SEED = 1  # rows the lm_head is rolled by


def weight_changed(bench: Bench, tree: Tree) -> Finding:
    f = Finding("g", tree.label)
    with recording(f), bench.engine(tree, "single", f"{tree.label}-weight-changed") as e:
        f.figures["engine"] = e.facts()
        before = e.generate("generate before the first sleep")
        sleep_and_wake(e, f, "first")
        f.tokens("after the first wake", before, e.generate("generate after the first wake"))
        after = change_a_weight(e, f, before)
        sleep_and_wake(e, f, "after the change")
        judge_after_change(f, before, after, e.generate("generate after the wake that follows the change"))
        sleep_and_wake(e, f, "again, nothing changed")
        judge_after_change(f, before, after, e.generate("generate after the last wake"), "after a second sleep and wake")
    return f


def change_a_weight(e: Engine, f: Finding, before: list[list[int]]) -> list[list[int]]:
    """The weight changed on every rank, and the tokens it gives; a change that moves no token
    proves nothing (error: the scenario could not tell a stale wake from a good one)."""
    f.figures["perturb"] = e.must("perturb", "changing a weight in place", seed=SEED).get("ranks")
    # The changed weight's tokens from a full prefill, as every generate after a sleep is
    # (vLLM's sleep empties the prefix cache): taken with the prompts cached, pristine
    # 0.33.0's reference parted from the tokens after the wakes at token 14 (2026-11-29).
    e.must("reset", "emptying the prefix cache")
    after = e.generate("generate after the change")
    f.figures["changed"] = first_difference(before, after) is not None
    if not f.figures["changed"]:
        f.figures.pop("tokens_identical", None)  # nothing after the change was judged
        raise Stop("error", "the weight changed in place changed no token: a stale wake could not be told apart")
    return after


def sleep_and_wake(e: Engine, f: Finding, what: str) -> None:
    """sleep(1) and wake; what the sleep copied and skipped (the skip's allocator alone says)."""
    slept = e.must("sleep", f"sleep ({what})", level=1)
    state = e.state()
    woke = e.must("wake", f"wake ({what})")
    f.figures.setdefault("sleeps", []).append({
        "what": what, "sleep_s": slept.get("seconds"), "wake_s": woke.get("seconds"),
        "copied_bytes": summed(state, "last_sleep_copied_bytes"),
        "skipped_bytes": summed(state, "last_sleep_skipped_bytes")})


def judge_after_change(f: Finding, before: list[list[int]], after: list[list[int]], got: list[list[int]],
                       name: str = "after the wake that follows the change") -> bool:
    """The tokens of the changed weights; those of the weights before the change are named as
    what they are: a backup taken before the change, restored."""
    if first_difference(before, got) is None:
        f.figures["tokens_identical"] = False
        return f.check(name, False, STALE)
    return f.tokens(name, after, got)
