#!/usr/bin/env python3
"""The 0.33.0 lane's sparse-MLA wiring, run on a GPU without vLLM installed.

Takes a folder holding the patched 0.33.0 files (``vllm/envs.py``,
``vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py`` and the
``vllm/v1/attention/ops/sm12x_sparse_mla/`` package) and:

- decision: runs the patched ``_use_triton_sparse_mla`` with the patched
  ``envs.py`` knob for VLLM_TRITON_MLA_SPARSE=1, =0 and unset;
- layer: runs the patched ``DeepseekV4FlashInferSM120Attention.forward_mqa``,
  ``_forward_decode``, ``_forward_prefill`` and ``_triton_sparse_mla`` (parsed
  out of the patched file, annotations dropped) on a stand-in layer with the
  fallback forced, FlashInfer's call replaced by a function that raises, over
  one mixed C4A batch; vLLM's ``compute_global_topk_indices_and_lens`` is
  replaced by a torch stand-in (block table lookup). The output is compared
  with a float64 reference built from positions.

Writes ``layer033.json`` under ``--out``. Usage:
    python3 bench/sparse_mla_layer_033.py --tree DIR --out DIR
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import os
import sys
import time
import types
from pathlib import Path

import torch

LAYER = "vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py"
PKG = "vllm/v1/attention/ops/sm12x_sparse_mla"
CLASS = "DeepseekV4FlashInferSM120Attention"
METHODS = ("forward_mqa", "_forward_sparse_impl", "_prepare_query", "_as_sparse_cache",
           "_forward_decode", "_forward_prefill", "_triton_sparse_mla")
DIM, NOPE, TOKEN_DATA, TOKEN_BYTES = 512, 448, 576, 584


def load_package(tree: Path) -> None:
    """The patched sm12x_sparse_mla modules under their vLLM names (stub parents)."""
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops"):
        sys.modules.setdefault(name, types.ModuleType(name))
    pkg = "vllm.v1.attention.ops.sm12x_sparse_mla"
    sys.modules[pkg] = types.ModuleType(pkg)
    for mod in ("dispatch", "attention"):
        spec = importlib.util.spec_from_file_location(f"{pkg}.{mod}", tree / PKG / f"{mod}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)


def load_envs_knob(tree: Path) -> None:
    """``vllm.envs`` with the patched VLLM_TRITON_MLA_SPARSE lambda, read by ast."""
    src = (tree / "vllm/envs.py").read_text()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if isinstance(key, ast.Constant) and key.value == "VLLM_TRITON_MLA_SPARSE":
                    knob = eval(compile(ast.Expression(value), "envs.py", "eval"), {"os": os})
    envs = types.ModuleType("vllm.envs")
    envs.__getattr__ = lambda name: knob() if name == "VLLM_TRITON_MLA_SPARSE" else None
    sys.modules["vllm.envs"] = envs
    sys.modules["vllm"].envs = envs


def _strip_annotations(fn: ast.FunctionDef) -> ast.FunctionDef:
    for arg in fn.args.args + fn.args.kwonlyargs:
        arg.annotation = None
    fn.returns = None
    return fn


def layer_source(tree: Path) -> tuple[dict, dict]:
    """(module functions, class methods) of the patched layer file we run."""
    module = ast.parse((tree / LAYER).read_text())
    funcs = [_strip_annotations(n) for n in module.body
             if isinstance(n, ast.FunctionDef) and n.name in ("_sm120_layer_shape", "_use_triton_sparse_mla")]
    cls = next(n for n in module.body if isinstance(n, ast.ClassDef) and n.name == CLASS)
    methods = [_strip_annotations(n) for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    assert len(funcs) == 2 and len(methods) == len(METHODS), "patched layer file not as expected"
    return ({f.name: f for f in funcs}, {m.name: m for m in methods})


def compile_defs(defs, namespace: dict) -> dict:
    mod = ast.Module(body=list(defs), type_ignores=[])
    exec(compile(ast.fix_missing_locations(mod), LAYER, "exec"), namespace)
    return {d.name: namespace[d.name] for d in defs}


class Logger:
    def __init__(self):
        self.lines = []

    def info_once(self, msg, *args):
        self.lines.append(msg % args if args else msg)


# ------------------------------------------------------------------ decision


def section_decision(funcs: dict) -> dict:
    logger = Logger()
    fns = compile_defs(funcs.values(), {"logger": logger, "VllmConfig": object})
    ns = types.SimpleNamespace
    layer = ns(padded_heads=32, window_size=128, max_image_tokens=0, compress_ratio=4,
               swa_cache_layer=ns(block_size=64), kv_cache_dtype="fp8_ds_mla", head_dim=512,
               kv_cache_torch_dtype=torch.uint8)
    config = ns(model_config=ns(hf_config=ns(index_topk=512)), cache_config=ns(block_size=256),
                speculative_config=None)
    out = {}
    for value in ("1", "0", None):
        if value is None:
            os.environ.pop("VLLM_TRITON_MLA_SPARSE", None)
        else:
            os.environ["VLLM_TRITON_MLA_SPARSE"] = value
        out[f"VLLM_TRITON_MLA_SPARSE={value or 'unset'}"] = fns["_use_triton_sparse_mla"](layer, config, 128)
    out["shape"] = repr(fns["_sm120_layer_shape"](layer, config, 128))
    out["log"] = logger.lines
    return out


# ------------------------------------------------------------------ layer


def pack_rows(rows: torch.Tensor, num_pages: int, page: int, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_ds_mla pages holding ``rows`` [pages*page, 512] at slot = row index.

    Returns (cache [pages, page, 584] uint8, padded page stride; the float64
    values it holds)."""
    n = num_pages * page
    nope = rows[:, :NOPE].float().view(n, 7, 64)
    exp = torch.ceil(torch.log2(nope.abs().amax(-1).clamp_min(1e-4) / 448.0))
    q8 = (nope / torch.exp2(exp)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    rope = rows[:, NOPE:].to(torch.bfloat16)
    held = torch.cat([(q8.double() * torch.exp2(exp.double())[..., None]).view(n, NOPE), rope.double()], 1)
    stride = -(-page * TOKEN_BYTES // 576) * 576
    raw = torch.full((num_pages, stride), 0x7F, dtype=torch.uint8, device=rows.device)
    data = torch.cat([q8.view(torch.uint8).view(n, NOPE), rope.view(torch.uint8)], 1)
    raw[:, : page * TOKEN_DATA] = data.view(num_pages, page * TOKEN_DATA)
    scales = torch.zeros(n, 8, dtype=torch.uint8, device=rows.device)
    scales[:, :7] = (exp + 127).to(torch.uint8)
    raw[:, page * TOKEN_DATA : page * TOKEN_BYTES] = scales.view(num_pages, page * 8)
    cache = raw.view(-1).as_strided((num_pages, page, TOKEN_BYTES), (stride, TOKEN_BYTES, 1))
    return cache, held


def global_topk_stand_in(local, token_to_req, block_table, block_size, is_valid):
    """vLLM's compute_global_topk_indices_and_lens, in torch: slot ids, valid prefix."""
    req = token_to_req[: local.shape[0]].long()  # decode passes every token's
    page = block_table[req[:, None], (local.clamp_min(0) // block_size).long()]
    slots = torch.where(local >= 0, page * block_size + local % block_size, -1).int()
    lens = torch.where(is_valid, (local >= 0).sum(-1), 0).int()
    return slots, lens


def section_layer(methods: dict, attention, small: bool) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(33)
    H, Hp, W, ratio, topk, page = 24, 32, 128, 4, 512, 64
    dec_ctx = [129, 700, 2048, 5000]  # decode requests: positions seen
    pre = [(40, 300), (24, 6000)]  # prefill requests: (new tokens, context before)
    if small:  # for the CPU interpreter
        H, Hp, W, topk, page, dec_ctx, pre = 3, 8, 16, 32, 16, [17, 90], [(5, 40), (3, 100)]
    lens = dec_ctx + [c + n for n, c in pre]
    # One SWA page table and one compressed page table per request, pages shuffled.
    swa_pages = [math.ceil(n / page) for n in lens]
    c4_pages = [math.ceil((n // ratio) / page) + 1 for n in lens]
    perm_s = torch.randperm(sum(swa_pages), generator=gen, device=dev)
    perm_c = torch.randperm(sum(c4_pages), generator=gen, device=dev)
    swa_bt = torch.zeros(len(lens), max(swa_pages), dtype=torch.long, device=dev)
    c4_bt = torch.zeros(len(lens), max(c4_pages), dtype=torch.long, device=dev)
    a = b = 0
    for r in range(len(lens)):
        swa_bt[r, : swa_pages[r]] = perm_s[a : a + swa_pages[r]]
        c4_bt[r, : c4_pages[r]] = perm_c[b : b + c4_pages[r]]
        a, b = a + swa_pages[r], b + c4_pages[r]
    swa_rows = torch.randn(sum(swa_pages) * page, DIM, device=dev, generator=gen)
    c4_rows = torch.randn(sum(c4_pages) * page, DIM, device=dev, generator=gen)
    swa_cache, swa_held = pack_rows(swa_rows, sum(swa_pages), page, gen)
    c4_cache, c4_held = pack_rows(c4_rows, sum(c4_pages), page, gen)

    # Tokens: decode first (one each), then the prefill requests' new tokens.
    tok_req, tok_pos = [], []
    for r, n in enumerate(dec_ctx):
        tok_req.append(r), tok_pos.append(n - 1)
    for i, (n, c) in enumerate(pre):
        r = len(dec_ctx) + i
        tok_req += [r] * n
        tok_pos += list(range(c, c + n))
    T = len(tok_req)
    swa_idx = torch.full((T, W), -1, dtype=torch.int32, device=dev)
    swa_len = torch.zeros(T, dtype=torch.int32, device=dev)
    local = torch.full((T, topk), -1, dtype=torch.int32, device=dev)
    keys = []
    for t, (r, p) in enumerate(zip(tok_req, tok_pos)):
        win = torch.arange(max(0, p - W + 1), p + 1, device=dev)
        slots = swa_bt[r, win // page] * page + win % page
        swa_idx[t, : len(win)] = slots.int()
        swa_len[t] = len(win)
        ncomp = (p + 1) // ratio
        chosen = torch.randperm(ncomp, generator=gen, device=dev)[: min(topk, ncomp)]
        local[t, : len(chosen)] = chosen.int()
        cslots = c4_bt[r, chosen // page] * page + chosen % page
        keys.append(torch.cat([swa_held[slots], c4_held[cslots]]))
    n_dec = len(dec_ctx)
    qsl = [0] + [1] * n_dec + [n for n, _ in pre]
    qsl_cpu = torch.tensor(qsl).cumsum(0).int()

    calls = []

    def spy(**kw):
        calls.append({k: (tuple(v.shape) if torch.is_tensor(v) else v) for k, v in kw.items()
                      if k in ("q", "num_heads", "scale")} | {"sink_is_layer_sink": kw["attn_sink"] is layer.attn_sink})
        return real(**kw)

    real = attention.sparse_mla_decode
    attention.sparse_mla_decode = spy

    def boom(*a, **k):
        raise AssertionError("FlashInfer was called")

    ctx = types.SimpleNamespace()
    ns = {"torch": torch, "cast": lambda _t, v: v, "get_forward_context": lambda: ctx,
          "compute_global_topk_indices_and_lens": global_topk_stand_in,
          "flashinfer_trtllm_batch_decode_sparse_mla_dsv4": boom,
          "DeepseekV4FlashMLAMetadata": object}
    fns = compile_defs(methods.values(), ns)
    Layer = type("Layer", (), fns)
    layer = Layer()
    sn = types.SimpleNamespace
    layer.prefix = "layers.0.attn"
    layer.swa_cache_layer = sn(prefix="layers.0.swa", kv_cache=swa_cache)
    layer.kv_cache = c4_cache
    layer.compress_ratio = ratio
    layer.n_local_heads = H
    layer.scale = 1 / math.sqrt(DIM)
    layer.attn_sink = torch.full((Hp,), float("-inf"), device=dev)
    layer.attn_sink[:H] = torch.randn(H, device=dev, generator=gen)
    layer.topk_indices_buffer = local
    layer.kv_cache_torch_dtype = torch.uint8
    layer.PREFILL_CHUNK_SIZE = 1  # one call per prefill request
    layer.use_triton_sparse_mla = True
    layer._get_workspace = boom
    layer._reserve_empty_forward_workspace = boom
    valid = torch.ones(T, dtype=torch.bool, device=dev)
    swa_md = sn(num_decode_tokens=n_dec, num_decodes=n_dec, num_prefills=len(pre),
                num_prefill_tokens=T - n_dec, is_valid_token=valid,
                token_to_req_indices=torch.tensor(tok_req, dtype=torch.int32, device=dev),
                decode_swa_indices=swa_idx[:n_dec], decode_swa_lens=swa_len[:n_dec],
                prefill_swa_indices=swa_idx[n_dec:], prefill_swa_lens=swa_len[n_dec:],
                query_start_loc_cpu=qsl_cpu)
    fm_md = sn(block_size=page * ratio, block_table=c4_bt)
    ctx.attn_metadata = {layer.prefix: fm_md, layer.swa_cache_layer.prefix: swa_md}
    q = torch.randn(T, H, DIM, device=dev, generator=gen).to(torch.bfloat16)
    out = torch.full((T, Hp, DIM), float("nan"), device=dev, dtype=torch.bfloat16)
    layer.forward_mqa(q, None, None, out)
    if dev == "cuda":
        torch.cuda.synchronize()
    attention.sparse_mla_decode = real

    ref = torch.zeros(T, H, DIM, dtype=torch.float64, device=dev)
    sink = layer.attn_sink[:H].double()
    for t in range(T):
        s = (q[t].double() @ keys[t].T) * layer.scale
        m = torch.maximum(s.max(1).values, sink)
        e = torch.exp(s - m[:, None])
        ref[t] = (e @ keys[t]) / (e.sum(1) + torch.exp(sink - m))[:, None]
    err = float((out[:, :H].double() - ref).abs().max() / ref.abs().max())
    return {"tokens": T, "decode_tokens": n_dec, "prefill_requests": pre, "decode_contexts": dec_ctx,
            "heads": H, "padded_heads": Hp, "topk": topk, "window": W, "page_block_size": page,
            "calls": calls, "rel_err": err, "padded_heads_zero": bool((out[:, H:] == 0).all()),
            "all_written": not bool(out.isnan().any()), "ok": err < 1e-2 and bool((out[:, H:] == 0).all())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU interpreter)")
    args = ap.parse_args()
    load_package(args.tree)
    load_envs_knob(args.tree)
    funcs, methods = layer_source(args.tree)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__}
    import triton

    report["triton"] = triton.__version__
    report["decision"] = section_decision(funcs)
    report["layer"] = section_layer(
        methods, sys.modules["vllm.v1.attention.ops.sm12x_sparse_mla.attention"], args.small)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "layer033.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(json.dumps(report, indent=1, default=str))
    return 0 if report["layer"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
