"""Correctness of patch 0004's Triton indexer logits and fp8 einsum (SM12x).

The sparse attention indexer's MQA logits (prefill: gathered keys; decode:
the paged indexer cache) and the output projection's block-scaled fp8 einsum
are loaded by path from their source in this repository
(patches/fixes/triton-sparse-mla-fallback/new/), without importing vLLM, and checked
against float64 references on fresh random data, outputs poisoned first.
Without a GPU they run under Triton's CPU interpreter at small shapes.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import needs
import pytest

torch = needs.module("torch")
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = needs.module("triton")

pytestmark = pytest.mark.triton

SOURCES = Path(__file__).resolve().parents[1] / "patches/fixes/triton-sparse-mla-fallback/new"
PKG = SOURCES / "vllm/v1/attention/ops/sm12x_sparse_mla"
FP8 = torch.float8_e4m3fn


def _on_gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda" if _on_gpu() else "cpu"


def _load(name):
    path = PKG / f"{name}.py"
    if not _on_gpu() and os.environ.get("TRITON_INTERPRET") != "1":
        needs.missing("no GPU, and triton was imported before TRITON_INTERPRET=1 was set")
    spec = importlib.util.spec_from_file_location(f"sm12x_sparse_mla_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def idx():
    return _load("indexer")


@pytest.fixture(scope="module")
def ein():
    return _load("einsum")


def _fp8(shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(FP8)


def _close(got: torch.Tensor, ref: torch.Tensor, what: str, rel=2e-5):
    got = got.double()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(got), fin), f"{what}: -inf/finite pattern differs"
    assert (got[~fin] == ref[~fin]).all(), f"{what}: masked entries are not -inf"
    peak = ref[fin].abs().max()
    assert peak > 0, f"{what}: degenerate reference"
    err = (got[fin] - ref[fin]).abs().max()
    assert err <= rel * peak, f"{what}: max error {err:.3g} vs peak {peak:.3g}"


def _ref_scores(q, k, k_scale, w):
    # q [M, H, D] fp8, k [N, D] fp8, k_scale [N], w [M, H] -> [M, N] float64
    s = torch.einsum("mhd,nd->mhn", q.double(), k.double()).clamp_min(0)
    return (s * w.double()[:, :, None]).sum(1) * k_scale.double()[None, :]


# ---------------------------------------------------------------- prefill


def test_prefill_logits(idx, device):
    gen = torch.Generator().manual_seed(11)
    M, H, D, N = 20, 6, 32, 300  # H padded to 16; 3 key tiles of 128, 2 token blocks
    q = _fp8((M, H, D), gen)
    k = _fp8((N, D), gen)
    k_scale = torch.rand(N, generator=gen) + 0.5
    w = torch.randn(M, H, generator=gen)
    # Two "requests": tokens 0..9 see keys [0, 100 + m) (tiles 1-2 idle for the
    # first block), tokens 10..19 see [140, 200 + 5 m); token 3 sees nothing.
    ks = torch.tensor([0] * 10 + [140] * 10, dtype=torch.int32)
    ke = torch.tensor([100 + m for m in range(10)] + [200 + 5 * m for m in range(10)],
                      dtype=torch.int32)
    ke[3] = 0
    ref = _ref_scores(q, k, k_scale, w)
    cols = torch.arange(N)[None, :]
    ref = ref.masked_fill((cols < ks[:, None]) | (cols >= ke[:, None]), float("-inf"))
    out = idx.fp8_mqa_logits(q.to(device), (k.to(device), k_scale.to(device)),
                             w.to(device), ks.to(device), ke.to(device))
    assert out.shape == (M, N) and out.dtype == torch.float32
    _close(out.cpu(), ref, "prefill logits")
    assert torch.isneginf(out[3]).all()


# ---------------------------------------------------------------- decode


def _pack_indexer_cache(keys, scales, block_table, lens, pbs, pages, pad, gen):
    """Paged indexer cache [pages, pbs, 1, D + 4] uint8 (page stride padded by
    ``pad`` poisoned bytes): per page pbs x D fp8 values, then pbs fp32 scales."""
    D = keys.shape[-1]
    page_bytes = pbs * (D + 4)
    stride = page_bytes + pad
    raw = torch.randint(0, 256, (pages * stride,), generator=gen, dtype=torch.uint8)
    for b in range(keys.shape[0]):
        for t in range(int(lens[b])):
            page = int(block_table[b, t // pbs])
            off = t % pbs
            base = page * stride
            raw[base + off * D: base + (off + 1) * D] = keys[b, t].view(torch.uint8)
            s = base + pbs * D + off * 4
            raw[s: s + 4] = scales[b, t].reshape(1).view(torch.uint8)
    cache = torch.as_strided(raw, (pages, pbs, 1, D + 4), (stride, D + 4, D + 4, 1))
    return cache


@pytest.mark.parametrize("next_n,per_token,num_splits", [
    (1, False, None), (1, False, 3), (2, True, 2), (2, False, 1),
])
def test_paged_logits(idx, device, next_n, per_token, num_splits):
    gen = torch.Generator().manual_seed(20 + next_n + 3 * per_token)
    B, H, D, pbs, max_len = 4, 5, 32, 16, 72
    max_blocks = -(-max_len // pbs)
    pages = B * max_blocks + 3
    lens = torch.tensor([37, 0, 72, 16], dtype=torch.int32)  # 0: empty; 72: clamp
    perm = torch.randperm(pages, generator=gen)[: B * max_blocks]
    block_table = perm.view(B, max_blocks).to(torch.int32)
    keys = _fp8((B, max_len, D), gen)
    scales = torch.rand(B, max_len, generator=gen) + 0.25
    cache = _pack_indexer_cache(keys, scales, block_table, lens, pbs, pages, 48, gen)
    q = _fp8((B, next_n, H, D), gen)
    w = torch.randn(B * next_n, H, generator=gen)
    if per_token:
        ctx = torch.stack([lens - 1, lens], 1).clamp_min(0).to(torch.int32)
    else:
        ctx = lens.view(B, 1)
    out = idx.fp8_paged_mqa_logits(
        q.to(device), cache.to(device), w.to(device), ctx.to(device),
        block_table.to(device), max_len, num_splits=num_splits,
    ).cpu()
    assert out.shape == (B * next_n, max_len)
    for b in range(B):
        for j in range(next_n):
            row = b * next_n + j
            limit = int(ctx[b, j]) if per_token else int(lens[b]) - next_n + j + 1
            limit = max(0, min(limit, max_len))
            ref = _ref_scores(q[b, j][None], keys[b], scales[b], w[row][None])[0]
            ref[limit:] = float("-inf")
            written = min(-(-limit // pbs) * pbs, max_len)
            if written == 0:
                continue
            _close(out[row, :written][None], ref[:written][None], f"row {row}")


def test_paged_logits_graph_safe_inputs(idx, device):
    """Output size and grid depend on shapes only: the same call on different
    lengths gives the same shapes; nothing reads lengths on the host."""
    gen = torch.Generator().manual_seed(3)
    B, H, D, pbs, max_len = 2, 4, 32, 16, 32
    block_table = torch.arange(4, dtype=torch.int32).view(2, 2)
    keys = _fp8((B, max_len, D), gen)
    scales = torch.ones(B, max_len)
    lens = torch.tensor([32, 32], dtype=torch.int32)
    cache = _pack_indexer_cache(keys, scales, block_table, lens, pbs, 4, 0, gen)
    q = _fp8((B, 1, H, D), gen)
    w = torch.ones(B, H)
    shapes = set()
    for L in ([5, 9], [32, 1]):
        out = idx.fp8_paged_mqa_logits(
            q.to(device), cache.to(device), w.to(device),
            torch.tensor(L, dtype=torch.int32).view(B, 1).to(device),
            block_table.to(device), max_len,
        )
        shapes.add(tuple(out.shape))
        for b in range(B):
            ref = _ref_scores(q[b, 0][None], keys[b], scales[b], w[b][None])[0]
            ref[L[b]:] = float("-inf")
            n = min(-(-L[b] // pbs) * pbs, max_len)
            _close(out.cpu()[b, :n][None], ref[:n][None], f"L={L}")
    assert shapes == {(B, max_len)}


# ---------------------------------------------------------------- einsum


def _quant_blocks(x: torch.Tensor, block_shape, e8m0: bool):
    """Block-quantize a float tensor [..., rows, cols] to fp8 with power-of-two
    (or free) scales per block; returns (fp8, scales, dequantized float64)."""
    *lead, rows, cols = x.shape
    br, bc = block_shape
    xb = x.reshape(*lead, rows // br, br, cols // bc, bc)
    amax = xb.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(1e-4)
    scale = amax / 448.0
    if e8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (xb / scale).to(FP8)
    deq = (q.double() * scale.double()).reshape(x.shape)
    return q.reshape(x.shape), scale.reshape(*lead, rows // br, cols // bc), deq


def _activation(T, G, R, gen):
    """fp8 [T, G, R] with strides (R, T*R, 1) and fp32 scales [T, G, R/128]
    with the transposed, padded layout fused_inv_rope_fp8_quant writes."""
    x = torch.randn(G, T, R, generator=gen) * 3
    q, s, deq = _quant_rows(x)
    t_al = -(-T // 4) * 4
    buf = torch.full((G * (R // 128) * t_al,), float("nan"))
    sc = buf.as_strided((G, T, R // 128), (R // 128 * t_al, 1, t_al))
    sc.copy_(s)
    return q.transpose(0, 1), sc.transpose(0, 1), deq.transpose(0, 1)


def _quant_rows(x):
    G, T, R = x.shape
    xb = x.reshape(G, T, R // 128, 128)
    scale = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1, keepdim=True)
                                             .clamp_min(1e-4) / 448.0)))
    q = (xb / scale).to(FP8)
    deq = (q.double() * scale.double()).reshape(G, T, R)
    return q.reshape(G, T, R), scale.reshape(G, T, R // 128), deq


@pytest.mark.parametrize("T,weight_2d,e8m0", [(3, False, False), (20, True, True)])
def test_fp8_einsum(ein, device, T, weight_2d, e8m0):
    gen = torch.Generator().manual_seed(100 + T)
    G, D, R = 2, 256, 384
    a, a_scale, a_deq = _activation(T, G, R, gen)
    w = torch.randn(G, D, R, generator=gen) * 0.05
    b, b_scale, b_deq = _quant_blocks(w, (128, 128), e8m0)
    if e8m0:
        b_scale = b_scale.to(torch.float8_e8m0fnu)
    if weight_2d:
        b = b.reshape(G * D, R)
        b_scale = b_scale.reshape(G * D // 128, R // 128)
    ref = torch.einsum("bhr,hdr->bhd", a_deq, b_deq)
    out = torch.full((T, G, D), float("nan"), dtype=torch.bfloat16).to(device)
    ein.fp8_einsum_bhr_hdr(a.to(device), a_scale.to(device), b.to(device),
                           b_scale.to(device), out)
    got = out.cpu().double()
    assert torch.isfinite(got).all()
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 8e-3, f"relative error {err:.3g}"


# ---------------------------------------------------------------- shared memory

_REPORT_SCRIPT = """
import importlib.util, json, sys
from triton.backends.compiler import GPUTarget
out = []
for path in sys.argv[1:]:
    spec = importlib.util.spec_from_file_location("k", path)
    k = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(k)
    out += k.shared_memory_report(GPUTarget("cuda", 120, 32))
    limit = k.SM120_MAX_SHARED_BYTES
print(json.dumps({"limit": limit, "report": out}))
"""


def test_indexer_and_einsum_configs_fit_sm120_shared_memory():
    """Every configuration of the indexer and einsum kernels, compiled for
    sm_120 without a GPU in a fresh process, fits 99 KiB of shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(PKG / f"{n}.py") for n in ("indexer", "einsum")]
    proc = subprocess.run([sys.executable, "-c", _REPORT_SCRIPT, *paths],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["limit"] == 99 * 1024
    names = [n for n, _ in data["report"]]
    assert any("indexer-prefill" in n for n in names)
    assert any("indexer-decode" in n for n in names)
    assert any("einsum" in n for n in names)
    for name, shared in data["report"]:
        assert 0 < shared <= data["limit"], f"{name}: {shared} bytes"
