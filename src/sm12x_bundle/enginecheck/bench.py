"""What every scenario has at hand: engines to start, the GPU to read, what it found.

:class:`Engine` is the parent's side of one session (session.py) in its own process group;
every call is bounded by a timeout, and a call that fails, times out or finds the session
dead is a reply like any other: the scenario records it as data. :class:`Finding` collects
a scenario's figures and checks; a step the scenario cannot go on without raises
:class:`Stop`, which ends the scenario with the words of that step.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import sm12x_bundle

from ..progress import Progress
from . import gpu, hostmem, procs, releases
from .ceilings import Ceilings
from .plan import EngineSize, Parallel, Sizes, Tree

MiB = 1 << 20
# How an engine session is started, by driver (the tests start their stand-in instead).
SESSIONS = {"api": (sys.executable, "-m", "sm12x_bundle.enginecheck.session"),
            "serve": (sys.executable, "-m", "sm12x_bundle.enginecheck.serve_session")}
SESSION = SESSIONS["api"]
# What the driver may still hold a moment after every process of a scenario ended.
RELEASE_SLACK = 256 * MiB


class Stop(Exception):
    """A step the scenario cannot go on without: ``outcome`` is fail (the engine did not do
    what it must) or error (the scenario could not set up what it needs to judge)."""

    def __init__(self, outcome: str, words: str) -> None:
        super().__init__(words)
        self.outcome, self.words = outcome, words


def child_env(path: Sequence[Path], work: Path) -> dict[str, str]:
    """A child's environment: the vLLM under test (and this package) importable, bytecode
    under the work folder (never written into a tree), the engine settings."""
    env = dict(os.environ)
    ours = str(Path(sm12x_bundle.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([*map(str, path), ours, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.update(releases.ENGINE_ENV)
    env.update(gpu.DEVICE_ORDER)
    return env


def settle(nvml: gpu.Nvml, baseline: int) -> dict:
    """Wait (up to a minute) for the GPU memory in use to come back to ``baseline``: the
    driver frees a process's memory shortly after it ends."""
    used = nvml.wait_used_at_most(baseline + RELEASE_SLACK, timeout=60)
    return {"used_before_bytes": baseline, "used_after_bytes": used, "released": used <= baseline + RELEASE_SLACK}


@dataclass
class Bench:
    groups: procs.Groups
    gpu: gpu.Gpus
    sizes: Sizes
    models: dict[str, Path]  # "single" / "pair" -> the model folder
    ceilings: Ceilings | None
    pristine: Tree  # where scenario e's engine B comes from
    work: Path
    prompts: list[list[int]]
    call_timeout: float = 300.0
    start_timeout: float = 600.0
    progress: Progress = field(default_factory=Progress.quiet)
    parallel: Parallel = field(default_factory=lambda: Parallel(driver="api"))
    session: tuple[str, ...] | None = None  # None: the driver's (SESSIONS)

    def session_argv(self) -> tuple[str, ...]:
        return self.session or SESSIONS[self.parallel.driver]

    def size(self, key: str) -> EngineSize:
        size = getattr(self.sizes, key)
        assert size is not None, f"no {key} engine size was planned"
        return size

    @contextmanager
    def engine(self, tree: Tree, key: str, name: str) -> Iterator[Engine]:
        """An engine of the ``key`` size from ``tree``, ended when the block ends."""
        e = Engine(self, tree, key, name)
        try:
            yield e
        finally:
            e.close()

    def holder(self, name: str, rank: int = 0) -> procs.Child:
        """Another process that takes memory on the GPU of ``rank`` (its device is the rank's)."""
        argv = [sys.executable, "-m", "sm12x_bundle.enginecheck.holder"]
        env = {**child_env([], self.work), "CUDA_VISIBLE_DEVICES": str(self.gpu.index_of(rank))}
        return self.groups.start(argv, env, self.work / "logs" / f"{name}.log", name)

    def settle(self, baseline: int) -> dict:
        return settle(self.gpu, baseline)


class Engine:
    """One session: a vLLM engine from one tree, driven call by call."""

    def __init__(self, bench: Bench, tree: Tree, key: str, name: str) -> None:
        self.bench, self.tree, self.name, self.size = bench, tree, name, bench.size(key)
        settings = {**self.size.settings(bench.models[key]), **bench.parallel.settings(),
                    "call_timeout": bench.call_timeout, "start_timeout": bench.start_timeout}
        argv = [*bench.session_argv(), "--settings", json.dumps(settings)]
        p = bench.parallel
        bench.progress.say(f"engine-check: {name}: starting vLLM from {tree.root} "
                           f"({self.size.weight_bytes / (1 << 30):.2f} GiB of weights; {p.driver}, TP={p.tp}, "
                           f"PP={p.pp}, {'eager' if p.eager else 'CUDA graphs'})")
        self.child = bench.groups.start(argv, child_env(tree.path, bench.work), bench.work / "logs" / f"{name}.log", name)
        self.ready = self.child.next_message(bench.start_timeout)
        if self.ready.get("event") != "ready":
            words = self.ready.get("error", "no answer")
            self.child.kill()  # a session that did not start answers nothing more
            raise Stop("error", f"{name}: the engine did not start: {words} (log: {self.child.log})")
        self.loaded = self._loaded_from_tree()

    def _loaded_from_tree(self) -> dict:
        """Where the engine's vllm, cumem.py and cumem extension came from: all from the tree
        under test, or the scenario would judge another vLLM (an error, said so)."""
        state = self.state()
        loaded = {k: self.ready.get("vllm_file") if k == "vllm_file" else state.get(k)
                  for k in ("vllm_file", "cumem_py", "extension")}
        root = self.tree.root.resolve()
        strays = [f"{k} {v}" for k, v in loaded.items() if v is not None and not Path(v).resolve().is_relative_to(root)]
        if strays:
            self.child.kill()
            raise Stop("error", f"{self.name}: the engine loaded {', '.join(strays)}, not from {root}")
        return loaded

    def call(self, cmd: str, timeout: float | None = None, **args) -> dict:
        reply = self.child.ask(cmd, timeout or self.bench.call_timeout, **args)
        status = "ok" if reply.get("ok") else f"FAILED: {reply.get('error')}"
        shown = " ".join(f"{k}={v}" for k, v in args.items() if k != "prompts")
        self.bench.progress.say(f"engine-check: {self.name}: {cmd} {shown} {reply.get('seconds', 0):.2f} s {status}")
        return reply

    def must(self, cmd: str, what: str, **args) -> dict:
        """A call the scenario cannot go on without: its failure ends the scenario (fail)."""
        reply = self.call(cmd, **args)
        if not reply.get("ok"):
            raise Stop("fail", f"{what} failed: {reply.get('error')}")
        return reply

    def generate(self, what: str) -> list[list[int]]:
        return self.generate_these(self.bench.prompts, what)

    def generate_these(self, prompts: list[list[int]], what: str) -> list[list[int]]:
        return self.must("generate", what, prompts=prompts, max_tokens=self.bench.sizes.max_tokens)["tokens"]

    def state(self) -> dict:
        reply = self.call("state")
        return reply if reply.get("ok") else {"error": reply.get("error")}

    def gc_collect(self) -> list | None:
        """Every rank's one timed gc.collect() (inject.gc_collect_time)."""
        return self.measured("gc", "gc.collect() not timed")

    def map_calls(self, only_rank: int | str = "") -> list | None:
        """Every rank's driver map calls on ranges of its own (inject.map_call_times)."""
        return self.measured("maps", "the map calls not timed", only_rank=only_rank)

    def measured(self, cmd: str, failed: str, **args) -> list | None:
        """Every rank's reply to a measuring command; None where the call failed, said in
        the progress output: a measurement, never a reason to fail."""
        reply = self.call(cmd, **args)
        ranks = reply.get("ranks") if reply.get("ok") else None
        if not isinstance(ranks, list):
            self.bench.progress.say(f"engine-check: {self.name}: {failed}: "
                                    f"{reply.get('error') or 'the reply lists no ranks'}")
            return None
        return ranks

    def host_memory(self) -> dict:
        return hostmem.snapshot(self.child.pid)

    def facts(self) -> dict:
        keys = ("vllm", "torch", "cuda", "python", "seconds", "driver", "argv")
        return {**{k: self.ready.get(k) for k in keys}, **self.loaded}

    def close(self) -> None:
        if self.child.alive():
            self.child.ask("exit", 60)
        self.child.kill()


def first_difference(want: list[list[int]], got: list[list[int]]) -> str | None:
    """Where two generations part (None: identical), in words."""
    if len(want) != len(got):
        return f"{len(got)} outputs for {len(want)} prompts"
    for i, (a, b) in enumerate(zip(want, got)):
        if a != b:
            at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return f"prompt {i}, token {at}: {a[at:at + 3]} became {b[at:at + 3]}"
    return None


@dataclass
class Finding:
    """A scenario's record on one tree: figures, named checks, and how it ended."""

    scenario: str
    tree: str
    figures: dict = field(default_factory=dict)
    checks: dict = field(default_factory=dict)  # name -> (held, words)
    stopped: Stop | None = None

    def check(self, name: str, held: bool, words: str) -> bool:
        self.checks[name] = (bool(held), words)
        return bool(held)

    def tokens(self, name: str, want: list[list[int]], got: list[list[int]]) -> bool:
        """Identical greedy tokens, recorded under ``tokens_identical`` (all of them so far)."""
        differs = first_difference(want, got)
        self.figures["tokens_identical"] = self.figures.get("tokens_identical", True) and differs is None
        return self.check(name, differs is None, "identical tokens" if differs is None else f"tokens differ: {differs}")

    def outcome(self) -> tuple[str, str]:
        """(pass | fail | error, the words that say why)."""
        failed = [f"{name}: {words}" for name, (held, words) in self.checks.items() if not held]
        if self.stopped is not None:
            return self.stopped.outcome, "; ".join([*failed, self.stopped.words])
        if failed:
            return "fail", "; ".join(failed)
        return "pass", "; ".join(f"{name}: {words}" for name, (_, words) in self.checks.items())


@contextmanager
def recording(finding: Finding) -> Iterator[Finding]:
    """Run a scenario's body; a Stop ends it with its words, as data."""
    try:
        yield finding
    except Stop as stop:
        finding.stopped = stop


def per_rank(state: dict, key: str) -> list:
    """``key`` of every rank's allocator state (an engine's state lists its ranks under
    ``ranks``; one rank's state stands alone); None for a rank that does not report it."""
    return [r.get(key) if isinstance(r, dict) else None for r in state.get("ranks") or [state]]


def summed(state: dict, key: str) -> int | None:
    """A per-rank figure summed over every rank; None where a rank does not report it."""
    values = per_rank(state, key)
    return None if not values or any(v is None for v in values) else sum(values)


def distinct_tokens(tokens: list[list[int]]) -> int:
    """How many different tokens a generation holds: identical runs of one repeated token
    would prove little, so the report shows it."""
    return len({t for row in tokens for t in row})
