"""One small vLLM 0.33.0 engine through ``vllm.LLM``, as the engine check starts it (scripts/gpu-engine-033.sh).

    python3 scripts/engine033/probe.py OUT.json [--native] [--graphs] [--model-dir DIR]

The vLLM imported is the first on PYTHONPATH (the script puts a prepared install there). A
Llama of 4 layers (hidden 1024) with dummy weights, TRITON_ATTN, eager (--graphs: CUDA
graphs without torch.compile), sleep mode on:
generate (greedy, token ids), sleep(1), wake, generate, and the tokens compared (level 2
and the rest are the engine check's). Each step's time and outcome go into
OUT.json as it goes, so a crash still leaves the steps before it.

--native: custom ops off (``compilation_config.custom_ops=["none"]``) and the IR norms on
their native implementation (``kernel_config.ir_op_priority``), so no ``torch.ops._C`` op is
called; without it the engine takes 0.33.0's defaults (custom ops on when eager, the IR
norms' vllm_c implementation first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024,
    "intermediate_size": 2816, "num_attention_heads": 8, "num_key_value_heads": 8,
    "num_hidden_layers": 4, "vocab_size": 32000, "max_position_embeddings": 2048,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
# --graphs: CUDA graphs without torch.compile, as scripts/gpu-engine-033.sh's graphs mode runs.
GRAPHS = {"enforce_eager": False, "compilation_config": {"mode": "NONE", "cudagraph_mode": "FULL"}}
NATIVE = {
    "compilation_config": {"custom_ops": ["none"]},
    "kernel_config": {"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}},
}


class Steps:
    def __init__(self, out: Path, doc: dict) -> None:
        self.out, self.doc = out, doc
        self.write()

    def write(self) -> None:
        self.out.write_text(json.dumps(self.doc, indent=2) + "\n")

    def run(self, name: str, fn):
        start = time.monotonic()
        try:
            value = fn()
        except BaseException as exc:
            self.doc["steps"].append({"step": name, "ok": False, "s": round(time.monotonic() - start, 2),
                                      "error": f"{type(exc).__name__}: {exc}"[:2000],
                                      "traceback": traceback.format_exc()[-6000:]})
            self.write()
            raise
        self.doc["steps"].append({"step": name, "ok": True, "s": round(time.monotonic() - start, 2)})
        self.write()
        return value


def engine_kwargs(model: Path, native: bool, graphs: bool = False) -> dict:
    kwargs = dict(model=str(model), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                  enforce_eager=True, enable_sleep_mode=True, attention_backend="TRITON_ATTN",
                  gpu_memory_utilization=0.3, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=2048,
                  tensor_parallel_size=1)
    kwargs.update(GRAPHS if graphs else {})
    if native:  # custom ops off, within whatever compilation config is set
        kwargs["compilation_config"] = {**kwargs.get("compilation_config", {}), **NATIVE["compilation_config"]}
        kwargs["kernel_config"] = NATIVE["kernel_config"]
    return kwargs


def session(steps: Steps, model: Path, native: bool, graphs: bool) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    steps.doc["vllm_file"], steps.doc["vllm_version"] = vllm.__file__, vllm.__version__
    llm = steps.run("LLM(...) (engine start, dummy load, profile, KV cache)", lambda: LLM(**engine_kwargs(model, native, graphs)))
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 31000 for j in range(24)]} for i in range(4)]

    def gen():
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    ref = steps.run("generate", gen)
    steps.run("sleep(1)", lambda: llm.sleep(level=1))
    steps.run("wake_up()", lambda: llm.wake_up())
    steps.doc["tokens_after_sleep1_equal"] = steps.run("generate after sleep(1)", gen) == ref
    steps.doc["tokens"] = ref[:1]
    steps.write()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--native", action="store_true")
    p.add_argument("--graphs", action="store_true", help="CUDA graphs (FULL), no torch.compile")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/sm12x-engine033-model"))
    a = p.parse_args(argv)
    a.model_dir.mkdir(parents=True, exist_ok=True)
    (a.model_dir / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    steps = Steps(a.out, {"native": a.native, "graphs": a.graphs, "env": env, "steps": []})
    try:
        session(steps, a.model_dir, a.native, a.graphs)
    except BaseException:
        return 1
    return 0 if steps.doc.get("tokens_after_sleep1_equal") else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
