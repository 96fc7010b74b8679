"""Scenario c: two engines from one tree share the GPU and take turns.

A starts, generates and sleeps (its first sleep, reported apart); B starts while A sleeps
and generates; then each swap sleeps the engine awake and wakes the other, and the engine
now awake generates: its tokens must equal its own first ones. The first swap holds B's
first sleep; the steady swaps are the rest. Before it, the check waits (FILL_WAIT_S at
most) until B's background fill is no longer running, as an operator's engine has served a
while before its first swap; the wait and the fill's own seconds are recorded
(``b_fill_waited_s``, ``b_fill_before_first_sleep``). A sleep that comes during the fill
copies what the fill has not made (the allocator's tests; scenario g's first sleep).
A swap's time is the sleep's and the wake's as the sessions timed vLLM's calls; the bytes
it moves are what the sleeping engine offloaded (D2H) and what the waking one restores
(H2D), set against the copy ceilings.
After each swap (outside its timed calls) both allocators are asked what the sleep copied
and skipped and what each stage of the wake took, and before the first swap what B's
background fill had done; an allocator that keeps no such record gives None. After the
swaps each engine's workers time the driver's map calls on ranges of their own, also with
host-to-device copies queued (``map_calls``), to set beside the wakes' maps. Before the
first swap is timed, the swaps' HTTP client asks each server twice whether it sleeps
(``client_requests_s``): the check process's first request also sets up urllib.
"""

from __future__ import annotations

import statistics
import time

from .bench import Bench, Engine, Finding, Stop, per_rank, recording, summed
from .ceilings import Ceilings
from .endpoints import Server
from .swap import rotate
from .plan import Tree
from .scenarios import offloaded_bytes, wake_copy_ratio, wake_stages


def rotation(bench: Bench, tree: Tree) -> Finding:
    f = Finding("c", tree.label)
    with recording(f), bench.engine(tree, "pair", f"{tree.label}-rotation-A") as a:
        f.figures["engine"] = a.facts()
        refs = {"A": a.generate("A's first generate")}
        f.figures["a_first_sleep_s"] = a.must("sleep", "A's first sleep", level=1)["seconds"]
        slept = a.state()
        f.figures["a_moved_bytes"] = offloaded_bytes(slept)
        f.figures["a_first_sleep_checksum_s"] = checksum_seconds(slept)
        f.figures["allocations"] = allocation_counts(slept)
        with bench.engine(tree, "pair", f"{tree.label}-rotation-B") as b:
            refs["B"] = b.generate("B's first generate")
            f.figures["host_b_awake"] = b.host_memory()
            fills, f.figures["b_fill_waited_s"] = wait_for_fill(b)
            f.figures["b_fill_before_first_sleep"] = fills if any(fills) else None
            swaps(bench, f, {"A": a, "B": b}, refs)
            f.figures["map_calls"] = map_calls(bench, {"A": a, "B": b})
    rotation_figures(bench.ceilings, f.figures)
    return f


FILL_WAIT_S = 120.0  # the longest the check waits for B's background fill
FILL_POLL_S = 0.1


def wait_for_fill(b: Engine) -> tuple[list, float]:
    """B's background fill on each rank once no rank's is running (or after FILL_WAIT_S),
    and the seconds waited: 0.0 when the first look found none running (an allocator
    without a fill, or one that is done)."""
    start, waited = time.perf_counter(), 0.0
    while True:
        fills = per_rank(b.state(), "background_fill")
        running = any(isinstance(r, dict) and r.get("state") == "running" for r in fills)
        if not running or waited >= FILL_WAIT_S:
            return fills, waited
        time.sleep(FILL_POLL_S)
        waited = time.perf_counter() - start


def swaps(bench: Bench, f: Finding, engines: dict[str, Engine], refs: dict[str, list]) -> None:
    awake, asleep = "B", "A"
    if bench.parallel.driver == "serve":
        f.figures["client_requests_s"] = warm_client(bench, engines)
    for i in range(bench.sizes.swaps):
        sleep_s, wake_s = one_swap(bench, engines[awake], engines[asleep], f"swap {i + 1}")
        slept = engines[awake].state()
        f.figures.setdefault("swaps", []).append(
            {"sleeps": awake, "wakes": asleep, "sleep_s": sleep_s, "wake_s": wake_s,
             **what_moved(slept, engines[asleep].state())})
        if i == 0:
            f.figures["b_moved_bytes"] = offloaded_bytes(slept)
            f.figures["host_both"] = {name: e.host_memory() for name, e in engines.items()}
        got = engines[asleep].generate(f"swap {i + 1}: {asleep}'s generate")
        f.tokens(f"swap {i + 1} ({asleep} awake)", refs[asleep], got)
        awake, asleep = asleep, awake


def warm_client(bench: Bench, engines: dict[str, Engine]) -> list[float]:
    """Two requests to each server through the swaps' HTTP client, before the first swap
    is timed: a process's first urllib request also builds urllib's opener, a cost of the
    client's, not of the swap's. Returns each request's seconds, in order."""
    seconds = []
    for engine in engines.values():
        port = engine.ready.get("port")
        for _ in range(2 if port else 0):
            start = time.perf_counter()
            Server(f"http://127.0.0.1:{port}").json("GET", "/is_sleeping", bench.call_timeout)
            seconds.append(time.perf_counter() - start)
    return seconds


QUEUED = "extension create_and_map, copies by the copy engine running"  # vmm.call_times' row


def map_calls(bench: Bench, engines: dict[str, Engine]) -> dict:
    """Each engine's driver map calls on ranges of its own, after the swaps (outside them):
    the same calls as a wake's maps, in the same processes, beside the wakes' own stages;
    on every rank at once as a wake makes them, then (with several ranks) on rank 0 alone."""
    out = {}
    for name, engine in engines.items():
        out[name] = ranks = engine.map_calls()
        if ranks is None or len(ranks) > 1:
            out[f"{name} rank 0 alone"] = engine.map_calls(only_rank=0)
    for name, ranks in out.items():
        for r in ranks or []:
            if r.get("skipped"):
                continue
            best = r.get("best_s") or {}
            per, queued = best.get("extension create_and_map"), best.get(QUEUED)
            if per is not None:
                beside = "" if queued is None else f", {queued / r['count'] * 1e6:.0f} us with copies queued"
                bench.progress.say(f"engine-check: {name}: rank {r.get('rank')}: the extension's "
                                   f"create_and_map {per / r['count'] * 1e6:.0f} us per allocation{beside} "
                                   f"({r['count']} x {r['size'] >> 20} MiB)")
    return out


def what_moved(slept: dict, woke: dict) -> dict:
    """What the sleep copied and skipped (summed over ranks) and each rank's stages of the wake."""
    return {"copied_bytes": summed(slept, "last_sleep_copied_bytes"),
            "skipped_bytes": summed(slept, "last_sleep_skipped_bytes"),
            "checksum_s": checksum_seconds(slept), "sleep_stages": sleep_stages(slept),
            "wake_stages": wake_stages(woke)}


def sleep_stages(slept: dict) -> list | None:
    """Each rank's stages of its last sleep (checksum, unmaps and how many, the collection and
    cache release: the patched allocator's ``last_sleep_stages``); None where a rank keeps none."""
    stages = per_rank(slept, "last_sleep_stages")
    return stages if stages and all(stages) else None


def allocation_counts(state: dict) -> dict[str, list] | None:
    """How many allocations each tag holds on each rank (what a sleep unmaps and a wake maps),
    so that a stage's seconds can be read per allocation; None where no rank says."""
    tags = per_rank(state, "tags")
    if not any(tags):
        return None
    names = sorted({name for t in tags if t for name in t})
    return {name: [(t or {}).get(name, {}).get("allocations") for t in tags] for name in names}


def checksum_seconds(slept: dict) -> list | None:
    """Each rank's seconds for its last sleep's checksum; None where a rank keeps no such record."""
    seconds = per_rank(slept, "last_sleep_checksum_s")
    return seconds if seconds and all(s is not None for s in seconds) else None


def one_swap(bench: Bench, awake: Engine, asleep: Engine, what: str) -> tuple[float, float]:
    """(sleep seconds, wake seconds): through the servers' endpoints as ``rotate`` swaps
    (the serve driver), else through the sessions."""
    port_a, port_b = awake.ready.get("port"), asleep.ready.get("port")
    if bench.parallel.driver != "serve" or not (port_a and port_b):
        slept = awake.must("sleep", f"{what}: {awake.name}'s sleep", level=1)
        return slept["seconds"], asleep.must("wake", f"{what}: {asleep.name}'s wake")["seconds"]
    swap = rotate(Server(f"http://127.0.0.1:{port_a}"), Server(f"http://127.0.0.1:{port_b}"), bench.call_timeout,
                  check=False)
    bench.progress.say(f"engine-check: {what}: " + ", ".join(f"{s['stage']} {s['seconds']:.2f} s" for s in swap.stages))
    if not swap.swapped:
        raise Stop("fail", f"{what}: {swap.error}")
    return swap.seconds("sleep A"), swap.seconds("wake B")


def rotation_figures(ceilings: Ceilings | None, figs: dict) -> None:
    """Swap times, the first against the steady ones (and against those of its own
    direction: in one rotation one server's sleeps and the other's wakes can be the slower
    ones, measured on two H200s), a steady swap against the time its bytes take at the
    ceilings, the median steady swap against one copy of the incoming engine's weights (a
    rank's) at the H2D ceiling (the issue's target: a swap in the time of one copy), and each
    steady wake's copy (where its stages are recorded) against the H2D ceiling."""
    swaps_done = figs.get("swaps") or []
    if len(swaps_done) < 2:
        return
    times = [s["sleep_s"] + s["wake_s"] for s in swaps_done]
    steady = times[1:]
    figs.update(swaps_s=times, first_swap_s=times[0], steady_median_s=statistics.median(steady),
                steady_max_s=max(steady))
    figs["first_over_steady"] = times[0] / figs["steady_median_s"]
    if times[2::2]:  # the swaps that, like the first, put B to sleep and wake A
        figs["first_over_its_direction"] = times[0] / statistics.median(times[2::2])
    moved = max(filter(None, [figs.get("a_moved_bytes"), figs.get("b_moved_bytes")]), default=None)
    if ceilings and moved:
        figs["one_copy_s"] = ceilings.wake_seconds(moved)
        figs["ideal_swap_s"] = ceilings.sleep_seconds(moved) + figs["one_copy_s"]
        figs["steady_over_ideal"] = figs["steady_max_s"] / figs["ideal_swap_s"]
        figs["steady_over_one_copy"] = figs["steady_median_s"] / figs["one_copy_s"]
    if ceilings:
        ratios = [wake_copy_ratio(ceilings, s.get("wake_stages")) for s in swaps_done[1:]]
        figs["wake_copy_ratios"] = [r for r in ratios if r is not None]
