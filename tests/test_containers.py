"""The container engine: error messages without a daemon, the probe script run by the
host's Python, and the Docker SDK implementation against a real daemon (marker docker).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from docker_support import daemon, standin_base, standin_novllm, standin_official, standin_opt  # noqa: F401

from sm12x_bundle import containers as engine_mod
from sm12x_bundle.containers import OFFICIAL_VLLM_ROOT, DockerEngine, Mount, docker_engine, probe_vllm
from sm12x_bundle.errors import CommandError, EngineError
from sm12x_bundle.progress import Progress

# --- no daemon ------------------------------------------------------------------------


def test_unreachable_daemon_is_a_clear_engine_error(tmp_path, monkeypatch):
    dead = f"unix://{tmp_path}/dead.sock"
    monkeypatch.setenv("DOCKER_HOST", dead)
    engine = docker_engine()  # makes no connection yet
    for call in (engine.ping, lambda: engine.image_id("x:1"), lambda: engine.read_files("x:1", ["/a"])):
        with pytest.raises(EngineError) as err:
            call()
        assert f"the Docker daemon at {dead} does not answer" in str(err.value)
        # advice a pip user can follow: nothing that only the repository has
        assert "dockerd" in str(err.value) and "set DOCKER_HOST" in str(err.value)
        assert ".ci/" not in str(err.value)


def test_default_socket_is_named_when_docker_host_is_unset(monkeypatch):
    monkeypatch.delenv("DOCKER_HOST", raising=False)
    assert "DOCKER_HOST is unset" in engine_mod.daemon_address()


def test_build_stream_errors_and_colours():
    said: list[str] = []

    class Capture(Progress):
        def say(self, text: str) -> None:
            said.append(text)

    stream = [{"stream": "Step 1/2 : FROM x\n"}, {"stream": "\x1b[91mcompiler says no\n\x1b[0m"},
              {"error": "The command '/bin/sh -c make' returned a non-zero code: 1"}]
    with pytest.raises(CommandError) as err:
        engine_mod._follow_build(iter(stream), "t:1", Capture())
    assert "docker build of t:1 failed" in str(err.value) and "compiler says no" in str(err.value)
    assert said == ["build: Step 1/2 : FROM x", "build: compiler says no"]
    assert engine_mod._follow_build(iter([{"aux": {"ID": "sha256:abc"}}]), "t", Progress.quiet()) == "sha256:abc"
    with pytest.raises(EngineError, match="without an image id"):
        engine_mod._follow_build(iter([{"stream": "hm\n"}]), "t", Progress.quiet())


class ScriptedEngine:
    """Answers run() with a fixed exit code and output."""

    def __init__(self, code: int, out: str):
        self.code, self.out = code, out

    def run(self, ref, argv, **kwargs):
        return self.code, self.out


def probe_answer(**fields) -> str:
    answer = {"root": "", "found": [], "versions": {}, "import_error": "x", "files": {}, "bytecode": {}}
    return "noise\nSM12X-PROBE " + json.dumps({**answer, **fields}) + "\n"


def test_probe_reports_no_vllm_several_and_no_python():
    with pytest.raises(EngineError, match="image i:1 holds no vLLM"):
        probe_vllm(ScriptedEngine(0, probe_answer()), "i:1")
    with pytest.raises(EngineError, match=r"several vLLM packages \(/a/vllm, /b/vllm\).*root:"):
        probe_vllm(ScriptedEngine(0, probe_answer(found=["/a/vllm", "/b/vllm"])), "i:1")
    with pytest.raises(EngineError, match="could not be asked.*exit code 127"):
        probe_vllm(ScriptedEngine(127, "sh: python3: not found"), "i:1")
    probe = probe_vllm(ScriptedEngine(0, probe_answer(root="/r/vllm", versions={"vllm": "1", "flashinfer-python": "2"},
                                                      import_error=None)), "i:1")
    assert probe.root == "/r/vllm" and probe.importable
    assert probe.versions == {"vllm": "1", "torch": None, "triton": None, "flashinfer": "2", "deep_gemm": None}


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def run_probe(root: str, paths: list[str], search: list[str]) -> dict:
    """The probe script, run by the host's Python over a folder (no container)."""
    proc = subprocess.run(
        [sys.executable, "-c", engine_mod._PROBE, root, json.dumps(paths), *search],
        capture_output=True, text=True, check=True, cwd="/",
    )
    return json.loads(proc.stdout.strip().splitlines()[-1].split(" ", 1)[1])


def test_probe_script_reads_files_bytecode_and_versions(tmp_path):
    root = tmp_path / "site" / "vllm"
    (root / "device_allocator" / "__pycache__").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "_version.py").write_text("__version__ = version = '0.21.0'\n")
    (root / "device_allocator" / "cumem.py").write_text("x = 1\n")
    (root / "device_allocator" / "__pycache__" / "cumem.cpython-312.pyc").write_bytes(b"")
    answer = run_probe(str(root), ["vllm/device_allocator/cumem.py", "vllm/missing.py"], [])
    assert answer["root"] == str(root) and answer["versions"]["vllm"] == "0.21.0"
    assert answer["files"]["vllm/missing.py"] is None
    assert answer["bytecode"]["vllm/device_allocator/cumem.py"] == [
        str(root / "device_allocator" / "__pycache__" / "cumem.cpython-312.pyc")
    ]
    assert answer["import_error"] is None  # this vllm/ imports (it needs nothing)
    # the mode of each file read, as the image has it (an executable envs.py stays 0755)
    assert answer["modes"] == {"vllm/device_allocator/cumem.py": 0o644 & ~_umask()}
    (root / "envs.py").write_text("x = 2\n")
    (root / "envs.py").chmod(0o755)
    assert run_probe(str(root), ["vllm/envs.py"], [])["modes"] == {"vllm/envs.py": 0o755}
    # no root given and no vllm on sys.path: the search finds it, skipping tests/ folders
    (tmp_path / "site" / "tests" / "vllm").mkdir(parents=True)
    (tmp_path / "site" / "tests" / "vllm" / "__init__.py").write_text("")
    assert run_probe("", [], [str(tmp_path)])["root"] == str(root)


# --- a real daemon ---------------------------------------------------------------------


@pytest.mark.docker
def test_missing_image(daemon):
    for call in (daemon.image_id, daemon.image_labels, lambda r: daemon.read_files(r, ["/x"]),
                 lambda r: daemon.run(r, ["true"])):
        with pytest.raises(EngineError, match="image sm12x-test/absent:0 not found"):
            call("sm12x-test/absent:0")


@pytest.mark.docker
def test_read_files_without_starting(daemon: DockerEngine, standin_base):
    before = {c.id for c in daemon.client.containers.list(all=True)}
    got = daemon.read_files(standin_base, ["/etc/debian_version", "/usr/bin/python3", "/nope", "/usr"])
    assert got["/etc/debian_version"].startswith(b"12.")
    # /usr/bin/python3 is a symlink to python3.11: the file itself comes back
    assert got["/usr/bin/python3"] == daemon.read_files(standin_base, ["/usr/bin/python3.11"])["/usr/bin/python3.11"]
    assert got["/usr/bin/python3"].startswith(b"\x7fELF")
    assert got["/nope"] is None and got["/usr"] is None
    assert {c.id for c in daemon.client.containers.list(all=True)} == before  # nothing left behind


@pytest.mark.docker
def test_modes_come_from_the_image(daemon: DockerEngine, standin_official):
    """The archive's header and the probe both give a file's mode as the image holds it:
    vLLM 0.21.0's envs.py is 0755 in the sdist, and so in the stand-in."""
    envs, cumem = OFFICIAL_VLLM_ROOT + "/envs.py", OFFICIAL_VLLM_ROOT + "/device_allocator/cumem.py"
    got = daemon.read_entries(standin_official.ref, [envs, cumem, "/usr/bin/python3", "/nope"])
    assert (got[envs].mode, got[cumem].mode) == (0o755, 0o644)
    assert got["/usr/bin/python3"].mode == 0o755 and got["/nope"] is None  # a symlink's target's mode
    probe = probe_vllm(daemon, standin_official.ref, paths=["vllm/envs.py", "vllm/device_allocator/cumem.py"])
    assert probe.modes == {"vllm/envs.py": 0o755, "vllm/device_allocator/cumem.py": 0o644}


@pytest.mark.docker
def test_tag_and_repo_digests(daemon: DockerEngine, standin_base):
    """An image built or imported here has no RepoDigests; a local tag names the same image."""
    image_id = daemon.image_id(standin_base)
    assert daemon.repo_digests(image_id) == []
    daemon.tag(image_id, "sm12x-test/tagged", "1")
    assert daemon.image_id("sm12x-test/tagged:1") == image_id


@pytest.mark.docker
def test_run_has_no_network_and_mounts_read_only(daemon, standin_base, tmp_path):
    (tmp_path / "f.txt").write_text("hello\n")
    # The shell's complaint about the read-only mount goes to /dev/null: Docker copies
    # stdout and stderr separately, so their lines may interleave in any order.
    script = "cat /m/f.txt; ls /sys/class/net; { echo x > /m/g.txt; } 2>/dev/null || echo read-only; exit 3"
    code, out = daemon.run(standin_base, ["sh", "-c", script], mounts=[Mount(tmp_path, "/m")])
    assert code == 3
    lines = out.split()
    assert lines[:2] == ["hello", "lo"] and "read-only" in out
    assert not (tmp_path / "g.txt").exists()


@pytest.mark.docker
def test_run_a_missing_program(daemon, standin_base):
    with pytest.raises(EngineError, match="no-such-program"):
        daemon.run(standin_base, ["no-such-program"])


@pytest.mark.docker
def test_build_failure_and_success(daemon, standin_base, tmp_path):
    (tmp_path / "Dockerfile").write_text(f"FROM {standin_base}\nRUN echo building; exit 4\n")
    with pytest.raises(CommandError, match="returned a non-zero code: 4"):
        daemon.build(tmp_path, "Dockerfile", "sm12x-test/fails:1", {}, Progress.quiet())
    (tmp_path / "Dockerfile").write_text(f'FROM {standin_base}\nLABEL a="1"\n')
    image_id = daemon.build(tmp_path, "Dockerfile", "sm12x-test/ok:1", {}, Progress.quiet())
    assert daemon.image_id("sm12x-test/ok:1") == image_id
    assert daemon.image_labels(image_id)["a"] == "1"


@pytest.mark.docker
def test_probe_official_root(daemon, standin_official):
    probe = probe_vllm(daemon, standin_official.ref, paths=["vllm/device_allocator/cumem.py"])
    assert probe.root == OFFICIAL_VLLM_ROOT
    assert probe.versions["vllm"] == "0.21.0" and probe.versions["torch"] is None
    assert not probe.importable and "torch" in probe.import_error
    assert probe.files["vllm/device_allocator/cumem.py"].startswith(b"# SPDX")
    assert probe.bytecode["vllm/device_allocator/cumem.py"] == [
        OFFICIAL_VLLM_ROOT + "/device_allocator/__pycache__/cumem.cpython-311.pyc"
    ]


@pytest.mark.docker
def test_probe_finds_opt_root_by_searching(daemon, standin_opt):
    probe = engine_mod.probe_vllm(daemon, standin_opt.ref)
    assert probe.root == "/opt/vllm/vllm"
    assert probe.versions["vllm"] == "0.21.0"


@pytest.mark.docker
def test_probe_image_without_vllm(daemon, standin_novllm):
    with pytest.raises(EngineError, match="holds no vLLM"):
        probe_vllm(daemon, standin_novllm.ref)


def test_mount_defaults_to_read_only():
    assert Mount(Path("/x"), "/y").read_only
