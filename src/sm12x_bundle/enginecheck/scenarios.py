"""Scenarios a, b and e of the engine check on one tree: sleep/wake cycles, level 2, and the seeds'
cross-image sequence. (c is rotation.py; d1 and d2 are failures.py.)

Each runs vLLM's own engine through a session and returns a :class:`~.bench.Finding`: the
tokens after every wake against those before the first sleep, every call's time, the GPU
memory each sleep freed (NVML, all processes), the bytes the engine offloaded (its own
allocator, asked inside the engine core) and the host memory its engine core holds.
"""

from __future__ import annotations

from .bench import Bench, Engine, Finding, distinct_tokens, first_difference, per_rank, recording
from .ceilings import Ceilings
from .model import fresh_prompts
from .plan import Tree


def offloaded_bytes(state: dict) -> int | None:
    """Bytes the allocator holds backups of (what the sleep copied to the host)."""
    tags = state.get("tags")
    return None if tags is None else sum(t["backed_up_bytes"] for t in tags.values())


def pool_bytes(state: dict) -> int | None:
    tags = state.get("tags")
    return None if tags is None else sum(t["bytes"] for t in tags.values())


def wake_stages(state: dict) -> list[dict] | None:
    """Each rank's seconds for the stages of its last wake and the bytes it copied back (the
    patched allocator's ``last_wake_up_stages``); None where a rank keeps no such record."""
    stages = per_rank(state, "last_wake_up_stages")
    return None if not stages or not all(stages) else stages


# --- a: cycles ------------------------------------------------------------------------------


def cycles(bench: Bench, tree: Tree) -> Finding:
    f = Finding("a", tree.label)
    with recording(f), bench.engine(tree, "single", f"{tree.label}-cycles") as e:
        f.figures["engine"] = e.facts()
        ref = e.generate("generate before the first sleep")
        f.figures["distinct_tokens"] = distinct_tokens(ref)
        awake = e.state()
        f.figures.update(allocator_awake=awake, pool_bytes=pool_bytes(awake), host_awake=e.host_memory())
        for i in range(bench.sizes.cycles):
            one_cycle(bench, e, f, ref, i)
        fixed_cycles(bench, e, f, ref)
        f.figures["gc_collect"] = e.gc_collect()
    speed_figures(bench.ceilings, f.figures)
    return f


def fixed_cycles(bench: Bench, e: Engine, f: Finding, ref: list[list[int]]) -> None:
    """Then sleep/wake cycles with one fixed prompt, its tokens checked after every wake."""
    fixed, first_bad = bench.prompts[:1], None
    for i in range(bench.sizes.fixed_cycles):
        e.must("sleep", f"fixed-prompt cycle {i + 1}: sleep", level=1)
        e.must("wake", f"fixed-prompt cycle {i + 1}: wake")
        got = e.generate_these(fixed, f"fixed-prompt cycle {i + 1}")
        if first_bad is None and first_difference(ref[:1], got):
            first_bad = got
    if bench.sizes.fixed_cycles:
        f.tokens(f"{bench.sizes.fixed_cycles} fixed-prompt cycles", ref[:1], first_bad or ref[:1])


def one_cycle(bench: Bench, e: Engine, f: Finding, ref: list[list[int]], i: int) -> None:
    used_awake = bench.gpu.used()
    slept = e.must("sleep", f"sleep {i + 1}", level=1)
    f.figures.setdefault("freed_bytes", []).append(used_awake - bench.gpu.used())
    if i == 0:
        asleep = e.state()
        f.figures.update(allocator_asleep=asleep, offloaded_bytes=offloaded_bytes(asleep), host_asleep=e.host_memory())
    woke = e.must("wake", f"wake {i + 1}")
    if i == 0:
        f.figures["wake_stages"] = wake_stages(e.state())
    f.figures.setdefault("sleeps_s", []).append(slept["seconds"])
    f.figures.setdefault("wakes_s", []).append(woke["seconds"])
    if bench.sizes.fixed_cycles:  # the full run: a fresh full prefill before the reference prompts
        fresh = e.generate_these(fresh_prompts(i), f"fresh prompts after wake {i + 1}")
        f.figures.setdefault("fresh_tokens", []).append(fresh)
    f.tokens(f"cycle {i + 1}", ref, e.generate(f"generate after wake {i + 1}"))


def speed_figures(ceilings: Ceilings | None, figs: dict) -> None:
    """The first sleep, the later sleeps and the wakes as shares of the copy ceilings, and
    what the first sleep freed against the engine's whole pool (weights + KV + the rest)."""
    moved, sleeps, wakes = figs.get("offloaded_bytes"), figs.get("sleeps_s") or [], figs.get("wakes_s") or []
    if figs.get("freed_bytes") and figs.get("pool_bytes"):
        figs["freed_share"] = figs["freed_bytes"][0] / figs["pool_bytes"]
    if not (ceilings and moved and sleeps and wakes):
        return
    figs["first_sleep_s"], figs["later_sleeps_s"] = sleeps[0], sleeps[1:]
    figs["first_sleep_ratio"] = ceilings.sleep_seconds(moved) / sleeps[0]
    if sleeps[1:]:
        figs["later_sleep_ratio"] = ceilings.sleep_seconds(moved) / min(sleeps[1:])
    figs["wake_ratio"] = ceilings.wake_seconds(moved) / min(wakes)
    ratio = wake_copy_ratio(ceilings, figs.get("wake_stages"))
    if ratio is not None:
        figs["wake_copy_ratio"] = ratio


def wake_copy_ratio(ceilings: Ceilings, stages: list[dict] | None) -> float | None:
    """The slowest rank's copy back against the H2D ceiling (1.0: at the ceiling); None where
    a rank does not say how long its copy took."""
    if not stages or not all(r.get("copy_s") for r in stages):
        return None
    return min(ceilings.wake_seconds(r["copied_bytes"]) / r["copy_s"] for r in stages)


# --- b: level 2 -----------------------------------------------------------------------------


def level2(bench: Bench, tree: Tree) -> Finding:
    f = Finding("b", tree.label)
    with recording(f), bench.engine(tree, "single", f"{tree.label}-level2") as e:
        f.figures["engine"] = e.facts()
        ref = e.generate("generate before sleep(2)")
        used_awake = bench.gpu.used()
        slept = e.must("sleep", "sleep(2)", level=2)
        asleep = e.state()
        f.figures.update(sleep_s=slept["seconds"], freed_bytes=used_awake - bench.gpu.used(),
                         offloaded_bytes=offloaded_bytes(asleep), host_asleep=e.host_memory())
        woke = e.must("wake", "wake after sleep(2)")
        reloaded = e.must("reload", "reloading the weights")
        f.figures.update(wake_s=woke["seconds"], reload_s=reloaded["seconds"], reload=reloaded.get("how"),
                         reload_weights_error=reloaded.get("reload_weights_error"))
        f.tokens("after sleep(2), wake and reload", ref, e.generate("generate after the reload"))
    return f


# --- e: the seeds' cross-image sequence -----------------------------------------------------


def cross_image(bench: Bench, tree: Tree) -> Finding:
    f = Finding("e", tree.label)
    with recording(f), bench.engine(tree, "pair", f"{tree.label}-cross-A") as a:
        f.figures["engine"] = a.facts()
        ref = a.generate("A's generate before its sleep")
        f.figures["a_sleep_s"] = a.must("sleep", "A's sleep", level=1)["seconds"]
        other_engine(bench, f)
        f.figures["a_wake_s"] = a.must("wake", "A's wake after the other engine exited")["seconds"]
        f.tokens("A after the other engine", ref, a.generate("A's generate after its wake"))
    return f


def other_engine(bench: Bench, f: Finding) -> None:
    """An engine of the install as it is (pristine) starts beside sleeping A, generates and exits."""
    asleep_used = bench.gpu.used()
    with bench.engine(bench.pristine, "pair", f"{f.tree}-cross-B") as b:
        f.figures["b_engine"] = {"tree": str(bench.pristine.root), **b.facts()}
        b.generate("the other engine's generate")
    f.figures["after_b"] = bench.settle(asleep_used)
