# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton MQA logits for the sparse attention indexer without DeepGEMM (SM12x).

The indexer scores every key position ``n`` for a query token ``m`` as

    logits[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q[m, h, :] . k[n, :])

with fp8 e4m3 ``q`` and ``k`` (the per-token q scale is folded into
``weights`` by the caller, ``k_scale`` is the fp32 scale of key ``n``).

* :func:`fp8_mqa_logits` (prefill): ``k`` is a gathered [N, D] fp8 tensor with
  [N] fp32 scales; query ``m`` sees keys ``cu_seqlen_ks[m] <= n <
  cu_seqlen_ke[m]``; every other element of the [M, N] result is ``-inf``.
* :func:`fp8_paged_mqa_logits` (decode): keys are read from the paged indexer
  cache by block table. A page of ``block_size`` tokens holds their D fp8
  values first, then one fp32 scale per token (the layout written by
  ``indexer_k_quant_and_cache``); the page stride is the cache's
  ``stride(0)``. Row ``b * next_n + j`` covers positions below its context
  limit: ``context_lens[b, j]`` when ``context_lens`` has ``next_n`` columns,
  otherwise ``L_b - next_n + j + 1`` with ``L_b`` the request's length.
  Positions in the last visited page at or past the limit get ``-inf``;
  positions past that page are not written (as DeepGEMM with
  ``clean_logits=False``; the top-k kernels read only below the limit).

Both are CUDA-graph capturable: no host synchronisation, output and grid
sizes depend on shapes only, loop bounds that depend on lengths are read on
the device. Only the FP8 indexer cache is supported (not MXFP4).
This module imports only torch and triton so that it can be tested alone.
"""

import torch
import triton
import triton.language as tl

# Largest dynamic shared memory a block may use on SM120/SM121 (99 KiB).
SM120_MAX_SHARED_BYTES = 99 * 1024

# (BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel; decode
# uses one cache page per step (BLOCK_N = block size) with _PAGED_CONFIG.
_PREFILL_CONFIG = (16, 128, 8, 1)
_PAGED_CONFIG = (4, 1)  # num_warps, num_stages
# Upper bound on the programs per decode row (bounds nothing in memory; only
# the grid); the split count is a function of shapes only.
_MAX_PAGED_SPLITS = 64


def _dot_in_fp32(device: torch.device) -> bool:
    # Only Triton's CPU interpreter runs on host tensors.
    return device.type != "cuda"


@triton.jit
def _fp8_dot(a, b, DOT_F32: tl.constexpr):
    # a, b: fp8 e4m3 bit patterns (uint8). The interpreter cannot run fp8 (or
    # bf16) tl.dot, so there both operands are widened to fp32 (exact).
    if DOT_F32:
        return tl.dot(
            a.to(tl.float8e4nv, bitcast=True).to(tl.float32),
            b.to(tl.float8e4nv, bitcast=True).to(tl.float32),
            input_precision="ieee",
        )
    else:
        return tl.dot(
            a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True)
        )


@triton.jit
def _mqa_logits_kernel(
    q_ptr, stride_qm, stride_qh,
    w_ptr, stride_wm,
    k_ptr, stride_kn,
    ks_ptr,
    lo_ptr, hi_ptr,
    out_ptr, stride_om,
    M, N, num_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    lo = tl.load(lo_ptr + offs_m, mask=m_mask, other=2147483647)
    hi = tl.load(hi_ptr + offs_m, mask=m_mask, other=0)
    # Skip the products when no token of this block sees any key of the tile.
    active = (tl.min(lo, 0) < pid_n * BLOCK_N + BLOCK_N) & (tl.max(hi, 0) > pid_n * BLOCK_N)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    neg_inf = tl.full([BLOCK_N], float("-inf"), tl.float32)
    if active:
        k = tl.load(
            k_ptr + offs_n.to(tl.int64)[:, None] * stride_kn + offs_d[None, :],
            mask=n_mask[:, None], other=0,
        )
        kt = tl.trans(k)
        k_scale = tl.load(ks_ptr + offs_n, mask=n_mask, other=0.0)
        for i in range(0, BLOCK_M):
            m = pid_m * BLOCK_M + i
            if m < M:
                m64 = m.to(tl.int64)
                q = tl.load(
                    q_ptr + m64 * stride_qm + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=h_mask[:, None], other=0,
                )
                w = tl.load(w_ptr + m64 * stride_wm + offs_h, mask=h_mask, other=0.0)
                s = _fp8_dot(q, kt, DOT_F32)
                logit = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0) * k_scale
                m_lo = tl.load(lo_ptr + m)
                m_hi = tl.load(hi_ptr + m)
                seen = (offs_n >= m_lo) & (offs_n < m_hi)
                tl.store(out_ptr + m64 * stride_om + offs_n, tl.where(seen, logit, neg_inf),
                         mask=n_mask)
    else:
        for i in range(0, BLOCK_M):
            m = pid_m * BLOCK_M + i
            if m < M:
                tl.store(out_ptr + m.to(tl.int64) * stride_om + offs_n, neg_inf, mask=n_mask)


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr, stride_qt, stride_qh,
    w_ptr, stride_wt,
    kv_ptr, kv_scale_ptr, page_stride,
    lens_ptr, stride_lb, stride_lj,
    bt_ptr, stride_bt,
    out_ptr, stride_ot,
    num_heads, max_model_len,
    NEXT_N: tl.constexpr,
    PER_TOKEN_LENS: tl.constexpr,
    PBS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    b = row // NEXT_N
    j = row % NEXT_N
    if PER_TOKEN_LENS:
        limit = tl.load(lens_ptr + b * stride_lb + j * stride_lj)
    else:
        limit = tl.load(lens_ptr + b * stride_lb) - NEXT_N + j + 1
    limit = tl.minimum(limit, max_model_len)
    num_pages = tl.cdiv(limit, PBS)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    offs_d = tl.arange(0, HEAD_DIM)
    offs_p = tl.arange(0, PBS)
    row64 = row.to(tl.int64)
    q = tl.load(
        q_ptr + row64 * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None], other=0,
    )
    w = tl.load(w_ptr + row64 * stride_wt + offs_h, mask=h_mask, other=0.0)
    for p in range(split, num_pages, NUM_SPLITS):
        page = tl.load(bt_ptr + b.to(tl.int64) * stride_bt + p).to(tl.int64)
        base = page * page_stride
        k = tl.load(kv_ptr + base + offs_p[:, None] * HEAD_DIM + offs_d[None, :])
        k_scale = tl.load(kv_scale_ptr + (base + PBS * HEAD_DIM) // 4 + offs_p)
        s = _fp8_dot(q, tl.trans(k), DOT_F32)
        logit = tl.sum(tl.maximum(s, 0.0) * w[:, None], 0) * k_scale
        pos = p * PBS + offs_p
        logit = tl.where(pos < limit, logit, float("-inf"))
        tl.store(out_ptr + row64 * stride_ot + pos, logit, mask=pos < max_model_len)


def _u8(x: torch.Tensor) -> torch.Tensor:
    assert x.element_size() == 1, f"expected fp8/uint8, got {x.dtype}"
    return x.view(torch.uint8)


def fp8_mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
) -> torch.Tensor:
    """Prefill logits. q [M, H, D] fp8; kv = (k [N, D] fp8, k_scale [N] fp32);
    weights [M, H] fp32; cu_seqlen_ks/ke [M] int32. Returns [M, N] fp32."""
    k, k_scale = kv
    M, H, D = q.shape
    N = k.shape[0]
    assert D == triton.next_power_of_2(D) and k.shape[1] == D
    assert q.stride(2) == 1 and k.stride(1) == 1
    k_scale = k_scale.reshape(N)
    assert k_scale.dtype == torch.float32 and weights.dtype == torch.float32
    assert weights.stride(1) == 1
    out = torch.empty((M, N), dtype=torch.float32, device=q.device)
    if M == 0 or N == 0:
        return out
    block_m, block_n, num_warps, num_stages = _prefill_config()
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _mqa_logits_kernel[grid](
        _u8(q), q.stride(0), q.stride(1),
        weights, weights.stride(0),
        _u8(k), k.stride(0),
        k_scale,
        cu_seqlen_ks, cu_seqlen_ke,
        out, out.stride(0),
        M, N, H,
        HEAD_DIM=D,
        BLOCK_H=max(16, triton.next_power_of_2(H)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_F32=_dot_in_fp32(q.device),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def _prefill_config() -> tuple[int, int, int, int]:
    return _PREFILL_CONFIG


_sm_count_cache: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_count_cache:
        props = torch.cuda.get_device_properties(index)
        _sm_count_cache[index] = props.multi_processor_count
    return _sm_count_cache[index]


def choose_paged_splits(rows: int, max_pages: int, num_sms: int) -> int:
    """Programs per decode row, from shapes only (a captured graph stays valid)."""
    want = triton.cdiv(4 * num_sms, max(1, rows))
    return int(max(1, min(want, max_pages, _MAX_PAGED_SPLITS)))


def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_model_len: int,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode logits. q [B, next_n, H, D] fp8; kv_cache [pages, block_size, 1,
    D + 4] (or [pages, block_size, D + 4]) uint8; weights [B * next_n, H] fp32;
    context_lens [B] or [B, 1] or [B, next_n] int32; block_tables [B, max
    blocks] int32. Returns [B * next_n, max_model_len] fp32."""
    B, next_n, H, D = q.shape
    assert D == triton.next_power_of_2(D)
    assert q.stride(3) == 1 and q.stride(0) == next_n * q.stride(1)
    pages, pbs = kv_cache.shape[0], kv_cache.shape[1]
    assert pages > 0
    assert kv_cache.dtype == torch.uint8 and kv_cache.shape[-1] == D + 4
    assert pbs == triton.next_power_of_2(pbs), "block size must be a power of 2"
    page_stride = kv_cache.stride(0)
    assert page_stride >= pbs * (D + 4) and page_stride % 4 == 0
    assert kv_cache.data_ptr() % 16 == 0
    flat = torch.as_strided(kv_cache, ((pages - 1) * page_stride + pbs * (D + 4),), (1,))
    scales = flat.view(torch.float32)
    assert weights.dtype == torch.float32 and weights.stride(1) == 1
    assert context_lens.dtype == torch.int32 and block_tables.dtype == torch.int32
    lens2 = context_lens.reshape(B, -1)
    per_token = next_n > 1 and lens2.shape[1] == next_n
    rows = B * next_n
    out = torch.empty((rows, max_model_len), dtype=torch.float32, device=q.device)
    if rows == 0:
        return out
    q3 = q.reshape(rows, H, D)
    if num_splits is None:
        num_splits = choose_paged_splits(
            rows, triton.cdiv(max_model_len, pbs), _num_sms(q.device)
        )
    num_warps, num_stages = _PAGED_CONFIG
    _paged_mqa_logits_kernel[(rows, num_splits)](
        _u8(q3), q3.stride(0), q3.stride(1),
        weights, weights.stride(0),
        flat, scales, page_stride,
        lens2, lens2.stride(0), lens2.stride(1),
        block_tables, block_tables.stride(0),
        out, out.stride(0),
        H, max_model_len,
        NEXT_N=next_n,
        PER_TOKEN_LENS=per_token,
        PBS=pbs,
        HEAD_DIM=D,
        BLOCK_H=max(16, triton.next_power_of_2(H)),
        NUM_SPLITS=num_splits,
        DOT_F32=_dot_in_fp32(q.device),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def _kernel_variants():
    """(name, kernel, signature, constexprs, num_warps, num_stages, aligned) of
    every launch the wrappers make at DeepSeek V4's shapes (64 heads, D=128)."""
    bm, bn, nw, ns = _prefill_config()
    sig = {
        "q_ptr": "*u8", "stride_qm": "i32", "stride_qh": "i32",
        "w_ptr": "*fp32", "stride_wm": "i32", "k_ptr": "*u8", "stride_kn": "i32",
        "ks_ptr": "*fp32", "lo_ptr": "*i32", "hi_ptr": "*i32",
        "out_ptr": "*fp32", "stride_om": "i32", "M": "i32", "N": "i32",
        "num_heads": "i32",
    }
    const = {"HEAD_DIM": 128, "BLOCK_H": 64, "BLOCK_M": bm, "BLOCK_N": bn,
             "DOT_F32": False}
    sig.update({k: "constexpr" for k in const})
    yield (f"indexer-prefill BLOCK_M={bm} BLOCK_N={bn} warps={nw} stages={ns}",
           _mqa_logits_kernel, sig, const, nw, ns,
           ["q_ptr", "w_ptr", "k_ptr", "ks_ptr", "out_ptr", "stride_qm", "stride_qh",
            "stride_kn", "stride_om"])
    nw, ns = _PAGED_CONFIG
    for pbs in (64, 128):
        sig = {
            "q_ptr": "*u8", "stride_qt": "i32", "stride_qh": "i32",
            "w_ptr": "*fp32", "stride_wt": "i32",
            "kv_ptr": "*u8", "kv_scale_ptr": "*fp32", "page_stride": "i32",
            "lens_ptr": "*i32", "stride_lb": "i32", "stride_lj": "i32",
            "bt_ptr": "*i32", "stride_bt": "i32", "out_ptr": "*fp32", "stride_ot": "i32",
            "num_heads": "i32", "max_model_len": "i32",
        }
        const = {"NEXT_N": 2, "PER_TOKEN_LENS": True, "PBS": pbs, "HEAD_DIM": 128,
                 "BLOCK_H": 64, "NUM_SPLITS": 8, "DOT_F32": False}
        sig.update({k: "constexpr" for k in const})
        yield (f"indexer-decode PBS={pbs} warps={nw} stages={ns}",
               _paged_mqa_logits_kernel, sig, const, nw, ns,
               ["q_ptr", "w_ptr", "kv_ptr", "kv_scale_ptr", "page_stride", "out_ptr",
                "stride_qt", "stride_qh"])


def shared_memory_report(target) -> list[tuple[str, int]]:
    """Compile every launch configuration for ``target`` (a triton GPUTarget)
    and return (name, shared bytes) from Triton's compiled-kernel metadata.
    Needs no GPU; needs a module imported without TRITON_INTERPRET."""
    from triton.compiler import ASTSource

    report = []
    for name, kernel, sig, const, nw, ns, aligned in _kernel_variants():
        if not hasattr(kernel, "arg_names"):
            raise RuntimeError("shared_memory_report needs a non-interpreted import")
        attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
        src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
        compiled = triton.compile(
            src, target=target, options={"num_warps": nw, "num_stages": ns}
        )
        report.append((name, int(compiled.metadata.shared)))
    return report
