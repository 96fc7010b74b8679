"""What differs between the lanes' vLLM releases, as far as the engine check drives them.

Read in vLLM 0.21.0's wheel and 0.33.0's sdist: the same ``LLM`` keyword arguments (an
``attention_backend`` name, ``kv_cache_memory_bytes``, ``enable_sleep_mode``), the same
``sleep(level, mode)`` and ``wake_up(tags)`` (0.33.0's returns whether the engine is fully
awake, 0.21.0's returns None), the same ``collective_rpc(method, timeout, args, kwargs)``
that runs a callable in the worker (cloudpickled: ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``),
and the same report of a failure inside the engine: the engine core logs it and the client
raises ``Exception("Call to <method> method failed: ...")`` while the engine core lives on.
Neither release resumes its scheduler when ``sleep`` fails (``EngineCore.sleep`` pauses it
first); ``wake_up(tags=["scheduling"])`` resumes it. What differs is kept here, in one table.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..serve_flags import option_name
from ..series.lane import version_key


@dataclass(frozen=True)
class ReleaseApi:
    since: str
    # What sleep(1) offloads (the rest, KV cache first, is discarded).
    level1_offloads: tuple[str, ...]
    # What sleep(2) offloads: weights are discarded, so they must be loaded again.
    level2_offloads: tuple[str, ...]
    wake_up_returns: str


TABLE = (
    ReleaseApi("0.21.0", ("weights",), (), "None"),
    ReleaseApi("0.33.0", ("weights", "runtime", "cudagraph"), ("runtime", "cudagraph"), "whether fully awake"),
)

# Both releases: vLLM's own reload_weights() needs the loader's get_all_weights(), which the
# dummy loader lacks (NotImplementedError); its load_weights() seeds every tensor with 1234,
# so running it again on the same shapes writes the same values.
RELOAD = "vLLM's reload_weights, else the dummy loader's load_weights again (fixed seed 1234)"


def api_for(version: str) -> ReleaseApi:
    """The row for ``version``: the newest row at or below it (the first row below all)."""
    try:
        key = version_key(version.split("+", 1)[0])
    except ValueError:
        return TABLE[0]
    rows = [r for r in TABLE if version_key(r.since) <= key]
    return rows[-1] if rows else TABLE[0]


def engine_kwargs(settings: dict) -> dict:
    """``LLM(**kwargs)`` for a session's settings (the same keywords in both releases)."""
    return {
        "model": settings["model"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": 0,
        "enforce_eager": bool(settings.get("eager", True)),
        "enable_sleep_mode": True,
        "attention_backend": "TRITON_ATTN",
        "gpu_memory_utilization": settings["gpu_memory_utilization"],
        "kv_cache_memory_bytes": settings["kv_cache_bytes"],
        "max_model_len": settings["max_model_len"],
        "max_num_seqs": settings["max_num_seqs"],
        "max_num_batched_tokens": settings["max_num_batched_tokens"],
        "tensor_parallel_size": int(settings.get("tp", 1)),
        "pipeline_parallel_size": int(settings.get("pp", 1)),
    }


# The flags the check sets itself for `vllm serve` (the same settings as engine_kwargs, in
# vLLM 0.21.0's spelling, engine/arg_utils.py); a --vllm-arg that sets one of them is left
# out and reported, since the check owns its model, its sizes and its address.
CHECK_FLAGS = (
    "model", "host", "port", "load-format", "skip-tokenizer-init", "dtype", "seed", "enforce-eager",
    "enable-sleep-mode", "attention-backend", "gpu-memory-utilization", "kv-cache-memory-bytes",
    "max-model-len", "max-num-seqs", "max-num-batched-tokens", "tensor-parallel-size", "pipeline-parallel-size",
    "worker-extension-cls", "served-model-name", "tokenizer", "distributed-executor-backend",
)
_SHORT = {"-tp": "tensor-parallel-size", "-pp": "pipeline-parallel-size", "-O": "compilation-config"}
# The check's flags that take no value (booleans): the token after one is not theirs.
_NO_VALUE = ("skip-tokenizer-init", "enforce-eager", "enable-sleep-mode")


def flag_name(token: str) -> str | None:
    """The option a command-line token names, without its dashes, as vLLM's parser reads it
    (serve_flags.option_name: ``_`` and ``-`` alike, ``=value`` and ``.key`` attached), with
    ``--no-X`` for a boolean X the check sets and the short aliases; None for a value."""
    name = option_name(token)
    if name in _SHORT:
        return _SHORT[name]
    if name is None or not name.startswith("--"):
        return None
    bare = name[2:]
    return bare[3:] if bare.startswith("no-") and bare[3:] in CHECK_FLAGS else bare


def split_vllm_args(args: list[str]) -> tuple[list[str], list[str]]:
    """(what the check passes on, what it leaves out because it sets that flag itself): a
    left-out flag takes its value with it."""
    kept, dropped, skip_value = [], [], False
    for token in args:
        if skip_value and flag_name(token) is None:
            dropped.append(token)
            skip_value = False
            continue
        skip_value = False
        name = flag_name(token)
        if name in CHECK_FLAGS:
            dropped.append(token)
            skip_value = "=" not in token and name not in _NO_VALUE
        else:
            kept.append(token)
    return kept, dropped


def parallel_from(args: list[str], key: str) -> int | None:
    """The value a list of vLLM flags gives ``key`` (e.g. pipeline-parallel-size), else None."""
    for i, token in enumerate(args):
        if flag_name(token) == key:
            value = token.split("=", 1)[1] if "=" in token else (args[i + 1] if i + 1 < len(args) else "")
            return int(value) if value.isdigit() else None
    return None


def api_keywords(args: list[str]) -> dict:
    """``LLM(...)`` keywords for vLLM flags, for --driver api: ``--name=VALUE`` gives the
    keyword ``name`` (dashes to underscores, as vLLM's EngineArgs spells it), VALUE read as
    JSON where it parses and as a string otherwise; a bare ``--name`` gives True;
    ``--name.key=VALUE`` sets one key of a dict keyword, as vLLM's own dotted flags do.
    ValueError for a token the API cannot take (a value apart from its flag, a short flag)."""
    import json

    kwargs: dict = {}
    for i, token in enumerate(args):
        if not token.startswith("--") or len(token) < 3:
            where = f"'{args[i - 1]} {token}'" if i and args[i - 1].startswith("--") else f"'{token}'"
            raise ValueError(f"{where}: with --driver api, give each flag and its value as one "
                             "token, --NAME=VALUE or a bare --NAME (--vllm-arg=--compilation-config={...})")
        name, eq, raw = token[2:].partition("=")
        if eq:
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
        else:
            value = True
        key, _, sub = name.replace("-", "_").partition(".")
        if sub:
            target = kwargs.setdefault(key, {})
            if not isinstance(target, dict):
                raise ValueError(f"'{token}': --{key} was given a value that is not a dict")
            target[sub] = value
        else:
            kwargs[key] = value
    return kwargs


def serve_argv(settings: dict, port: int, served_name: str) -> list[str]:
    """``vllm serve`` for a session's settings: the same engine as engine_kwargs, on
    127.0.0.1, with the worker probe mixed in, then the operator's own flags."""
    import sys

    kw = engine_kwargs(settings)
    argv = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", kw["model"],
            "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
            "--load-format", "dummy", "--skip-tokenizer-init", "--dtype", "bfloat16", "--seed", "0",
            "--enable-sleep-mode", "--attention-backend", kw["attention_backend"],
            "--gpu-memory-utilization", f"{kw['gpu_memory_utilization']:g}",
            "--kv-cache-memory-bytes", str(kw["kv_cache_memory_bytes"]),
            "--max-model-len", str(kw["max_model_len"]), "--max-num-seqs", str(kw["max_num_seqs"]),
            "--max-num-batched-tokens", str(kw["max_num_batched_tokens"]),
            "--tensor-parallel-size", str(kw["tensor_parallel_size"]),
            "--pipeline-parallel-size", str(kw["pipeline_parallel_size"]),
            "--worker-extension-cls", "sm12x_bundle.enginecheck.probe.Probe"]
    if kw["enforce_eager"]:
        argv.append("--enforce-eager")
    return argv + list(settings.get("vllm_args", []))


def installed_version(spec) -> str | None:
    """The vllm distribution's version as its metadata says, without importing it."""
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


# The environment of every engine session: the settings known to work on the device
# (FIELD-NOTES "A real vLLM engine on the device"), the engine core in its own process,
# and callables allowed through collective_rpc.
ENGINE_ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
