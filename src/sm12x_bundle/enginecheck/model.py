"""The model the engine runs: a Llama-shaped ``config.json`` written locally.

No hub, no tokenizer, no weight files: vLLM builds the model from the config and its dummy
loader fills every weight with values drawn from a fixed seed (``load_format="dummy"``),
so an engine started twice holds the same weights. :func:`plan_model` picks the shape for a
number of bf16 weight bytes from Llama-2's own shapes (7B is hidden 4096 x 32 layers, 13B
hidden 5120 x 40): the widest hidden size that still gets 32 layers, then as many layers as
fill the bytes.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from ..fsutil import write_file

GiB = 1 << 30
BF16 = 2
VOCAB = 32000
MIN_LAYERS = 32
# (hidden, intermediate, attention heads, key/value heads), head size 128 but the smallest.
SHAPES = (
    (1024, 2816, 8, 8),
    (2048, 5632, 16, 16),
    (4096, 11008, 32, 32),  # Llama-2 7B
    (5120, 13824, 40, 40),  # Llama-2 13B
    (8192, 28672, 64, 8),  # Llama-2 70B
)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int = VOCAB

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        kv = self.kv_heads * self.head_dim
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * kv  # q, o; k, v
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden  # mlp; two norms

    def params(self) -> int:
        embeddings = 2 * self.vocab * self.hidden  # input embedding and lm_head (not tied)
        return embeddings + self.layers * self.layer_params() + self.hidden  # final norm

    def weight_bytes(self) -> int:
        return self.params() * BF16

    def to_dict(self) -> dict:
        return {**asdict(self), "params": self.params(), "weight_bytes": self.weight_bytes()}


def plan_model(target_bytes: int) -> ModelShape:
    """The shape whose bf16 weights come nearest ``target_bytes`` (at least one layer)."""
    chosen = SHAPES[0]
    for shape in SHAPES:
        if _layers_for(shape, target_bytes) >= MIN_LAYERS:
            chosen = shape
    return ModelShape(*chosen, layers=max(1, _layers_for(chosen, target_bytes)))


def _layers_for(shape: tuple[int, int, int, int], target_bytes: int) -> int:
    one = ModelShape(*shape, layers=1)
    rest = target_bytes - (one.weight_bytes() - one.layer_params() * BF16)
    return round(rest / (one.layer_params() * BF16))


def llama_config(shape: ModelShape) -> dict:
    """What transformers' LlamaConfig reads; vLLM takes the architecture from it."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": shape.vocab,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
    }


def write_model(folder: Path, shape: ModelShape) -> Path:
    """The model folder: config.json alone. Returns the folder."""
    text = json.dumps(llama_config(shape), indent=2, sort_keys=True) + "\n"
    write_file(folder / "config.json", text.encode())
    return folder


def prompts(count: int, length: int, vocab: int = VOCAB, seed: int = 23) -> list[list[int]]:
    """Token-id prompts, the same for every engine and every run (no tokenizer needed)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(count)]


def fresh_prompts(cycle: int, count: int = 2, shortest: int = 200, longest: int = 900,
                  vocab: int = VOCAB) -> list[list[int]]:
    """Prompts no engine has seen before this cycle (a full prefill each, 200-900 tokens, as
    the seeds' recipe after every wake), the same for every tree in a run."""
    rng = random.Random(1000 + cycle)
    return [[rng.randrange(100, vocab - 1) for _ in range(rng.randint(shortest, longest))] for _ in range(count)]
