"""Nomad job specs: golden files, HCL <-> API JSON equivalence, the memory preflight, bad input.

No Nomad binary and no daemon: the HCL is parsed back with python-hcl2 and reduced, like the
API JSON, to a normalised view of the fields that matter (image, args, env, mounts, devices,
constraints, update, services and checks, artifacts, resources); the two views must be equal.
Each reducer consumes every key it reads and fails on any key left over, so a field that only
one of the two forms carries cannot slip through.

The golden files and the committed examples are rendered by ``bin/regenerate`` from
tools/golden/nomad.py and the embedded default config; tests/test_generated.py fails while
one differs from its render.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import hcl2
import pytest
from hcl2.utils import SerializationOptions

from sm12x_bundle import cli, jobs
from sm12x_bundle import config as config_mod
from sm12x_bundle.errors import ConfigError, EnvironmentProblem
from sm12x_bundle.outputs import nomad
from sm12x_bundle.plan import files as plan_files
from sm12x_bundle.selftest import plan as selftest_plan
from tools.golden.nomad import (
    ALLOCATOR_GATED_JOB,
    ARTIFACT_JOB,
    GATED_JOB,
    HOST_JOB,
    ROOT,
    TARGETS,
    jobs_config,
    manifest,
    render,
)
from tools.golden.nomad import GOLDEN as GOLDEN_JOBS
from tools.golden.nomad import TOOL as RENDERER  # the golden gates' stand-in fingerprint

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "nomad"
EXAMPLES = REPO / "nomad"


# --- normalised views of the two forms -------------------------------------------

_MISSING = object()


class Take:
    """Read a mapping by consuming it; ``done()`` fails on keys nobody read."""

    def __init__(self, d: dict, where: str):
        assert isinstance(d, dict), f"{where}: not a mapping: {d!r}"
        self.d, self.where = dict(d), where

    def __call__(self, key: str, default=_MISSING):
        if key in self.d:
            return self.d.pop(key)
        assert default is not _MISSING, f"{self.where}: missing {key}"
        return default

    def sub(self, key: str) -> Take:
        return Take(self(key), f"{self.where}.{key}")

    def done(self) -> None:
        assert not self.d, f"{self.where}: unexpected {sorted(self.d)}"


def _api_seconds(ns: int) -> int:
    assert ns % 1_000_000_000 == 0, ns
    return ns // 1_000_000_000


def _hcl_seconds(s: str) -> int:
    m = re.fullmatch(r"(\d+)([smh])", s)
    assert m, s
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def _api_constraints(items) -> list:
    out = []
    for c in items:
        t = Take(c, "constraint")
        out.append((t("LTarget"), t("Operand"), t("RTarget")))
        t.done()
    return sorted(out)


def api_view(doc: dict) -> dict:
    top = Take(doc, "json")
    job = top.sub("Job")
    top.done()
    (group,) = job("TaskGroups")
    g = Take(group, "group")
    tasks = [Take(task, "task") for task in g("Tasks")]
    gates = [t for t in tasks if "Lifecycle" in t.d]
    (t,) = [t for t in tasks if t not in gates]
    view = {
        "job": {"id": job("ID"), "name": job("Name"), "type": job("Type"), "datacenters": job("Datacenters"), "meta": job("Meta")},
        "group": _api_group(g),
        "task": _api_task(t),
        "gate": _api_task(gates[0]) if gates else None,
    }
    assert len(gates) <= 1, "one gate at most"
    for part in (job, g, *tasks):
        part.done()
    return view


def _api_group(g: Take) -> dict:
    (network,) = g("Networks")
    n = Take(network, "network")
    ports = []
    for p in n("ReservedPorts"):
        pt = Take(p, "port")
        ports.append((pt("Label"), pt("Value"), pt("To")))
        pt.done()
    n.done()
    disk = g.sub("EphemeralDisk")
    u = g.sub("Update")
    view = {
        "name": g("Name"),
        "count": g("Count"),
        "constraints": _api_constraints(g("Constraints", [])),
        "ports": ports,
        "disk": {"size_mb": disk("SizeMB"), "sticky": disk("Sticky"), "migrate": disk("Migrate")},
        "update": {
            "max_parallel": u("MaxParallel"),
            "canary": u("Canary"),
            "health_check": u("HealthCheck"),
            "min_healthy_time": _api_seconds(u("MinHealthyTime")),
            "healthy_deadline": _api_seconds(u("HealthyDeadline")),
            "progress_deadline": _api_seconds(u("ProgressDeadline")),
            "auto_revert": u("AutoRevert"),
        },
        "services": [_api_service(Take(s, "service")) for s in g("Services")],
    }
    disk.done()
    u.done()
    return view


def _api_service(s: Take) -> dict:
    checks = []
    for c in s("Checks"):
        ct = Take(c, "check")
        r = ct.sub("CheckRestart")
        checks.append(
            {
                "name": ct("Name"),
                "type": ct("Type"),
                "path": ct("Path"),
                "interval": _api_seconds(ct("Interval")),
                "timeout": _api_seconds(ct("Timeout")),
                "check_restart": {"limit": r("Limit"), "grace": _api_seconds(r("Grace")), "ignore_warnings": r("IgnoreWarnings")},
            }
        )
        r.done()
        ct.done()
    view = {"name": s("Name"), "provider": s("Provider"), "port": s("PortLabel"), "checks": checks}
    s.done()
    return view


def _api_task(t: Take) -> dict:
    cfg = t.sub("Config")
    res = t.sub("Resources")
    artifacts = []
    for a in t("Artifacts", []):
        at = Take(a, "artifact")
        artifacts.append(
            {"source": at("GetterSource"), "destination": at("RelativeDest"), "mode": at("GetterMode"), "options": at("GetterOptions")}
        )
        at.done()
    devices = []
    for d in res("Devices", []):
        dt = Take(d, "device")
        devices.append({"name": dt("Name"), "count": dt("Count"), "constraints": _api_constraints(dt("Constraints", []))})
        dt.done()
    kill_timeout = t("KillTimeout", None)
    view = {
        "name": t("Name"),
        "driver": t("Driver"),
        "lifecycle": _api_lifecycle(t("Lifecycle", None)),
        "restart": _api_restart(t("RestartPolicy", None)),
        "kill_timeout": None if kill_timeout is None else _api_seconds(kill_timeout),
        "env": t("Env"),
        "artifacts": artifacts,
        "resources": {"cpu": res("CPU"), "memory": res("MemoryMB"), "devices": devices},
        "docker": _docker_view(cfg),
    }
    cfg.done()
    res.done()
    return view


def _api_lifecycle(lifecycle: dict | None) -> dict | None:
    if lifecycle is None:
        return None
    lt = Take(lifecycle, "lifecycle")
    view = {"hook": lt("Hook"), "sidecar": lt("Sidecar")}
    lt.done()
    return view


def _api_restart(restart: dict | None) -> dict | None:
    if restart is None:
        return None
    rt = Take(restart, "restart")
    view = {"attempts": rt("Attempts"), "mode": rt("Mode")}
    rt.done()
    return view


def _docker_view(cfg: Take) -> dict:
    mounts = []
    for m in cfg("mount", []):
        mt = Take(m, "mount")
        mounts.append({"type": mt("type"), "source": mt("source"), "target": mt("target"), "readonly": mt("readonly")})
        mt.done()
    return {
        "image": cfg("image"),
        "entrypoint": cfg("entrypoint"),
        "args": cfg("args"),
        "ports": cfg("ports", None),
        "readonly_rootfs": cfg("readonly_rootfs"),
        "shm_size": cfg("shm_size"),
        "runtime": cfg("runtime", None),
        "mounts": mounts,
    }


def _unescape(value):
    """HCL template escapes that python-hcl2 keeps: $${ -> ${, %%{ -> %{."""
    if isinstance(value, str):
        return value.replace("$${", "${").replace("%%{", "%{")
    if isinstance(value, list):
        return [_unescape(v) for v in value]
    if isinstance(value, dict):
        return {k: _unescape(v) for k, v in value.items()}
    return value


def _labeled(body: Take, key: str) -> list[tuple[str, Take]]:
    return [(label, Take(b, f"{body.where}.{key}.{label}")) for item in body(key, []) for label, b in item.items()]


def _block(body: Take, key: str) -> Take:
    (b,) = body(key)
    return Take(b, f"{body.where}.{key}")


def _hcl_constraints(body: Take) -> list:
    out = []
    for c in body("constraint", []):
        ct = Take(c, "constraint")
        out.append((ct("attribute"), ct("operator"), ct("value")))
        ct.done()
    return sorted(out)


def hcl_view(text: str) -> dict:
    options = SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
    top = Take(_unescape(hcl2.loads(text, serialization_options=options)), "hcl")
    ((job_id, job),) = _labeled(top, "job")
    top.done()
    ((group_name, g),) = _labeled(job, "group")
    tasks = _labeled(g, "task")
    gates = [(name, t) for name, t in tasks if "lifecycle" in t.d]
    ((task_name, t),) = [(name, t) for name, t in tasks if (name, t) not in gates]
    meta = _block(job, "meta")
    view = {
        "job": {"id": job_id, "name": job_id, "type": job("type"), "datacenters": job("datacenters"), "meta": meta.d},
        "group": _hcl_group(group_name, g),
        "task": _hcl_task(task_name, t),
        "gate": _hcl_task(*gates[0]) if gates else None,
    }
    assert len(gates) <= 1, "one gate at most"
    for part in (job, g, *(t for _, t in tasks)):
        part.done()
    return view


def _hcl_group(name: str, g: Take) -> dict:
    network = _block(g, "network")
    ports = []
    for label, p in _labeled(network, "port"):
        ports.append((label, p("static"), p("to")))
        p.done()
    network.done()
    disk = _block(g, "ephemeral_disk")
    u = _block(g, "update")
    view = {
        "name": name,
        "count": g("count"),
        "constraints": _hcl_constraints(g),
        "ports": ports,
        "disk": {"size_mb": disk("size"), "sticky": disk("sticky"), "migrate": disk("migrate")},
        "update": {
            "max_parallel": u("max_parallel"),
            "canary": u("canary"),
            "health_check": u("health_check"),
            "min_healthy_time": _hcl_seconds(u("min_healthy_time")),
            "healthy_deadline": _hcl_seconds(u("healthy_deadline")),
            "progress_deadline": _hcl_seconds(u("progress_deadline")),
            "auto_revert": u("auto_revert"),
        },
        "services": [_hcl_service(Take(s, "service")) for s in g("service")],
    }
    disk.done()
    u.done()
    return view


def _hcl_service(s: Take) -> dict:
    checks = []
    for c in s("check"):
        ct = Take(c, "check")
        r = _block(ct, "check_restart")
        checks.append(
            {
                "name": ct("name"),
                "type": ct("type"),
                "path": ct("path"),
                "interval": _hcl_seconds(ct("interval")),
                "timeout": _hcl_seconds(ct("timeout")),
                "check_restart": {"limit": r("limit"), "grace": _hcl_seconds(r("grace")), "ignore_warnings": r("ignore_warnings")},
            }
        )
        r.done()
        ct.done()
    view = {"name": s("name"), "provider": s("provider"), "port": s("port"), "checks": checks}
    s.done()
    return view


def _hcl_task(name: str, t: Take) -> dict:
    cfg = _block(t, "config")
    res = _block(t, "resources")
    env = _block(t, "env")
    artifacts = []
    for a in t("artifact", []):
        at = Take(a, "artifact")
        options = _block(at, "options")
        artifacts.append({"source": at("source"), "destination": at("destination"), "mode": at("mode"), "options": options.d})
        at.done()
    devices = []
    for label, d in _labeled(res, "device"):
        devices.append({"name": label, "count": d("count"), "constraints": _hcl_constraints(d)})
        d.done()
    kill_timeout = t("kill_timeout", None)
    view = {
        "name": name,
        "driver": t("driver"),
        "lifecycle": _hcl_optional_block(t, "lifecycle", ("hook", "sidecar")),
        "restart": _hcl_optional_block(t, "restart", ("attempts", "mode")),
        "kill_timeout": None if kill_timeout is None else _hcl_seconds(kill_timeout),
        "env": env.d,
        "artifacts": artifacts,
        "resources": {"cpu": res("cpu"), "memory": res("memory"), "devices": devices},
        "docker": _docker_view(cfg),
    }
    cfg.done()
    res.done()
    return view


def _hcl_optional_block(body: Take, key: str, fields: tuple[str, ...]) -> dict | None:
    if key not in body.d:
        return None
    b = _block(body, key)
    view = {f: b(f) for f in fields}
    b.done()
    return view


def assert_same_job(hcl_bytes: bytes, json_bytes: bytes) -> dict:
    a, b = hcl_view(hcl_bytes.decode()), api_view(json.loads(json_bytes))
    assert a == b
    return b


# --- golden files -----------------------------------------------------------------


def test_golden_pairs_describe_the_same_job():
    """Their bytes are the renders of tools/golden/nomad.py (tests/test_generated.py)."""
    names = sorted(p.name.removesuffix(".nomad.hcl") for p in GOLDEN.glob("*.nomad.hcl"))
    assert names == sorted(GOLDEN_JOBS) == ["allocator-gated-job", "artifact-job", "gated-job", "host-job"]
    for name in names:
        assert_same_job((GOLDEN / f"{name}.nomad.hcl").read_bytes(), (GOLDEN / f"{name}.nomad.json").read_bytes())


def test_host_delivery_binds_content_addressed_host_paths():
    view = api_view(json.loads(render(HOST_JOB)["host-job.nomad.json"]))
    mounts = {m["target"]: m for m in view["task"]["docker"]["mounts"]}
    cumem = mounts[ROOT + "/device_allocator/cumem.py"]
    assert cumem == {
        "type": "bind",
        "source": "/opt/sm12x-bundle/overlays/vllm-openai-v0.21.0/0123456789abcdef/files" + ROOT + "/device_allocator/cumem.py",
        "target": ROOT + "/device_allocator/cumem.py",
        "readonly": True,
    }
    assert mounts["/root/.cache"] == {"type": "bind", "source": "../alloc/data", "target": "/root/.cache", "readonly": False}
    assert view["task"]["artifacts"] == []
    hcl = render(HOST_JOB)["host-job.nomad.hcl"].decode()
    assert 'plugin "docker" { config { volumes { enabled = true } } }' in hcl


def test_artifact_delivery_fetches_with_checksum_then_binds_relative_path():
    m = manifest()
    view = api_view(json.loads(render(ARTIFACT_JOB, m=m)["artifact-job.nomad.json"]))
    so = next(f for f in m["files"] if f["container_path"].endswith(".so"))
    dest = "local/overlay/files" + ROOT + "/cumem_allocator.abi3.so"
    assert {
        "source": "https://overlays.example.internal/sm12x/vllm-openai-v0.21.0/0123456789abcdef/files" + ROOT + "/cumem_allocator.abi3.so",
        "destination": dest,
        "mode": "file",
        "options": {"checksum": "sha256:" + so["sha256"]},
    } in view["task"]["artifacts"]
    mounts = view["task"]["docker"]["mounts"]
    assert {"type": "bind", "source": dest, "target": so["container_path"], "readonly": True} in mounts
    assert all(not m["source"].startswith("/") for m in mounts), "artifact delivery needs no host paths"
    assert "volumes { enabled = true }" not in render(ARTIFACT_JOB)["artifact-job.nomad.hcl"].decode()


def test_sleep_mode_stale_bytecode_guard_and_caches():
    view = api_view(json.loads(render(HOST_JOB)["host-job.nomad.json"]))
    env = view["task"]["env"]
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--enable-sleep-mode" in view["task"]["docker"]["args"]
    assert env["PYTHONPYCACHEPREFIX"] == "/local/pycache"
    for key in ("TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "TMPDIR"):
        assert env[key].startswith("/local")
    assert view["task"]["docker"]["readonly_rootfs"] is True
    assert view["task"]["docker"]["entrypoint"] == ["python3", "-m", "vllm.entrypoints.cli.main", "serve"]
    assert view["group"]["update"] == {
        "max_parallel": 1,
        "canary": 0,
        "health_check": "checks",
        "min_healthy_time": 60,
        "healthy_deadline": 1800,
        "progress_deadline": 2400,
        "auto_revert": True,
    }
    (check,) = view["group"]["services"][0]["checks"]
    assert (check["type"], check["path"], check["check_restart"]["grace"]) == ("http", "/health", 1200)


@pytest.mark.parametrize("name", ["host-job", "artifact-job"])
def test_caches_survive_an_update(name):
    """alloc/data (FlashInfer's JIT under /root/.cache) and local/ (Triton, vLLM, bytecode) start
    empty in a new allocation unless the group's disk is sticky and migrates: in both forms."""
    job = HOST_JOB if name == "host-job" else ARTIFACT_JOB
    files = render(job)
    for view in (api_view(json.loads(files[f"{name}.nomad.json"])), hcl_view(files[f"{name}.nomad.hcl"].decode())):
        assert view["group"]["disk"] == {"size_mb": 20480, "sticky": True, "migrate": True}
        mounts = {m["target"]: m["source"] for m in view["task"]["docker"]["mounts"]}
        assert mounts["/root/.cache"] == "../alloc/data"
        env = view["task"]["env"]
        assert all(env[k].startswith("/local/") for k in ("TRITON_CACHE_DIR", "VLLM_CACHE_ROOT", "PYTHONPYCACHEPREFIX"))


def test_no_claim_that_nomad_orders_the_rotation():
    """Nomad's update block acts inside one job; the peers are two jobs. The specs say so and
    claim no rotation-wide order."""
    for data in render(HOST_JOB).values():
        text = data.decode().lower()
        assert "one peer at a time" not in text
    hcl = render(HOST_JOB)["host-job.nomad.hcl"].decode()
    assert "nothing orders it against its rotation peer" in hcl and "GET /v1/job/host-job/deployment" in hcl
    assert "Nomad does not order the two" in hcl and "max_parallel 1 is Nomad's default" in hcl


def test_gpus_device_reservation_versus_shared_peers():
    device = api_view(json.loads(render(HOST_JOB)["host-job.nomad.json"]))
    (gpu,) = device["task"]["resources"]["devices"]
    assert gpu == {
        "name": "nvidia/gpu",
        "count": 4,
        "constraints": [("${device.attr.memory}", ">=", "97280 MiB"), ("${device.model}", "regexp", "RTX PRO 6000")],
    }
    shared = api_view(json.loads(render(ARTIFACT_JOB)["artifact-job.nomad.json"]))
    assert shared["task"]["resources"]["devices"] == []
    assert shared["task"]["env"]["NVIDIA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert shared["task"]["docker"]["runtime"] == "nvidia"
    assert shared["group"]["constraints"] == [("${meta.gpu_pool}", "=", "rtx-pro-6000-tp4-a")]


# --- the rollout gate ---------------------------------------------------------------

TOOL = {"type": "bind", "source": "/opt/sm12x-bundle/tool", "target": "/opt/sm12x-bundle", "readonly": True}


def _sorted_mounts(mounts: list[dict]) -> list[dict]:
    return sorted(mounts, key=lambda m: m["target"])


def test_gate_is_a_prestart_task_with_vllms_image_overlays_env_and_gpus():
    """Both forms: the gate runs before vLLM (prestart, not a sidecar, never restarted), in the
    same image with the same mounts, env, nvidia runtime and visible GPUs, plus the tool."""
    files = render(GATED_JOB)
    for view in (api_view(json.loads(files["gated-job.nomad.json"])), hcl_view(files["gated-job.nomad.hcl"].decode())):
        gate, main = view["gate"], view["task"]
        assert (gate["name"], gate["driver"]) == ("gate", "docker")
        assert gate["lifecycle"] == {"hook": "prestart", "sidecar": False}
        assert gate["restart"] == {"attempts": 0, "mode": "fail"}
        assert gate["docker"]["entrypoint"] == ["python3", "-m", "sm12x_bundle"]
        assert gate["docker"]["args"] == [
            "--require-tool", RENDERER, "engine-check", "--installed", "--quick", "--lane", "0.21.0", "--tp", "4",
            "--vllm-arg=--max-num-seqs", "--vllm-arg=12", "--vllm-arg=--enforce-eager",
        ]
        for key in ("image", "runtime", "readonly_rootfs", "shm_size"):
            assert gate["docker"][key] == main["docker"][key], key
        assert main["docker"]["runtime"] == "nvidia" and gate["env"]["NVIDIA_VISIBLE_DEVICES"] == "0,1,2,3"
        assert _sorted_mounts(gate["docker"]["mounts"]) == _sorted_mounts([*main["docker"]["mounts"], TOOL])
        assert gate["env"] == {**main["env"], "PYTHONPATH": "/opt/sm12x-bundle/src"}
        assert gate["resources"] == main["resources"] and gate["resources"]["devices"] == []
        assert gate["docker"]["ports"] is None and gate["kill_timeout"] is None
        assert (main["lifecycle"], main["restart"]) == (None, None)
    tasks = json.loads(files["gated-job.nomad.json"])["Job"]["TaskGroups"][0]["Tasks"]
    assert [t["Name"] for t in tasks] == ["gate", "vllm"]


def test_a_job_without_a_gate_has_one_task():
    for job, name in ((HOST_JOB, "host-job"), (ARTIFACT_JOB, "artifact-job")):
        files = render(job)
        assert api_view(json.loads(files[f"{name}.nomad.json"]))["gate"] is None
        assert "lifecycle" not in files[f"{name}.nomad.hcl"].decode() and "Rollout gate" not in files[f"{name}.nomad.hcl"].decode()


def test_allocator_gate_fetches_the_same_overlay_artifacts():
    """A relative mount source resolves in the task's own directory, so the gate fetches the
    overlay files itself; it runs the selftest's scenarios that leave the GPUs' other users alone."""
    files = render(ALLOCATOR_GATED_JOB)
    for view in (api_view(json.loads(files["allocator-gated-job.nomad.json"])), hcl_view(files["allocator-gated-job.nomad.hcl"].decode())):
        gate, main = view["gate"], view["task"]
        assert gate["docker"]["args"] == [
            "--require-tool", RENDERER, "selftest", "--installed", "--scenario", "inflight-free,stale-error,double-wake,failing-sleep",
        ]
        assert gate["artifacts"] == main["artifacts"] and len(gate["artifacts"]) == 2
        assert [m for m in gate["docker"]["mounts"] if m != TOOL] == main["docker"]["mounts"]
        assert gate["env"]["NVIDIA_VISIBLE_DEVICES"] == "4,5"


def test_allocator_gate_scenarios_stay_small_and_in_their_own_process():
    """The names are the selftest's own, and on a 95 GiB GPU (and any larger) each takes at most
    2 GiB: a rotation peer asleep or awake on the same GPUs keeps its memory."""
    chosen = selftest_plan.select([",".join(nomad.GATE_ALLOCATOR_SCENARIOS)])
    assert [s.name for s in chosen] == ["inflight-free", "stale-error", "double-wake", "failing-sleep"]
    GiB = 1 << 30
    for free in (95 * GiB, 180 * GiB):
        sizes = selftest_plan.plan_sizes(free)
        assert max(sizes.inflight_bytes, sizes.stale_bytes, 2 * sizes.guard_bytes, sizes.sleep_count * sizes.sleep_each) <= 2 * GiB
    left_out = {"partial-wake", "moe-churn", "foreign-process", "ranks", "speed", "first-sleep", "rotation", "stress", "fault-stress"}
    assert left_out.isdisjoint(s.name for s in chosen) and left_out | {s.name for s in chosen} == set(selftest_plan.BY_NAME)


def test_engine_gate_needs_the_manifests_pinned_release():
    m = manifest()
    del m["pin"]
    with pytest.raises(ConfigError, match="names no pinned release .pin.version., which the engine gate holds the image to"):
        render(GATED_JOB, m=m)
    assert render(ALLOCATOR_GATED_JOB, m=m)  # the selftest takes no --lane


def test_gate_notes_name_the_check_and_the_client_checkout():
    hcl = render(GATED_JOB)["gated-job.nomad.hcl"].decode()
    assert ("# Rollout gate: task \"gate\" runs 'sm12x-bundle engine-check --installed --quick --lane 0.21.0 --tp 4 "
            "--vllm-arg=--max-num-seqs --vllm-arg=12 --vllm-arg=--enforce-eager' before vLLM starts;") in hcl
    assert f"#   It runs only with the sm12x-bundle that rendered this job ({RENDERER}): another exits 13." in hcl
    assert "#   a checkout of the sm12x-bundle that rendered this job (src/ and patches/) at /opt/sm12x-bundle/tool, for the gate" in hcl
    assert 'plugin "docker" { config { volumes { enabled = true } } }' in render(ALLOCATOR_GATED_JOB)["allocator-gated-job.nomad.hcl"].decode()


def _gate_command(checkout: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """The gate's command as the prestart task runs it: `python3 -m sm12x_bundle ...` with only the
    checkout's src/ on PYTHONPATH, without the modules the target image lacks (docker, hcl2)."""
    blocker = (
        "import runpy, sys\n"
        "for name in ('docker', 'hcl2', 'lark'):\n"
        "    sys.modules[name] = None\n"
        "sys.argv = ['sm12x-bundle', *sys.argv[1:]]\n"
        "runpy.run_module('sm12x_bundle', run_name='__main__', alter_sys=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(checkout / "src"), "SM12X_BUNDLE_CACHE": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-c", blocker, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def gate_checkout(tmp_path):
    """What gate_tool_dir holds: src/ and patches/ of this checkout; and a stand-in vLLM 0.21.0 install."""
    checkout = tmp_path / "tool"
    for part in ("src", "patches"):
        shutil.copytree(REPO / part, checkout / part, ignore=shutil.ignore_patterns("__pycache__"))
    install = tmp_path / "site"
    (install / "vllm").mkdir(parents=True)
    (install / "vllm" / "__init__.py").write_text("")
    (install / "vllm-0.21.0.dist-info").mkdir()
    (install / "vllm-0.21.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.21.0\n\n")
    (tmp_path / "cwd").mkdir()
    return checkout, install, tmp_path / "cwd"


def rendered_gate_args(job: str) -> list[str]:
    """The gate's arguments exactly as ``sm12x-bundle nomad`` renders them: this tool's own fingerprint."""
    cfg = jobs_config(job)
    return list(nomad.plan_job(cfg, cfg.jobs[0], manifest()).gate.args)


def _engine_check_takes_the_jobs_options() -> bool:
    """engine-check's --tp and --vllm-arg (the gate passes the job's own; engine-check adds them)."""
    from sm12x_bundle.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["engine-check"].format_help()
    return "--tp" in text and "--vllm-arg" in text


def test_the_gates_command_runs_from_a_checkout_without_docker_or_hcl2(gate_checkout):
    """Up to the GPU: the fingerprint, the config (the embedded default's lanes, whose series are in
    patches/), the lane and the arguments pass; here it stops at the missing NVIDIA driver, on a node
    at the GPU. --vllm-path stands in for the image's vLLM, which the gate finds on its own."""
    checkout, install, cwd = gate_checkout
    done = _gate_command(checkout, cwd, *rendered_gate_args(ALLOCATOR_GATED_JOB))
    assert done.returncode == 12 and "no vLLM is installed in this Python" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    if not _engine_check_takes_the_jobs_options():
        pytest.skip("engine-check does not take --tp and --vllm-arg yet")
    args = rendered_gate_args(GATED_JOB)
    done = _gate_command(checkout, cwd, *args, "--vllm-path", str(install))
    assert done.returncode == 12 and "no NVIDIA driver here" in done.stderr, done.stderr
    other = [a if a != "0.21.0" else "0.33.0" for a in args]
    done = _gate_command(checkout, cwd, *other, "--vllm-path", str(install))
    assert done.returncode == 3 and "--lane 0.33.0 disagrees with the vLLM under test" in done.stderr, done.stderr


@pytest.mark.parametrize("edit", ["src/sm12x_bundle/jobs.py", "patches/0.21.0/series"])
def test_the_gate_refuses_a_checkout_other_than_the_renderers(gate_checkout, edit):
    """One byte more in the mounted checkout's sources or series: exit 13 before anything runs
    (before the command's own options too, which another version may not know), naming both."""
    checkout, install, cwd = gate_checkout
    args = rendered_gate_args(GATED_JOB)
    with open(checkout / edit, "a") as fh:
        fh.write("\n")
    done = _gate_command(checkout, cwd, *args, "--vllm-path", str(install))
    ours = args[1]
    assert done.returncode == 13, done.stderr
    (line,) = done.stderr.splitlines()
    theirs = re.search(r"this sm12x-bundle is (\S+), but the job was rendered by (\S+):", line)
    assert theirs and theirs.group(2) == ours and theirs.group(1) != ours and theirs.group(1).startswith(ours.split("/")[0] + "/sha256:")


def test_the_fingerprint_is_the_same_for_the_same_files(gate_checkout):
    """A copy of src/ and patches/ (other paths, other mtimes) has the renderer's fingerprint;
    bytecode beside the sources does not count."""
    checkout, install, cwd = gate_checkout
    (checkout / "src" / "sm12x_bundle" / "__pycache__").mkdir(exist_ok=True)
    (checkout / "src" / "sm12x_bundle" / "__pycache__" / "jobs.cpython-312.pyc").write_bytes(b"x")
    touched = checkout / "src" / "sm12x_bundle" / "jobs.py"
    os.utime(touched, (1, 1))
    touched.chmod(0o600)
    probe = "from sm12x_bundle.fingerprint import tool_fingerprint; print(tool_fingerprint())"
    env = {**os.environ, "PYTHONPATH": str(checkout / "src")}
    theirs = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert theirs == rendered_gate_args(GATED_JOB)[1]


def test_require_tool_with_the_right_fingerprint_runs_the_command(capsys):
    from sm12x_bundle.fingerprint import tool_fingerprint

    assert cli.main(["--require-tool", tool_fingerprint(), "series"]) == 0
    assert "cumem-stream-aware-free" in capsys.readouterr().out
    assert cli.main(["--require-tool", "0.0.0/sha256:" + "0" * 64, "series", "--no-such-option"]) == 13
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"this sm12x-bundle is {tool_fingerprint()}, but the job was rendered by 0.0.0/sha256:" in err


def test_src_alone_is_not_enough_for_the_gate(gate_checkout):
    checkout, install, cwd = gate_checkout
    shutil.rmtree(checkout / "patches")
    args = [a for a in rendered_gate_args(ALLOCATOR_GATED_JOB)][2:]  # without patches/, the fingerprint differs too
    done = _gate_command(checkout, cwd, *args)
    assert done.returncode == 3 and "no series is shipped for vLLM 0.21.0" in done.stderr, done.stderr


# --- the host-RAM preflight -------------------------------------------------------------

# The seeds' node with both peers at memory_mb 98304 (96 GiB each).
PEERS = [GATED_JOB, GATED_JOB.replace("name: gated-job", "name: peer-job").replace("port: 8003", "port: 8005")]


def test_host_ram_arithmetic():
    b = jobs.HostRam(node_gib=192, jobs=(("a", 96.0), ("b", 96.0)))
    assert b.total_gib == 200 and not b.fits()
    assert b.describe() == "96 GiB a + 96 GiB b + 8 GiB margin = 200 GiB"
    assert jobs.HostRam(node_gib=200, jobs=(("a", 96.0), ("b", 96.0))).fits()


def test_host_ram_counts_every_job_of_the_node():
    files = render(*PEERS)
    for name in ("gated-job", "peer-job"):
        assert (
            "# Host RAM budget of this job's node: 96 GiB gated-job + 96 GiB peer-job + 8 GiB margin = 200 GiB of 256 GiB."
            in files[f"{name}.nomad.hcl"].decode()
        )


def test_host_ram_that_does_not_fit_names_the_numbers_and_the_jobs():
    small = [PEERS[0].replace("host_ram_gib: 256", "host_ram_gib: 192"), PEERS[1].replace("host_ram_gib: 256", "host_ram_gib: 192")]
    with pytest.raises(ConfigError) as exc:
        render(*small)
    line = TARGETS.count("\n") + 1 + GATED_JOB.splitlines().index("    host_ram_gib: 256") + 1
    assert str(exc.value) == (
        f"cfg.yaml:{line}: jobs[0].host_ram_gib: the host RAM budget does not fit: 96 GiB gated-job + 96 GiB peer-job"
        " + 8 GiB margin = 200 GiB > 192 GiB host_ram_gib (each job's memory_mb holds its engine's weights, pinned by"
        " the backup pool awake or asleep): lower memory_mb, or place the jobs on a node with more RAM"
    )


def test_host_ram_groups_jobs_by_their_node():
    """Another node's job does not count; a device job (the device plugin picks its node) counts alone."""
    elsewhere = PEERS[1].replace("rtx-pro-6000-tp4-a", "rtx-pro-6000-tp4-b").replace("host_ram_gib: 256", "host_ram_gib: 104")
    files = render(PEERS[0].replace("host_ram_gib: 256", "host_ram_gib: 104"), elsewhere)
    assert "96 GiB gated-job + 8 GiB margin = 104 GiB of 104 GiB" in files["gated-job.nomad.hcl"].decode()
    with pytest.raises(ConfigError, match="jobs\\[0\\].host_ram_gib: .* 64 GiB host-job \\+ 8 GiB margin = 72 GiB > 70 GiB"):
        render(HOST_JOB + "    host_ram_gib: 70\n")


def test_jobs_of_one_node_give_one_host_ram():
    other = PEERS[1].replace("host_ram_gib: 256", "host_ram_gib: 512")
    with pytest.raises(ConfigError, match="jobs that share a node give different host_ram_gib \\('gated-job' 256 GiB, 'peer-job' 512 GiB\\)"):
        render(PEERS[0], other)


def test_without_host_ram_the_note_says_it_was_not_checked():
    hcl = render(HOST_JOB)["host-job.nomad.hcl"].decode()
    assert "# Host RAM budget: not checked (no host_ram_gib for this job's node)." in hcl


# --- the committed examples ---------------------------------------------------------


def example_pairs() -> list[str]:
    return sorted(p.name.removesuffix(".nomad.hcl") for p in EXAMPLES.glob("*.nomad.hcl"))


def test_examples_are_the_rotation():
    assert example_pairs() == ["dsv4-flash", "mimo-flash"]
    cfg = config_mod.parse(config_mod.default_text(), "<embedded default>", EXAMPLES)
    for job in cfg.jobs:
        assert (job.tensor_parallel_size, job.gpus, job.gpu_ids, job.sleep_mode) == (4, 4, ("0", "1", "2", "3"), True)
        assert job.gpu_memory_utilization == 0.70
    assert {j.node_constraints["${meta.gpu_pool}"] for j in cfg.jobs} == {"rtx-pro-6000-tp4-a"}
    assert cfg.jobs[0].non_cumem_gib == 22
    # The gate is opt-in and has never run under a Nomad; the seeds' node RAM is not known here.
    assert [(j.gate, j.host_ram_gib) for j in cfg.jobs] == [("none", None)] * 2


@pytest.mark.parametrize("name", example_pairs())
def test_example_hcl_and_json_describe_the_same_job(name):
    view = assert_same_job((EXAMPLES / f"{name}.nomad.hcl").read_bytes(), (EXAMPLES / f"{name}.nomad.json").read_bytes())
    assert view["job"]["id"] == name


def test_example_manifest_matches_the_pinned_series(patched_tree, pinned_tree, series):
    """The example manifest's cumem.py hashes are the pinned file's and the series' result;
    every file keeps the pinned tree's mode (envs.py is 0755 there)."""
    m = json.loads((EXAMPLES / "example-manifest.json").read_text())
    nomad.check_manifest(m, "example")
    overlaid = [f["container_path"].removeprefix(ROOT) for f in m["files"]]
    assert "/cumem_allocator.abi3.so" in overlaid and "/device_allocator/cumem.py" in overlaid
    plan = plan_files.plan_series(series)
    # the rebuilt extension and every Python file the series changes or adds
    assert sorted(overlaid) == sorted(p.removeprefix("vllm") for p in [*plan.files, *(b.artifact for b in plan.native)])
    assert m["files"][overlaid.index("/envs.py")]["mode"] == "0755"
    assert m["series_sha256"] == series.sha256, "nomad/example-manifest.json is stale: make it again as nomad/README.md says"
    for entry in m["files"]:
        rel = entry["container_path"].removeprefix("/usr/local/lib/python3.12/dist-packages/")
        if rel.endswith(".so"):
            continue  # the rebuilt extension's bytes depend on the compiler that built it
        pinned = pinned_tree / rel
        assert entry["pre_image_sha256"] == (hashlib.sha256(pinned.read_bytes()).hexdigest() if pinned.exists() else None)
        assert entry["sha256"] == hashlib.sha256((patched_tree / rel).read_bytes()).hexdigest(), rel


# --- the memory-budget preflight ------------------------------------------------------


def budget(util: float) -> jobs.Budget:
    return jobs.Budget(utilization=util, capacity_gib=95, non_cumem_gib=22, residue_gib=4.8)


def test_preflight_seed_numbers():
    assert not budget(0.85).fits()
    assert budget(0.70).fits()
    assert budget(0.71).fits() and not budget(0.72).fits()
    assert budget(0.85).largest_utilization() == 0.71
    assert budget(0.70).describe() == (
        "0.7 x 95 GiB (66.5 GiB cumem) + 22 GiB non-cumem + 4.8 GiB sleeping-peer residue = 93.3 GiB"
    )


def test_preflight_error_names_the_numbers_and_the_largest_fit():
    with pytest.raises(ConfigError) as exc:
        render(HOST_JOB.replace("gpu_memory_utilization: 0.70", "gpu_memory_utilization: 0.85"))
    assert str(exc.value) == (
        "cfg.yaml:14: jobs[0].gpu_memory_utilization: the GPU memory budget does not fit: 0.85 x 95 GiB (80.75 GiB cumem)"
        " + 22 GiB non-cumem + 4.8 GiB sleeping-peer residue = 107.55 GiB > 95 GiB;"
        " the largest gpu_memory_utilization that fits is 0.71"
    )


def test_preflight_when_nothing_fits():
    b = jobs.Budget(utilization=0.1, capacity_gib=24, non_cumem_gib=22, residue_gib=4.8)
    assert b.largest_utilization() == 0
    with pytest.raises(ConfigError, match="no utilization fits"):
        jobs.check_budget(config_mod.JobConfig(name="j", model="m", target="t", gpu_capacity_gib=24,
                                                gpu_memory_utilization=0.1, non_cumem_gib=22, peer_residue_gib=4.8), "w")


def test_preflight_rounds_down():
    # (95 - 28.5) / 95 = 0.7 exactly; float noise must not turn it into 0.69.
    assert jobs.Budget(0.9, 95, 28.5, 0).largest_utilization() == 0.70
    assert jobs.Budget(0.9, 80, 10, 2.5).largest_utilization() == 0.84  # 0.84375


# --- determinism ---------------------------------------------------------------------


def test_same_inputs_same_bytes():
    m = manifest()
    shuffled = copy.deepcopy(m)
    shuffled["files"].reverse()
    shuffled = json.loads(json.dumps(shuffled, sort_keys=False))
    assert render(HOST_JOB, ARTIFACT_JOB, m=m) == render(ARTIFACT_JOB, HOST_JOB, m=shuffled)


def test_strings_survive_both_forms():
    job = HOST_JOB.replace(
        'env: {HF_HUB_OFFLINE: "1"}',
        'env: {Q: "say \\"hi\\" \\\\ ${HOME} %{x} ${NOMAD_ALLOC_DIR}/y", MULTI: "a\\nb"}',
    )
    files = render(job)
    view = assert_same_job(files["host-job.nomad.hcl"], files["host-job.nomad.json"])
    assert view["task"]["env"]["Q"] == 'say "hi" \\ ${HOME} %{x} ${NOMAD_ALLOC_DIR}/y'
    assert view["task"]["env"]["MULTI"] == "a\nb"
    assert '${NOMAD_ALLOC_DIR}/y' in files["host-job.nomad.hcl"].decode()  # runtime variables stay readable


# --- bad input: a clear error, nothing written ------------------------------------------


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest()))
    return tmp_path


def run_cli(workdir: Path, jobs: list[str], *extra: str) -> int:
    (workdir / "cfg.yaml").write_text(TARGETS + "jobs:\n" + "".join(jobs))
    return cli.main(["nomad", "-q", "--config", str(workdir / "cfg.yaml"), "--out", str(workdir / "out"), *extra])


@pytest.mark.parametrize(
    "change, message",
    [
        (("overlay_delivery: host", "overlay_delivery: rsync"), "unknown overlay_delivery 'rsync': choose one of host, artifact"),
        (("tensor_parallel_size: 4", "tensor_parallel_size: 2"), "tensor_parallel_size 2 needs as many GPUs, but gpus is 4"),
        (("gpu_allocation: device", "gpu_allocation: mig"), "unknown gpu_allocation 'mig'"),
        (('extra_args: ["--max-num-seqs", "12"]', 'extra_args: ["--port=9000"]'), "extra_args sets --port"),
        (('env: {HF_HUB_OFFLINE: "1"}', 'env: {PYTHONPYCACHEPREFIX: "/tmp"}'), "env PYTHONPYCACHEPREFIX is set by sm12x-bundle"),
        (("load_time_s: 1200", "load_time_s: 2000"), "healthy_deadline_s (1800) must exceed load_time_s (2000)"),
        (("gpu_memory_utilization: 0.70", "gpu_memory_utilization: 0.85"), "the largest gpu_memory_utilization that fits is 0.71"),
    ],
)
def test_bad_job_is_refused_and_nothing_is_written(workdir, capsys, change, message):
    rc = run_cli(workdir, [ARTIFACT_JOB, HOST_JOB.replace(*change)], "--manifest", str(workdir / "manifest.json"))
    assert rc == ConfigError.exit_code
    assert message in capsys.readouterr().err
    assert not (workdir / "out").exists(), "the valid first job must not be written either"


def test_artifact_delivery_needs_a_base_url(workdir, capsys):
    job = ARTIFACT_JOB.replace("    artifact_base_url: https://overlays.example.internal/sm12x/\n", "")
    rc = run_cli(workdir, [job], "--manifest", str(workdir / "manifest.json"))
    assert rc == ConfigError.exit_code
    assert "overlay_delivery 'artifact' needs artifact_base_url" in capsys.readouterr().err
    assert not (workdir / "out").exists()


def test_missing_manifest_says_which_command_to_run(workdir, capsys):
    rc = run_cli(workdir, [HOST_JOB])
    err = capsys.readouterr().err
    assert rc == EnvironmentProblem.exit_code  # an input this machine does not hold yet, not a malformed config
    assert "no overlay manifest for target 'vllm-openai-v0.21.0' at overlays/vllm-openai-v0.21.0/current.json" in err
    assert "run 'sm12x-bundle overlay'" in err
    assert not (workdir / "out").exists()


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m["files"][0].update(sha256="abc"), "sha256 must be 64 lowercase hex digits"),
        (lambda m: m["files"][0].update(source="files/../../etc/passwd"), "source must be a normalised path under files/"),
        (lambda m: m.update(image="vllm/vllm-openai:v0.26.0"), "was made for vllm/vllm-openai:v0.26.0"),
        (lambda m: m.update(schema=2), "not a schema 1 manifest"),
    ],
)
def test_bad_manifest_is_refused(workdir, capsys, edit, message):
    m = manifest()
    edit(m)
    (workdir / "manifest.json").write_text(json.dumps(m))
    assert run_cli(workdir, [HOST_JOB], "--manifest", str(workdir / "manifest.json")) == ConfigError.exit_code
    assert message in capsys.readouterr().err
    assert not (workdir / "out").exists()


def test_default_output_dir_and_rerun_changes_nothing(workdir, capsys):
    current = workdir / "overlays" / "vllm-openai-v0.21.0" / "current.json"
    current.parent.mkdir(parents=True)
    current.write_text(json.dumps(manifest()))
    (workdir / "cfg.yaml").write_text(TARGETS + "jobs:\n" + HOST_JOB)
    assert cli.main(["nomad", "-q", "--config", str(workdir / "cfg.yaml")]) == 0
    out = workdir / "build" / "nomad"
    assert sorted(p.name for p in out.iterdir()) == [".sm12x-bundle-output", "host-job.nomad.hcl", "host-job.nomad.json"]
    first = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()}
    capsys.readouterr()
    assert cli.main(["nomad", "-q", "--config", str(workdir / "cfg.yaml")]) == 0
    assert "(unchanged)" in capsys.readouterr().out
    assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir()} == first


def test_rotation_peers_need_their_own_ports():
    peer = ARTIFACT_JOB.replace("name: artifact-job", "name: peer-job")
    with pytest.raises(ConfigError, match="jobs 'artifact-job' and 'peer-job' share a node and both use port 8002"):
        render(ARTIFACT_JOB, peer)
    assert len(render(ARTIFACT_JOB, peer.replace("port: 8002", "port: 8003"))) == 4


def test_no_jobs_is_a_clear_error(workdir, capsys):
    (workdir / "cfg.yaml").write_text(TARGETS)
    assert cli.main(["nomad", "-q", "--config", str(workdir / "cfg.yaml")]) == ConfigError.exit_code
    assert "no jobs to render" in capsys.readouterr().err
