# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton block-scaled fp8 einsum for DeepSeek V4's output projection (SM12x).

DeepSeek V4 computes ``z = einsum("bhr,hdr->bhd", o, wo_a)`` with both
operands in fp8 e4m3 and block scales; DeepGEMM's ``fp8_einsum`` has no SM12x
kernel. Here:

* ``a`` [T, G, R] fp8 with ``a_scale`` [T, G, R / 128] fp32 (one scale per
  token, group and 128-wide block of R; any strides, as written by
  ``fused_inv_rope_fp8_quant`` with ``tma_aligned_scales=False``);
* ``b`` [G, D, R] (or [G * D, R]) fp8 with ``b_scale`` [G, D / 128, R / 128]
  (or [G * D / 128, R / 128]) fp32 or float8_e8m0fnu (128 x 128 weight
  blocks, as the checkpoint stores them);
* ``out`` [T, G, D] bf16: ``out[t, g, d] = sum_r a[t, g, r] * a_scale[t, g,
  r // 128] * b[g, d, r] * b_scale[g, d // 128, r // 128]``.

fp8 products are accumulated in fp32 per 128-wide block and scaled there, so
nothing is dequantized to a bf16 copy. CUDA-graph capturable (no host
synchronisation, shape-only allocation). DeepGEMM's packed INT32 UE8M0 scale
layout is not accepted (it only exists when DeepGEMM post-processed the
weights). This module imports only torch and triton.
"""

import torch
import triton
import triton.language as tl

SM120_MAX_SHARED_BYTES = 99 * 1024
SCALE_BLOCK = 128

# (BLOCK_M, BLOCK_N, num_warps, num_stages), BLOCK_K = 128 (one scale block).
_CONFIGS = {
    "small": (16, 64, 4, 3),  # decode: T <= 16
    "large": (64, 128, 4, 3),
}


def _dot_in_fp32(device: torch.device) -> bool:
    return device.type != "cuda"


@triton.jit
def _fp8_einsum_kernel(
    a_ptr, stride_at, stride_ag,
    as_ptr, stride_st, stride_sg, stride_sk,
    b_ptr, stride_bg, stride_bd,
    bs_ptr, stride_bsg, stride_bsd, stride_bsk,
    out_ptr, stride_ot, stride_og,
    T, D, R,
    B_SCALE_E8M0: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < T
    n_mask = offs_n < D
    a_rows = a_ptr + g * stride_ag + offs_m.to(tl.int64)[:, None] * stride_at
    b_rows = b_ptr + g * stride_bg + offs_n.to(tl.int64)[:, None] * stride_bd
    as_rows = as_ptr + g * stride_sg + offs_m.to(tl.int64) * stride_st
    bs_rows = bs_ptr + g * stride_bsg + (offs_n // 128).to(tl.int64) * stride_bsd
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(R, BLOCK_K)):
        k = kb * BLOCK_K + offs_k
        k_mask = k < R
        a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0)
        b = tl.load(b_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)
        a = a.to(tl.float8e4nv, bitcast=True)
        b = b.to(tl.float8e4nv, bitcast=True)
        if DOT_F32:
            part = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)),
                          input_precision="ieee")
        else:
            part = tl.dot(a, tl.trans(b))
        sa = tl.load(as_rows + kb * stride_sk, mask=m_mask, other=0.0)
        if B_SCALE_E8M0:
            e = tl.load(bs_rows + kb * stride_bsk, mask=n_mask, other=127)
            sb = tl.exp2(e.to(tl.float32) - 127.0)
        else:
            sb = tl.load(bs_rows + kb * stride_bsk, mask=n_mask, other=0.0)
        acc += part * sa[:, None] * sb[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_ot + g * stride_og + offs_n[None, :]
    tl.store(out, acc.to(tl.bfloat16), mask=m_mask[:, None] & n_mask[None, :])


def pick_config(num_tokens: int) -> tuple[int, int, int, int]:
    return _CONFIGS["small" if num_tokens <= 16 else "large"]


def fp8_einsum_bhr_hdr(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out[t, g, d] = sum_r deq(a)[t, g, r] * deq(b)[g, d, r]; see module doc."""
    T, G, R = a.shape
    assert a.element_size() == 1 and b.element_size() == 1
    if b.dim() == 2:
        b = b.view(G, -1, R)
    _, D, Rb = b.shape
    assert Rb == R and b.shape[0] == G and a.stride(2) == 1 and b.stride(2) == 1
    assert R % SCALE_BLOCK == 0 and D % SCALE_BLOCK == 0
    assert out.shape == (T, G, D) and out.dtype == torch.bfloat16 and out.stride(2) == 1
    assert a_scale.dtype == torch.float32, (
        "the SM12x fp8 einsum needs fp32 activation scales (tma_aligned_scales=False)"
    )
    assert a_scale.shape == (T, G, R // SCALE_BLOCK)
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    if b_scale.dtype == e8m0:
        b_scale = b_scale.view(torch.uint8)
        is_e8m0 = True
    else:
        assert b_scale.dtype == torch.float32, (
            f"the SM12x fp8 einsum needs fp32 or e8m0 weight scales, got {b_scale.dtype}"
        )
        is_e8m0 = False
    b_scale = b_scale.reshape(G, D // SCALE_BLOCK, R // SCALE_BLOCK)
    if T == 0:
        return
    block_m, block_n, num_warps, num_stages = pick_config(T)
    grid = (triton.cdiv(T, block_m), triton.cdiv(D, block_n), G)
    _fp8_einsum_kernel[grid](
        a.view(torch.uint8), a.stride(0), a.stride(1),
        a_scale, a_scale.stride(0), a_scale.stride(1), a_scale.stride(2),
        b.view(torch.uint8), b.stride(0), b.stride(1),
        b_scale, b_scale.stride(0), b_scale.stride(1), b_scale.stride(2),
        out, out.stride(0), out.stride(1),
        T, D, R,
        B_SCALE_E8M0=is_e8m0,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=SCALE_BLOCK,
        DOT_F32=_dot_in_fp32(a.device),
        num_warps=num_warps,
        num_stages=num_stages,
    )


def shared_memory_report(target) -> list[tuple[str, int]]:
    """Compile every configuration for ``target`` (a triton GPUTarget) and
    return (name, shared bytes) from Triton's compiled-kernel metadata."""
    from triton.compiler import ASTSource

    kernel = _fp8_einsum_kernel
    if not hasattr(kernel, "arg_names"):
        raise RuntimeError("shared_memory_report needs a non-interpreted import")
    sig = {
        "a_ptr": "*u8", "stride_at": "i32", "stride_ag": "i32",
        "as_ptr": "*fp32", "stride_st": "i32", "stride_sg": "i32", "stride_sk": "i32",
        "b_ptr": "*u8", "stride_bg": "i32", "stride_bd": "i32",
        "bs_ptr": "*fp32", "stride_bsg": "i32", "stride_bsd": "i32", "stride_bsk": "i32",
        "out_ptr": "*bf16", "stride_ot": "i32", "stride_og": "i32",
        "T": "i32", "D": "i32", "R": "i32",
    }
    aligned = ["a_ptr", "b_ptr", "out_ptr", "stride_at", "stride_ag", "stride_bg",
               "stride_bd", "stride_ot", "stride_og", "R", "D"]
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    report = []
    for label, (bm, bn, nw, ns) in sorted(_CONFIGS.items()):
        const = {"B_SCALE_E8M0": False, "BLOCK_M": bm, "BLOCK_N": bn,
                 "BLOCK_K": SCALE_BLOCK, "DOT_F32": False}
        s = dict(sig)
        s.update({k: "constexpr" for k in const})
        src = ASTSource(fn=kernel, signature=s, constexprs=const, attrs=attrs)
        compiled = triton.compile(src, target=target,
                                  options={"num_warps": nw, "num_stages": ns})
        report.append((f"einsum-{label} BLOCK_M={bm} BLOCK_N={bn} warps={nw} "
                       f"stages={ns}", int(compiled.metadata.shared)))
    return report
