"""The Nomad job rules, at the command line: a job may not undo a flag the job spec manages (in
any spelling vLLM's parser reads), and a dangerous mount or env passes only when the job's
allow_* key names it.

Each row edits the valid config of tests/test_bad_input.py and runs ``build --dry-run`` (a
render would refuse the same, since the rules run when the config is loaded): the exit code,
the one sentence with ``cfg.yaml:LINE: KEY``, and a working directory, canary and cache left
exactly as they were. The last test reads the pinned sdists (integration) to keep the managed
flags' spellings in step with vLLM's own argument list.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_bad_input import BASE, CONFIG, run_main, snapshot

from sm12x_bundle import serve_flags

EXTRA = '    extra_args: ["--max-num-seqs", "12"]\n'
MOUNT = "      /models: /srv/models\n"
ENV = '      HF_HUB_OFFLINE: "1"\n'
DEVICE = '    gpu_allocation: shared\n    gpu_ids: ["0", "1", "2", "3"]\n'
GATE_AT = "    load_time_s: 1200\n"


@dataclass(frozen=True)
class Row:
    """BASE with each ``(old, new)`` edit; the error names ``key`` on the line of ``at``."""

    edits: tuple[tuple[str, str], ...]
    key: str = ""
    at: str = ""

    def text(self) -> str:
        text = BASE
        for old, new in self.edits:
            assert text.count(old) == 1, old
            text = text.replace(old, new)
        return text

    def line(self) -> int:
        return next(i for i, line in enumerate(self.text().splitlines(), 1) if line.strip() == self.at.strip())


def extra(*args: str) -> tuple[tuple[str, str], ...]:
    quoted = ", ".join(f'"{a}"' for a in args)
    return ((EXTRA, f"    extra_args: [{quoted}]\n"),)


def flag_row(args: tuple[str, ...], k: int) -> Row:
    (edit,) = extra(*args)
    return Row((edit,), f"jobs[0].extra_args[{k}]", edit[1])


def run(cwd: Path, cache: Path, row: Row, capsys) -> tuple[int, str]:
    (cwd / CONFIG).write_text(row.text())
    (cwd / "canary.txt").write_text("keep me\n")
    before = snapshot(cwd, cache)
    code = run_main(["build", "-q", "--config", CONFIG, "--dry-run"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert snapshot(cwd, cache) == before, "a refused config must leave the working directory and cache untouched"
    return code, err


@pytest.fixture
def world(tmp_path, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cache = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("SM12X_BUNDLE_CACHE", str(cache))
    return tmp_path, cache


# --- managed flags, in every spelling vLLM's parser reads ----------------------------------

# (extra_args, index of the refused token, the managed flag it sets)
MANAGED = [
    (("--gpu_memory_utilization=0.99",), 0, "--gpu-memory-utilization"),
    (("--gpu-memory-utilization", "0.99"), 0, "--gpu-memory-utilization"),
    (("--gpu-mem=0.99",), 0, "--gpu-memory-utilization"),  # argparse's abbreviation
    (("--gpu_mem", "0.99"), 0, "--gpu-memory-utilization"),
    (("--gpu-memory-utilization.x=1",), 0, "--gpu-memory-utilization"),  # a nested value of the flag
    (("--device_memory_utilization=0.99",), 0, "--gpu-memory-utilization"),  # 0.33.0's alias
    (("--device-mem", "0.99"), 0, "--gpu-memory-utilization"),
    (("--max-num-seqs", "12", "--gpu_memory_utilization=0.99"), 2, "--gpu-memory-utilization"),
    (("--tensor_parallel_size=8",), 0, "--tensor-parallel-size"),
    (("--tensor-parallel-size", "8"), 0, "--tensor-parallel-size"),
    (("-tp", "8"), 0, "--tensor-parallel-size"),
    (("-tp=8",), 0, "--tensor-parallel-size"),
    (("-t", "8"), 0, "--tensor-parallel-size"),  # -t abbreviates -tp
    (("--tensor", "8"), 0, "--tensor-parallel-size"),
    (("--no-enable-sleep-mode",), 0, "--enable-sleep-mode"),
    (("--no_enable_sleep_mode",), 0, "--enable-sleep-mode"),
    (("--no-enable-sleep",), 0, "--enable-sleep-mode"),
    (("--disable-sleep-mode",), 0, "--enable-sleep-mode"),  # 0.33.0's EnableDisableAction
    (("--no-disable-sleep-mode",), 0, "--enable-sleep-mode"),
    (("--enable-sleep-mode",), 0, "--enable-sleep-mode"),
    (("--max_model_len=1024",), 0, "--max-model-len"),
    (("--served-model-name=other",), 0, "--served-model-name"),
    (("--port=9000",), 0, "--port"),
    (("--host", "::"), 0, "--host"),
    (("--model=/other",), 0, "--model"),
    (("-pp", "2"), 0, "--pipeline-parallel-size"),
    (("--pipeline_parallel_size=2",), 0, "--pipeline-parallel-size"),
    (("-dp=2",), 0, "--data-parallel-size"),
    (("--kv-cache-memory-bytes=80G",), 0, "--kv-cache-memory-bytes"),
    (("--kv_cache_mem=80G",), 0, "--kv-cache-memory-bytes"),
    (("--uds=/tmp/vllm.sock",), 0, "--uds"),
    (("--config", "serve.yaml"), 0, "--config"),
]


@pytest.mark.parametrize("args, k, flag", MANAGED, ids=[" ".join(r[0]) for r in MANAGED])
def test_a_managed_flag_in_any_spelling_is_refused(world, capsys, args, k, flag):
    row = flag_row(args, k)
    code, err = run(*world, row, capsys)
    assert code == 3
    assert err.startswith(f"sm12x-bundle: error: {CONFIG}:{row.line()}: jobs[0].extra_args[{k}]: extra_args sets {flag}")
    assert err.count("\n") == 1


# Flags of vLLM's own that are not managed (and not abbreviations of one) pass.
OTHERS = [
    ("--max-num-seqs", "12"),
    ("--enforce-eager",),
    ("--no-enable-prefix-caching",),
    ("-dpl", "1"),  # --data-parallel-size-local: an option of its own, not -dp
    ("-dpp", "1"),
    ("--data-parallel-size-local=1",),
    ("--model-impl=vllm",),
    ("-O3",),
    ("--hf-overrides.rope_scaling.factor=2",),
    ("--max-num-batched-tokens", "8192"),
]


@pytest.mark.parametrize("args", OTHERS, ids=[" ".join(a) for a in OTHERS])
def test_other_flags_pass(world, capsys, args):
    code, err = run(*world, Row(extra(*args)), capsys)
    assert (code, err) == (0, "")


def test_the_spelling_reader_agrees_with_vllms_rules():
    read = serve_flags.option_name
    assert read("--gpu_memory_utilization=0.99") == "--gpu-memory-utilization"
    assert read("--hf_overrides.rope_scaling=x") == "--hf-overrides"
    assert read("0.99") is None and read("-") is None and read("--") is None
    assert serve_flags.managed_flag("-tp8") is None  # argparse reads it as no option: vLLM refuses it itself


# --- dangerous host mounts, mount targets and env --------------------------------------------

GATED = ((GATE_AT, GATE_AT + "    gate: engine\n    gate_time_s: 300\n"),)

# (id, edits, key, the line's text, fragment of the sentence, the allow_* line that lets it through)
DANGERS = [
    ("host-root", ((MOUNT, "      /models: /\n"),), "jobs[0].host_mounts./models", "/models: /",
     "mounts the host's /: it holds /var/run/docker.sock", "allow_host_mounts: [/]"),
    ("docker-socket", ((MOUNT, "      /models: /var/run/docker.sock\n"),), "jobs[0].host_mounts./models",
     "/models: /var/run/docker.sock", "Docker's socket", "allow_host_mounts: [/var/run/docker.sock]"),
    ("run-docker-socket", ((MOUNT, "      /models: /run/docker.sock\n"),), "jobs[0].host_mounts./models",
     "/models: /run/docker.sock", "Docker's socket", "allow_host_mounts: [/run/docker.sock]"),
    ("host-run", ((MOUNT, "      /models: /run\n"),), "jobs[0].host_mounts./models", "/models: /run",
     "it holds /run/docker.sock", "allow_host_mounts: [/run]"),
    ("host-proc", ((MOUNT, "      /models: /proc\n"),), "jobs[0].host_mounts./models", "/models: /proc",
     "the host's kernel view", "allow_host_mounts: [/proc]"),
    ("host-sys", ((MOUNT, "      /models: /sys/class\n"),), "jobs[0].host_mounts./models", "/models: /sys/class",
     "kernel and device settings", "allow_host_mounts: [/sys/class]"),
    ("host-dev", ((MOUNT, "      /models: /dev\n"),), "jobs[0].host_mounts./models", "/models: /dev",
     "the host's devices", "allow_host_mounts: [/dev]"),
    ("host-etc", ((MOUNT, "      /models: /etc/ssh\n"),), "jobs[0].host_mounts./models", "/models: /etc/ssh",
     "configuration and secrets", "allow_host_mounts: [/etc/ssh]"),
    ("host-root-home", ((MOUNT, "      /models: /root\n"),), "jobs[0].host_mounts./models", "/models: /root",
     "root user's files", "allow_host_mounts: [/root]"),
    ("host-home", ((MOUNT, "      /models: /home/me/models\n"),), "jobs[0].host_mounts./models",
     "/models: /home/me/models", "users' files", "allow_host_mounts: [/home/me/models]"),
    ("docker-state", ((MOUNT, "      /models: /var/lib/docker\n"),), "jobs[0].host_mounts./models",
     "/models: /var/lib/docker", "Docker's state", "allow_host_mounts: [/var/lib/docker]"),
    ("host-var", ((MOUNT, "      /models: /var\n"),), "jobs[0].host_mounts./models", "/models: /var",
     "it holds /var/run/docker.sock", "allow_host_mounts: [/var]"),
    ("target-root", ((MOUNT, "      /: /srv/models\n"),), "jobs[0].host_mounts./", "/: /srv/models",
     "mounts over the container's /,", "allow_mount_targets: [/]"),
    ("target-usr", ((MOUNT, "      /usr/lib: /srv/models\n"),), "jobs[0].host_mounts./usr/lib", "/usr/lib: /srv/models",
     "mounts over the container's /usr/lib,", "allow_mount_targets: [/usr/lib]"),
    ("target-ld-preload", ((MOUNT, "      /etc/ld.so.preload: /srv/preload\n"),), "jobs[0].host_mounts./etc/ld.so.preload",
     "/etc/ld.so.preload: /srv/preload", "mounts over the container's /etc/ld.so.preload,",
     "allow_mount_targets: [/etc/ld.so.preload]"),
    ("target-task-dir", ((MOUNT, "      /local: /srv/models\n"),), "jobs[0].host_mounts./local", "/local: /srv/models",
     "Nomad's task folders", "allow_mount_targets: [/local]"),
    ("env-nvidia-device", ((DEVICE, "    gpu_allocation: device\n"), (ENV, "      NVIDIA_VISIBLE_DEVICES: all\n")),
     "jobs[0].env.NVIDIA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES: all",
     "env NVIDIA_VISIBLE_DEVICES chooses the GPUs the job sees, which the device plugin decides",
     "allow_env: [NVIDIA_VISIBLE_DEVICES]"),
    ("env-cuda-visible", ((ENV, '      CUDA_VISIBLE_DEVICES: "0"\n'),), "jobs[0].env.CUDA_VISIBLE_DEVICES",
     'CUDA_VISIBLE_DEVICES: "0"', "which gpu_ids decides", "allow_env: [CUDA_VISIBLE_DEVICES]"),
    ("env-ld-preload", ((ENV, "      LD_PRELOAD: /srv/hook.so\n"),), "jobs[0].env.LD_PRELOAD", "LD_PRELOAD: /srv/hook.so",
     "env LD_PRELOAD changes what the loader or Python loads", "allow_env: [LD_PRELOAD]"),
    ("env-ld-library-path", ((ENV, "      LD_LIBRARY_PATH: /srv/lib\n"),), "jobs[0].env.LD_LIBRARY_PATH",
     "LD_LIBRARY_PATH: /srv/lib", "changes what the loader or Python loads", "allow_env: [LD_LIBRARY_PATH]"),
    ("env-pythonpath", ((ENV, "      PYTHONPATH: /srv/py\n"),), "jobs[0].env.PYTHONPATH", "PYTHONPATH: /srv/py",
     "changes what the loader or Python loads", "allow_env: [PYTHONPATH]"),
    ("env-ld-audit", ((ENV, "      LD_AUDIT: /srv/audit.so\n"),), "jobs[0].env.LD_AUDIT", "LD_AUDIT: /srv/audit.so",
     "changes what the loader or Python loads", "allow_env: [LD_AUDIT]"),
    ("env-pythonhome", ((ENV, "      PYTHONHOME: /srv/py\n"),), "jobs[0].env.PYTHONHOME", "PYTHONHOME: /srv/py",
     "changes what the loader or Python loads", "allow_env: [PYTHONHOME]"),
    ("gate-tool-dir-root", (*GATED, ("    overlay_delivery: host\n", "    overlay_delivery: host\n    gate_tool_dir: /\n")),
     "jobs[0].gate_tool_dir", "gate_tool_dir: /", "mounts the host's / into the gate: it holds", "allow_host_mounts: [/]"),
]


def _allowed(edits, allow: str):
    return (*edits, (GATE_AT, GATE_AT + f"    {allow}\n"))


@pytest.mark.parametrize("name, edits, key, at, fragment, allow", DANGERS, ids=[r[0] for r in DANGERS])
def test_a_dangerous_value_is_refused(world, capsys, name, edits, key, at, fragment, allow):
    row = Row(edits, key, at)
    code, err = run(*world, row, capsys)
    assert code == 3, err
    assert err.startswith(f"sm12x-bundle: error: {CONFIG}:{row.line()}: {key}: ") and fragment in err, err
    assert err.count("\n") == 1 and len(err) < 500


@pytest.mark.parametrize("name, edits, key, at, fragment, allow", DANGERS, ids=[r[0] for r in DANGERS])
def test_the_allow_key_lets_it_through(world, capsys, name, edits, key, at, fragment, allow):
    code, err = run(*world, Row(_allowed(edits, allow)), capsys)
    assert (code, err) == (0, ""), err


def test_a_gated_job_may_not_set_pythonpath_even_when_allowed(world, capsys):
    """The gate sets PYTHONPATH (to the mounted tool): allow_env does not override that."""
    row = Row((*GATED, (ENV, "      PYTHONPATH: /srv/py\n"), (GATE_AT, GATE_AT + "    allow_env: [PYTHONPATH]\n")),
              "jobs[0].env.PYTHONPATH", "PYTHONPATH: /srv/py")
    code, err = run(*world, row, capsys)
    assert code == 3 and "env PYTHONPATH is set by sm12x-bundle in the gate" in err, err
    assert err.startswith(f"sm12x-bundle: error: {CONFIG}:{row.line()}: jobs[0].env.PYTHONPATH: ")


ALLOW_NOTHING = [
    ("allow_host_mounts: [/etc]", "jobs[0].allow_host_mounts[0]", "'/etc' is no host path of host_mounts"),
    ("allow_mount_targets: [/model]", "jobs[0].allow_mount_targets[0]", "'/model' is no container path of host_mounts (did you mean '/models'?)"),
    ("allow_env: [HF_HUB_OFFLINE, LD_PRELOAD]", "jobs[0].allow_env[1]", "'LD_PRELOAD' is no name of env"),
]


@pytest.mark.parametrize("allow, key, fragment", ALLOW_NOTHING, ids=[r[1] for r in ALLOW_NOTHING])
def test_an_allow_entry_that_allows_nothing_is_refused(world, capsys, allow, key, fragment):
    row = Row(_allowed((), allow), key, "    " + allow)
    code, err = run(*world, row, capsys)
    assert code == 3 and err.startswith(f"sm12x-bundle: error: {CONFIG}:{row.line()}: {key}: {fragment}"), err


# --- the managed flags against the lanes' own argument lists (the cached sdists) -------------

_OPTION = re.compile(r"--?[a-z][a-z0-9-]*")


def aliases(root: Path) -> dict[str, set[str]]:
    """For each managed flag registered by an ``add_argument`` call in arg_utils.py (by one of
    its names, or by ``dest``), every option string of that call: a new alias shows here."""
    canonical = {f.flag for f in serve_flags.MANAGED}
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse((root / "vllm" / "engine" / "arg_utils.py").read_text("utf-8"))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = {a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
            dest = next((k.value.value for k in node.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)), None)
            for flag in names & canonical | ({"--" + dest.replace("_", "-")} & canonical if dest else set()):
                found.setdefault(flag, set()).update(names)
    return found


def serve_options(root: Path) -> set[str]:
    """Every option string ``vllm serve`` may register in a source tree, read without importing
    it: the option-like string constants of the files that build its parser, the frontend's
    dataclass fields, and the negations BooleanOptionalAction (and 0.33.0's EnableDisableAction)
    add. A superset: extra strings can only make the prefix check below stricter."""
    entry = root / "vllm" / "entrypoints"
    cli_args = next(p for p in (entry / "openai" / "cli_args.py", entry / "common" / "cli_args.py") if p.is_file())
    found: set[str] = set()
    for path in (root / "vllm" / "engine" / "arg_utils.py", cli_args, entry / "cli" / "serve.py"):
        for node in ast.walk(ast.parse(path.read_text("utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _OPTION.fullmatch(node.value):
                found.add(node.value)
            if isinstance(node, ast.ClassDef) and node.name.endswith("Args"):
                found |= {"--" + n.target.id.replace("_", "-") for n in node.body
                          if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    longs = {o for o in found if o.startswith("--")}
    found |= {"--no-" + o[2:] for o in longs}
    if "class EnableDisableAction" in (root / "vllm" / "utils" / "argparse_utils.py").read_text("utf-8"):
        enables = [o[len("--enable-"):] for o in longs if o.startswith("--enable-")]
        found |= {f"--{prefix}disable-{name}" for name in enables for prefix in ("", "no-")}
    return found


@pytest.mark.integration
def test_the_managed_flags_match_each_lanes_argument_list(default_context):
    spellings = serve_flags.spellings()
    seen: set[str] = set()
    for lane in default_context.lanes:
        root = default_context.source(lane.version).root
        options = serve_options(root)
        assert {f.flag for f in serve_flags.MANAGED} <= options, lane.version
        seen |= spellings & options
        for flag, names in aliases(root).items():
            assert names <= spellings, (lane.version, flag, names - spellings)
        # An exact option wins over an abbreviation: none of vLLM's may be a proper prefix of ours.
        shadowing = [(o, s) for o in options - spellings for s in spellings
                     if s.startswith(o) and o.startswith("--") == s.startswith("--")]
        assert shadowing == [], (lane.version, shadowing)
        parser = (root / "vllm" / "utils" / "argparse_utils.py").read_text("utf-8")
        assert 'pattern = re.compile(r"(?<=--)[^\\.]*")' in parser and '.replace("_", "-")' in parser
        for path in ("vllm/utils/argparse_utils.py", "vllm/entrypoints/cli/main.py", "vllm/entrypoints/cli/serve.py"):
            assert "allow_abbrev" not in (root / path).read_text("utf-8"), (lane.version, path)  # prefixes count
    assert seen == spellings, sorted(spellings - seen)
