# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Whether a DeepSeek V4 layer needs the Triton fallback instead of FlashInfer.

Since vLLM 0.26, DeepSeek V4 on SM12x runs FlashInfer's SM120 sparse-MLA
kernel (``trtllm_batch_decode_sparse_mla_dsv4``). The layer asks here once, at
init, whether that kernel has an entry for every call the layer will make; the
answer comes from FlashInfer's own dispatch information, never from catching
a failed call. Standard library only: no torch, no vLLM, no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

# The flashinfer-python release vLLM 0.33.0 pins; the prefill facts below are
# read from its sources and hold for it alone.
PINNED_FLASHINFER = "0.7.2.post1"

# The one cache layout the Triton kernels read: fp8_ds_mla, 448 fp8 NoPE
# bytes + 64 bf16 RoPE values + 8 scale bytes per token.
FP8_DS_MLA_BYTES_PER_TOKEN = 584

# FlashInfer 0.7.2.post1 keeps its prefill envelope in C++ only
# (include/flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h,
# visit_prefill_heads for DSV4 multi-group and dual-cache prefill;
# csrc/sparse_mla_sm120/attention_resolve.cu, "topk % 64 == 0"). Every call
# with more tokens than the decode kernels take goes there.
_PREFILL_FACTS = {
    PINNED_FLASHINFER: {"heads": frozenset({8, 16, 32, 64, 128}), "topk_multiple": 64},
}


@dataclass(frozen=True)
class LayerShape:
    """Every shape one attention layer hands the kernel over its life."""

    heads: int  # padded query heads per rank
    topks: tuple[int, ...]  # width of each index segment (SWA, compressed)
    page_block_sizes: tuple[int, ...]  # tokens per page of each cache
    tokens_per_request: int  # 1 + speculative tokens
    bytes_per_token: int = FP8_DS_MLA_BYTES_PER_TOKEN


@dataclass(frozen=True)
class FlashInferEntries:
    """What FlashInfer's SM120 DSV4 kernels have entries for."""

    version: str
    bytes_per_token: int
    max_heads: int
    head_counts: frozenset[int] | None  # None: every count up to max_heads
    min_topk: int
    topks: frozenset[int] | None  # None: any top-k from min_topk up
    page_sizes: frozenset[int] | None  # None: any positive page size
    max_decode_tokens: int
    prefill_heads: frozenset[int]
    prefill_topk_multiple: int


@dataclass(frozen=True)
class Decision:
    use_triton: bool
    reason: str


class UnreadableCacheLayout(ValueError):
    """The layer's KV cache is in a layout the Triton kernels do not read."""


def entries_from_config(config, version: str) -> FlashInferEntries | None:
    """FlashInfer's ``SparseMLASm120DecodeConfig`` for dsv4, plus the prefill
    facts of that release; None for a release whose prefill facts are unknown."""
    prefill = _PREFILL_FACTS.get(version)
    if prefill is None:
        return None
    pages = config.page_block_sizes or frozenset({config.page_block_size})
    return FlashInferEntries(
        version=version,
        bytes_per_token=config.bytes_per_token,
        max_heads=config.max_num_heads,
        head_counts=config.head_counts,
        min_topk=config.min_topk,
        topks=None if config.topk_is_runtime else frozenset(config.topks),
        page_sizes=None if config.page_block_size_is_runtime else frozenset(pages),
        max_decode_tokens=config.max_num_tokens,
        prefill_heads=prefill["heads"],
        prefill_topk_multiple=prefill["topk_multiple"],
    )


def read_installed_flashinfer() -> tuple[FlashInferEntries | None, str]:
    """The installed FlashInfer's entries, or None and the sentence why not."""
    try:
        import flashinfer
        from flashinfer.mla import supported_sparse_mla_sm120_configs
    except Exception as exc:  # any import failure means: no table to read
        return None, f"FlashInfer's SM120 sparse-MLA table cannot be imported ({exc})"
    version = getattr(flashinfer, "__version__", "unknown")
    if version != PINNED_FLASHINFER:
        return None, (
            f"FlashInfer {version} is installed, not {PINNED_FLASHINFER}, "
            "whose dispatch facts this fallback knows"
        )
    config = supported_sparse_mla_sm120_configs().get("dsv4")
    if config is None:
        return None, f"FlashInfer {version} lists no dsv4 sparse-MLA family"
    return entries_from_config(config, version), f"FlashInfer {version}"


def _decode_gaps(shape: LayerShape, fi: FlashInferEntries) -> list[str]:
    gaps = []
    heads_ok = (
        shape.heads in fi.head_counts
        if fi.head_counts is not None
        else 1 <= shape.heads <= fi.max_heads
    )
    if not heads_ok:
        gaps.append(f"no decode kernel for {shape.heads} heads")
    for topk in shape.topks:
        if topk < fi.min_topk or (fi.topks is not None and topk not in fi.topks):
            gaps.append(f"no decode kernel for top-k {topk}")
    for page in shape.page_block_sizes:
        if fi.page_sizes is not None and page not in fi.page_sizes:
            gaps.append(f"no decode kernel for page_block_size {page}")
    if shape.tokens_per_request > fi.max_decode_tokens:
        gaps.append(
            f"{shape.tokens_per_request} tokens per request exceed the decode "
            f"kernels' {fi.max_decode_tokens}"
        )
    return gaps


def _prefill_gaps(shape: LayerShape, fi: FlashInferEntries) -> list[str]:
    gaps = []
    if shape.heads not in fi.prefill_heads:
        gaps.append(f"no prefill kernel for {shape.heads} heads")
    for topk in shape.topks:
        if topk % fi.prefill_topk_multiple:
            gaps.append(
                f"no prefill kernel for top-k {topk} (not a multiple of "
                f"{fi.prefill_topk_multiple})"
            )
    return gaps


def flashinfer_gaps(shape: LayerShape, fi: FlashInferEntries) -> list[str]:
    """Why FlashInfer's SM120 kernel cannot serve some call of this layer.

    A layer makes decode-form calls (up to ``max_decode_tokens`` tokens) and
    larger ones (prefill chunks, big decode batches) that only the prefill
    kernels take, so both envelopes must hold the shape.
    """
    if shape.bytes_per_token != fi.bytes_per_token:
        return [f"no kernel for {shape.bytes_per_token}-byte cache rows"]
    return _decode_gaps(shape, fi) + _prefill_gaps(shape, fi)


def decide(
    shape: LayerShape,
    forced: bool | None,
    fi: FlashInferEntries | None,
    why_unreadable: str = "",
) -> Decision:
    """Triton or FlashInfer for this layer; raises for a cache Triton can't read.

    ``forced`` is VLLM_TRITON_MLA_SPARSE: True always, False never (the
    pristine FlashInfer path, gaps and all), None: exactly at FlashInfer's gaps.
    """
    if forced is False:
        return Decision(False, "VLLM_TRITON_MLA_SPARSE=0")
    if forced:
        decision = Decision(True, "VLLM_TRITON_MLA_SPARSE=1")
    elif fi is None:
        # Without the table nothing says FlashInfer has an entry; the Triton
        # kernels serve every head count, top-k and page size.
        decision = Decision(True, f"{why_unreadable}; using the Triton fallback")
    else:
        gaps = flashinfer_gaps(shape, fi)
        if not gaps:
            return Decision(False, f"FlashInfer {fi.version} has entries for {shape}")
        decision = Decision(True, f"FlashInfer {fi.version}: " + "; ".join(gaps))
    if shape.bytes_per_token != FP8_DS_MLA_BYTES_PER_TOKEN:
        raise UnreadableCacheLayout(
            f"The Triton sparse-MLA fallback reads only the "
            f"{FP8_DS_MLA_BYTES_PER_TOKEN}-byte fp8_ds_mla cache, not this "
            f"layer's {shape.bytes_per_token}-byte rows ({decision.reason})."
        )
    return decision
