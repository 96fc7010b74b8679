# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton sparse-MLA attention for DeepSeek V4 without FlashMLA (SM12x).

Two entry points, both CUDA-graph capturable (no host synchronisation, no
``.item()``, every allocation's size depends on shapes only):

* :func:`sparse_mla_decode` reads the paged ``fp8_ds_mla`` caches directly by
  slot id and dequantizes in registers. It takes the SWA subset (slot ids into
  the SWA cache) and, optionally, the compressed top-k subset (slot ids into
  the layer's own compressed cache); both have per-token lengths. The two
  subsets are one online softmax, the per-head attention sink is applied once
  to the merged result.
* :func:`sparse_mla_prefill` attends over gathered bf16 KV rows with one set of
  indices and lengths per query token, and the sink.

Semantics follow FlashMLA's sparse kernels: an index of -1, an index outside
the cache, or a position at or past the token's length is skipped; duplicate
indices count as many times as they appear; a row with no valid entry outputs
zeros; with a sink ``s_h`` the output is ``sum_j e^{x_j} v_j / (sum_j e^{x_j} +
e^{s_h})``. Keys and values share the 512-wide latent.

``fp8_ds_mla`` layout (584 bytes per token): a page of ``page_block_size``
tokens stores the 576-byte token data of all its tokens first (448 fp8 e4m3
NoPE values, then 64 bf16 RoPE values), then one 8-byte scale group per token
(7 UE8M0 exponents with bias 127, one per 64-value NoPE tile, and a pad
byte). The page stride is the cache tensor's ``stride(0)`` (pages are padded).

This module imports only torch and triton so that it can be tested alone.
"""

import os

import torch
import triton
import triton.language as tl

HEAD_DIM = 512
NOPE_DIM = 448
ROPE_DIM = 64
TILE = 64  # one UE8M0 scale per 64 NoPE values; the RoPE part is tile 7
TOKEN_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
SCALE_BYTES = 8
TOKEN_BYTES = TOKEN_DATA_BYTES + SCALE_BYTES  # 584

# Largest dynamic shared memory a block may use on SM120/SM121 (99 KiB).
SM120_MAX_SHARED_BYTES = 99 * 1024

_LOG2E = 1.4426950408889634
# Upper bound on the split-K factor; bounds the fp32 partial workspace.
_DEFAULT_MAX_SPLITS = 32


def _dot_in_fp32(device: torch.device) -> bool:
    # Only Triton's CPU interpreter runs on host tensors.
    return device.type != "cuda"


# --------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------


@triton.jit
def _mma(a, b, acc, DOT_F32: tl.constexpr):
    # Triton's CPU interpreter multiplies bf16 operands as raw uint16 bit
    # patterns, so under TRITON_INTERPRET=1 the operands are widened to fp32
    # first (values are unchanged: every bf16 is exact in fp32).
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _load_q_tile(q_row_ptr, offs_h, offs_d, h_mask, C: tl.constexpr, stride_qh):
    return tl.load(
        q_row_ptr + offs_h[:, None] * stride_qh + (C * 64 + offs_d)[None, :],
        mask=h_mask[:, None],
        other=0.0,
    )


@triton.jit
def _load_raw_tile(tok_ptr, valid, offs_d, C: tl.constexpr, FP8: tl.constexpr):
    """Raw bytes of tile C (dims C*64 .. C*64+63) of BLOCK_N rows: fp8 bits
    (uint8) for the NoPE tiles of the fp8_ds_mla layout, bf16 otherwise."""
    if FP8 and C < 7:
        return tl.load(
            tok_ptr[:, None] + (C * 64 + offs_d)[None, :], mask=valid[:, None], other=0
        )
    elif FP8:
        rope_ptr = (tok_ptr + 448).to(tl.pointer_type(tl.bfloat16))
        return tl.load(rope_ptr[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
    else:
        return tl.load(
            tok_ptr[:, None] + (C * 64 + offs_d)[None, :],
            mask=valid[:, None],
            other=0.0,
        )


@triton.jit
def _dequant_tile(raw, exp, C: tl.constexpr, FP8: tl.constexpr):
    """bf16 values of a raw tile; ``exp`` is the UE8M0 exponent byte per row."""
    if FP8 and C < 7:
        scale = tl.exp2(exp.to(tl.float32) - 127.0)
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return (x * scale[:, None]).to(tl.bfloat16)
    else:
        return raw


@triton.jit
def _fetch_block(
    p0,
    end,
    n_a,
    t,
    offs_n,
    offs_d,
    a_cache_ptr,
    a_page_stride,
    a_num_rows,
    a_idx_ptr,
    a_idx_stride,
    b_cache_ptr,
    b_page_stride,
    b_num_rows,
    b_idx_ptr,
    b_idx_stride,
    A_PBS: tl.constexpr,
    B_PBS: tl.constexpr,
    HAS_B: tl.constexpr,
    FP8: tl.constexpr,
):
    """Issue every global load of one key block (positions p0 .. p0+BLOCK_N-1
    of the token's SWA-then-top-k list): validity, 8 raw tiles, 7 exponents."""
    v = p0 + offs_n
    in_range = v < end
    in_a = v < n_a
    idx_a = tl.load(a_idx_ptr + t * a_idx_stride + v, mask=in_range & in_a, other=-1)
    ok_a = in_range & in_a & (idx_a >= 0) & (idx_a < a_num_rows)
    tok, scl = _row_pointers(idx_a, ok_a, a_cache_ptr, a_page_stride, A_PBS, FP8)
    valid = ok_a
    if HAS_B:
        in_b = in_range & (v >= n_a)
        idx_b = tl.load(b_idx_ptr + t * b_idx_stride + (v - n_a), mask=in_b, other=-1)
        ok_b = in_b & (idx_b >= 0) & (idx_b < b_num_rows)
        tok_b, scl_b = _row_pointers(idx_b, ok_b, b_cache_ptr, b_page_stride, B_PBS, FP8)
        tok = tl.where(in_a, tok, tok_b)
        scl = tl.where(in_a, scl, scl_b)
        valid = ok_a | ok_b
    if FP8:
        tok = tl.multiple_of(tok, 16)
        e0 = tl.load(scl + 0, mask=valid, other=127)
        e1 = tl.load(scl + 1, mask=valid, other=127)
        e2 = tl.load(scl + 2, mask=valid, other=127)
        e3 = tl.load(scl + 3, mask=valid, other=127)
        e4 = tl.load(scl + 4, mask=valid, other=127)
        e5 = tl.load(scl + 5, mask=valid, other=127)
        e6 = tl.load(scl + 6, mask=valid, other=127)
    else:
        e0 = valid
        e1 = valid
        e2 = valid
        e3 = valid
        e4 = valid
        e5 = valid
        e6 = valid
    r0 = _load_raw_tile(tok, valid, offs_d, 0, FP8)
    r1 = _load_raw_tile(tok, valid, offs_d, 1, FP8)
    r2 = _load_raw_tile(tok, valid, offs_d, 2, FP8)
    r3 = _load_raw_tile(tok, valid, offs_d, 3, FP8)
    r4 = _load_raw_tile(tok, valid, offs_d, 4, FP8)
    r5 = _load_raw_tile(tok, valid, offs_d, 5, FP8)
    r6 = _load_raw_tile(tok, valid, offs_d, 6, FP8)
    r7 = _load_raw_tile(tok, valid, offs_d, 7, FP8)
    return valid, r0, r1, r2, r3, r4, r5, r6, r7, e0, e1, e2, e3, e4, e5, e6


@triton.jit
def _store_tile(row_ptr, offs_h, offs_d, h_mask, C: tl.constexpr, stride_h, x):
    tl.store(
        row_ptr + offs_h[:, None] * stride_h + (C * 64 + offs_d)[None, :],
        x,
        mask=h_mask[:, None],
    )


@triton.jit
def _row_pointers(
    idx,
    valid,
    cache_ptr,
    page_stride,
    PBS: tl.constexpr,
    FP8: tl.constexpr,
):
    """Token-data and scale-group pointers for slot ids ``idx`` (invalid -> 0)."""
    safe = tl.where(valid, idx, 0).to(tl.int64)
    if FP8:
        page = safe // PBS
        off = safe % PBS
        base = cache_ptr + page * page_stride
        tok = base + off * 576
        scl = base + PBS * 576 + off * 8
    else:
        tok = cache_ptr + safe * page_stride
        scl = tok
    return tok, scl


@triton.jit
def _sparse_mla_attn_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    out_ptr,
    stride_ot,
    stride_oh,
    part_o_ptr,
    part_lse_ptr,
    sink_ptr,
    # subset A: cache, its page stride, slot ids, their row stride, lengths
    a_cache_ptr,
    a_page_stride,
    a_num_rows,
    a_idx_ptr,
    a_idx_stride,
    a_lens_ptr,
    a_width,
    # subset B (compressed top-k); unused when HAS_B is False
    b_cache_ptr,
    b_page_stride,
    b_num_rows,
    b_idx_ptr,
    b_idx_stride,
    b_lens_ptr,
    b_width,
    num_heads,
    num_head_blocks,
    num_splits,
    sm_scale_log2,
    A_PBS: tl.constexpr,
    B_PBS: tl.constexpr,
    HAS_B: tl.constexpr,
    FP8: tl.constexpr,
    HAS_SINK: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid = tl.program_id(0)
    hb = pid % num_head_blocks
    rest = pid // num_head_blocks
    split = rest % num_splits
    t = (rest // num_splits).to(tl.int64)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_d = tl.arange(0, 64)
    offs_n = tl.arange(0, BLOCK_N)

    # Valid prefix of each subset for this token.
    n_a = tl.minimum(tl.maximum(tl.load(a_lens_ptr + t), 0), a_width)
    if HAS_B:
        n_b = tl.minimum(tl.maximum(tl.load(b_lens_ptr + t), 0), b_width)
    else:
        n_b = 0
    n = n_a + n_b
    per_split = (n + num_splits - 1) // num_splits
    per_split = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = split * per_split
    end = tl.minimum(n, start + per_split)

    q_row = q_ptr + t * stride_qt
    q0 = _load_q_tile(q_row, offs_h, offs_d, h_mask, 0, stride_qh)
    q1 = _load_q_tile(q_row, offs_h, offs_d, h_mask, 1, stride_qh)
    q2 = _load_q_tile(q_row, offs_h, offs_d, h_mask, 2, stride_qh)
    q3 = _load_q_tile(q_row, offs_h, offs_d, h_mask, 3, stride_qh)
    q4 = _load_q_tile(q_row, offs_h, offs_d, h_mask, 4, stride_qh)
    q5 = _load_q_tile(q_row, offs_h, offs_d, h_mask, 5, stride_qh)
    q6 = _load_q_tile(q_row, offs_h, offs_d, h_mask, 6, stride_qh)
    q7 = _load_q_tile(q_row, offs_h, offs_d, h_mask, 7, stride_qh)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc4 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc5 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc6 = tl.zeros([BLOCK_H, 64], tl.float32)
    acc7 = tl.zeros([BLOCK_H, 64], tl.float32)

    # Software pipeline: the loads of block i+1 are issued before block i is
    # dequantized and multiplied, so their latency overlaps the math.
    valid, r0, r1, r2, r3, r4, r5, r6, r7, e0, e1, e2, e3, e4, e5, e6 = _fetch_block(
        start, end, n_a, t, offs_n, offs_d,
        a_cache_ptr, a_page_stride, a_num_rows, a_idx_ptr, a_idx_stride,
        b_cache_ptr, b_page_stride, b_num_rows, b_idx_ptr, b_idx_stride,
        A_PBS, B_PBS, HAS_B, FP8,
    )
    for p0 in range(start, end, BLOCK_N):
        (nvalid, n0, n1, n2, n3, n4, n5, n6, n7,
         f0, f1, f2, f3, f4, f5, f6) = _fetch_block(
            p0 + BLOCK_N, end, n_a, t, offs_n, offs_d,
            a_cache_ptr, a_page_stride, a_num_rows, a_idx_ptr, a_idx_stride,
            b_cache_ptr, b_page_stride, b_num_rows, b_idx_ptr, b_idx_stride,
            A_PBS, B_PBS, HAS_B, FP8,
        )
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        k0 = _dequant_tile(r0, e0, 0, FP8)
        s = _mma(q0, tl.trans(k0), s, DOT_F32)
        k1 = _dequant_tile(r1, e1, 1, FP8)
        s = _mma(q1, tl.trans(k1), s, DOT_F32)
        k2 = _dequant_tile(r2, e2, 2, FP8)
        s = _mma(q2, tl.trans(k2), s, DOT_F32)
        k3 = _dequant_tile(r3, e3, 3, FP8)
        s = _mma(q3, tl.trans(k3), s, DOT_F32)
        k4 = _dequant_tile(r4, e4, 4, FP8)
        s = _mma(q4, tl.trans(k4), s, DOT_F32)
        k5 = _dequant_tile(r5, e5, 5, FP8)
        s = _mma(q5, tl.trans(k5), s, DOT_F32)
        k6 = _dequant_tile(r6, e6, 6, FP8)
        s = _mma(q6, tl.trans(k6), s, DOT_F32)
        k7 = _dequant_tile(r7, e0, 7, FP8)
        s = _mma(q7, tl.trans(k7), s, DOT_F32)

        s = tl.where(valid[None, :], s * sm_scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        pb = p.to(tl.bfloat16)
        a2 = alpha[:, None]
        acc0 = _mma(pb, k0, acc0 * a2, DOT_F32)
        acc1 = _mma(pb, k1, acc1 * a2, DOT_F32)
        acc2 = _mma(pb, k2, acc2 * a2, DOT_F32)
        acc3 = _mma(pb, k3, acc3 * a2, DOT_F32)
        acc4 = _mma(pb, k4, acc4 * a2, DOT_F32)
        acc5 = _mma(pb, k5, acc5 * a2, DOT_F32)
        acc6 = _mma(pb, k6, acc6 * a2, DOT_F32)
        acc7 = _mma(pb, k7, acc7 * a2, DOT_F32)
        valid, r0, r1, r2, r3, r4, r5, r6, r7 = nvalid, n0, n1, n2, n3, n4, n5, n6, n7
        e0, e1, e2, e3, e4, e5, e6 = f0, f1, f2, f3, f4, f5, f6

    has_any = l_i > 0.0
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    if not SPLIT:
        denom = l_i
        if HAS_SINK:
            sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=float("-inf"))
            denom = denom + tl.exp2(sink * 1.4426950408889634 - m_safe)
        inv = tl.where(has_any, 1.0 / tl.where(has_any, denom, 1.0), 0.0)[:, None]
        o_row = out_ptr + t * stride_ot
        dt = out_ptr.dtype.element_ty
        _store_tile(o_row, offs_h, offs_d, h_mask, 0, stride_oh, (acc0 * inv).to(dt))
        _store_tile(o_row, offs_h, offs_d, h_mask, 1, stride_oh, (acc1 * inv).to(dt))
        _store_tile(o_row, offs_h, offs_d, h_mask, 2, stride_oh, (acc2 * inv).to(dt))
        _store_tile(o_row, offs_h, offs_d, h_mask, 3, stride_oh, (acc3 * inv).to(dt))
        _store_tile(o_row, offs_h, offs_d, h_mask, 4, stride_oh, (acc4 * inv).to(dt))
        _store_tile(o_row, offs_h, offs_d, h_mask, 5, stride_oh, (acc5 * inv).to(dt))
        _store_tile(o_row, offs_h, offs_d, h_mask, 6, stride_oh, (acc6 * inv).to(dt))
        _store_tile(o_row, offs_h, offs_d, h_mask, 7, stride_oh, (acc7 * inv).to(dt))
    else:
        # Partial state: subset-normalised output and log2-sum-exp.
        l_safe = tl.where(has_any, l_i, 1.0)
        inv = tl.where(has_any, 1.0 / l_safe, 0.0)[:, None]
        lse = tl.where(has_any, m_safe + tl.log2(l_safe), float("-inf"))
        row = (t * num_splits + split) * num_heads
        tl.store(part_lse_ptr + row + offs_h, lse, mask=h_mask)
        o_row = part_o_ptr + row * 512
        _store_tile(o_row, offs_h, offs_d, h_mask, 0, 512, acc0 * inv)
        _store_tile(o_row, offs_h, offs_d, h_mask, 1, 512, acc1 * inv)
        _store_tile(o_row, offs_h, offs_d, h_mask, 2, 512, acc2 * inv)
        _store_tile(o_row, offs_h, offs_d, h_mask, 3, 512, acc3 * inv)
        _store_tile(o_row, offs_h, offs_d, h_mask, 4, 512, acc4 * inv)
        _store_tile(o_row, offs_h, offs_d, h_mask, 5, 512, acc5 * inv)
        _store_tile(o_row, offs_h, offs_d, h_mask, 6, 512, acc6 * inv)
        _store_tile(o_row, offs_h, offs_d, h_mask, 7, 512, acc7 * inv)


@triton.jit
def _merge_splits_kernel(
    part_o_ptr,
    part_lse_ptr,
    sink_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    HAS_SINK: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token, block of heads and slice of the 512 dims: at
    # batch 1 the splits are many and the programs few.
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_s = tl.arange(0, SPLITS_P2)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)

    lse = tl.load(
        part_lse_ptr + (t * NUM_SPLITS + offs_s[:, None]) * num_heads + offs_h[None, :],
        mask=(offs_s[:, None] < NUM_SPLITS) & h_mask[None, :],
        other=float("-inf"),
    )
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_all = tl.exp2(lse - m_safe[None, :])
    total = tl.sum(w_all, 0)
    denom = total
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=float("-inf"))
        denom = denom + tl.exp2(sink * 1.4426950408889634 - m_safe)
    inv = tl.where(total > 0.0, 1.0 / tl.where(total > 0.0, denom, 1.0), 0.0)

    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for sp in range(NUM_SPLITS):
        lse_s = tl.load(
            part_lse_ptr + (t * NUM_SPLITS + sp) * num_heads + offs_h,
            mask=h_mask,
            other=float("-inf"),
        )
        w = tl.exp2(lse_s - m_safe)
        o = tl.load(
            part_o_ptr
            + ((t * NUM_SPLITS + sp) * num_heads + offs_h[:, None]) * 512
            + offs_d[None, :],
            mask=h_mask[:, None] & (w[:, None] > 0.0),
            other=0.0,
        )
        acc += o * w[:, None]
    out = acc * inv[:, None]
    tl.store(
        out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None],
    )


# --------------------------------------------------------------------------
# Launch configuration
# --------------------------------------------------------------------------

# (BLOCK_H, BLOCK_N, num_warps, num_stages) by kernel, by the computed heads
# rounded up to 16, 32, 64 or 128, and by whether the device is SM12x.
# SM12x: (16, 16, 4 warps) only: ptxas for sm_120a builds it without spills
# and the H200 sweep timed it (four-warp builds with BLOCK_H 32 or BLOCK_N 32
# reach 255 registers and spill 24-228 B, (64, 32, 8 warps) 1.7-3.5 KB).
# Elsewhere (the forced path on SM90/SM100) the fastest of a sweep on an H200
# against FlashMLA (docs/sparse-mla.md). Every entry is compiled for sm_120 by
# the tests and must fit SM120_MAX_SHARED_BYTES.
_SM12X_CONFIG = (16, 16, 4, 1)
_CONFIGS: dict[tuple[str, int, bool], tuple[int, int, int, int]] = {
    ("decode", 16, False): (16, 32, 4, 1),
    ("decode", 32, False): (32, 32, 8, 1),
    ("decode", 64, False): (64, 32, 8, 1),
    ("decode", 128, False): (64, 32, 8, 1),
    ("prefill", 16, False): (16, 32, 4, 1),
    ("prefill", 32, False): (64, 16, 8, 1),
    ("prefill", 64, False): (64, 16, 8, 1),
    ("prefill", 128, False): (64, 16, 8, 1),
    **{(kind, heads, True): _SM12X_CONFIG
       for kind in ("decode", "prefill") for heads in (16, 32, 64, 128)},
}
# Decode with fewer programs than this share of the SMs (batch 1) takes the
# 16-head configuration: more programs, each with a shorter chain of loads.
_FEW_PROGRAMS_PER_SM = 0.25
_MERGE_BLOCK_H = 8
_MERGE_BLOCK_D = 128


def _head_class(num_heads: int) -> int:
    return 16 if num_heads <= 16 else 32 if num_heads <= 32 else 64 if num_heads <= 64 else 128


def _pick_config(
    kind: str, num_heads: int, device: torch.device, num_tokens: int | None = None
) -> tuple[int, int, int, int]:
    override = os.environ.get("VLLM_TRITON_MLA_SPARSE_KERNEL_CONFIG")
    if override:
        bh, bn, nw, ns = (int(x) for x in override.split(","))
        return bh, bn, nw, ns
    config = _CONFIGS[(kind, _head_class(num_heads), _is_sm12x(device))]
    if kind == "decode" and num_tokens is not None:
        programs = num_tokens * triton.cdiv(num_heads, config[0])
        if programs < _FEW_PROGRAMS_PER_SM * _num_sms(device):
            config = _CONFIGS[(kind, 16, _is_sm12x(device))]
    return config


def all_configs() -> list[tuple[int, int, int, int]]:
    """Every (BLOCK_H, BLOCK_N, num_warps, num_stages) the wrappers can pick."""
    return sorted(set(_CONFIGS.values()))


_sm_count_cache: dict[int, int] = {}
_sm12x_cache: dict[int, bool] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _is_sm12x(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    index = _device_index(device)
    if index not in _sm12x_cache:
        _sm12x_cache[index] = torch.cuda.get_device_capability(index)[0] == 12
    return _sm12x_cache[index]


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = _device_index(device)
    if index not in _sm_count_cache:
        props = torch.cuda.get_device_properties(index)
        _sm_count_cache[index] = props.multi_processor_count
    return _sm_count_cache[index]


def _max_splits() -> int:
    value = os.environ.get("VLLM_TRITON_MLA_SPARSE_MAX_SPLITS")
    return max(1, int(value)) if value else _DEFAULT_MAX_SPLITS


# The H200 sweep against FlashMLA: the best split count filled the SMs with
# programs once (eight warps) or twice (four warps), rounding down, kept at
# least two key blocks per split and was never above 16.
_SPLITS_CAP = 16


def choose_num_splits(
    num_tokens: int,
    num_head_blocks: int,
    max_keys: int,
    block_n: int,
    num_sms: int,
    num_warps: int = 4,
) -> int:
    """Split-K factor from shapes only (so a captured graph stays valid)."""
    ctas = max(1, num_tokens * num_head_blocks)
    resident = num_sms * (2 if num_warps <= 4 else 1)
    want = resident // ctas
    most = triton.cdiv(max_keys, 2 * block_n)
    return int(max(1, min(want, most, _SPLITS_CAP, _max_splits())))


def _as_rows(x: torch.Tensor, num_tokens: int) -> torch.Tensor:
    x = x.reshape(num_tokens, -1)
    assert x.stride(-1) == 1, "index rows must be contiguous"
    assert x.dtype == torch.int32, f"indices must be int32, got {x.dtype}"
    return x


def _launch(
    q: torch.Tensor,
    output: torch.Tensor,
    num_heads: int,
    sink: torch.Tensor | None,
    scale: float,
    fp8: bool,
    a: tuple,
    b: tuple | None,
    num_splits: int | None,
) -> None:
    num_tokens = q.shape[0]
    assert q.shape[-1] == HEAD_DIM and output.shape[-1] == HEAD_DIM
    assert q.stride(-1) == 1 and output.stride(-1) == 1
    assert num_heads <= q.shape[1] and num_heads <= output.shape[1]
    if output.shape[1] > num_heads:
        # Heads the layer pads for FlashMLA are sliced off later; write zeros
        # so that every element of the output is defined.
        output[:, num_heads:].zero_()
    if num_tokens == 0 or num_heads == 0:
        return
    block_h, block_n, num_warps, num_stages = _pick_config(
        "decode" if fp8 else "prefill", num_heads, q.device, num_tokens
    )
    num_head_blocks = triton.cdiv(num_heads, block_h)
    a_cache, a_stride, a_rows, a_idx, a_lens, a_pbs = a
    max_keys = a_idx.shape[1]
    if b is not None:
        b_cache, b_stride, b_rows, b_idx, b_lens, b_pbs = b
        max_keys += b_idx.shape[1]
    else:
        b_cache, b_stride, b_rows, b_idx, b_lens, b_pbs = a_cache, 0, 0, a_idx, a_lens, 1
    if num_splits is None:
        num_splits = choose_num_splits(
            num_tokens, num_head_blocks, max_keys, block_n, _num_sms(q.device), num_warps
        )
    if num_splits > 1:
        part_o = torch.empty(
            (num_tokens, num_splits, num_heads, HEAD_DIM),
            dtype=torch.float32,
            device=q.device,
        )
        part_lse = torch.empty(
            (num_tokens, num_splits, num_heads), dtype=torch.float32, device=q.device
        )
    else:
        part_o = part_lse = output  # unused
    has_sink = sink is not None
    if has_sink:
        assert sink.dtype == torch.float32 and sink.numel() >= num_heads
    sink_arg = sink if has_sink else q
    grid = (num_tokens * num_splits * num_head_blocks,)
    _sparse_mla_attn_kernel[grid](
        q,
        q.stride(0),
        q.stride(1),
        output,
        output.stride(0),
        output.stride(1),
        part_o,
        part_lse,
        sink_arg,
        a_cache,
        a_stride,
        a_rows,
        a_idx,
        a_idx.stride(0),
        a_lens,
        a_idx.shape[1],
        b_cache,
        b_stride,
        b_rows,
        b_idx,
        b_idx.stride(0),
        b_lens,
        b_idx.shape[1] if b is not None else 0,
        num_heads,
        num_head_blocks,
        num_splits,
        scale * _LOG2E,
        A_PBS=a_pbs,
        B_PBS=b_pbs,
        HAS_B=b is not None,
        FP8=fp8,
        HAS_SINK=has_sink,
        SPLIT=num_splits > 1,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        DOT_F32=_dot_in_fp32(q.device),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        merge_grid = (num_tokens, triton.cdiv(num_heads, _MERGE_BLOCK_H),
                      HEAD_DIM // _MERGE_BLOCK_D)
        _merge_splits_kernel[merge_grid](
            part_o,
            part_lse,
            sink_arg,
            output,
            output.stride(0),
            output.stride(1),
            num_heads,
            HAS_SINK=has_sink,
            NUM_SPLITS=num_splits,
            SPLITS_P2=triton.next_power_of_2(num_splits),
            BLOCK_H=_MERGE_BLOCK_H,
            BLOCK_D=_MERGE_BLOCK_D,
            num_warps=4,
        )


def _paged_cache(cache: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(uint8 cache, page stride in bytes, slot count, page block size)."""
    assert cache.dtype == torch.uint8, "fp8_ds_mla caches are uint8"
    num_pages = cache.shape[0]
    page_block_size = cache.shape[1]
    page_stride = cache.stride(0)
    assert page_stride >= page_block_size * TOKEN_BYTES
    assert page_stride % 16 == 0 and cache.data_ptr() % 16 == 0
    return cache, page_stride, num_pages * page_block_size, page_block_size


def _lens_or_full(lens: torch.Tensor | None, idx: torch.Tensor) -> torch.Tensor:
    if lens is None:
        return torch.full(
            (idx.shape[0],), idx.shape[1], dtype=torch.int32, device=idx.device
        )
    assert lens.dtype == torch.int32
    return lens


def sparse_mla_decode(
    q: torch.Tensor,
    swa_cache: torch.Tensor,
    swa_indices: torch.Tensor,
    swa_lens: torch.Tensor | None,
    output: torch.Tensor,
    scale: float,
    attn_sink: torch.Tensor | None = None,
    extra_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_lens: torch.Tensor | None = None,
    num_heads: int | None = None,
    num_splits: int | None = None,
) -> None:
    """Sparse MLA decode over fp8_ds_mla paged caches, written into ``output``.

    q: [T, H_pad, 512] bf16. swa_cache / extra_cache: [pages, page_block_size,
    584] uint8 views of the paged caches (``stride(0)`` is the padded page
    size). swa_indices / extra_indices: [T, W] or [T, 1, W] int32 slot ids
    (``page * page_block_size + offset``; -1 = none). swa_lens / extra_lens:
    [T] int32 valid prefix lengths. attn_sink: [>= num_heads] fp32.
    output: [T, H_pad, 512]; heads at or past ``num_heads`` get zeros.
    """
    num_tokens = q.shape[0]
    if num_heads is None:
        num_heads = q.shape[1]
    swa_idx = _as_rows(swa_indices, num_tokens)
    a = (*_paged_cache(swa_cache)[:3], swa_idx, _lens_or_full(swa_lens, swa_idx))
    a = (*a, swa_cache.shape[1])
    b = None
    if extra_cache is not None:
        assert extra_indices is not None
        ex_idx = _as_rows(extra_indices, num_tokens)
        b = (*_paged_cache(extra_cache)[:3], ex_idx, _lens_or_full(extra_lens, ex_idx))
        b = (*b, extra_cache.shape[1])
    _launch(q, output, num_heads, attn_sink, scale, True, a, b, num_splits)


def sparse_mla_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    lens: torch.Tensor | None,
    output: torch.Tensor,
    scale: float,
    attn_sink: torch.Tensor | None = None,
    num_heads: int | None = None,
    num_splits: int | None = None,
) -> None:
    """Sparse MLA prefill over gathered bf16 KV rows, written into ``output``.

    q: [T, H_pad, 512] bf16. kv: [rows, 512] or [rows, 1, 512] bf16.
    indices: [T, K] or [T, 1, K] int32 row ids into kv (-1 = none).
    lens: [T] int32 valid prefix lengths. attn_sink: [>= num_heads] fp32.
    """
    num_tokens = q.shape[0]
    if num_heads is None:
        num_heads = q.shape[1]
    kv2 = kv.reshape(kv.shape[0], -1)
    assert kv2.shape[1] == HEAD_DIM and kv2.stride(1) == 1
    assert kv2.dtype == torch.bfloat16
    idx = _as_rows(indices, num_tokens)
    a = (kv2, kv2.stride(0), kv2.shape[0], idx, _lens_or_full(lens, idx), 1)
    _launch(q, output, num_heads, attn_sink, scale, False, a, None, num_splits)


def _kernel_variants(configs=None):
    """(name, signature, constexprs) of every attention kernel the wrappers launch."""
    for block_h, block_n, num_warps, num_stages in configs or all_configs():
        for label, fp8, has_b, splits in (
            ("decode-swa+topk", True, True, 1),
            ("decode-swa+topk-split", True, True, 2),
            ("decode-swa", True, False, 1),
            ("prefill", False, False, 1),
            ("prefill-split", False, False, 2),
        ):
            cache_ty = "*u8" if fp8 else "*bf16"
            signature = {
                "q_ptr": "*bf16", "stride_qt": "i32", "stride_qh": "i32",
                "out_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32",
                "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "sink_ptr": "*fp32",
                "a_cache_ptr": cache_ty, "a_page_stride": "i32", "a_num_rows": "i32",
                "a_idx_ptr": "*i32", "a_idx_stride": "i32", "a_lens_ptr": "*i32",
                "a_width": "i32",
                "b_cache_ptr": cache_ty, "b_page_stride": "i32", "b_num_rows": "i32",
                "b_idx_ptr": "*i32", "b_idx_stride": "i32", "b_lens_ptr": "*i32",
                "b_width": "i32",
                "num_heads": "i32", "num_head_blocks": "i32", "num_splits": "i32",
                "sm_scale_log2": "fp32",
            }
            constexprs = {
                "A_PBS": 64, "B_PBS": 2, "HAS_B": has_b, "FP8": fp8, "HAS_SINK": True,
                "SPLIT": splits > 1, "BLOCK_H": block_h, "BLOCK_N": block_n,
                "DOT_F32": False,
            }
            for name in constexprs:
                signature[name] = "constexpr"
            name = (
                f"{label} BLOCK_H={block_h} BLOCK_N={block_n} "
                f"warps={num_warps} stages={num_stages}"
            )
            yield name, signature, constexprs, num_warps, num_stages


def shared_memory_report(target, configs=None) -> list[tuple[str, int]]:
    """Compile every launch configuration for ``target`` (a triton GPUTarget,
    e.g. ``GPUTarget("cuda", 120, 32)``) and return (name, shared bytes) from
    Triton's compiled-kernel metadata. Needs no GPU; needs a module imported
    without TRITON_INTERPRET."""
    from triton.compiler import ASTSource

    kernel = _sparse_mla_attn_kernel
    if not hasattr(kernel, "arg_names"):
        raise RuntimeError("shared_memory_report needs a non-interpreted import")
    aligned = [
        "q_ptr", "out_ptr", "part_o_ptr", "part_lse_ptr", "sink_ptr", "a_cache_ptr",
        "a_page_stride", "a_idx_ptr", "a_lens_ptr", "b_cache_ptr", "b_page_stride",
        "b_idx_ptr", "b_lens_ptr", "stride_qt", "stride_qh", "stride_ot", "stride_oh",
    ]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    report = []
    for name, signature, constexprs, num_warps, num_stages in _kernel_variants(configs):
        src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(
            src, target=target, options={"num_warps": num_warps, "num_stages": num_stages}
        )
        report.append((name, int(compiled.metadata.shared)))
    merge_sig = {
        "part_o_ptr": "*fp32", "part_lse_ptr": "*fp32", "sink_ptr": "*fp32",
        "out_ptr": "*bf16", "stride_ot": "i32", "stride_oh": "i32", "num_heads": "i32",
        "HAS_SINK": "constexpr", "NUM_SPLITS": "constexpr", "SPLITS_P2": "constexpr",
        "BLOCK_H": "constexpr", "BLOCK_D": "constexpr",
    }
    merge_const = {"HAS_SINK": True, "NUM_SPLITS": _DEFAULT_MAX_SPLITS,
                   "SPLITS_P2": _DEFAULT_MAX_SPLITS, "BLOCK_H": _MERGE_BLOCK_H,
                   "BLOCK_D": _MERGE_BLOCK_D}
    src = ASTSource(fn=_merge_splits_kernel, signature=merge_sig, constexprs=merge_const)
    compiled = triton.compile(src, target=target, options={"num_warps": 4})
    report.append((f"merge BLOCK_H={_MERGE_BLOCK_H}", int(compiled.metadata.shared)))
    return report
