"""The selftest's results: the verdict, the table, the JSON.

A scenario ends in one of three outcomes: ``pass``; ``fail`` (the bug the scenario
looks for showed, or a figure missed its target); ``error`` (the scenario could not
do what it needs to judge, e.g. a wake that should fail for lack of memory did not).
Comparing trees, a fix is proven only when the pristine tree *fails* and the patched
tree passes; an error on either side proves nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..errors import VerifyError
from .plan import SCENARIOS, Scenario

PASS, FAIL, ERROR = "pass", "fail", "error"
OUTCOMES = (PASS, FAIL, ERROR)
EXIT_FAILED = VerifyError.exit_code
SCHEMA = 1


@dataclass
class ScenarioResult:
    scenario: str
    target: str
    outcome: str
    reason: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {self.outcome!r}")


@dataclass
class TargetInfo:
    label: str
    tree: str | None  # None: the installed vLLM
    cumem_py: str
    extension: str
    build: list[str] | None = None  # the compiler command, when built here
    placeholders: list[str] = field(default_factory=list)  # vllm._C & co., absent from a source tree
    platform: str | None = None  # the vLLM platform class cumem.py saw
    version: str | None = None  # the vLLM release the tree says it is (vllm.__version__)


@dataclass
class Report:
    mode: str  # "single" or "compare"
    targets: list[TargetInfo]
    environment: dict
    sizes: dict
    results: list[ScenarioResult]

    def result(self, target: str, scenario: str) -> ScenarioResult | None:
        for r in self.results:
            if r.target == target and r.scenario == scenario:
                return r
        return None

    def version(self) -> str | None:
        """The release under test (the pristine tree's when comparing): it decides
        which bug scenarios upstream has fixed, and so only guard."""
        for t in self.targets:
            if t.label == "pristine":
                return t.version
        return self.targets[0].version if self.targets else None

    def scenarios(self) -> list[Scenario]:
        names = {r.scenario for r in self.results}
        return [s for s in SCENARIOS if s.name in names]


# --- the verdict ----------------------------------------------------------------------


def row_verdict(report: Report, scenario: Scenario) -> tuple[bool, str]:
    """(holds, words) for one scenario of the report."""
    if report.mode != "compare":
        r = report.result(report.targets[0].label, scenario.name)
        return (r is not None and r.outcome == PASS), (r.outcome if r else "not run")
    before, after = report.result("pristine", scenario.name), report.result("patched", scenario.name)
    if after is None or after.outcome != PASS:
        return False, "patched does not pass"
    if scenario.guards(report.version()):
        seen = before.outcome.upper() if before else "not run"
        upstream = "" if scenario.guard else f"; fixed upstream from {scenario.upstream_from}"
        return True, f"regression guard (pristine {seen}{upstream}): not a proof"
    if not scenario.proves(report.version()):
        return True, "pass"
    if before is None:
        return False, "pristine not run"
    if before.outcome == PASS:
        return False, "no teeth: pristine passes too"
    if before.outcome == ERROR:
        return False, "inconclusive: pristine could not run it"
    return True, "proven: fails on pristine, passes on patched"


def holds(report: Report) -> bool:
    return bool(report.results) and all(row_verdict(report, s)[0] for s in report.scenarios())


def exit_code(report: Report) -> int:
    """0 when every scenario passes (comparing: each fix is proven and the patched
    tree passes everything), else VerifyError's code."""
    return 0 if holds(report) else EXIT_FAILED


# --- output ---------------------------------------------------------------------------


def to_json(report: Report) -> str:
    doc = {
        "schema": SCHEMA,
        "mode": report.mode,
        "targets": [asdict(t) for t in report.targets],
        "environment": report.environment,
        "sizes": report.sizes,
        "results": [asdict(r) for r in report.results],
        "verdict": {
            s.name: {"holds": ok, "words": words}
            for s in report.scenarios()
            for ok, words in [row_verdict(report, s)]
        },
        "holds": holds(report),
        "exit_code": exit_code(report),
    }
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def from_json(text: str) -> Report:
    doc = json.loads(text)
    return Report(
        mode=doc["mode"],
        targets=[TargetInfo(**t) for t in doc["targets"]],
        environment=doc["environment"],
        sizes=doc["sizes"],
        results=[ScenarioResult(**r) for r in doc["results"]],
    )


def _environment_line(env: dict) -> str:
    if not env:
        return "GPU: unknown"
    parts = [f"{env.get('gpu', '?')} (sm_{env.get('capability', '?').replace('.', '')})"]
    parts.append(f"driver {env.get('driver', '?')}")
    parts.append(f"torch {env.get('torch', '?')}")
    if env.get("cuda"):
        parts.append(f"CUDA {env['cuda']}")
    if env.get("free_bytes") is not None:
        parts.append(f"{env['free_bytes'] / (1 << 30):.1f} GiB free")
    return ", ".join(parts)


def _grid(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def table(report: Report) -> str:
    lines = [f"vLLM cumem selftest on {_environment_line(report.environment)}"]
    for t in report.targets:
        where = t.tree or "installed vLLM"
        platform = f" (vLLM platform: {t.platform})" if t.platform else ""
        lines.append(f"  {t.label}: {where}{platform}")
        if t.placeholders:
            lines.append(f"    placeholders for compiled modules the tree lacks: {', '.join(t.placeholders)}")
    lines.append("")
    labels = [t.label for t in report.targets]
    rows = [["#", "scenario", *labels, "verdict"]]
    for s in report.scenarios():
        cells = []
        for label in labels:
            r = report.result(label, s.name)
            cells.append(r.outcome.upper() if r else "-")
        ok, words = row_verdict(report, s)
        rows.append([str(s.number), s.title, *cells, words if report.mode == "compare" else ("ok" if ok else "NOT OK")])
    lines += _grid(rows)
    lines.append("")
    for s in report.scenarios():
        for label in labels:
            r = report.result(label, s.name)
            if r is not None:
                lines.append(f"{s.number} {label}: {r.reason} [{r.seconds:.1f} s]")
    lines.append("")
    lines.append(_summary(report))
    return "\n".join(lines) + "\n"


def _summary(report: Report) -> str:
    if report.mode == "compare":
        if holds(report):
            return "result: every fix is proven (the pristine tree fails each bug scenario, the patched tree passes all)"
        return "result: NOT proven (see the verdict column)"
    return "result: all scenarios pass" if holds(report) else "result: some scenario did not pass"
