"""Benchmark and real-shape checks of patch 0004 (Triton sparse MLA for DeepSeek V4).

Runs on one CUDA GPU, without installing or importing vLLM as a whole. The
kernel package is loaded by path from its source in this repository,
patches/fixes/triton-sparse-mla-fallback/new/ (its modules import only torch and
triton); the patched tree (or a copy of just the files it needs) gives the
layer wiring and envs.py, and the pinned helpers the kernels are compared with
(``cache_utils.py``'s Triton cache writer and gatherers,
``rocm_aiter_mla_sparse.py``'s torch reference), loaded by path with small
stand-ins for the few vLLM modules they import.

    python bench/sparse_mla_bench.py --tree PATCHED_TREE --out DIR [--sections ...]
        [--baseline OLD_ATTENTION_PY] [--kernel ATTENTION_PY] [--flashmla DIR]

Sections: env, smem, sweep, correctness, layer, decode, reference, prefill,
indexer (the sparse indexer's Triton MQA logits), einsum (the output
projection's Triton fp8 einsum), flashmla (our decode over FlashMLA's sparse
FP8 decode from the vLLM 0.21.0 wheel, same tensors, same run; --flashmla DIR),
flashmla_sweep (our decode at those shapes for each candidate configuration
and split count).
Prints a report and writes DIR/sparse_mla_bench.json.
"""

import argparse
import ast
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
import types
import typing
from pathlib import Path

import torch

KERNEL = "vllm/v1/attention/ops/sm12x_sparse_mla/attention.py"
INDEXER = "vllm/v1/attention/ops/sm12x_sparse_mla/indexer.py"
EINSUM = "vllm/v1/attention/ops/sm12x_sparse_mla/einsum.py"
SELECTION = "vllm/v1/attention/ops/sm12x_sparse_mla/selection.py"
CACHE_UTILS = "vllm/v1/attention/ops/deepseek_v4_ops/cache_utils.py"
ROCM_REF = "vllm/v1/attention/ops/rocm_aiter_mla_sparse.py"
LAYER = "vllm/model_executor/layers/deepseek_v4_attention.py"
SWA_BACKEND = "vllm/v1/attention/backends/mla/sparse_swa.py"
ENVS = "vllm/envs.py"
SOURCES = Path(__file__).resolve().parents[1] / "patches/fixes/triton-sparse-mla-fallback/new"

DIM, TOKEN_BYTES = 512, 584
RESULTS: dict = {}


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------ loading


def _stub(name: str, **attrs) -> types.ModuleType:
    mod = sys.modules.get(name) or types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(_stub(parent), child, mod)
    return mod


def load(tree: Path, rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, tree / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Platform:
    """Stand-in for vllm.platforms.current_platform on a CUDA device."""

    def __init__(self, capability=None):
        self.capability = capability

    def _cap(self):
        return self.capability or torch.cuda.get_device_capability()

    def is_rocm(self):
        return False

    def is_cuda(self):
        return True

    def is_xpu(self):
        return False

    def fp8_dtype(self):
        return torch.float8_e4m3fn

    def is_device_capability_family(self, capability, device_id=0):
        major, minor = self._cap()
        return (major * 10 + minor) // 10 == capability // 10


def load_pinned_helpers(tree: Path):
    import triton
    import triton.language as tl

    _stub("vllm.triton_utils", tl=tl, triton=triton)
    _stub("vllm.platforms", current_platform=_Platform())
    _stub("vllm.forward_context", get_forward_context=None)
    _stub("vllm.utils.torch_utils", LayerNameType=str)
    _stub("vllm.v1.attention.backends.mla.indexer", DeepseekV32IndexerMetadata=object)
    _stub("vllm.v1.attention.ops.common", pack_seq_triton=None, unpack_seq_triton=None)
    cache_utils = load(tree, CACHE_UTILS, "pinned_cache_utils")
    rocm = load(tree, ROCM_REF, "pinned_rocm_aiter_mla_sparse")
    return cache_utils, rocm


# ------------------------------------------------------------------ helpers


def timed(fn, iters=50, warmup=5, graph=True):
    """Mean microseconds per call; replays a CUDA graph when graph=True."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            with torch.cuda.graph(g, stream=s):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        run = g.replay
        run()
    else:
        run = fn
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def paged_cache(num_slots: int, page_block_size: int, device="cuda"):
    """A zeroed paged fp8_ds_mla cache view with vLLM's 576-aligned page stride."""
    pages = -(-num_slots // page_block_size)
    stride = -(-(page_block_size * TOKEN_BYTES) // 576) * 576
    raw = torch.zeros(pages * stride, dtype=torch.uint8, device=device)
    return raw.as_strided((pages, page_block_size, TOKEN_BYTES), (stride, TOKEN_BYTES, 1))


def fill_cache(cache_utils, cache, gen_scale=1.0, chunk=1 << 16):
    """Write random K into every slot with the pinned tree's own quantizing writer."""
    pages, pbs, _ = cache.shape
    flat = cache.view(pages, -1)
    n = pages * pbs
    for s0 in range(0, n, chunk):
        s1 = min(n, s0 + chunk)
        k = torch.randn(s1 - s0, DIM, device=cache.device) * gen_scale
        k[:, :448] *= torch.rand(s1 - s0, 1, device=cache.device) * 4
        slots = torch.arange(s0, s1, device=cache.device, dtype=torch.int64)
        cache_utils.quantize_and_insert_k_cache(k.bfloat16(), flat, slots, block_size=pbs)


def dequant_rows(rocm, cache, slots):
    """float64 rows of ``slots`` via the pinned tree's torch dequantizer (whole cache)."""
    full = rocm.rocm_dequantize_blocked_k_cache(cache, DIM, 448, 64)  # [pages, pbs, 1, 512]
    flat = full.view(-1, DIM)
    return flat[slots.long().clamp(min=0)].double()


def reference_attention(q, keys, valid, scale, sink, num_heads):
    """float64 attention. q [T,Hp,512]; keys [T,N,512] f64; valid [T,N] bool."""
    qf = q[:, :num_heads].double()
    s = torch.einsum("thd,tnd->thn", qf, keys) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m_safe)
    denom = e.sum(-1)
    if sink is not None:
        denom = denom + torch.exp(sink[:num_heads].double()[None, :] - m_safe[..., 0])
    out = torch.einsum("thn,tnd->thd", e, keys) / denom[..., None].clamp_min(1e-300)
    out[~valid.any(dim=1)] = 0
    full = torch.zeros(q.shape[0], q.shape[1], DIM, dtype=torch.float64, device=q.device)
    full[:, :num_heads] = out
    return full


def rel_err(out, ref):
    out = out.double()
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def padded_heads(h):
    return 64 if h <= 64 else 128


def decode_inputs(T, H, topk, window, swa_cache, top_cache, gen, full=True, dup=False):
    dev = swa_cache.device
    swa_slots = swa_cache.shape[0] * swa_cache.shape[1]
    top_slots = top_cache.shape[0] * top_cache.shape[1]
    hp = padded_heads(H)
    q = torch.randn(T, hp, DIM, device=dev, generator=gen).bfloat16()
    q[:, H:] = 0
    # Distinct rows per token (a cache row is read once per token).
    swa_idx = torch.randint(0, swa_slots, (T, 1, window), device=dev, generator=gen).int()
    top_idx = torch.randint(0, top_slots, (T, 1, topk), device=dev, generator=gen).int()
    if full:
        swa_lens = torch.full((T,), window, dtype=torch.int32, device=dev)
        top_lens = torch.full((T,), topk, dtype=torch.int32, device=dev)
    else:
        swa_lens = torch.randint(0, window + 1, (T,), device=dev, generator=gen).int()
        top_lens = torch.randint(0, topk + 1, (T,), device=dev, generator=gen).int()
        swa_lens[0] = 0
        top_lens[0] = 0  # a row with no valid entry
        mask = torch.rand(T, 1, topk, device=dev, generator=gen) < 0.1
        top_idx[mask] = -1
    if dup and topk >= 2:
        top_idx[:, :, 1] = top_idx[:, :, 0]
    sink = torch.full((hp,), float("-inf"), device=dev)
    sink[:H] = torch.randn(H, device=dev, generator=gen)
    return q, swa_idx, swa_lens, top_idx, top_lens, sink


# ------------------------------------------------------------------ sections


def section_env(args):
    import triton

    info = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        info["driver"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception as e:  # noqa: BLE001
        info["driver"] = f"unknown ({e})"
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), iters=20, graph=False)
    info["copy_bw_GBps"] = 2 * n / us / 1e3  # bytes read + written
    a = torch.randn(8192, 8192, device="cuda").bfloat16()
    b = torch.randn(8192, 8192, device="cuda").bfloat16()
    us = timed(lambda: a @ b, iters=10, graph=False)
    info["bf16_matmul_TFLOPs"] = 2 * 8192**3 / us / 1e6
    del src, dst, a, b
    RESULTS["env"] = info
    log("env", json.dumps(info))


def section_smem(args, mla):
    from triton.backends.compiler import GPUTarget

    extra = [load(SOURCES, rel, f"sm12x_{Path(rel).stem}") for rel in (INDEXER, EINSUM)]
    out = {}
    for cap in (120, 90):
        rep = mla.shared_memory_report(GPUTarget("cuda", cap, 32))
        for mod in extra:
            rep = rep + mod.shared_memory_report(GPUTarget("cuda", cap, 32))
        out[f"sm_{cap}"] = rep
        for name, shared in rep:
            ok = shared <= mla.SM120_MAX_SHARED_BYTES
            log(f"smem sm_{cap} {name}: {shared} B {'OK' if ok else 'OVER 99 KiB'}")
    RESULTS["smem"] = out
    RESULTS["smem_ok"] = all(s <= mla.SM120_MAX_SHARED_BYTES for _, s in out["sm_120"])


SWEEP = [
    (16, 32, 4, 1), (32, 16, 4, 1), (32, 32, 4, 1), (64, 16, 8, 1), (64, 32, 8, 1),
]


def hbm_pools(cache_utils):
    """SWA and top-k caches of 262144 slots each, larger than L2 so that rows come
    from HBM, written by the pinned tree's own cache writer."""
    swa = paged_cache(1 << 18, 64)
    top = paged_cache(1 << 18, 64)
    fill_cache(cache_utils, swa)
    fill_cache(cache_utils, top)
    return swa, top


def section_sweep(args, mla, cache_utils):
    from triton.backends.compiler import GPUTarget

    gen = torch.Generator(device="cuda").manual_seed(0)
    swa, top = hbm_pools(cache_utils)
    rows = []
    for cfg in SWEEP:
        os.environ["VLLM_TRITON_MLA_SPARSE_KERNEL_CONFIG"] = ",".join(map(str, cfg))
        try:
            smem = max(s for _, s in mla.shared_memory_report(GPUTarget("cuda", 120, 32), [cfg]))
        except Exception as e:  # noqa: BLE001
            smem = f"compile failed: {e}"[:200]
        for H in (16, 32, 64, 128):
            for topk in (512, 2048):
                for T in (64, 256):
                    q, si, sl, ti, tl_, sink = decode_inputs(T, H, topk, 128, swa, top, gen)
                    out = torch.empty_like(q)
                    fn = lambda: mla.sparse_mla_decode(  # noqa: E731
                        q, swa, si, sl, out, 0.04, sink, top, ti, tl_, num_heads=H)
                    try:
                        us = timed(fn, iters=20)
                    except Exception as e:  # noqa: BLE001
                        us = float("nan")
                        log("sweep error", cfg, e)
                    rows.append({"cfg": cfg, "H": H, "topk": topk, "T": T, "us": us,
                                 "sm120_smem": smem})
                    log(f"sweep cfg={cfg} H={H} topk={topk} T={T}: {us:.1f} us smem120={smem}")
        # prefill
        kv = torch.randn(1 << 17, DIM, device="cuda").bfloat16()
        for H in (64, 128):
            T, K = 512, 2176
            q = torch.randn(T, padded_heads(H), DIM, device="cuda").bfloat16()
            idx = torch.randint(0, kv.shape[0], (T, K), device="cuda", generator=gen).int()
            lens = torch.full((T,), K, dtype=torch.int32, device="cuda")
            out = torch.empty_like(q)
            sink = torch.zeros(padded_heads(H), device="cuda")
            fn = lambda: mla.sparse_mla_prefill(q, kv, idx, lens, out, 0.04, sink, num_heads=H)  # noqa: E731
            try:
                us = timed(fn, iters=5, graph=False)
            except Exception as e:  # noqa: BLE001
                us = float("nan")
                log("sweep error", cfg, e)
            tflops = 4 * T * H * K * DIM / us / 1e6
            rows.append({"cfg": cfg, "prefill": True, "H": H, "T": T, "K": K, "us": us,
                         "TFLOPs": tflops, "sm120_smem": smem})
            log(f"sweep prefill cfg={cfg} H={H}: {us:.1f} us {tflops:.1f} TFLOP/s")
    os.environ.pop("VLLM_TRITON_MLA_SPARSE_KERNEL_CONFIG", None)
    RESULTS["sweep"] = rows


def section_correctness(args, mla, cache_utils, rocm):
    gen = torch.Generator(device="cuda").manual_seed(1)
    swa = paged_cache(1 << 15, 64)
    c4 = paged_cache(1 << 15, 64)
    c128 = paged_cache(1 << 12, 2)
    for c in (swa, c4, c128):
        fill_cache(cache_utils, c)
    swa_full = rocm.rocm_dequantize_blocked_k_cache(swa, DIM, 448, 64).view(-1, DIM)
    deq = {id(swa): swa_full,
           id(c4): rocm.rocm_dequantize_blocked_k_cache(c4, DIM, 448, 64).view(-1, DIM),
           id(c128): rocm.rocm_dequantize_blocked_k_cache(c128, DIM, 448, 64).view(-1, DIM)}
    rows = []
    worst = 0.0
    for H in (16, 32, 64, 128):
        for kind, top, topk in (("swa", None, 0), ("c4a", c4, 512), ("c4a", c4, 2048),
                                ("c128a", c128, 2048)):
            for T in (1, 8, 64, 256):
                if T == 256 and H < 64 and kind != "c4a":
                    continue
                tc = top if top is not None else c4
                q, si, sl, ti, tl_, sink = decode_inputs(
                    T, H, max(topk, 1), 128, swa, tc, gen, full=False, dup=True)
                out = torch.full_like(q, float("nan"))
                mla.sparse_mla_decode(q, swa, si, sl, out, 1 / math.sqrt(DIM), sink,
                                      top, ti if top is not None else None,
                                      tl_ if top is not None else None, num_heads=H)
                pos = torch.arange(128, device="cuda")
                v_swa = (pos[None] < sl[:, None]) & (si[:, 0] >= 0)
                keys = deq[id(swa)][si[:, 0].long().clamp(min=0)]
                valid = v_swa
                if top is not None:
                    pos_t = torch.arange(topk, device="cuda")
                    v_top = (pos_t[None] < tl_[:, None]) & (ti[:, 0] >= 0)
                    keys = torch.cat([keys, deq[id(top)][ti[:, 0].long().clamp(min=0)]], 1)
                    valid = torch.cat([valid, v_top], 1)
                ref = reference_attention(q, keys.double(), valid, 1 / math.sqrt(DIM), sink, H)
                finite = bool(torch.isfinite(out).all())
                pad_zero = bool((out[:, H:] == 0).all())
                err = rel_err(out, ref)
                empty_zero = bool((out[~valid.any(1)] == 0).all())
                ok = finite and pad_zero and empty_zero and err < 2e-2
                worst = max(worst, err)
                rows.append({"H": H, "Hp": padded_heads(H), "kind": kind, "topk": topk,
                             "T": T, "rel_err": err, "ok": ok})
                log(f"decode check H={H}/{padded_heads(H)} {kind} topk={topk} T={T}: "
                    f"rel_err={err:.2e} finite={finite} pad0={pad_zero} empty0={empty_zero}"
                    f" {'OK' if ok else 'FAIL'}")
                del keys, ref
    # prefill: long-context chunks over gathered bf16 KV
    for H in (16, 64, 128):
        for T, ctx, topk in ((256, 65536, 2048), (64, 1 << 20, 512)):
            N = ctx // 4
            M = N + 128 + T
            kv = torch.randn(2 * M, DIM, device="cuda", generator=gen).bfloat16()
            K = -(-(topk + 128) // 128) * 128
            idx = torch.randint(0, 2 * M, (T, K), device="cuda", generator=gen).int()
            lens = torch.randint(1, topk + 129, (T,), device="cuda", generator=gen).int()
            lens[0] = 0
            idx[:, 5] = idx[:, 4]
            q = torch.randn(T, padded_heads(H), DIM, device="cuda", generator=gen).bfloat16()
            sink = torch.randn(padded_heads(H), device="cuda", generator=gen)
            out = torch.full_like(q, float("nan"))
            mla.sparse_mla_prefill(q, kv, idx, lens, out, 1 / math.sqrt(DIM), sink, num_heads=H)
            valid = (torch.arange(K, device="cuda")[None] < lens[:, None]) & (idx >= 0)
            ref = reference_attention(q, kv[idx.long().clamp(min=0)].double(), valid,
                                      1 / math.sqrt(DIM), sink, H)
            err = rel_err(out, ref)
            ok = bool(torch.isfinite(out).all()) and err < 2e-2 and bool((out[0] == 0).all())
            worst = max(worst, err)
            rows.append({"prefill": True, "H": H, "T": T, "ctx": ctx, "topk": topk,
                         "rel_err": err, "ok": ok})
            log(f"prefill check H={H} T={T} ctx={ctx} K={K}: rel_err={err:.2e} "
                f"{'OK' if ok else 'FAIL'}")
            del kv, ref
    RESULTS["correctness"] = {"rows": rows, "worst_rel_err": worst,
                              "all_ok": all(r["ok"] for r in rows)}


def decode_flops(T, H, keys):
    """Tensor-core work of one decode call: q.k over 512 dims and p.v over 512."""
    return 2 * T * H * keys * (DIM + DIM)


def section_decode_perf(args, mla, cache_utils, copy_bw, mm_tflops, baseline=None):
    """Achieved bandwidth against the copy bandwidth, and against what the call
    could reach at best: its bytes at copy bandwidth or its FLOPs at the bf16
    matmul rate, whichever takes longer. With --baseline, the same inputs through
    another revision of the kernel file, in the same run."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    swa, top = hbm_pools(cache_utils)
    rows = []
    for H in (16, 32, 64, 128):
        for topk in (512, 2048):
            for T in (1, 8, 64, 128, 256):
                q, si, sl, ti, tl_, sink = decode_inputs(T, H, topk, 128, swa, top, gen)
                out = torch.empty_like(q)

                def decode(kernel):
                    return lambda: kernel.sparse_mla_decode(
                        q, swa, si, sl, out, 0.04, sink, top, ti, tl_, num_heads=H)

                us = timed(decode(mla), iters=50)
                rows_read = T * (128 + topk)
                nbytes = (rows_read * TOKEN_BYTES + q[:, :H].numel() * 2 + out.numel() * 2
                          + rows_read * 4 + 2 * T * 4)
                flops = decode_flops(T, H, rows_read // T)
                bw = nbytes / us / 1e3
                memory_us, compute_us = nbytes / copy_bw / 1e3, flops / mm_tflops / 1e6
                row = {"H": H, "topk": topk, "T": T, "us": us, "bytes": nbytes,
                       "GBps": bw, "frac_copy_bw": bw / copy_bw, "flops": flops,
                       "TFLOPs": flops / us / 1e6,
                       "bound": "memory" if memory_us >= compute_us else "compute",
                       "frac_attainable": max(memory_us, compute_us) / us}
                note = ""
                if baseline is not None:
                    base_us = timed(decode(baseline), iters=50)
                    row.update(baseline_us=base_us, speedup_vs_baseline=base_us / us)
                    note = f"; baseline {base_us:.1f} us ({base_us / us:.2f}x)"
                rows.append(row)
                log(f"decode perf H={H} topk={topk} T={T}: {us:.1f} us, {nbytes/1e6:.1f} MB, "
                    f"{bw:.0f} GB/s = {100 * bw / copy_bw:.0f}% of copy, "
                    f"{row['TFLOPs']:.0f} TFLOP/s, {row['bound']}-bound, "
                    f"{100 * row['frac_attainable']:.0f}% of attainable{note}")
    RESULTS["decode_perf"] = rows


def section_reference(args, mla, cache_utils, rocm):
    """Against the pinned tree's rocm_forward_decode_fallback at a 32K-token cache."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    swa = paged_cache(32768, 64)  # 32K SWA slots
    c4 = paged_cache(32768 // 4, 64)  # the C4A pool of a 32K-token context
    fill_cache(cache_utils, swa)
    fill_cache(cache_utils, c4)
    rows = []
    for H in (64, 128):
        for T in (1, 64):
            q, si, sl, ti, tl_, sink = decode_inputs(T, H, 512, 128, swa, c4, gen)
            out = torch.empty_like(q)
            ref_out = torch.empty_like(q)

            def ours():
                mla.sparse_mla_decode(q, swa, si, sl, out, 0.04, sink, c4, ti, tl_,
                                      num_heads=H)

            def theirs():
                rocm.rocm_forward_decode_fallback(
                    q=q, kv_cache=c4, swa_k_cache=swa, swa_only=False, topk_indices=ti,
                    topk_lens=tl_, swa_indices=si, swa_lens=sl, attn_sink=sink, scale=0.04,
                    head_dim=DIM, nope_head_dim=448, rope_head_dim=64, output=ref_out)

            t_ours = timed(ours, iters=50)
            t_ref = timed(theirs, iters=10, graph=False)
            t_ours_eager = timed(ours, iters=50, graph=False)
            diff = rel_err(out[:, :H], ref_out[:, :H].double())
            rows.append({"H": H, "T": T, "ours_graph_us": t_ours, "ours_eager_us": t_ours_eager,
                         "rocm_ref_us": t_ref, "speedup_graph": t_ref / t_ours,
                         "speedup_eager": t_ref / t_ours_eager, "rel_diff": diff})
            log(f"vs rocm_forward_decode_fallback H={H} T={T}: ours {t_ours:.1f} us "
                f"(eager {t_ours_eager:.1f}), reference {t_ref:.1f} us -> "
                f"{t_ref / t_ours:.0f}x (eager {t_ref / t_ours_eager:.0f}x), rel diff {diff:.1e}")
    RESULTS["reference"] = rows


def section_prefill(args, mla, mm_tflops):
    gen = torch.Generator(device="cuda").manual_seed(4)
    rows = []
    kv = torch.randn(4 * (65536 // 4 + 128 + 4096), DIM, device="cuda").bfloat16()
    for H in (64, 128):
        for T, topk in ((1024, 512), (1024, 2048), (4096, 2048)):
            K = -(-(topk + 128) // 128) * 128
            q = torch.randn(T, padded_heads(H), DIM, device="cuda").bfloat16()
            idx = torch.randint(0, kv.shape[0], (T, K), device="cuda", generator=gen).int()
            lens = torch.full((T,), topk + 128, dtype=torch.int32, device="cuda")
            sink = torch.randn(padded_heads(H), device="cuda")
            out = torch.empty_like(q)
            us = timed(lambda: mla.sparse_mla_prefill(q, kv, idx, lens, out, 0.04, sink,  # noqa: E731
                                                      num_heads=H), iters=5, graph=False)
            flops = 4 * T * H * (topk + 128) * DIM
            tf = flops / us / 1e6
            rows.append({"H": H, "T": T, "topk": topk, "us": us, "TFLOPs": tf,
                         "frac_matmul": tf / mm_tflops})
            log(f"prefill perf H={H} T={T} topk={topk}: {us:.0f} us, {tf:.1f} TFLOP/s = "
                f"{100 * tf / mm_tflops:.0f}% of bf16 matmul")
    RESULTS["prefill_perf"] = rows


# ------------------------------------------------------------- against FlashMLA

# The decode shapes of the FlashMLA comparison: heads per rank, top-k, batch
# (window 128, a 32K-token context).
FM_HEADS, FM_TOPKS, FM_BATCHES = (16, 32, 64, 128), (512, 2048), (1, 64, 256)
FM_SWEEP = [(16, 16, 4, 1), (16, 32, 4, 1), (16, 64, 4, 1), (32, 16, 4, 1), (32, 32, 4, 1),
            (32, 32, 8, 1), (64, 16, 8, 1), (64, 32, 8, 1), (64, 64, 8, 1), (16, 32, 4, 2),
            (64, 32, 8, 2)]
FM_SPLITS = (None, 1, 2, 4, 8, 16, 32, 64)


def load_flashmla(folder: Path):
    """FlashMLA from the vLLM 0.21.0 wheel without vLLM: its compiled ops
    (vllm/_flashmla_C.abi3.so, loaded into torch.ops) and its Python interface
    (vllm/third_party/flashmla/flash_mla_interface.py), extracted into FOLDER."""
    torch.ops.load_library(str(folder / "vllm/_flashmla_C.abi3.so"))
    _stub("vllm._flashmla_C")  # the interface imports it for its side effect only
    return load(folder, "vllm/third_party/flashmla/flash_mla_interface.py", "flashmla_iface")


def context_pools(cache_utils):
    """The SWA pool and the C4A pool of a 32K-token context (page 64), written by
    the pinned tree's own cache writer."""
    swa, c4 = paged_cache(32768, 64), paged_cache(32768 // 4, 64)
    fill_cache(cache_utils, swa)
    fill_cache(cache_utils, c4)
    return swa, c4


def flashmla_decode(fm, q, swa, c4, si, sl, ti, tl_, sink, scale, out):
    """A decode call as 0.21.0's DeepseekV4MLAAttention._forward_decode makes it:
    heads padded, SWA cache as k_cache, the compressed cache as extra_k_cache.
    The scheduler plan is made by the first call and reused, as every layer of a
    type after the first reuses it within a decode step."""
    meta = fm.get_mla_metadata()[0]
    return lambda: fm.flash_mla_with_kvcache(
        q=q.unsqueeze(1), k_cache=swa.unsqueeze(-2), block_table=None, cache_seqlens=None,
        head_dim_v=DIM, tile_scheduler_metadata=meta, is_fp8_kvcache=True, indices=si,
        topk_length=sl, softmax_scale=scale, attn_sink=sink, extra_k_cache=c4.unsqueeze(-2),
        extra_indices_in_kvcache=ti, extra_topk_length=tl_, out=out.unsqueeze(1))


def fm_reference(q, swa_rows, c4_rows, si, sl, ti, tl_, sink, scale, H):
    keys = torch.cat([swa_rows[si[:, 0].long().clamp(min=0)],
                      c4_rows[ti[:, 0].long().clamp(min=0)]], 1).double()
    pos_s = torch.arange(si.shape[-1], device=q.device)
    pos_t = torch.arange(ti.shape[-1], device=q.device)
    valid = torch.cat([(pos_s[None] < sl[:, None]) & (si[:, 0] >= 0),
                       (pos_t[None] < tl_[:, None]) & (ti[:, 0] >= 0)], 1)
    return reference_attention(q, keys, valid, scale, sink, H)


def section_flashmla(args, mla, cache_utils, rocm, baseline=None):
    """Our decode over FlashMLA's, same tensors, same run; both checked against
    float64 at batch <= 64 (the pinned tree's dequantizer gives the rows)."""
    fm = load_flashmla(args.flashmla)
    gen = torch.Generator(device="cuda").manual_seed(5)
    swa, c4 = context_pools(cache_utils)
    swa_rows = rocm.rocm_dequantize_blocked_k_cache(swa, DIM, 448, 64).view(-1, DIM)
    c4_rows = rocm.rocm_dequantize_blocked_k_cache(c4, DIM, 448, 64).view(-1, DIM)
    scale, rows = 1 / math.sqrt(576), []
    for H in FM_HEADS:
        for topk in FM_TOPKS:
            for T in FM_BATCHES:
                q, si, sl, ti, tl_, sink = decode_inputs(T, H, topk, 128, swa, c4, gen)
                out, out_fm = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))

                def ours(kernel=mla):
                    return lambda: kernel.sparse_mla_decode(
                        q, swa, si, sl, out, scale, sink, c4, ti, tl_, num_heads=H)

                theirs = flashmla_decode(fm, q, swa, c4, si, sl, ti, tl_, sink, scale, out_fm)
                ours()()
                theirs()
                row = {"H": H, "Hp": padded_heads(H), "topk": topk, "T": T,
                       "rel_diff_vs_flashmla": rel_err(out[:, :H], out_fm[:, :H].double())}
                if T <= 64:
                    ref = fm_reference(q, swa_rows, c4_rows, si, sl, ti, tl_, sink, scale, H)
                    row.update(rel_err=rel_err(out[:, :H], ref[:, :H]),
                               flashmla_rel_err=rel_err(out_fm[:, :H], ref[:, :H]))
                    del ref
                row["us"] = timed(ours(), iters=50)
                row["flashmla_us"] = timed(theirs, iters=50)
                row["ratio"] = row["us"] / row["flashmla_us"]
                note = ""
                if baseline is not None:
                    row["baseline_us"] = timed(ours(baseline), iters=50)
                    row["baseline_ratio"] = row["baseline_us"] / row["flashmla_us"]
                    note = f"; before {row['baseline_us']:.1f} us ({row['baseline_ratio']:.2f})"
                rows.append(row)
                log(f"vs FlashMLA H={H}/{padded_heads(H)} topk={topk} T={T}: ours "
                    f"{row['us']:.1f} us, FlashMLA {row['flashmla_us']:.1f} us, ratio "
                    f"{row['ratio']:.2f}{note}; rel err {row.get('rel_err', float('nan')):.1e} "
                    f"(FlashMLA {row.get('flashmla_rel_err', float('nan')):.1e}), "
                    f"ours vs FlashMLA {row['rel_diff_vs_flashmla']:.1e}")
    RESULTS["flashmla"] = rows


def section_flashmla_sweep(args, mla, cache_utils):
    """Our decode at the FlashMLA comparison's shapes for every candidate
    (BLOCK_H, BLOCK_N, warps, stages) and split count (None: the wrapper's)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    swa, c4 = context_pools(cache_utils)
    rows = []
    for cfg in FM_SWEEP:
        os.environ["VLLM_TRITON_MLA_SPARSE_KERNEL_CONFIG"] = ",".join(map(str, cfg))
        for H in FM_HEADS:
            for topk in FM_TOPKS:
                for T in FM_BATCHES:
                    q, si, sl, ti, tl_, sink = decode_inputs(T, H, topk, 128, swa, c4, gen)
                    out = torch.empty_like(q)
                    for splits in FM_SPLITS:
                        if splits and (splits - 1) * cfg[1] >= topk + 128:
                            continue
                        fn = lambda: mla.sparse_mla_decode(  # noqa: E731
                            q, swa, si, sl, out, 0.04, sink, c4, ti, tl_, num_heads=H,
                            num_splits=splits)
                        try:
                            us = timed(fn, iters=20)
                        except Exception as e:  # noqa: BLE001
                            us = float("nan")
                            log("flashmla sweep error", cfg, splits, repr(e)[:200])
                        rows.append({"cfg": cfg, "H": H, "topk": topk, "T": T,
                                     "splits": splits, "us": us})
                    best = min((r for r in rows[-len(FM_SPLITS):] if r["cfg"] == cfg
                                and r["H"] == H and r["T"] == T and r["topk"] == topk),
                               key=lambda r: r["us"])
                    log(f"fm-sweep cfg={cfg} H={H} topk={topk} T={T}: best {best['us']:.1f} us "
                        f"at splits={best['splits']}")
    os.environ.pop("VLLM_TRITON_MLA_SPARSE_KERNEL_CONFIG", None)
    RESULTS["flashmla_sweep"] = rows


# ------------------------------------------------------------------ layer check


def section_layer(args, tree, mla, cache_utils, rocm):
    """Run the patched layer's own forward/_forward_decode/_forward_prefill.

    The three methods are taken from the patched deepseek_v4_attention.py by
    parsing it and executed on a stand-in ``self``, with the pinned tree's own
    Triton helpers (topk -> global slots, gather, combine) and a spy around the
    fallback entry points; FlashMLA and the ROCm path raise if called. One
    mixed batch (decode tokens first, then prefill requests) of a C4A layer.
    """
    report = {}
    # 1. selection: envs parsing and the capability gate
    envs = load(tree, ENVS, "pinned_envs_patched")
    _stub("vllm.envs")
    sys.modules["vllm"].envs = envs
    sys.modules["vllm.envs"] = envs
    plat = _Platform()
    _stub("vllm.platforms", current_platform=plat)
    selection = load(SOURCES, SELECTION, "patched_selection")
    table = {}
    for value in (None, "1", "0"):
        for cap in ((9, 0), (10, 0), (12, 0), (12, 1)):
            if value is None:
                os.environ.pop("VLLM_TRITON_MLA_SPARSE", None)
            else:
                os.environ["VLLM_TRITON_MLA_SPARSE"] = value
            plat.capability = cap
            table[f"env={value} cap={cap[0]}.{cap[1]}"] = selection.use_triton_sparse_mla()
    os.environ.pop("VLLM_TRITON_MLA_SPARSE", None)
    plat.capability = None
    expected = {f"env={v} cap={c}": (v == "1") or (v is None and c.startswith("12"))
                for v in (None, "1", "0") for c in ("9.0", "10.0", "12.0", "12.1")}
    report["selection"] = table
    report["selection_ok"] = table == expected
    log("selection", json.dumps(table), "OK" if table == expected else "FAIL")

    # 2. the layer methods
    src = (tree / LAYER).read_text()
    mod = ast.parse(src)
    cls = next(n for n in mod.body
               if isinstance(n, ast.ClassDef) and n.name == "DeepseekV4MLAAttention")
    funcs = [f for f in cls.body if isinstance(f, ast.FunctionDef)
             and f.name in ("forward", "_forward_decode", "_forward_prefill")]
    chunk_const = next(n for n in mod.body if isinstance(n, ast.Assign)
                       and getattr(n.targets[0], "id", "") == "PREFILL_CHUNK_SIZE")
    calls = []

    def spy(name, fn):
        def wrapper(**kw):
            calls.append((name, kw))
            return fn(**kw)
        return wrapper

    _stub("vllm.v1.attention.ops.sm12x_sparse_mla.attention",
          sparse_mla_decode=spy("decode", mla.sparse_mla_decode),
          sparse_mla_prefill=spy("prefill", mla.sparse_mla_prefill))

    def boom(*a, **k):
        raise AssertionError("FlashMLA / ROCm path called while the fallback is selected")

    class Workspace:
        def get_simultaneous(self, *specs):
            return [torch.full(shape, float("nan"), dtype=dt, device="cuda")
                    for shape, dt in specs]

    ctx = types.SimpleNamespace(attn_metadata=None)
    g = {"torch": torch, "cast": typing.cast, "get_forward_context": lambda: ctx,
         "current_platform": _Platform(), "FlashMLASparseMetadata": object,
         "rocm_forward_decode_fallback": boom, "rocm_sparse_attn_prefill": boom,
         "flash_mla_with_kvcache": boom, "flash_mla_sparse_fwd": boom,
         "compute_global_topk_indices_and_lens": cache_utils.compute_global_topk_indices_and_lens,
         "dequantize_and_gather_k_cache": cache_utils.dequantize_and_gather_k_cache,
         "combine_topk_swa_indices": cache_utils.combine_topk_swa_indices,
         "current_workspace_manager": lambda: Workspace()}
    exec(compile(ast.Module(body=[chunk_const, *funcs], type_ignores=[]),
                 str(tree / LAYER), "exec"), g)
    Layer = type("Layer", (), {f.name: g[f.name] for f in funcs})

    gen = torch.Generator(device="cuda").manual_seed(5)
    dev = "cuda"
    H, Hp, W, ratio, topk = 16, 64, 128, 4, 512
    block = 256  # vLLM block size of the C4A group; compressed page = 64
    cpbs, spbs = block // ratio, 64
    dec_lens = [300, 4000, 129, 5000]  # decode requests (1 token each)
    pre = [(700, 300), (6000, 256)]  # prefill requests: (seq_len, query_len)
    seq_lens = dec_lens + [s for s, _ in pre]
    qlens = [1] * len(dec_lens) + [q for _, q in pre]
    R = len(seq_lens)
    n_blocks = [-(-s // block) for s in seq_lens]
    total_blocks = sum(n_blocks) + 3
    perm = torch.randperm(total_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    max_b = max(n_blocks)
    block_table = torch.zeros(R, max_b, dtype=torch.int32)
    k = 0
    for r in range(R):
        for j in range(n_blocks[r]):
            block_table[r, j] = perm[k]
            k += 1
    # The SWA group and the C4A group have their own block tables in vLLM;
    # here SWA pages hold 64 tokens (4 per 256-token block), C4A 64 compressed.
    swa_bt = torch.zeros(R, max_b * 4, dtype=torch.int32)
    for r in range(R):
        for j in range(n_blocks[r] * 4):
            swa_bt[r, j] = int(block_table[r, j // 4]) * 4 + j % 4
    swa_cache = paged_cache(total_blocks * 4 * spbs, spbs)
    c4_cache = paged_cache(total_blocks * cpbs, cpbs)
    fill_cache(cache_utils, swa_cache)
    fill_cache(cache_utils, c4_cache)
    swa_deq = rocm.rocm_dequantize_blocked_k_cache(swa_cache, DIM, 448, 64).view(-1, DIM)
    c4_deq = rocm.rocm_dequantize_blocked_k_cache(c4_cache, DIM, 448, 64).view(-1, DIM)

    def swa_slot(r, p):
        return int(swa_bt[r, p // spbs]) * spbs + p % spbs

    def c4_slot(r, c):
        return int(block_table[r, c // cpbs]) * cpbs + c % cpbs

    tokens = []  # (request, position)
    for r in range(R):
        for i in range(qlens[r]):
            tokens.append((r, seq_lens[r] - qlens[r] + i))
    T = len(tokens)
    nd = len(dec_lens)
    topk_buf = torch.full((T, topk), -1, dtype=torch.int32)
    chosen = []
    for t, (r, p) in enumerate(tokens):
        n_c = min((p + 1) // ratio, topk)
        sel = torch.randperm((p + 1) // ratio, generator=torch.Generator().manual_seed(t))[:n_c]
        topk_buf[t, :n_c] = sel.int()
        chosen.append(sel.tolist())
    dec_swa_idx = torch.full((T, 1, W), -1, dtype=torch.int32)
    dec_swa_len = torch.zeros(T, dtype=torch.int32)
    for t in range(nd):
        r, p = tokens[t]
        lo = max(0, p - W + 1)
        for j, pp in enumerate(range(lo, p + 1)):
            dec_swa_idx[t, 0, j] = swa_slot(r, pp)
        dec_swa_len[t] = p + 1 - lo
    qsl = torch.tensor([0] + list(torch.tensor(qlens).cumsum(0)), dtype=torch.int32)
    pre_gather = torch.tensor(
        [q + min(s - q, W - 1) for s, q in pre], dtype=torch.int32, device=dev)
    swa_md = types.SimpleNamespace(
        num_decodes=nd, num_prefills=len(pre), num_decode_tokens=nd,
        num_prefill_tokens=T - nd, is_valid_token=torch.ones(T, dtype=torch.bool, device=dev),
        token_to_req_indices=torch.tensor([r for r, _ in tokens], dtype=torch.int32, device=dev),
        decode_swa_indices=dec_swa_idx[:nd].to(dev), decode_swa_lens=dec_swa_len[:nd].to(dev),
        prefill_seq_lens=torch.tensor(seq_lens[nd:], dtype=torch.int32, device=dev),
        prefill_gather_lens=pre_gather, query_start_loc_cpu=qsl, query_start_loc=qsl.to(dev),
        block_table=swa_bt.to(dev), block_size=spbs)
    fm_md = types.SimpleNamespace(block_table=block_table.to(dev), block_size=block)
    layer = Layer()
    layer.prefix = "layers.0.attn"
    layer.swa_cache_layer = types.SimpleNamespace(prefix="layers.0.swa", kv_cache=swa_cache)
    layer.kv_cache = c4_cache
    layer.compress_ratio = ratio
    layer.num_heads = H
    layer.scale = 1 / math.sqrt(DIM)
    layer.attn_sink = torch.full((Hp,), float("-inf"), device=dev)
    layer.attn_sink[:H] = torch.randn(H, device=dev, generator=gen)
    layer.topk_indices_buffer = topk_buf.to(dev)
    layer.window_size = W
    layer.max_model_len = 8192
    layer.max_num_batched_tokens = 1024
    layer.use_triton_sparse_mla = True
    ctx.attn_metadata = {layer.prefix: fm_md, layer.swa_cache_layer.prefix: swa_md}
    q = torch.randn(T, Hp, DIM, device=dev, generator=gen).bfloat16()
    q[:, H:] = 0
    out = torch.full_like(q, float("nan"))
    layer.forward(q, torch.empty(T, DIM, device=dev), torch.arange(T, device=dev), out)
    torch.cuda.synchronize()

    # Reference by position (independent of the layer's index plumbing).
    keys, valid = [], []
    for t, (r, p) in enumerate(tokens):
        rows = [c4_deq[c4_slot(r, c)] for c in chosen[t]]
        rows += [swa_deq[swa_slot(r, pp)] for pp in range(max(0, p - W + 1), p + 1)]
        keys.append(torch.stack(rows))
    n_max = max(k_.shape[0] for k_ in keys)
    kt = torch.zeros(T, n_max, DIM, dtype=torch.float64, device=dev)
    vt = torch.zeros(T, n_max, dtype=torch.bool, device=dev)
    for t, k_ in enumerate(keys):
        kt[t, :k_.shape[0]] = k_.double()
        vt[t, :k_.shape[0]] = True
    ref = reference_attention(q, kt, vt, layer.scale, layer.attn_sink, H)
    err = rel_err(out, ref)
    kinds = [c[0] for c in calls]
    dec_call = next(kw for name, kw in calls if name == "decode")
    pre_calls = [kw for name, kw in calls if name == "prefill"]
    args_ok = (
        dec_call["swa_cache"] is swa_cache and dec_call["extra_cache"] is c4_cache
        and dec_call["num_heads"] == H and dec_call["q"].shape == (nd, Hp, DIM)
        and dec_call["output"].data_ptr() == out.data_ptr()
        and dec_call["attn_sink"] is layer.attn_sink
        and dec_call["extra_indices"].shape[0] == nd
        and all(kw["num_heads"] == H and kw["attn_sink"] is layer.attn_sink for kw in pre_calls)
    )
    report.update({
        "calls": kinds, "rel_err": err, "finite": bool(torch.isfinite(out).all()),
        "padded_heads_zero": bool((out[:, H:] == 0).all()), "args_ok": bool(args_ok),
        "tokens": T, "decode_tokens": nd,
    })
    report["ok"] = (report["selection_ok"] and report["finite"] and err < 2e-2
                    and report["padded_heads_zero"] and args_ok
                    and kinds.count("decode") == 1 and kinds.count("prefill") >= 1)
    log("layer check", json.dumps({k_: v for k_, v in report.items() if k_ != "selection"}))

    # 3. the SWA metadata builder's tile-scheduler skip
    swa_src = (tree / SWA_BACKEND).read_text()
    smod = ast.parse(swa_src)
    scls = next(n for n in smod.body if isinstance(n, ast.ClassDef)
                and n.name == "DeepseekSparseSWAMetadataBuilder")
    bts = next(f for f in scls.body if isinstance(f, ast.FunctionDef)
               and f.name == "build_tile_scheduler")
    consts = [n for n in smod.body if isinstance(n, ast.Assign)
              and getattr(n.targets[0], "id", "").startswith("_LAYER_TYPE_")]
    g2 = {"current_platform": _Platform(), "get_mla_metadata": boom,
          "FlashMLASchedMeta": object}
    exec(compile(ast.Module(body=[*consts, bts], type_ignores=[]), str(tree / SWA_BACKEND),
                 "exec"), g2)
    b = types.SimpleNamespace(_use_triton_sparse_mla=True, _layer_types={"swaonly", "c4a"})
    plan = g2["build_tile_scheduler"](b, 8)
    report["tile_scheduler_skipped"] = all(v is None for v in plan.values())
    log("build_tile_scheduler with the fallback:", plan)
    report["ok"] = report["ok"] and report["tile_scheduler_skipped"]
    RESULTS["layer"] = report


# ------------------------------------------------------------ indexer, einsum


def _ref_logits(q, k, k_scale, w):
    """float64 MQA logits. q [M,H,D] fp8, k [N,D] fp8, k_scale [N], w [M,H]."""
    s = torch.einsum("mhd,nd->mhn", q.double(), k.double()).clamp_min(0)
    return (s * w.double()[:, :, None]).sum(1) * k_scale.double()[None, :]


def _logits_err(got, ref):
    fin = torch.isfinite(ref)
    pattern = bool(torch.equal(torch.isfinite(got), fin))
    err = ((got.double()[fin] - ref[fin]).abs().max() / ref[fin].abs().max()).item()
    return pattern, err


def section_indexer(args, copy_bw, mm_tflops):
    """The sparse indexer's logits at DeepSeek V4's shapes (64 heads, D=128,
    C4 indexer cache pages of 64): correctness against float64, then speed."""
    idx = load(SOURCES, INDEXER, "sm12x_indexer")
    gen = torch.Generator(device="cuda").manual_seed(7)
    dev, fp8 = "cuda", torch.float8_e4m3fn
    H, D, PBS = 64, 128, 64
    checks, perf = [], []

    # Prefill: 2 requests in one chunk, causal key ranges over gathered keys.
    for M, N in ((512, 8192), (2048, 16384)):
        q = torch.randn(M, H, D, device=dev, generator=gen).to(fp8)
        k = torch.randn(N, D, device=dev, generator=gen).to(fp8)
        ks_ = torch.rand(N, device=dev, generator=gen) + 0.5
        w = torch.randn(M, H, device=dev, generator=gen) * 0.1
        half, first = M // 2, N // 2
        pos = torch.arange(M, device=dev)
        ks = torch.where(pos < half, 0, first).int()
        ke = torch.where(pos < half, first - half + pos + 1, N - M + pos + 1).int()
        ke[5] = ks[5]  # an empty row
        out = idx.fp8_mqa_logits(q, (k, ks_), w, ks, ke)
        errs, ok = [], True
        for m0 in range(0, M, 64):
            ref = _ref_logits(q[m0:m0 + 64], k, ks_, w[m0:m0 + 64])
            cols = torch.arange(N, device=dev)[None, :]
            ref = ref.masked_fill((cols < ks[m0:m0 + 64, None]) | (cols >= ke[m0:m0 + 64, None]),
                                  float("-inf"))
            p, e = _logits_err(out[m0:m0 + 64], ref)
            ok &= p
            errs.append(e)
        checks.append({"kind": "prefill", "M": M, "N": N, "pattern_ok": ok, "rel_err": max(errs)})
        log(f"indexer prefill M={M} N={N}: -inf pattern {'OK' if ok else 'WRONG'}, "
            f"rel err {max(errs):.2e}")
        us = timed(lambda: idx.fp8_mqa_logits(q, (k, ks_), w, ks, ke), iters=20)
        pairs = int((ke - ks).clamp_min(0).sum())
        tflops = 2 * pairs * H * D / us / 1e6
        perf.append({"kind": "prefill", "M": M, "N": N, "us": us, "pairs": pairs,
                     "TFLOPs_useful": tflops})
        log(f"indexer prefill perf M={M} N={N}: {us:.1f} us, {tflops:.0f} TFLOP/s useful "
            f"({100 * tflops / mm_tflops:.0f}% of bf16 matmul)")

    # Decode: paged cache, block table, lengths up to max_model_len.
    for B, next_n, max_len in ((1, 1, 32768), (64, 1, 32768), (16, 2, 65536), (256, 1, 8192)):
        max_blocks = max_len // PBS
        pages = B * max_blocks + 7
        stride = PBS * (D + 4) + 64  # padded pages (the kernel must use stride(0))
        raw = torch.randint(0, 256, (pages * stride,), device=dev, dtype=torch.uint8,
                            generator=gen)
        cache = raw.as_strided((pages, PBS, 1, D + 4), (stride, D + 4, D + 4, 1))
        vals = torch.randn(pages, PBS, D, device=dev, generator=gen).to(fp8)
        scl = torch.rand(pages, PBS, device=dev, generator=gen) + 0.5
        pg = raw.view(pages, stride)
        pg[:, :PBS * D] = vals.view(torch.uint8).view(pages, PBS * D)
        pg[:, PBS * D:PBS * (D + 4)] = scl.view(torch.uint8).view(pages, PBS * 4)
        bt = torch.randperm(pages, device=dev, generator=gen)[:B * max_blocks].view(
            B, max_blocks).int()
        lens = torch.randint(1, max_len + 1, (B,), device=dev, generator=gen).int()
        lens[0] = max_len
        if B > 2:
            lens[1] = 0
        ctx = (torch.stack([lens - 1, lens], 1).clamp_min(0).int() if next_n == 2
               else lens.view(B, 1))
        q = torch.randn(B, next_n, H, D, device=dev, generator=gen).to(fp8)
        w = torch.randn(B * next_n, H, device=dev, generator=gen) * 0.1
        out = idx.fp8_paged_mqa_logits(q, cache, w, ctx, bt, max_len)
        ok, errs = True, []
        for b in range(min(B, 8)):
            keys = vals.view(torch.uint8)[bt[b].long()].reshape(-1, D).view(fp8)
            ksc = scl[bt[b].long()].reshape(-1)
            for j in range(next_n):
                row = b * next_n + j
                lim = int(ctx[b, j])
                ref = _ref_logits(q[b, j][None], keys, ksc, w[row][None])[0]
                ref[lim:] = float("-inf")
                n = min(-(-lim // PBS) * PBS, max_len)
                if n == 0:
                    continue
                p, e = _logits_err(out[row, :n], ref[:n])
                ok &= p
                errs.append(e)
        checks.append({"kind": "decode", "B": B, "next_n": next_n, "max_len": max_len,
                       "pattern_ok": ok, "rel_err": max(errs)})
        log(f"indexer decode B={B} next_n={next_n} max_len={max_len}: "
            f"-inf pattern {'OK' if ok else 'WRONG'}, rel err {max(errs):.2e}")
        full = torch.full_like(ctx, max_len)
        us = timed(lambda: idx.fp8_paged_mqa_logits(q, cache, w, full, bt, max_len), iters=20)
        # Must move: each request's keys once (132 B each), the fp32 logits out.
        nbytes = B * max_len * (D + 4) + B * next_n * max_len * 4
        bw = nbytes / us / 1e3
        perf.append({"kind": "decode", "B": B, "next_n": next_n, "keys": max_len, "us": us,
                     "bytes": nbytes, "GBps": bw, "frac_copy_bw": bw / copy_bw})
        log(f"indexer decode perf B={B} next_n={next_n} keys={max_len}: {us:.1f} us, "
            f"{nbytes / 1e6:.1f} MB, {bw:.0f} GB/s = {100 * bw / copy_bw:.0f}% of copy")
        del raw, cache, vals, scl, pg
    RESULTS["indexer"] = {"checks": checks, "perf": perf,
                          # fp8 tensor-core sums are not exact fp32 on Hopper
                          "all_ok": all(c["pattern_ok"] and c["rel_err"] < 1e-3
                                        for c in checks)}


def section_einsum(args, copy_bw, mm_tflops):
    """The output projection's fp8 einsum 'bhr,hdr->bhd' with 128x128 weight
    blocks and per-token 1x128 activation scales (DeepSeek V4: o_lora_rank
    1024, 8 heads x 512 per group)."""
    ein = load(SOURCES, EINSUM, "sm12x_einsum")
    gen = torch.Generator(device="cuda").manual_seed(9)
    dev, fp8 = "cuda", torch.float8_e4m3fn
    D, R = 1024, 4096
    checks, perf = [], []
    for G in (16, 2):
        w = torch.randn(G, D, R, device=dev, generator=gen) * 0.02
        wb = w.view(G, D // 128, 128, R // 128, 128)
        wsc = torch.exp2(torch.ceil(torch.log2(wb.abs().amax((2, 4), keepdim=True) / 448)))
        wq = (wb / wsc).to(fp8).view(G, D, R)
        wsc = wsc.view(G, D // 128, R // 128)
        w_deq = wq.double() * wsc.repeat_interleave(128, 1).repeat_interleave(128, 2).double()
        for T in (1, 16, 64, 256, 2048):
            x = torch.randn(G, T, R, device=dev, generator=gen) * 2
            xb = x.view(G, T, R // 128, 128)
            xs = torch.exp2(torch.ceil(torch.log2(xb.abs().amax(-1, keepdim=True) / 448)))
            a = (xb / xs).to(fp8).view(G, T, R).transpose(0, 1)
            a_scale = xs.view(G, T, R // 128).transpose(0, 1)
            out = torch.full((T, G, D), float("nan"), device=dev, dtype=torch.bfloat16)
            ein.fp8_einsum_bhr_hdr(a, a_scale, wq, wsc, out)
            a_deq = (a.double() * a_scale.double().repeat_interleave(128, 2))
            ref = torch.einsum("bhr,hdr->bhd", a_deq, w_deq)
            err = rel_err(out, ref)
            finite = bool(torch.isfinite(out).all())
            checks.append({"G": G, "T": T, "rel_err": err, "all_written": finite})
            us = timed(lambda: ein.fp8_einsum_bhr_hdr(a, a_scale, wq, wsc, out), iters=20)
            wbf = w_deq.bfloat16()
            abf = a_deq.bfloat16()
            us_bf16 = timed(lambda: torch.einsum("bhr,hdr->bhd", abf, wbf), iters=20)
            flops = 2 * T * G * D * R
            nbytes = G * D * R + T * G * R + T * G * D * 2
            perf.append({"G": G, "T": T, "us": us, "TFLOPs": flops / us / 1e6,
                         "GBps": nbytes / us / 1e3, "bf16_einsum_us": us_bf16})
            log(f"einsum G={G} T={T}: rel err {err:.2e}, written {finite}; {us:.1f} us "
                f"({flops / us / 1e6:.0f} TFLOP/s, {nbytes / us / 1e3:.0f} GB/s = "
                f"{100 * nbytes / us / 1e3 / copy_bw:.0f}% of copy); bf16 einsum on "
                f"pre-dequantized weights {us_bf16:.1f} us")
        wq_last, wsc_last = wq, wsc
        del w, w_deq
    # Wiring: the patched layer file's custom-op body, parsed out and run with
    # the gate on and DeepGEMM's fp8_einsum replaced by a function that raises.
    src = (args.tree / LAYER).read_text()
    fn = next(n for n in ast.parse(src).body
              if isinstance(n, ast.FunctionDef) and n.name == "deepseek_v4_fp8_einsum")
    mod = ast.Module(body=[fn], type_ignores=[])
    pkg = "vllm.v1.attention.ops.sm12x_sparse_mla"
    _stub(pkg)
    sys.modules[f"{pkg}.einsum"] = ein

    def _no_deepgemm(*a, **k):
        raise AssertionError("DeepGEMM fp8_einsum called with the fallback on")

    ns = {"torch": torch, "use_triton_sparse_mla": lambda: True, "fp8_einsum": _no_deepgemm}
    exec(compile(mod, str(args.tree / LAYER), "exec"), ns)
    out2 = torch.full_like(out, float("nan"))
    ns["deepseek_v4_fp8_einsum"](a, a_scale, wq_last, wsc_last, out2,
                                  "bhr,hdr->bhd", [1, 1, 128])
    ein.fp8_einsum_bhr_hdr(a, a_scale, wq_last, wsc_last, out)
    wiring = bool(torch.equal(out, out2))
    log(f"einsum wiring (patched deepseek_v4_fp8_einsum -> Triton): {'OK' if wiring else 'WRONG'}")
    RESULTS["einsum_wiring_ok"] = wiring
    RESULTS["einsum"] = {"checks": checks, "perf": perf,
                         "all_ok": all(c["rel_err"] < 1e-2 and c["all_written"]
                                       for c in checks)}


# ------------------------------------------------------------------ main


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--sections", default="env,smem,correctness,layer,decode,reference,prefill")
    ap.add_argument("--flashmla", type=Path, default=Path(".gpu-carry/flashmla"),
                    help="folder holding vllm/_flashmla_C.abi3.so and vllm/third_party/"
                         "flashmla/ from the vLLM 0.21.0 wheel (section flashmla)")
    ap.add_argument("--kernel", type=Path, default=SOURCES / KERNEL,
                    help="the attention.py timed as ours (default: this repository's source)")
    ap.add_argument("--baseline", type=Path,
                    help="another revision of attention.py, timed on the same decode inputs")
    args = ap.parse_args()
    sections = args.sections.split(",")
    mla = load(args.kernel.parent, args.kernel.name, "sm12x_sparse_mla_attention")
    cache_utils, rocm = load_pinned_helpers(args.tree)
    baseline = load(args.baseline.parent, args.baseline.name, "baseline_attention") if args.baseline else None
    args.out.mkdir(parents=True, exist_ok=True)
    RESULTS["command"] = " ".join(sys.argv)
    RESULTS["kernel_configs"] = mla.all_configs()

    def run(name, fn):
        t0 = time.time()
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            RESULTS.setdefault("errors", {})[name] = repr(e)
        log(f"[section {name}: {time.time() - t0:.1f} s]")
        (args.out / "sparse_mla_bench.json").write_text(json.dumps(RESULTS, indent=1))

    env = {}
    steps = {
        "env": lambda: section_env(args),
        "smem": lambda: section_smem(args, mla),
        "sweep": lambda: section_sweep(args, mla, cache_utils),
        "correctness": lambda: section_correctness(args, mla, cache_utils, rocm),
        "layer": lambda: section_layer(args, args.tree, mla, cache_utils, rocm),
        "decode": lambda: section_decode_perf(args, mla, cache_utils,
                                              env.get("copy_bw_GBps", 4000.0),
                                              env.get("bf16_matmul_TFLOPs", 790.0), baseline),
        "reference": lambda: section_reference(args, mla, cache_utils, rocm),
        "flashmla": lambda: section_flashmla(args, mla, cache_utils, rocm, baseline),
        "flashmla_sweep": lambda: section_flashmla_sweep(args, mla, cache_utils),
        "prefill": lambda: section_prefill(args, mla, env.get("bf16_matmul_TFLOPs", 790.0)),
        "indexer": lambda: section_indexer(args, env.get("copy_bw_GBps", 4000.0),
                                           env.get("bf16_matmul_TFLOPs", 790.0)),
        "einsum": lambda: section_einsum(args, env.get("copy_bw_GBps", 4000.0),
                                         env.get("bf16_matmul_TFLOPs", 790.0)),
    }
    for name in sections:
        run(name, steps[name])
        env = RESULTS.get("env", {})

if __name__ == "__main__":
    main()
