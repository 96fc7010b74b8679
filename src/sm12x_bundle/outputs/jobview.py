"""Reading a rendered job back: the HCL (parsed by python-hcl2) and the API JSON, each reduced
to one comparable view, field by field, so that ``nomad`` refuses to write a pair of files that
describe two different jobs (a value that became HCL structure, a field one writer dropped).

The view holds every field either file sets: the job (id, name, type, datacenters, meta), the
group (count, constraints, ports, ephemeral disk, update, services and their checks) and every
task, the rollout gate included (driver, lifecycle, restart, kill timeout, env, artifacts,
resources and devices, the docker config and its mounts). Each reducer consumes the keys it
reads and refuses any key left over, so a field only one file carries cannot slip through.
Durations become seconds; HCL strings mean what Nomad reads (hcl.literal).
"""

from __future__ import annotations

import json
import re

from ..errors import VerifyError
from . import hcl

_NS = 1_000_000_000
_MISSING = object()


class Unexpected(Exception):
    """The file holds something the view does not know: a key too many, a key missing."""


class _Take:
    """Read a mapping by consuming it; ``done()`` refuses keys nobody read."""

    def __init__(self, d: object, where: str):
        if not isinstance(d, dict):
            raise Unexpected(f"{where}: not a mapping")
        self.d, self.where = dict(d), where

    def __call__(self, key: str, default: object = _MISSING) -> object:
        if key in self.d:
            return self.d.pop(key)
        if default is _MISSING:
            raise Unexpected(f"{self.where}: {key} is missing")
        return default

    def sub(self, key: str) -> _Take:
        return _Take(self(key), f"{self.where}.{key}")

    def done(self) -> None:
        if self.d:
            raise Unexpected(f"{self.where}: unexpected {', '.join(sorted(map(str, self.d)))}")


def _one(items: object, where: str) -> object:
    if not isinstance(items, list) or len(items) != 1:
        raise Unexpected(f"{where}: one expected")
    return items[0]


def same_job(name: str, hcl_text: str, json_text: str) -> dict:
    """The view both files give, or VerifyError naming the first field where they differ."""
    try:
        hcl_side, json_side = hcl_view(hcl_text), api_view(json.loads(json_text))
    except Unexpected as exc:
        raise VerifyError(f"{name}: the generated files do not read back as one job: {exc} (a bug in sm12x-bundle)") from None
    where = first_difference(hcl_side, json_side, "job")
    if where is not None:
        raise VerifyError(
            f"{name}: the HCL and the API JSON describe different jobs at {where} (a bug in sm12x-bundle): nothing written"
        )
    return json_side


def first_difference(a: object, b: object, where: str) -> str | None:
    """The path of the first field where two views differ (None: they are equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(a.keys() | b.keys(), key=str):
            found = first_difference(a.get(key, _MISSING), b.get(key, _MISSING), f"{where}.{key}")
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next((f for i, (x, y) in enumerate(zip(a, b)) if (f := first_difference(x, y, f"{where}[{i}]"))), None)
    same = a == b and type(a) is type(b)
    return None if same else f"{where} (HCL {_shown(a)}, JSON {_shown(b)})"


def _shown(value: object) -> str:
    text = "nothing" if value is _MISSING else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# --- the API JSON --------------------------------------------------------------------


def _seconds(ns: object, where: str) -> int:
    if not isinstance(ns, int) or isinstance(ns, bool) or ns % _NS:
        raise Unexpected(f"{where}: {ns!r} is not whole seconds in nanoseconds")
    return ns // _NS


def api_view(doc: object) -> dict:
    top = _Take(doc, "json")
    job = top.sub("Job")
    top.done()
    g = _Take(_one(job("TaskGroups"), "TaskGroups"), "group")
    view = {
        "id": job("ID"),
        "name": job("Name"),
        "type": job("Type"),
        "datacenters": job("Datacenters"),
        "meta": job("Meta"),
        "group": _api_group(g),
    }
    job.done()
    g.done()
    return view


def _api_group(g: _Take) -> dict:
    n = _Take(_one(g("Networks"), "Networks"), "network")
    ports = [_api_port(_Take(p, "port")) for p in n("ReservedPorts")]
    n.done()
    disk, u = g.sub("EphemeralDisk"), g.sub("Update")
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
            "min_healthy_time": _seconds(u("MinHealthyTime"), "MinHealthyTime"),
            "healthy_deadline": _seconds(u("HealthyDeadline"), "HealthyDeadline"),
            "progress_deadline": _seconds(u("ProgressDeadline"), "ProgressDeadline"),
            "auto_revert": u("AutoRevert"),
        },
        "services": [_api_service(_Take(s, "service")) for s in g("Services")],
        "tasks": [_api_task(_Take(t, "task")) for t in g("Tasks")],
    }
    disk.done()
    u.done()
    return view


def _api_port(p: _Take) -> list:
    view = [p("Label"), p("Value"), p("To")]
    p.done()
    return view


def _api_constraints(items: object) -> list:
    out = []
    for c in items if isinstance(items, list) else [items]:
        t = _Take(c, "constraint")
        out.append([t("LTarget"), t("Operand"), t("RTarget")])
        t.done()
    return out


def _api_service(s: _Take) -> dict:
    checks = []
    for c in s("Checks"):
        ct = _Take(c, "check")
        r = ct.sub("CheckRestart")
        checks.append(
            {
                "name": ct("Name"),
                "type": ct("Type"),
                "path": ct("Path"),
                "interval": _seconds(ct("Interval"), "Interval"),
                "timeout": _seconds(ct("Timeout"), "Timeout"),
                "check_restart": {"limit": r("Limit"), "grace": _seconds(r("Grace"), "Grace"), "ignore_warnings": r("IgnoreWarnings")},
            }
        )
        r.done()
        ct.done()
    view = {"name": s("Name"), "provider": s("Provider"), "port": s("PortLabel"), "checks": checks}
    s.done()
    return view


def _api_task(t: _Take) -> dict:
    cfg, res = t.sub("Config"), t.sub("Resources")
    kill = t("KillTimeout", None)
    view = {
        "name": t("Name"),
        "driver": t("Driver"),
        "lifecycle": _api_pair(t("Lifecycle", None), "lifecycle", (("hook", "Hook"), ("sidecar", "Sidecar"))),
        "restart": _api_pair(t("RestartPolicy", None), "restart", (("attempts", "Attempts"), ("mode", "Mode"))),
        "kill_timeout": None if kill is None else _seconds(kill, "KillTimeout"),
        "env": t("Env"),
        "artifacts": [_api_artifact(_Take(a, "artifact")) for a in t("Artifacts", [])],
        "resources": {"cpu": res("CPU"), "memory": res("MemoryMB"), "devices": [_api_device(_Take(d, "device")) for d in res("Devices", [])]},
        "docker": _docker_view(cfg),
    }
    for part in (t, cfg, res):
        part.done()
    return view


def _api_pair(block: object, where: str, fields: tuple[tuple[str, str], ...]) -> dict | None:
    if block is None:
        return None
    b = _Take(block, where)
    view = {ours: b(theirs) for ours, theirs in fields}
    b.done()
    return view


def _api_artifact(a: _Take) -> dict:
    view = {"source": a("GetterSource"), "destination": a("RelativeDest"), "mode": a("GetterMode"), "options": a("GetterOptions")}
    a.done()
    return view


def _api_device(d: _Take) -> dict:
    view = {"name": d("Name"), "count": d("Count"), "constraints": _api_constraints(d("Constraints", []))}
    d.done()
    return view


def _docker_view(cfg: _Take) -> dict:
    """The docker driver's config: the same keys in both files (drivers/docker/config.go)."""
    mounts = []
    for m in cfg("mount", []):
        mt = _Take(m, "mount")
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


# --- the HCL ----------------------------------------------------------------------------


def hcl_view(text: str) -> dict:
    import hcl2  # python-hcl2; imported here so the CLI starts fast
    from hcl2.utils import SerializationOptions

    options = SerializationOptions(with_comments=False, explicit_blocks=False, strip_string_quotes=True)
    try:
        parsed = _literal(hcl2.loads(text, serialization_options=options))
    except Exception as exc:  # lark raises several types; hcl.literal a ValueError
        raise Unexpected(f"the HCL does not parse back: {' '.join(str(exc).split())[:200]}") from None
    top = _Take(parsed, "hcl")
    ((job_id, job),) = _labeled(top, "job", one=True)
    top.done()
    ((group_name, g),) = _labeled(job, "group", one=True)
    meta = _block(job, "meta")
    view = {
        "id": job_id,
        "name": job_id,
        "type": job("type"),
        "datacenters": job("datacenters"),
        "meta": meta.d,
        "group": _hcl_group(group_name, g),
    }
    job.done()
    g.done()
    return view


def _literal(value: object) -> object:
    """Every string (and block label) as Nomad reads it."""
    if isinstance(value, str):
        return hcl.literal(value)
    if isinstance(value, list):
        return [_literal(v) for v in value]
    if isinstance(value, dict):
        return {_literal(k): _literal(v) for k, v in value.items()}
    return value


def _labeled(body: _Take, key: str, one: bool = False) -> list[tuple[str, _Take]]:
    items = body(key, [])
    found = [(label, _Take(b, f"{body.where}.{key}.{label}")) for item in items for label, b in _Take(item, key).d.items()]
    if one and len(found) != 1:
        raise Unexpected(f"{body.where}: one {key} block expected, found {len(found)}")
    return found


def _block(body: _Take, key: str) -> _Take:
    return _Take(_one(body(key), f"{body.where}.{key}"), f"{body.where}.{key}")


_DURATION = re.compile(r"(\d+)([smh])")


def _hcl_seconds(value: object, where: str) -> int:
    m = _DURATION.fullmatch(value) if isinstance(value, str) else None
    if not m:
        raise Unexpected(f"{where}: {value!r} is not a duration")
    return int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)]


def _hcl_group(name: str, g: _Take) -> dict:
    network = _block(g, "network")
    ports = []
    for label, p in _labeled(network, "port"):
        ports.append([label, p("static"), p("to")])
        p.done()
    network.done()
    disk, u = _block(g, "ephemeral_disk"), _block(g, "update")
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
            "min_healthy_time": _hcl_seconds(u("min_healthy_time"), "min_healthy_time"),
            "healthy_deadline": _hcl_seconds(u("healthy_deadline"), "healthy_deadline"),
            "progress_deadline": _hcl_seconds(u("progress_deadline"), "progress_deadline"),
            "auto_revert": u("auto_revert"),
        },
        "services": [_hcl_service(_Take(s, "service")) for s in g("service")],
        "tasks": [_hcl_task(label, t) for label, t in _labeled(g, "task")],
    }
    disk.done()
    u.done()
    return view


def _hcl_constraints(body: _Take) -> list:
    out = []
    for c in body("constraint", []):
        ct = _Take(c, "constraint")
        out.append([ct("attribute"), ct("operator"), ct("value")])
        ct.done()
    return out


def _hcl_service(s: _Take) -> dict:
    checks = []
    for c in s("check"):
        ct = _Take(c, "check")
        r = _block(ct, "check_restart")
        checks.append(
            {
                "name": ct("name"),
                "type": ct("type"),
                "path": ct("path"),
                "interval": _hcl_seconds(ct("interval"), "interval"),
                "timeout": _hcl_seconds(ct("timeout"), "timeout"),
                "check_restart": {"limit": r("limit"), "grace": _hcl_seconds(r("grace"), "grace"), "ignore_warnings": r("ignore_warnings")},
            }
        )
        r.done()
        ct.done()
    view = {"name": s("name"), "provider": s("provider"), "port": s("port"), "checks": checks}
    s.done()
    return view


def _hcl_task(name: str, t: _Take) -> dict:
    cfg, res, env = _block(t, "config"), _block(t, "resources"), _block(t, "env")
    kill = t("kill_timeout", None)
    view = {
        "name": name,
        "driver": t("driver"),
        "lifecycle": _hcl_optional(t, "lifecycle", ("hook", "sidecar")),
        "restart": _hcl_optional(t, "restart", ("attempts", "mode")),
        "kill_timeout": None if kill is None else _hcl_seconds(kill, "kill_timeout"),
        "env": env.d,
        "artifacts": [_hcl_artifact(_Take(a, "artifact")) for a in t("artifact", [])],
        "resources": {"cpu": res("cpu"), "memory": res("memory"), "devices": _hcl_devices(res)},
        "docker": _docker_view(cfg),
    }
    for part in (t, cfg, res):
        part.done()
    return view


def _hcl_optional(body: _Take, key: str, fields: tuple[str, ...]) -> dict | None:
    if key not in body.d:
        return None
    b = _block(body, key)
    view = {f: b(f) for f in fields}
    b.done()
    return view


def _hcl_artifact(a: _Take) -> dict:
    options = _block(a, "options")
    view = {"source": a("source"), "destination": a("destination"), "mode": a("mode"), "options": options.d}
    a.done()
    return view


def _hcl_devices(res: _Take) -> list:
    devices = []
    for label, d in _labeled(res, "device"):
        devices.append({"name": label, "count": d("count"), "constraints": _hcl_constraints(d)})
        d.done()
    return devices
