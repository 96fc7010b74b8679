"""One ``vllm serve`` driven over HTTP, behind the same JSON lines as session.py:

    python -m sm12x_bundle.enginecheck.serve_session --settings JSON

This is the operators' configuration: the check starts vLLM's own server (its CLI, in dev
mode, on a free port of 127.0.0.1) with the tensor- and pipeline-parallel sizes, CUDA graphs
and flags it is given, and turns each request of the protocol into the HTTP calls an
operator's rotation makes (endpoints.py). What runs inside the workers (allocator state, fault
injection, pids) is a method of probe.Probe, which vLLM mixes into every worker
(``--worker-extension-cls``) and ``/collective_rpc`` calls on every rank by name.

After every call ``/health`` is read and the reply says ``healthy``. An HTTP failure is the
reply's error, with the lines the server logged about it while the call ran. The server
runs in this process's process group: ending the group ends it and its workers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

from .. import cmd
from . import protocol, releases
from .endpoints import HttpError, Server

SERVED_NAME = "engine-check"
# Lines of the server's log that say what failed (vLLM logs the exception it answers 500 with).
_ERROR_LINE = re.compile(r"Error|Exception|error:|failed|Traceback", re.I)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeDriver:
    """The server process, its address, its log, and the protocol's commands over HTTP."""

    def __init__(self, settings: dict, log: Path | None) -> None:
        self.settings, self.log = settings, log
        self.port = free_port()
        self.server = Server(f"http://127.0.0.1:{self.port}", SERVED_NAME)
        self.timeout = float(settings.get("call_timeout", 300))
        argv = releases.serve_argv(settings, self.port, SERVED_NAME)
        # Logs go where this session's stderr goes (the check's log file).
        self.proc = cmd.start(argv, env=serve_env(), echo=False, stdout=2, stderr=2)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited (code {self.proc.returncode}) before it was ready: "
                                   f"{self.logged_errors(0)}")
            if self.server.healthy(timeout=5):
                return
            time.sleep(1.0)
        raise RuntimeError(f"vllm serve was not healthy within {timeout:.0f} s")

    def log_size(self) -> int:
        try:
            return self.log.stat().st_size if self.log else 0
        except OSError:
            return 0

    def logged_errors(self, since: int, lines: int = 4) -> str:
        """The last few error lines the server logged after byte ``since``."""
        if self.log is None:
            return ""
        try:
            with open(self.log, "rb") as f:
                f.seek(since)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        found = [line.strip() for line in text.splitlines() if _ERROR_LINE.search(line)]
        return " | ".join(found[-lines:])

    # --- the protocol's commands ----------------------------------------------------------

    def generate(self, prompts: list[list[int]], max_tokens: int) -> dict:
        return {"tokens": self.server.complete(prompts, max_tokens, self.timeout)}

    def sleep(self, level: int) -> dict:
        self.server.sleep(level, self.timeout)
        return {"is_sleeping": self.server.is_sleeping(self.timeout)}

    def wake(self, tags: list[str] | None = None) -> dict:
        self.server.wake_up(self.timeout, tags)
        asleep = self.server.is_sleeping(self.timeout)
        return {"is_sleeping": asleep, "fully_awake": not asleep}

    def inject(self, at: str = "middle", rank: int | None = None) -> dict:
        results = self.server.rpc("sm12x_inject", self.timeout, at, "" if rank is None else rank)
        return {"ranks": results, **_the_rank(results, rank)}

    def uninject(self) -> dict:
        results = self.server.rpc("sm12x_uninject", self.timeout)
        return {"ranks": results, **_the_rank(results, None, key="fired")}

    def reload(self) -> dict:
        try:
            self.server.rpc("reload_weights", self.timeout)
            return {"how": "vLLM's reload_weights"}
        except HttpError as exc:
            refused = protocol.sentence(exc)
        self.server.rpc("sm12x_reload_dummy", self.timeout)
        return {"how": "the dummy loader's load_weights again", "reload_weights_error": refused}

    def reset(self) -> dict:
        self.server.reset_prefix_cache(self.timeout)
        return {"reset": True}

    def state(self) -> dict:
        ranks = self.server.rpc("sm12x_state", self.timeout)
        first = ranks[0] if ranks and isinstance(ranks[0], dict) else {}
        return {**first, "ranks": ranks, "is_sleeping": self.server.is_sleeping(self.timeout)}

    def kill_rank(self, rank: int) -> dict:
        """SIGKILL one worker (as the OOM killer or a crash would)."""
        pids = self.server.rpc("sm12x_pid", self.timeout)
        pid = int(pids[int(rank)]["pid"])
        os.kill(pid, signal.SIGKILL)
        return {"killed_pid": pid, "pids": pids}

    def perturb(self, seed: int = 1) -> dict:
        """A weight changed in place on every rank (scenario g)."""
        return {"ranks": self.server.rpc("sm12x_perturb", self.timeout, seed)}

    def gc_time(self) -> dict:
        """One gc.collect() in every worker, timed there (scenario a)."""
        return {"ranks": self.server.rpc("sm12x_gc", self.timeout)}

    def map_times(self, count: int = 200, size_mib: int = 12, only_rank: int | str = "") -> dict:
        """The driver's map calls on ranges of each worker's own, timed there (scenario c)."""
        return {"ranks": self.server.rpc("sm12x_maps", self.timeout, count, size_mib, only_rank)}

    def leave(self) -> dict:
        return {}


def _the_rank(results: list, rank: int | None, key: str = "installed") -> dict:
    """The reply of the rank the fault is on (the first that says ``key``), for the scenarios."""
    chosen = [r for r in results if isinstance(r, dict) and r.get(key)]
    if rank is not None:
        chosen = [r for r in chosen if r.get("rank") == int(rank)] or chosen
    return dict(chosen[0]) if chosen else {}


COMMANDS = {"generate": "generate", "sleep": "sleep", "wake": "wake", "inject": "inject", "uninject": "uninject",
            "reload": "reload", "reset": "reset", "state": "state", "kill_rank": "kill_rank", "perturb": "perturb",
            "gc": "gc_time", "maps": "map_times", "exit": "leave"}


def serve_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(releases.ENGINE_ENV)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # /sleep, /wake_up, /is_sleeping, /collective_rpc
    return env


def answer(driver: ServeDriver, line: str) -> tuple[str | None, dict]:
    try:
        name, args = protocol.parse_request(line)
    except protocol.ProtocolError as exc:
        return None, protocol.failed_reply(0.0, exc)
    start, since = time.perf_counter(), driver.log_size()
    try:
        data = getattr(driver, COMMANDS[name])(**args)
        reply = protocol.ok(time.perf_counter() - start, **data)
    except Exception as exc:  # noqa: BLE001  (every failure is the reply; the session lives on)
        said = driver.logged_errors(since)
        words = f"{exc}; the server logged: {said}" if said else str(exc)
        reply = protocol.failed_reply(time.perf_counter() - start, words,
                                      timed_out=bool(getattr(exc, "timed_out", False)))
    if name != "exit":
        reply["healthy"] = driver.server.healthy(timeout=min(30.0, driver.timeout))
        reply["server_alive"] = driver.proc.poll() is None
    return name, reply


def facts(driver: ServeDriver) -> dict:
    import torch

    spec = importlib.util.find_spec("vllm")
    return {"vllm": releases.installed_version(spec), "vllm_file": spec.origin if spec else None,
            "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0],
            "pid": os.getpid(), "server_pid": driver.proc.pid, "port": driver.port, "driver": "serve",
            "argv": releases.serve_argv(driver.settings, driver.port, SERVED_NAME)}


def _log_path() -> Path | None:
    try:
        return Path(os.readlink("/proc/self/fd/2"))
    except OSError:
        return None


def start(settings: dict):
    driver = ServeDriver(settings, _log_path())
    driver.wait_ready(float(settings.get("start_timeout", 600)))
    return driver, facts(driver)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m sm12x_bundle.enginecheck.serve_session")
    p.add_argument("--settings", required=True, help="JSON: model, sizes, parallelism (plan.EngineSize.settings)")
    settings = json.loads(p.parse_args(argv).settings)
    protocol.speak(lambda: start(settings), answer)


if __name__ == "__main__":
    main()
