"""The report the golden engine-check table (tests/golden/engine_check/compare.txt) is
rendered from: a compare run on an H100 in which the pristine tree fails where the patched
one holds.

tests/test_engine_check.py judges the same report; ``bin/regenerate`` writes the golden file
and tests/test_generated.py fails while it differs from its render.
"""

from __future__ import annotations

from sm12x_bundle.enginecheck import plan, report, rotation, scenarios, table
from sm12x_bundle.enginecheck.ceilings import Ceilings
from sm12x_bundle.enginecheck.model import GiB

H100 = {"free": 79 * GiB, "total": int(79.65 * GiB), "host": 120 * GiB}
CEILINGS = Ceilings(4 * GiB, 55e9, 53e9)
WEIGHTS_13B, WEIGHTS_7B = 26_031_728_640, 13_476_831_232
ALLOCATION = ("Exception: Call to sleep method failed: CuMemAllocator: sleep failed to back up the allocation "
              "(tag 'weights', 262144000 bytes) at 0x7f3a00000000: injected fault: out of host memory")


def cycles_figures(sleeps: list[float], wakes: list[float], stages: list[dict] | None = None,
                   gc_collect: list[dict] | None = None) -> dict:
    core = {"engine_core": {"pid": 7, "rss_bytes": 30 * GiB, "locked_bytes": 0, "pinned_bytes": 0}}
    figs = {"tokens_identical": True, "offloaded_bytes": WEIGHTS_13B, "sleeps_s": sleeps, "wakes_s": wakes,
            "freed_bytes": [39 * GiB] * 3, "pool_bytes": 39 * GiB, "distinct_tokens": 57, "host_awake": core,
            "host_asleep": core, "wake_stages": stages, "gc_collect": gc_collect}
    scenarios.speed_figures(CEILINGS, figs)
    return figs


def rotation_figures(first: float, steady: list[float], moved: dict | None = None, fill: list | None = None) -> dict:
    """Scenario c's figures; ``moved``: what every swap's sleep copied and wake took (the
    patched allocator's records), ``fill``: B's background fill per rank."""
    swaps = [{"sleep_s": t / 2, "wake_s": t / 2, **(moved or {})} for t in [first, *steady]]
    figs = {"tokens_identical": True, "swaps": swaps, "a_moved_bytes": WEIGHTS_7B, "b_moved_bytes": WEIGHTS_7B,
            "b_fill_before_first_sleep": fill}
    rotation.rotation_figures(CEILINGS, figs)
    return figs


# The patched pair with the unchanged-skip: B's fill was done before its first sleep, so
# every sleep copies nothing; every wake copies the weights back.
SWAP_STAGES = [{"map_restored_s": 0.02, "copy_s": 0.26, "map_emptied_s": 0.02, "copied_bytes": WEIGHTS_7B}]
SWAP_MOVED = {"copied_bytes": 0, "skipped_bytes": WEIGHTS_7B, "wake_stages": SWAP_STAGES}
B_FILL = [{"filled_bytes": WEIGHTS_7B, "seconds": 3.2, "state": "done", "dropped": 0}]


def checks(*held: tuple[str, bool]) -> dict:
    return {name: {"held": ok, "words": "ok" if ok else "not so"} for name, ok in held}


def survived_result(key: str, tree: str, survived: bool) -> report.ScenarioResult:
    if survived:
        return report.ScenarioResult(key, tree, "pass", "survived", 60, {"tokens_identical": True, "survived": True,
                                     "error": ALLOCATION}, checks(("the failure names the allocation", True)))
    return report.ScenarioResult(key, tree, "fail", "generate after the failed sleep failed: engine core died", 90,
                                 {"survived": False, "error": "Exception: Call to sleep method failed: injected fault"},
                                 checks(("the failure names the allocation", False)))


# One gc.collect() in each worker: pristine 0.21.0's heap is not frozen (0.44-0.47 s in each
# TP=2 worker); the patched series freezes it after warm-up.
GC_PRISTINE = [{"rank": 0, "pid": 11, "seconds": 0.46, "frozen": 0}]
GC_PATCHED = [{"rank": 0, "pid": 12, "seconds": 0.002, "frozen": 412_345}]


def compare_results() -> list[report.ScenarioResult]:
    r = report.ScenarioResult
    return [
        r("a", "pristine", "pass", "identical tokens", 120,
          cycles_figures([18.7, 0.51, 0.51], [0.59] * 3, gc_collect=GC_PRISTINE)),
        r("a", "patched", "pass", "identical tokens", 90, cycles_figures([0.51, 0.5, 0.5], [0.59] * 3, [
            {"map_restored_s": 0.04, "copy_s": 0.5, "map_emptied_s": 0.03, "copied_bytes": WEIGHTS_13B}], GC_PATCHED)),
        r("b", "pristine", "pass", "identical tokens", 80, {"tokens_identical": True, "reload": "the dummy loader"}),
        r("b", "patched", "pass", "identical tokens", 80, {"tokens_identical": True, "reload": "the dummy loader"}),
        r("c", "pristine", "pass", "identical tokens", 200, rotation_figures(16.1, [0.63] * 5)),
        r("c", "patched", "pass", "identical tokens", 150,
          rotation_figures(0.61, [0.60, 0.61, 0.60, 0.62, 0.60], SWAP_MOVED, B_FILL)),
        survived_result("d1", "pristine", False), survived_result("d1", "patched", True),
        survived_result("d2", "pristine", False), survived_result("d2", "patched", True),
        r("e", "pristine", "pass", "identical tokens", 100, {"tokens_identical": True}),
        r("e", "patched", "pass", "identical tokens", 100, {"tokens_identical": True}),
        killed_result("pristine"), killed_result("patched"),
        changed_result("pristine", skip=False), changed_result("patched", skip=True),
    ]


def changed_result(tree: str, skip: bool) -> report.ScenarioResult:
    """Scenario g: with the unchanged-skip, the sleep after the change copies the changed
    lm_head's allocation alone and the last sleep nothing (its allocator says what each sleep
    copied and skipped; pristine's does not)."""
    copied = [WEIGHTS_13B, 262_144_000, 0] if skip else [None] * 3
    sleeps = [{"what": what, "sleep_s": 0.5, "wake_s": 0.6, "copied_bytes": c,
               "skipped_bytes": None if c is None else WEIGHTS_13B - c}
              for what, c in zip(("first", "after the change", "again, nothing changed"), copied)]
    return report.ScenarioResult("g", tree, "pass", "identical tokens", 70,
                                 {"tokens_identical": True, "changed": True, "sleeps": sleeps})


def killed_result(tree: str) -> report.ScenarioResult:
    """Scenario f as both trees ran it on two H200s (2026-11-27): every call answered, and failed."""
    held = checks(("no call hung", True), ("calls fail", True), ("health fails", True))
    return report.ScenarioResult("f", tree, "pass", "no call hung; calls fail; health fails", 150,
                                 {"killed_rank": 1, "said_within_s": 4.4, "worker_gone": True}, held)


def compare_report(results: list | None = None, quick: bool = False) -> report.Report:
    sizes = plan.plan_sizes(plan.SCENARIOS, *H100.values())
    return report.Report(
        mode="compare", quick=quick, lane="0.21.0",
        install={"root": "/opt/P", "version": "0.21.0", "version_from": "/opt/P/vllm-0.21.0.dist-info/METADATA"},
        card={"index": 0, "name": "NVIDIA H100 80GB HBM3", "driver": "580.95.05", "total_bytes": H100["total"],
              "free_bytes": H100["free"], "used_bytes": GiB // 2},
        date="2026-11-26T10:00:00+00:00",
        trees=[{"label": "pristine", "root": "/opt/P", "path": ["/opt/P"]},
               {"label": "patched", "root": "/w/patched", "path": ["/w/patched", "/opt/P"]}],
        sizes=sizes.to_dict(), ceilings=CEILINGS.to_dict(), results=compare_results() if results is None else results,
        copy={"root": "/w/patched", "linked": 3194, "copied": 0, "replaced": [{"path": "vllm/envs.py"}] * 14},
        cleanup={"used_before_bytes": GiB // 2, "used_after_bytes": GiB // 2, "released": True},
        versions={label: {"vllm": "0.21.0", "torch": "2.11.0+cu130"} for label in ("pristine", "patched")},
    )


def render() -> bytes:
    return table.table(compare_report()).encode()
