"""The engine check's serve driver: `vllm serve` driven over HTTP, as operators run it.

The server here is tests/stubs/fake_vllm_serve (vLLM's endpoints answered by a small HTTP
server, one sleeping process per rank); the driver's side is the real one: the session that
starts the server in its process group (serve_session.py), the HTTP client (endpoints.py),
the protocol, the scenario's judgement. On the GPU machine the same code drives vLLM's own
server (docs/results.md).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from sm12x_bundle.enginecheck import (
    bench,
    changed,
    failures,
    model,
    plan,
    procs,
    releases,
    scenarios,
)
from sm12x_bundle.errors import ConfigError

FAKE_VLLM = Path(__file__).parent / "stubs" / "fake_vllm_serve"
SERVE = (sys.executable, "-m", "sm12x_bundle.enginecheck.serve_session")


def settings(tp: int = 1, **more) -> str:
    return json.dumps({"model": "/nowhere", "gpu_memory_utilization": 0.5, "kv_cache_bytes": 1 << 28,
                       "max_model_len": 1024, "max_num_seqs": 8, "max_num_batched_tokens": 1024, "tp": tp,
                       "pp": 1, "eager": False, "vllm_args": [], "call_timeout": 15, "start_timeout": 60, **more})


def env(fake: str = "") -> dict:
    ours = str(Path(bench.__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_VLLM), ours]), "FAKE_SERVE": fake}


def start(groups: procs.Groups, tmp_path: Path, fake: str = "", tp: int = 1) -> procs.Child:
    child = groups.start([*SERVE, "--settings", settings(tp)], env(fake), tmp_path / "serve.log", "serve", echo=False)
    ready = child.next_message(120)
    assert ready.get("event") == "ready", ready
    return child


def test_the_serve_session_drives_sleep_wake_and_generate_over_http(tmp_path):
    with procs.groups() as groups:
        child = start(groups, tmp_path, tp=2)
        got = child.ask("generate", 30, prompts=[[1, 2], [3]], max_tokens=3)
        assert got["ok"] and got["tokens"] == [[3, 10, 17], [3, 10, 17]] and got["healthy"] is True
        slept = child.ask("sleep", 30, level=1)
        assert slept["ok"] and slept["is_sleeping"] is True
        state = child.ask("state", 30)
        assert [r["rank"] for r in state["ranks"]] == [0, 1] and state["is_sleeping"] is True
        woke = child.ask("wake", 30)
        assert woke["ok"] and woke["fully_awake"] is True
        assert child.ask("exit", 30)["ok"]


def test_the_server_gets_the_operators_settings_and_their_flags(tmp_path):
    argv = releases.serve_argv({**json.loads(settings(tp=2)), "vllm_args": ["--compilation-config", "{}"]}, 8123, "x")
    assert argv[1:5] == ["-m", "vllm.entrypoints.cli.main", "serve", "/nowhere"]
    joined = " ".join(argv)
    for flag in ("--enable-sleep-mode", "--tensor-parallel-size 2", "--pipeline-parallel-size 1", "--port 8123",
                 "--worker-extension-cls sm12x_bundle.enginecheck.probe.Probe", "--load-format dummy"):
        assert flag in joined
    assert "--enforce-eager" not in argv and argv[-2:] == ["--compilation-config", "{}"]


def test_a_fault_goes_to_one_rank_alone(tmp_path):
    with procs.groups() as groups:
        child = start(groups, tmp_path, tp=2)
        reply = child.ask("inject", 30, at="middle", rank=1)
        assert [r["installed"] for r in reply["ranks"]] == [False, True] and reply["rank"] == 1


def test_a_failed_sleep_says_what_the_server_logged_and_the_health_after_it(tmp_path):
    with procs.groups() as groups:
        child = start(groups, tmp_path, fake="fail-sleep-rank-1", tp=2)
        reply = child.ask("sleep", 30, level=1)
        assert reply["ok"] is False and "HTTP 500" in reply["error"]
        assert "rank 1" in reply["error"] and "tag 'weights', 1048576 bytes" in reply["error"]
        assert failures.names_allocation(reply["error"]) and reply["healthy"] is True


def test_a_call_that_hangs_is_a_timed_out_reply_not_a_hang(tmp_path):
    with procs.groups() as groups:
        child = start(groups, tmp_path, fake="hang-wake")
        reply = child.ask("wake", 60)
        assert reply["ok"] is False and reply["timed_out"] is True and "no answer within 15 s" in reply["error"]


def test_a_server_that_dies_at_start_is_a_failed_start_with_its_words(tmp_path):
    with procs.groups() as groups:
        child = groups.start([*SERVE, "--settings", settings()], env("exit-at-start"), tmp_path / "s.log", "serve",
                             echo=False)
        ready = child.next_message(60)
        assert ready["event"] == "failed" and "exited (code 1)" in ready["error"]
        assert "CUDA out of memory" in ready["error"]


class Gpus:
    """NVML's answers for a machine without a GPU: nothing in use, every rank on its own index."""

    def used(self) -> int:
        return 0

    def used_each(self) -> list[int]:
        return [0, 0]

    def index_of(self, rank: int) -> int:
        return rank


def serve_bench(tmp_path: Path, groups: procs.Groups, fake: str, tp: int) -> bench.Bench:
    size = plan.engine_size(plan.GiB, 80 * plan.GiB, tp)
    sizes = plan.Sizes(size, None, 2, 4, 4, 1, 0, 4, None)
    par = plan.Parallel("serve", tp=tp)
    return bench.Bench(groups, Gpus(), sizes, {"single": tmp_path / "model"}, None, None, tmp_path,
                       model.prompts(2, 4), call_timeout=15, start_timeout=60, parallel=par,
                       session=(sys.executable, str(Path(__file__).parent / "stubs" / "serve_with_fake_vllm.py"), fake))


def on_fake_server(tmp_path: Path, scenario, label: str, fake: str = "", tp: int = 2):
    """``scenario`` run on the stand-in server (``fake``: its fault flags) at ``tp`` ranks."""
    tree = plan.Tree(label, FAKE_VLLM, (FAKE_VLLM,))
    with procs.groups() as groups:
        return scenario(serve_bench(tmp_path, groups, fake, tp), tree)


def test_a_worker_killed_while_asleep_is_seen_by_every_call_within_the_timeout(tmp_path):
    f = on_fake_server(tmp_path, failures.killed_worker, "patched")
    outcome, words = f.outcome()
    assert outcome == "pass", words
    assert f.figures["killed_rank"] == 1 and f.figures["said_within_s"] < 3 * 15
    assert f.checks["health fails"][0] and f.checks["calls fail"][0] and f.checks["no call hung"][0]


def test_a_wedged_server_fails_the_killed_worker_scenario(tmp_path):
    f = on_fake_server(tmp_path, failures.killed_worker, "pristine", "wedge-after-kill")
    outcome, words = f.outcome()
    assert outcome == "fail" and "hung until the 15 s timeout" in words


def test_a_weight_changed_in_place_survives_the_next_sleep_and_wake_on_every_rank(tmp_path):
    f = on_fake_server(tmp_path, changed.weight_changed, "patched")
    outcome, words = f.outcome()
    assert outcome == "pass", words
    assert f.figures["changed"] is True and f.figures["tokens_identical"] is True
    assert [r["rank"] for r in f.figures["perturb"]] == [0, 1]
    assert [s["copied_bytes"] for s in f.figures["sleeps"]] == [2 << 20] * 3


def test_a_wake_that_restores_the_weights_from_before_the_change_fails_as_a_stale_backup(tmp_path):
    f = on_fake_server(tmp_path, changed.weight_changed, "patched", "stale-wake")
    outcome, words = f.outcome()
    assert outcome == "fail" and f.figures["tokens_identical"] is False
    assert words == f"after the wake that follows the change: {changed.STALE}; after a second sleep and wake: {changed.STALE}"
    assert [s["skipped_bytes"] for s in f.figures["sleeps"]] == [0, 2 << 20, 2 << 20]


def test_scenario_a_times_a_gc_collect_on_every_rank_over_collective_rpc(tmp_path):
    f = on_fake_server(tmp_path, scenarios.cycles, "patched")
    assert f.outcome()[0] == "pass", f.outcome()
    assert [(r["rank"], r["frozen"]) for r in f.figures["gc_collect"]] == [(0, 400_000), (1, 400_000)]


def test_the_serve_session_times_the_map_calls_on_every_rank_over_collective_rpc(tmp_path):
    with procs.groups() as groups:
        child = start(groups, tmp_path, tp=2)
        got = child.ask("maps", 30, count=50, size_mib=4, only_rank="")
        assert got["ok"], got
        assert [(r["rank"], r["count"], r["size"]) for r in got["ranks"]] == [(0, 50, 4 << 20), (1, 50, 4 << 20)]
        assert child.ask("exit", 30)["ok"]


@pytest.mark.parametrize("given, tp, pp, eager, kept, left", [
    (["--compilation-config", '{"cudagraph_mode":"FULL_AND_PIECEWISE"}'], 1, 1, False,
     ["--compilation-config", '{"cudagraph_mode":"FULL_AND_PIECEWISE"}'], []),
    (["--pipeline_parallel_size=2", "-tp", "2", "--max-num-seqs", "12"], 2, 2, False, [],
     ["--pipeline_parallel_size=2", "-tp", "2", "--max-num-seqs", "12"]),
    (["--enforce-eager", "--kv-cache-dtype", "fp8"], 1, 1, True, ["--kv-cache-dtype", "fp8"], ["--enforce-eager"]),
    (["--enforce-eager", "-O3"], 1, 1, True, ["-O3"], ["--enforce-eager"]),  # a boolean takes no value
    (["--compilation_config.mode=3"], 1, 1, False, ["--compilation_config.mode=3"], []),
])
def test_the_operators_flags_set_the_engine_and_the_checks_own_are_left_out(given, tp, pp, eager, kept, left):
    p = plan.parallel("serve", None, None, False, given)
    assert (p.tp, p.pp, p.eager, list(p.vllm_args), list(p.left_out)) == (tp, pp, eager, kept, left)


def test_the_api_refuses_a_flag_whose_value_stands_apart():
    with pytest.raises(ConfigError, match="'--compilation-config {}': with --driver api, give each flag and its value as one token"):
        plan.parallel("api", None, None, False, ["--compilation-config", "{}"])
    with pytest.raises(ConfigError, match="'-O3'"):
        plan.parallel("api", None, None, False, ["-O3"])


def test_the_api_takes_flags_as_llm_keywords():
    from sm12x_bundle.enginecheck.releases import api_keywords

    p = plan.parallel("api", None, None, False, [
        '--compilation-config={"mode":"NONE","cudagraph_mode":"FULL"}', "--sleep-mode-offload-cudagraph",
        "--tensor-parallel-size=2", "--kernel_config.ir_op_priority={\"rms_norm\":[\"native\"]}",
        "--kv-cache-dtype=fp8", "--max-num-seqs=4"])
    assert p.left_out == ("--tensor-parallel-size=2", "--max-num-seqs=4")  # the check's own
    assert api_keywords(list(p.vllm_args)) == {
        "compilation_config": {"mode": "NONE", "cudagraph_mode": "FULL"}, "sleep_mode_offload_cudagraph": True,
        "kernel_config": {"ir_op_priority": {"rms_norm": ["native"]}}, "kv_cache_dtype": "fp8"}
    assert p.to_dict()["graphs"] == "CUDA graphs, compilation as the operator's flags set it"


def test_an_api_session_starts_its_engine_with_the_operators_keywords(monkeypatch):
    import sys
    import types

    from sm12x_bundle.enginecheck import session

    seen = {}
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kw: seen.update(kw) or "engine"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(session, "facts", lambda: {})
    settings = {"model": "m", "gpu_memory_utilization": 0.5, "kv_cache_bytes": 1, "max_model_len": 8,
                "max_num_seqs": 1, "max_num_batched_tokens": 8, "eager": False,
                "vllm_args": ['--compilation-config={"mode":"NONE"}', "--enforce-eager=false"]}
    assert session.start(settings) == ("engine", {})
    assert seen["compilation_config"] == {"mode": "NONE"} and seen["enforce_eager"] is False
    assert seen["attention_backend"] == "TRITON_ATTN"


def test_sizes_are_per_gpu_when_an_engine_spreads_over_several():
    one, two = plan.engine_size(8 * plan.GiB, 80 * plan.GiB, 1), plan.engine_size(8 * plan.GiB, 80 * plan.GiB, 2)
    assert two.kv_cache_bytes * 2 == one.kv_cache_bytes
    assert two.gpu_memory_utilization < one.gpu_memory_utilization


def test_an_unknown_job_is_refused_with_the_jobs_there_are(capsys, tmp_path):
    from sm12x_bundle.cli import main

    assert main(["engine-check", "--installed", "--vllm-path", str(tmp_path), "--job", "nope"]) == 3
    assert "--job nope: no such job in the configuration (its jobs: dsv4-flash, mimo-flash)" in capsys.readouterr().err


def test_a_job_gives_the_engine_its_tp_and_flags(default_context):
    import argparse

    from sm12x_bundle.cli.engine_check import engine_settings

    args = argparse.Namespace(tp=None, pp=None, eager=False, driver="serve", vllm_arg=[], job="dsv4-flash")
    job = next(j for j in default_context.config.jobs if j.name == "dsv4-flash")
    p = engine_settings(default_context, args)
    assert p.tp == job.tensor_parallel_size and p.driver == "serve"
    assert list(p.vllm_args) + list(p.left_out) == list(job.extra_args)


def test_a_sleep_that_fails_on_one_rank_is_judged_over_every_rank(tmp_path):
    f = on_fake_server(tmp_path, failures.failing_sleep, "patched", "fail-sleep-rank-1")
    outcome, words = f.outcome()
    assert outcome == "pass", words
    assert f.figures["fault_rank"] == 1 and f.figures["fault"]["rank"] == 1
    assert f.checks["the failure names the rank"][0] and f.checks["the failure names the allocation"][0]
    # is_sleeping is judged once the scheduler is resumed, not before (vLLM counts a paused one as asleep)
    assert f.figures["is_sleeping_after_resume"] is False and f.checks["is_sleeping tells the truth"][0]


def test_the_record_names_the_allocator_switches_the_environment_sets(monkeypatch):
    """The engines inherit the check's environment: a switch set there (the skip turned off,
    say) is in the record and on the table's engine line; one unset is at the tree's default."""
    from types import SimpleNamespace

    from sm12x_bundle.enginecheck import plan, table

    for name in plan.ALLOCATOR_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    assert plan.allocator_switches() == {}
    monkeypatch.setenv("VLLM_CUMEM_SKIP_UNCHANGED", "0")
    monkeypatch.setenv("VLLM_CUMEM_MERGE_RUNS", "0")
    switches = plan.allocator_switches()
    assert switches == {"VLLM_CUMEM_SKIP_UNCHANGED": "0", "VLLM_CUMEM_MERGE_RUNS": "0"}
    report = SimpleNamespace(engine_settings={"driver": "serve", "tp": 2, "pp": 1, "graphs": "g",
                                              "allocator_switches": switches}, cards=[{"index": 0}])
    line = table.engine_line(report)[0]
    assert line.endswith("; allocator switches set: VLLM_CUMEM_SKIP_UNCHANGED=0 VLLM_CUMEM_MERGE_RUNS=0")
