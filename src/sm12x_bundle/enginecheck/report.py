"""The engine check's results: the verdict, the table, the JSON (and back, for the tests).

Each scenario ends in ``pass``, ``fail`` (the engine did not do what it must, or a figure
missed) or ``error`` (the scenario could not set up what it judges). On the pristine tree
a failure is data: it is shown beside the patched tree's column, never a crash of the
check. The verdict reads the tree under test (patched with --compare, else the installed
one): every scenario passes and every measured target holds; with --compare, patched is
never worse than pristine on any scenario or target. Then the exit code is 0, else 9.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..errors import VerifyError
from . import targets as targets_mod
from .bench import Finding
from .plan import SCENARIOS

PASS, FAIL, ERROR = "pass", "fail", "error"
SCHEMA = 1
EXIT_FAILED = VerifyError.exit_code
_RANK = {PASS: 2, FAIL: 1, ERROR: 0}


@dataclass
class ScenarioResult:
    scenario: str  # a, b, c, d1, d2, e
    tree: str  # installed, pristine, patched
    outcome: str
    reason: str
    seconds: float = 0.0
    figures: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)  # name -> {"held", "words"}

    @classmethod
    def of(cls, finding: Finding, seconds: float) -> ScenarioResult:
        outcome, reason = finding.outcome()
        checks = {name: {"held": held, "words": words} for name, (held, words) in finding.checks.items()}
        return cls(finding.scenario, finding.tree, outcome, reason, seconds, finding.figures, checks)


@dataclass
class Report:
    mode: str  # "installed" or "compare"
    quick: bool
    lane: str
    install: dict  # root, version, version_from
    card: dict  # gpu name, driver, memory (NVML)
    date: str
    trees: list[dict]  # label, root, path
    sizes: dict
    ceilings: dict | None
    results: list[ScenarioResult]
    copy: dict | None = None  # the patched copy: files replaced, linked, the native build
    versions: dict = field(default_factory=dict)  # tree -> what its engine imported: vllm, torch, cuda, python
    cleanup: dict = field(default_factory=dict)  # GPU memory after every process ended
    cards: list = field(default_factory=list)  # every GPU an engine spreads over (NVML)
    engine_settings: dict = field(default_factory=dict)  # driver, TP, PP, graphs, the vLLM flags passed on

    @property
    def judged(self) -> str:
        return "patched" if self.mode == "compare" else self.trees[0]["label"]

    def labels(self) -> list[str]:
        return [t["label"] for t in self.trees]

    def result(self, tree: str, scenario: str) -> ScenarioResult | None:
        return next((r for r in self.results if r.tree == tree and r.scenario == scenario), None)

    def scenario_keys(self) -> list[str]:
        ran = {r.scenario for r in self.results}
        return [s.key for s in SCENARIOS if s.key in ran]

    def targets(self) -> dict[str, dict[str, dict]]:
        """{tree: {target: {holds, value, words}}}."""
        return {label: targets_mod.evaluate(self.results, label, self.quick) for label in self.labels()}


# --- the verdict ----------------------------------------------------------------------


def worse(report: Report) -> list[str]:
    """Where patched is worse than pristine: a scenario or a target pristine meets and it does not."""
    if report.mode != "compare":
        return []
    out = []
    for key in report.scenario_keys():
        before, after = report.result("pristine", key), report.result("patched", key)
        if before and (after is None or _RANK[after.outcome] < _RANK[before.outcome]):
            out.append(f"scenario {key}: pristine {before.outcome}, patched {after.outcome if after else 'not run'}")
    judged = report.targets()
    for key, row in judged["pristine"].items():
        if row["holds"] is True and judged["patched"][key]["holds"] is not True:
            out.append(f"target {key}: pristine holds it, patched does not")
    return out


def failures(report: Report) -> list[str]:
    """Why the verdict does not hold (empty: it holds)."""
    tree = report.judged
    out = [f"scenario {r.scenario} on {tree}: {r.outcome}" for r in report.results
           if r.tree == tree and r.outcome != PASS]
    out += [f"target {k} on {tree}: {row['value']}" for k, row in report.targets()[tree].items()
            if row["holds"] is False]
    if not report.results:
        out.append("no scenario ran")
    return out + worse(report)


def holds(report: Report) -> bool:
    return not failures(report)


def exit_code(report: Report) -> int:
    return 0 if holds(report) else EXIT_FAILED


# --- JSON -----------------------------------------------------------------------------


def to_json(report: Report) -> str:
    doc = {"schema": SCHEMA, **asdict(report), "targets": report.targets(), "not_holding": failures(report),
           "holds": holds(report), "exit_code": exit_code(report)}
    return json.dumps(doc, indent=2, sort_keys=True, default=str) + "\n"


def from_json(text: str) -> Report:
    doc = json.loads(text)
    fields = {k: doc[k] for k in Report.__dataclass_fields__ if k in doc and k != "results"}
    return Report(**fields, results=[ScenarioResult(**r) for r in doc["results"]])
