"""`sm12x-bundle rotate`: one swap of a rotation pool over the servers' HTTP endpoints.

The two servers are tests/stubs/fake_vllm_serve (vLLM's endpoints, no GPU); the command,
its HTTP client and its rollback are the real ones.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sm12x_bundle.cli import main
from sm12x_bundle.enginecheck import serve_session
from sm12x_bundle.enginecheck.endpoints import Server

FAKE_VLLM = Path(__file__).parent / "stubs" / "fake_vllm_serve"


@pytest.fixture
def servers(tmp_path):
    """Start fake servers (flags per server); each is ended with the test."""
    started = []

    def start(flags: str = "", asleep: bool = False) -> Server:
        port = serve_session.free_port()
        env = {**os.environ, "PYTHONPATH": str(FAKE_VLLM), "FAKE_SERVE": flags}
        argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "m", "--port", str(port),
                "--served-model-name", "m"]
        started.append(subprocess.Popen(argv, env=env, stderr=open(tmp_path / f"{port}.log", "w"), start_new_session=True))
        server = Server(f"http://127.0.0.1:{port}")
        deadline = time.monotonic() + 30
        while not server.healthy(2):
            assert time.monotonic() < deadline, "the fake server did not start"
            time.sleep(0.1)
        if asleep:
            server.sleep(1, 20)
        return server

    yield start
    for proc in started:
        os.killpg(proc.pid, 9)
        proc.wait()


def rotate(capsys, a: Server, b: Server, *more: str) -> tuple[int, str]:
    code = main(["rotate", "--from", a.base, "--to", b.base, "--timeout", "20", *more])
    return code, capsys.readouterr().out


def test_a_swap_sleeps_a_wakes_b_and_checks_that_b_serves(servers, capsys):
    a, b = servers(), servers(asleep=True)
    code, out = rotate(capsys, a, b, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["swapped"] and [s["stage"] for s in doc["stages"]] == ["sleep A", "wake B", "B serves"]
    assert a.is_sleeping(20) and not b.is_sleeping(20)


def test_when_b_does_not_wake_a_is_woken_again_and_serves(servers, capsys):
    a, b = servers(), servers("fail-wake", asleep=True)
    code, out = rotate(capsys, a, b)
    assert code == 9 and "NOT swapped: --from serves again" in out
    assert "wake B: " in out and "FAILED: POST /wake_up: HTTP 500" in out
    assert not a.is_sleeping(20) and b.is_sleeping(20)
    Server(a.base, "m").complete([[1, 2]], 1, 20)  # the pool serves


def test_when_a_does_not_sleep_it_is_woken_and_b_is_left_alone(servers, capsys):
    a, b = servers("fail-sleep-rank-0"), servers(asleep=True)
    code, out = rotate(capsys, a, b)
    assert code == 9 and "sleep A: " in out and "wake A again" in out and "wake B" not in out
    assert b.is_sleeping(20)


def test_when_neither_serves_the_exit_code_says_so(servers, capsys):
    b = servers(asleep=True)
    code, out = rotate(capsys, Server("http://127.0.0.1:9"), b)
    assert code == 8 and "NOT swapped, and --from does not serve" in out


@pytest.mark.parametrize("bad", ["127.0.0.1:8000", "ftp://x", "http://", "http://a b"])
def test_an_address_that_is_not_a_url_is_refused_before_anything_is_sent(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["rotate", "--from", bad, "--to", "http://127.0.0.1:9"])
    assert exit_.value.code == 2
    assert "must be an http:// or https:// address" in capsys.readouterr().err


def test_the_engine_checks_rotation_warms_its_client_on_each_server_first(servers):
    """A process's first urllib request also sets urllib up (33 ms against 1 ms after, on
    the GPU machine): the rotation scenario makes two requests to each server before it
    times the first swap, and records them."""
    from types import SimpleNamespace

    from sm12x_bundle.enginecheck import rotation

    a, b = servers(), servers(asleep=True)
    engines = {name: SimpleNamespace(ready={"port": int(s.base.rsplit(":", 1)[1])}) for name, s in (("A", a), ("B", b))}
    seconds = rotation.warm_client(SimpleNamespace(call_timeout=20), engines)
    assert len(seconds) == 4 and all(0 < s < 20 for s in seconds)
    assert b.json("GET", "/is_sleeping", 20) == {"is_sleeping": True}  # asked, not changed
    no_port = {"A": SimpleNamespace(ready={})}
    assert rotation.warm_client(SimpleNamespace(call_timeout=20), no_port) == []
