"""The engine check's report as text: per scenario a table with a column per tree
(pristine beside patched), then the targets, then the verdict."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from itertools import groupby

from .plan import SCENARIOS
from .report import Report, ScenarioResult, failures, holds

GiB = 1 << 30
Cell = Callable[[dict], str]


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f} GiB"


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _ratio(x, of: str) -> str:
    return "" if x is None else f" ({x:.2f} of {of})"


def _tokens(f: dict) -> str:
    got = f.get("tokens_identical")
    return "-" if got is None else ("identical" if got else "DIFFER")


def _host(key: str) -> Cell:
    def cell(f: dict) -> str:
        core = (f.get(key) or {}).get("engine_core") or {}
        if not core:
            return "-"
        return (f"RSS {_gib(core.get('rss_bytes'))}, locked {_gib(core.get('locked_bytes'))}, "
                f"pinned {_gib(core.get('pinned_bytes'))}")

    return cell


def _later(f: dict) -> str:
    later = f.get("later_sleeps_s") or (f.get("sleeps_s") or [])[1:]
    return "-" if not later else f"{min(later):.2f}-{max(later):.2f} s" + _ratio(f.get("later_sleep_ratio"), "D2H")


def _wakes(f: dict) -> str:
    wakes = f.get("wakes_s") or []
    return "-" if not wakes else f"{min(wakes):.2f}-{max(wakes):.2f} s" + _ratio(f.get("wake_ratio"), "H2D")


def _freed(f: dict) -> str:
    freed = f.get("freed_bytes")
    first = freed[0] if isinstance(freed, list) and freed else freed
    share = f" ({f['freed_share']:.0%} of its {_gib(f.get('pool_bytes'))} pool)" if f.get("freed_share") else ""
    return _gib(first) + share


def _check(name: str) -> Callable[[ScenarioResult], str]:
    def cell(r: ScenarioResult) -> str:
        c = r.checks.get(name)
        return "-" if c is None else ("yes" if c["held"] else "NO") + f": {c['words'][:70]}"

    return cell


def _f(cell: Cell) -> Callable[[ScenarioResult], str]:
    """A cell of the figures alone."""
    return lambda r: cell(r.figures)


def _swaps(f: dict) -> str:
    if f.get("steady_median_s") is None:
        return "-"
    against = [f"{f['steady_over_ideal']:.2f}x the ceilings"] if f.get("steady_over_ideal") else []
    if f.get("steady_over_one_copy"):
        against.append(f"median {f['steady_over_one_copy']:.2f}x one H2D copy")
    return f"median {f['steady_median_s']:.2f} s, slowest {f['steady_max_s']:.2f} s" + (
        f" ({'; '.join(against)})" if against else "")


def _first_sleep(f: dict) -> str:
    first = f.get("first_sleep_s") or (f.get("sleeps_s") or [None])[0]
    return _s(first) + _ratio(f.get("first_sleep_ratio"), "D2H")


def _first_swap(f: dict) -> str:
    over, same = f.get("first_over_steady"), f.get("first_over_its_direction")
    both = f"{over:.2f}x steady" + (f", {same:.2f}x those of its direction" if same else "")
    return _s(f.get("first_swap_s")) + (f" ({both})" if over else "")


def _changed(f: dict) -> str:
    got = f.get("changed")
    return "-" if got is None else ("yes" if got else "NO (the scenario cannot judge)")


def _copied(f: dict) -> str:
    """Each sleep's copied / skipped bytes (the unchanged-skip's allocator alone says)."""
    sleeps = f.get("sleeps") or []
    if not any(s.get("copied_bytes") is not None for s in sleeps):
        return "-" if not sleeps else "not reported (no unchanged-skip)"
    return "; ".join(f"{_gib(s.get('copied_bytes'))} / {_gib(s.get('skipped_bytes'))}" for s in sleeps)


def _wake_stages(f: dict) -> str:
    """The first wake's stages on its slowest rank (the patched allocator alone says)."""
    stages = f.get("wake_stages")
    return "not reported" if not stages else _stages_line(_slowest(stages), f.get("wake_copy_ratio"))


def _slowest(stages: list[dict]) -> dict:
    """Each stage's seconds on the rank slowest at it."""
    return {k: max(r.get(k) or 0.0 for r in stages) for k in stages[0] if k.endswith("_s")}


def _stages_line(slowest: dict, copy_ratio: float | None) -> str:
    names = {"map_restored_s": "map", "copy_s": "copy", "map_emptied_s": "map discarded", "fill_emptied_s": "fill"}
    return ", ".join(f"{names.get(k, k)} {_s(v)}" + (_ratio(copy_ratio, "H2D") if k == "copy_s" else "")
                     for k, v in slowest.items())


def _swap_wakes(f: dict) -> str:
    """The steady wakes' stages: each stage's median over the swaps of its slowest rank's
    seconds, and the median of the swaps' copy ratios (each its slowest rank's)."""
    steady = [s["wake_stages"] for s in (f.get("swaps") or [])[1:] if s.get("wake_stages")]
    if not steady:
        return "-" if not f.get("swaps") else "not reported"
    per_swap = [_slowest(stages) for stages in steady]
    medians = {k: statistics.median(s.get(k) or 0.0 for s in per_swap) for k in per_swap[0]}
    ratios = f.get("wake_copy_ratios")
    return _stages_line(medians, statistics.median(ratios) if ratios else None)


def _swap_copies(f: dict) -> str:
    """Each swap's sleep: copied / skipped, a run of equal swaps as one (xN)."""
    swaps = f.get("swaps") or []
    if not any(s.get("copied_bytes") is not None for s in swaps):
        return "-"
    each = [f"{_n(s.get('copied_bytes'))} / {_n(s.get('skipped_bytes'))} GiB" for s in swaps]
    runs = [(words, len(list(same))) for words, same in groupby(each)]
    return "; ".join(words + (f" (x{n})" if n > 1 else "") for words, n in runs)


def _n(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _fill(f: dict) -> str:
    """B's background fill before its first sleep: bytes summed over ranks, the slowest
    rank's seconds, each state, and how long the check waited for it."""
    ranks = [r for r in f.get("b_fill_before_first_sleep") or [] if r]
    if not ranks:
        return "-"
    states = "/".join(dict.fromkeys(str(r.get("state")) for r in ranks))
    dropped = sum(r.get("dropped") or 0 for r in ranks)
    waited = f.get("b_fill_waited_s")
    return (f"{_gib(sum(r.get('filled_bytes') or 0 for r in ranks))} in "
            f"{_s(max(r.get('seconds') or 0.0 for r in ranks))}, {states}" + (f", {dropped} dropped" if dropped else "")
            + (f" (the check waited {_s(waited)})" if waited else ""))


def _gc(f: dict) -> str:
    """The slowest rank's one gc.collect() and the objects frozen out of it (the patched
    series freezes the worker's heap after warm-up; pristine 0.21.0 does not)."""
    ranks = [r for r in f.get("gc_collect") or [] if isinstance(r, dict) and r.get("seconds") is not None]
    if not ranks:
        return "-"
    slowest = max(ranks, key=lambda r: r["seconds"])
    shown = f"{slowest['seconds']:.2f}" if slowest["seconds"] >= 0.1 else f"{slowest['seconds']:.3f}"
    return f"{shown} s ({slowest.get('frozen', 0) or 0:,} frozen)"


def _asleep_a(f: dict) -> str:
    return _host("host_both")({"host_both": (f.get("host_both") or {}).get("A")})


ROWS: dict[str, list[tuple[str, Callable[[ScenarioResult], str]]]] = {
    "a": [("tokens after each wake", _f(_tokens)), ("first sleep", _f(_first_sleep)),
          ("later sleeps", _f(_later)), ("wakes", _f(_wakes)), ("first wake's stages", _f(_wake_stages)),
          ("GPU memory freed", _f(_freed)),
          ("offloaded", _f(lambda f: _gib(f.get("offloaded_bytes")))),
          ("engine core awake", _f(_host("host_awake"))), ("engine core asleep", _f(_host("host_asleep"))),
          ("a worker's gc.collect()", _f(_gc))],
    "b": [("tokens after reload", _f(_tokens)), ("sleep(2)", _f(lambda f: _s(f.get("sleep_s")))),
          ("GPU memory freed", _f(_freed)), ("wake", _f(lambda f: _s(f.get("wake_s")))),
          ("weights reloaded by", _f(lambda f: f"{f.get('reload') or '-'} ({_s(f.get('reload_s'))})"))],
    "c": [("tokens after every wake", _f(_tokens)), ("A's first sleep", _f(lambda f: _s(f.get("a_first_sleep_s")))),
          ("first swap", _f(_first_swap)), ("steady swaps", _f(_swaps)),
          ("sleeps copied / skipped", _f(_swap_copies)), ("steady wakes' stages", _f(_swap_wakes)),
          ("B's fill before its first sleep", _f(_fill)), ("engine A asleep", _f(_asleep_a))],
    "d1": [("fails naming the allocation", _check("the failure names the allocation")),
           ("left as before", _check("every byte still on the GPU")),
           ("serves after it", _check("served after the failed sleep")),
           ("retry", _check("after the retried sleep and wake"))],
    "d2": [("fails naming the allocation", _check("the failure names the allocation")),
           ("left as before", _check("still asleep, nothing kept mapped")),
           ("retry", _check("after the retried wake"))],
    "e": [("A's tokens after the other engine", _f(_tokens)),
          ("the other engine", _f(lambda f: str((f.get("b_engine") or {}).get("tree", "-")))),
          ("A's wake", _f(lambda f: _s(f.get("a_wake_s"))))],
    "f": [("no call hung", _check("no call hung")), ("calls fail", _check("calls fail")),
          ("/health fails", _check("health fails")),
          ("said within", _f(lambda f: _s(f.get("said_within_s"))))],
    "g": [("tokens after each wake", _f(_tokens)), ("the change moved tokens", _f(_changed)),
          ("copied / skipped per sleep", _f(_copied))],
}


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def scenario_block(report: Report, key: str) -> list[str]:
    scenario = next(s for s in SCENARIOS if s.key == key)
    labels = report.labels()
    results = [report.result(label, key) for label in labels]
    rows = [[f"{key} {scenario.title}", *labels], ["outcome", *[r.outcome.upper() if r else "-" for r in results]]]
    for name, cell in ROWS[key]:
        rows.append([name, *[cell(r) if r else "-" for r in results]])
    lines = [*_grid(rows)]
    lines += [f"  {label}: {r.reason} [{r.seconds:.0f} s]" for label, r in zip(labels, results) if r]
    return lines


def engine_line(report: Report) -> list[str]:
    """How the engines ran: the driver, TP x PP over which GPUs, graphs, the flags passed on."""
    e = report.engine_settings
    if not e:
        return []
    how = "vllm serve over HTTP" if e.get("driver") == "serve" else "the Python API (vllm.LLM)"
    gpus = ", ".join(str(c.get("index")) for c in report.cards) or "?"
    line = f"  engines: {how}, TP={e.get('tp')} x PP={e.get('pp')} on GPUs {gpus}, {e.get('graphs')}"
    if e.get("vllm_args"):
        line += f"; the operator's flags: {' '.join(e['vllm_args'])}"
    if e.get("left_out_vllm_args"):
        line += f"; left out (the check sets them): {' '.join(e['left_out_vllm_args'])}"
    if e.get("allocator_switches"):
        line += "; allocator switches set: " + " ".join(f"{k}={v}" for k, v in e["allocator_switches"].items())
    return [line]


def header(report: Report) -> list[str]:
    card = report.card
    first = (f"vLLM engine check on {card.get('name', '?')} (driver {card.get('driver', '?')}), "
             f"vLLM {report.install.get('version')} with lane {report.lane}, {report.date}")
    lines = [first, *engine_line(report)]
    said = {"patched": "a copy of pristine, the lane's series applied", "pristine": "as installed",
            "installed": "as installed"}
    for t in report.trees:
        got = report.versions.get(t["label"]) or {}
        ran = f"; its engine ran vLLM {got.get('vllm')} with torch {got.get('torch')}" if got else ""
        lines.append(f"  {t['label']}: {t['root']} ({said.get(t['label'], '')}{ran})")
    if report.copy:
        c = report.copy
        lines.append(f"  the patched copy: {len(c['replaced'])} files replaced, {c['linked']} hard-linked, "
                     f"{c['copied']} copied")
    if report.ceilings:
        lines.append(f"  copy ceilings (pinned, {report.ceilings['bytes'] / GiB:.1f} GiB): D2H "
                     f"{report.ceilings['d2h_gbps']:.1f} GB/s, H2D {report.ceilings['h2d_gbps']:.1f} GB/s")
    for key in ("single", "pair"):
        size = report.sizes.get(key)
        if size:
            what = "one engine alone" if key == "single" else "two engines, each"
            per = f" per GPU over {size['gpus']} GPUs" if size.get("gpus", 1) > 1 else ""
            lines.append(f"  {what}: {_gib(size['weight_bytes'])} of weights + {_gib(size['kv_cache_bytes'])} of KV "
                         f"cache{per} (gpu_memory_utilization {size['gpu_memory_utilization']})")
    return lines


def targets_block(report: Report) -> list[str]:
    judged = report.targets()
    labels = report.labels()
    rows = [["target", *labels]]
    for key, row in judged[labels[0]].items():
        cells = [_verdict_cell(judged[label][key]) for label in labels]
        rows.append([row["words"], *cells])
    return _grid(rows)


def _verdict_cell(row: dict) -> str:
    mark = {True: "yes", False: "NO", None: "-"}[row["holds"]]
    return f"{mark}: {row['value']}"


def table(report: Report) -> str:
    lines = header(report) + [""]
    for key in report.scenario_keys():
        lines += scenario_block(report, key) + [""]
    lines += targets_block(report) + [""]
    if report.cleanup:
        c = report.cleanup
        lines.append(f"after every process ended: GPU memory in use {_gib(c.get('used_after_bytes'))} "
                     f"(before the check: {_gib(c.get('used_before_bytes'))})"
                     + ("" if c.get("released") else " NOT RELEASED"))
    why = failures(report)
    lines.append(f"result: every target holds on {report.judged}" if holds(report)
                 else f"result: NOT holding on {report.judged}: " + "; ".join(why))
    return "\n".join(lines) + "\n"
