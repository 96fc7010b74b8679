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
        "enforce_eager": True,
        "enable_sleep_mode": True,
        "attention_backend": "TRITON_ATTN",
        "gpu_memory_utilization": settings["gpu_memory_utilization"],
        "kv_cache_memory_bytes": settings["kv_cache_bytes"],
        "max_model_len": settings["max_model_len"],
        "max_num_seqs": settings["max_num_seqs"],
        "max_num_batched_tokens": settings["max_num_batched_tokens"],
        "tensor_parallel_size": 1,
    }


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
