"""One vLLM engine driven over JSON lines (started by the check; safe to run by hand):

    python -m sm12x_bundle.enginecheck.session --settings JSON

``vllm.LLM`` starts here, with the engine core in a process of its own (V1 multiprocessing,
as ``vllm serve`` runs it); PYTHONPATH says which vLLM (the install, or the patched copy
before it). Each request runs one call of vLLM's own API and is answered with its time and
what it returned, or with the error vLLM raised, as one sentence (protocol.py). What runs
inside the engine core (allocator state, fault injection, weight reload) is a function of
inject.py sent through ``LLM.collective_rpc``. Replies go to the real stdout; everything
else printed (vLLM logs to stdout too) goes to stderr, which the check keeps in a log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from . import inject, protocol, releases


def generate(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def sleep(llm, level: int) -> dict:
    llm.sleep(level=level)
    return {}


def wake(llm, tags: list[str] | None = None) -> dict:
    awake = llm.wake_up(tags)
    return {"fully_awake": awake if isinstance(awake, bool) else None}


def inject_fault(llm, at: str = "middle", rank: int | None = None) -> dict:
    ranks = llm.collective_rpc(inject.install_on_rank, args=(at, rank))
    return {"ranks": ranks, **next((r for r in ranks if r.get("installed")), {})}


def uninject(llm) -> dict:
    ranks = llm.collective_rpc(inject.remove_host_failure)
    return {"ranks": ranks, **next((r for r in ranks if r.get("fired")), ranks[0])}


def reload(llm) -> dict:
    """vLLM's own reload_weights; where its loader cannot (the dummy loader has no weights
    to read), the dummy loader's load_weights again, which writes the same seeded values."""
    try:
        llm.collective_rpc("reload_weights")
        return {"how": "vLLM's reload_weights"}
    except Exception as exc:  # noqa: BLE001  (vLLM raises a bare Exception for a failed call)
        refused = protocol.sentence(exc)
    llm.collective_rpc(inject.reload_dummy_weights)
    return {"how": "the dummy loader's load_weights again", "reload_weights_error": refused}


def reset(llm) -> dict:
    return {"reset": bool(llm.reset_prefix_cache())}


def state(llm) -> dict:
    ranks = llm.collective_rpc(inject.allocator_state)
    return {**ranks[0], "ranks": ranks, "is_sleeping": bool(llm.llm_engine.is_sleeping())}


def kill_rank(llm, rank: int) -> dict:
    """SIGKILL one worker (as the OOM killer or a crash would)."""
    pids = llm.collective_rpc(inject.worker_pid)
    os.kill(int(pids[int(rank)]["pid"]), 9)
    return {"killed_pid": int(pids[int(rank)]["pid"]), "pids": pids}


def perturb(llm, seed: int = 1) -> dict:
    """A weight changed in place on every rank (scenario g)."""
    return {"ranks": llm.collective_rpc(inject.perturb_weights, args=(seed,))}


def gc_time(llm) -> dict:
    """One gc.collect() in every worker, timed there (scenario a)."""
    return {"ranks": llm.collective_rpc(inject.gc_collect_time)}


def map_times(llm, count: int = 200, size_mib: int = 12, only_rank: int | str = "") -> dict:
    """The driver's map calls on ranges of each worker's own, timed there (scenario c)."""
    return {"ranks": llm.collective_rpc(inject.map_call_times, args=(count, size_mib, only_rank))}


def leave(llm) -> dict:
    return {}


HANDLERS = {"generate": generate, "sleep": sleep, "wake": wake, "inject": inject_fault, "uninject": uninject,
            "reload": reload, "reset": reset, "state": state, "kill_rank": kill_rank, "perturb": perturb,
            "gc": gc_time, "maps": map_times, "exit": leave}


def facts() -> dict:
    import torch
    import vllm

    return {"vllm": getattr(vllm, "__version__", None), "vllm_file": vllm.__file__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0], "pid": os.getpid(), "driver": "api"}


def answer(llm, line: str) -> tuple[str | None, dict]:
    """(the command, its reply) for one request line."""
    try:
        cmd, args = protocol.parse_request(line)
    except protocol.ProtocolError as exc:
        return None, protocol.failed_reply(0.0, exc)
    start = time.perf_counter()
    try:
        data = HANDLERS[cmd](llm, **args)
    except Exception as exc:  # noqa: BLE001  (every failure is the reply, the session lives on)
        return cmd, protocol.failed_reply(time.perf_counter() - start, exc)
    return cmd, protocol.ok(time.perf_counter() - start, **data)


def start(settings: dict):
    from vllm import LLM

    extra = releases.api_keywords(settings.get("vllm_args", []))  # the operator's flags, as keywords
    return LLM(**{**releases.engine_kwargs(settings), **extra}), facts()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sm12x_bundle.enginecheck.session")
    p.add_argument("--settings", required=True, help="JSON: model, sizes (plan.EngineSize.settings)")
    settings = json.loads(p.parse_args(argv).settings)
    protocol.speak(lambda: start(settings), answer)


if __name__ == "__main__":
    main()
