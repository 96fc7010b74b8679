"""Correctness of patch 0004's Triton sparse-MLA kernels (DeepSeek V4 on SM12x).

The kernels are loaded by path from their source in this repository
(patches/fixes/triton-sparse-mla-fallback/new/, which the patch carries; the
patch is kept in step by tests/test_generated.py), without importing vLLM,
and checked against a float64 reference on fresh random data. Without a GPU
they run under Triton's CPU interpreter (TRITON_INTERPRET=1) at small shapes.
The fp8_ds_mla cache is packed here, byte by byte, following the layout:
584 bytes per token, a page holding the 576-byte token data of all its tokens
first, then their 8-byte scale groups, pages padded to 576-byte multiples.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import needs
import pytest

torch = needs.module("torch")
if not torch.cuda.is_available() and "triton" not in sys.modules:
    # Triton decides at import and decoration time whether to interpret, so
    # this must happen before triton is first imported in this process.
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = needs.module("triton")

pytestmark = pytest.mark.triton

SOURCES = Path(__file__).resolve().parents[1] / "patches/fixes/triton-sparse-mla-fallback/new"
KERNEL_FILE = SOURCES / "vllm/v1/attention/ops/sm12x_sparse_mla/attention.py"
NOPE, ROPE, DIM = 448, 64, 512
TOKEN_DATA, SCALE_GROUP, TOKEN_BYTES = 576, 8, 584
FP8_MAX = 448.0


def _on_gpu() -> bool:
    return torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def device() -> str:
    return "cuda" if _on_gpu() else "cpu"


@pytest.fixture(scope="module")
def mla():
    """The kernel module, imported alone by path."""
    if not _on_gpu() and not _interpreting():
        needs.missing("no GPU, and triton was imported before TRITON_INTERPRET=1 was set")
    spec = importlib.util.spec_from_file_location("sm12x_sparse_mla_attention", KERNEL_FILE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- packing


def pack_fp8_ds_mla(kv: torch.Tensor, slots: torch.Tensor, num_pages: int,
                    page_block_size: int, pad_pages_to: int = 576):
    """Quantize ``kv`` [n, 512] into a paged fp8_ds_mla cache at ``slots``.

    Returns (cache view [pages, page_block_size, 584] uint8 with the padded
    page stride, the dequantized float64 values the cache holds, [n, 512]).
    """
    n = kv.shape[0]
    page_bytes = page_block_size * TOKEN_BYTES
    page_stride = -(-page_bytes // pad_pages_to) * pad_pages_to
    raw = torch.zeros(num_pages * page_stride, dtype=torch.uint8)
    # Poison the padding so that a kernel that reads it is caught.
    raw.fill_(0x7F)
    held = torch.empty(n, DIM, dtype=torch.float64)
    for i in range(n):
        slot = int(slots[i])
        page, off = divmod(slot, page_block_size)
        base = page * page_stride
        tok = base + off * TOKEN_DATA
        scl = base + page_block_size * TOKEN_DATA + off * SCALE_GROUP
        row = kv[i].float()
        for tile in range(NOPE // 64):
            x = row[tile * 64:(tile + 1) * 64]
            amax = max(float(x.abs().max()), 1e-4)
            exp = math.ceil(math.log2(amax / FP8_MAX))
            q8 = (x / 2.0**exp).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            raw[tok + tile * 64:tok + (tile + 1) * 64] = q8.view(torch.uint8)
            raw[scl + tile] = exp + 127
            held[i, tile * 64:(tile + 1) * 64] = q8.double() * 2.0**exp
        raw[scl + 7] = 0
        rope = kv[i, NOPE:].to(torch.bfloat16).contiguous()
        raw[tok + NOPE:tok + TOKEN_DATA] = rope.view(torch.uint8)
        held[i, NOPE:] = rope.double()
    # Unused token rows and scale groups stay poisoned except the scale
    # bytes, which a NaN scale would not reveal; set them to an absurd scale.
    cache = raw.as_strided((num_pages, page_block_size, TOKEN_BYTES),
                           (page_stride, TOKEN_BYTES, 1))
    return cache, held


def test_packer_follows_the_layout():
    kv = torch.randn(3, DIM) * 4
    slots = torch.tensor([0, 5, 6])
    cache, held = pack_fp8_ds_mla(kv, slots, num_pages=2, page_block_size=4)
    assert cache.stride(0) == 2880  # 4 * 584 = 2336, padded to 5 * 576
    flat = torch.as_strided(cache, (2 * 2880,), (1,))
    # slot 5 is page 1, offset 1: token data at 2880 + 576, scales at
    # 2880 + 4 * 576 + 8.
    tok, scl = 2880 + 576, 2880 + 4 * 576 + 8
    rope = flat[tok + 448:tok + 576].view(torch.bfloat16)
    assert torch.equal(rope, kv[1, 448:].to(torch.bfloat16))
    e = flat[scl:scl + 7].to(torch.int64) - 127
    x = flat[tok:tok + 448].view(torch.float8_e4m3fn).double().view(7, 64)
    assert torch.equal((x * 2.0 ** e[:, None].double()).flatten(), held[1, :448])
    assert int(flat[scl + 7]) == 0
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 1/16.
    err = (held[:, :448] - kv[:, :448].double()).abs()
    assert (err <= kv[:, :448].double().abs() / 16 + 0.02).all()


# ---------------------------------------------------------------- reference


def reference(q, keys_per_token, scale, sink, num_heads):
    """float64 sparse attention with a sink; keys_per_token: list of [n_t, 512]."""
    T = q.shape[0]
    out = torch.zeros(T, q.shape[1], DIM, dtype=torch.float64)
    for t in range(T):
        k = keys_per_token[t]
        if k.shape[0] == 0:
            continue
        qt = q[t, :num_heads].double()
        s = (qt @ k.T) * scale
        m = s.max(dim=1, keepdim=True).values
        e = torch.exp(s - m)
        denom = e.sum(dim=1)
        if sink is not None:
            denom = denom + torch.exp(sink[:num_heads].double() - m[:, 0])
        out[t, :num_heads] = (e @ k) / denom[:, None]
    return out


def selected(held, slot_to_row, idx_row, length):
    rows = []
    for j in range(min(int(length), idx_row.numel())):
        slot = int(idx_row[j])
        if slot >= 0 and slot in slot_to_row:
            rows.append(held[slot_to_row[slot]])
    return torch.stack(rows) if rows else torch.zeros(0, DIM, dtype=torch.float64)


def check(out, ref, num_heads):
    out = out.double().cpu()
    assert torch.isfinite(out).all(), "output has unwritten (NaN-poisoned) elements"
    assert (out[:, num_heads:] == 0).all(), "padded heads must be zero"
    err = (out - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert scale > 0.05, "degenerate reference"
    assert err <= 2e-2 * scale + 1e-3, f"max abs err {err} (ref max {scale})"
    empty = (ref.abs().sum(dim=(1, 2)) == 0)
    assert (out[empty] == 0).all()


def make_paged(n_tokens, page_block_size, num_pages, gen):
    slots = torch.randperm(num_pages * page_block_size, generator=gen)[:n_tokens]
    kv = torch.randn(n_tokens, DIM, generator=gen)
    kv[:, :NOPE] *= torch.rand(n_tokens, 1, generator=gen) * 8  # spread scales
    cache, held = pack_fp8_ds_mla(kv, slots, num_pages, page_block_size)
    return cache, held, {int(s): i for i, s in enumerate(slots)}, slots


def random_rows(slots, T, width, gen, lens):
    idx = slots[torch.randint(0, slots.numel(), (T, width), generator=gen)].to(torch.int32)
    idx[torch.rand(T, width, generator=gen) < 0.2] = -1
    idx[:, 1] = idx[:, 0]  # duplicates count twice, as in FlashMLA
    for t in range(T):
        idx[t, int(lens[t]):] = torch.randint(0, int(slots.max()) + 1, (1,), generator=gen).int()
    return idx


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("num_heads,padded,num_splits", [(16, 64, 1), (24, 64, 3)])
def test_decode_swa_and_topk(mla, device, num_heads, padded, num_splits):
    gen = torch.Generator().manual_seed(1000 + num_heads)
    T, W, K = 4, 16, 40
    swa_cache, swa_held, swa_map, swa_slots = make_paged(40, 8, 6, gen)
    top_cache, top_held, top_map, top_slots = make_paged(60, 2, 40, gen)
    swa_lens = torch.tensor([16, 7, 0, 12], dtype=torch.int32)
    top_lens = torch.tensor([40, 0, 0, 23], dtype=torch.int32)  # token 2: no entry
    swa_idx = random_rows(swa_slots, T, W, gen, swa_lens).view(T, 1, W)
    top_idx = random_rows(top_slots, T, K, gen, top_lens).view(T, 1, K)
    q = torch.randn(T, padded, DIM, generator=gen).to(torch.bfloat16)
    q[:, num_heads:] = 0
    sink = torch.full((padded,), float("-inf"))
    sink[:num_heads] = torch.randn(num_heads, generator=gen)
    sink[1] = float("-inf")  # a real head without a sink
    scale = DIM ** -0.5
    out = torch.full((T, padded, DIM), float("nan"), dtype=torch.bfloat16)

    d = lambda x: x.to(device)  # noqa: E731
    mla.sparse_mla_decode(
        d(q), d(swa_cache), d(swa_idx), d(swa_lens), out_dev := d(out), scale,
        attn_sink=d(sink), extra_cache=d(top_cache), extra_indices=d(top_idx),
        extra_lens=d(top_lens), num_heads=num_heads, num_splits=num_splits,
    )
    keys = [
        torch.cat([selected(swa_held, swa_map, swa_idx[t, 0], swa_lens[t]),
                   selected(top_held, top_map, top_idx[t, 0], top_lens[t])])
        for t in range(T)
    ]
    assert keys[2].shape[0] == 0 and keys[1].shape[0] > 0
    ref = reference(q, keys, scale, sink, num_heads)
    check(out_dev, ref, num_heads)


def test_decode_swa_only_and_split_merge_agree(mla, device):
    gen = torch.Generator().manual_seed(7)
    T, W = 3, 24
    cache, held, smap, slots = make_paged(50, 8, 8, gen)
    lens = torch.tensor([24, 5, 17], dtype=torch.int32)
    idx = random_rows(slots, T, W, gen, lens)
    q = torch.randn(T, 64, DIM, generator=gen).to(torch.bfloat16)
    sink = torch.randn(64, generator=gen) + 2.0
    scale = 0.04
    outs = []
    for splits in (1, 2, 5):
        out = torch.full((T, 64, DIM), float("nan"), dtype=torch.bfloat16).to(device)
        mla.sparse_mla_decode(q.to(device), cache.to(device), idx.to(device),
                              lens.to(device), out, scale, attn_sink=sink.to(device),
                              num_splits=splits)
        outs.append(out)
    keys = [selected(held, smap, idx[t], lens[t]) for t in range(T)]
    ref = reference(q, keys, scale, sink, 64)
    for out in outs:
        check(out, ref, 64)


def test_sink_applied_once_to_the_merged_subsets(mla, device):
    """Two subsets with a sink equal one subset holding their union."""
    gen = torch.Generator().manual_seed(11)
    T = 2
    cache, held, smap, slots = make_paged(30, 4, 10, gen)
    a = slots[:12].to(torch.int32).repeat(T, 1)
    b = slots[12:30].to(torch.int32).repeat(T, 1)
    la = torch.tensor([12, 9], dtype=torch.int32)
    lb = torch.tensor([18, 4], dtype=torch.int32)
    union = torch.full((T, 30), -1, dtype=torch.int32)
    for t in range(T):
        u = torch.cat([a[t, :la[t]], b[t, :lb[t]]])
        union[t, :u.numel()] = u
    lu = la + lb
    q = torch.randn(T, 16, DIM, generator=gen).to(torch.bfloat16)
    sink = torch.randn(16, generator=gen) + 3.0  # a large sink makes errors visible
    d = lambda x: x.to(device)  # noqa: E731
    two = d(torch.full((T, 16, DIM), float("nan"), dtype=torch.bfloat16))
    one = d(torch.full((T, 16, DIM), float("nan"), dtype=torch.bfloat16))
    mla.sparse_mla_decode(d(q), d(cache), d(a), d(la), two, 0.05, attn_sink=d(sink),
                          extra_cache=d(cache), extra_indices=d(b), extra_lens=d(lb))
    mla.sparse_mla_decode(d(q), d(cache), d(union), d(lu), one, 0.05, attn_sink=d(sink))
    keys = [selected(held, smap, union[t], lu[t]) for t in range(T)]
    ref = reference(q, keys, 0.05, sink, 16)
    check(two, ref, 16)
    check(one, ref, 16)
    assert (two.float() - one.float()).abs().max().item() < 1e-2


def test_prefill(mla, device):
    gen = torch.Generator().manual_seed(3)
    T, rows, K, H, padded = 5, 70, 48, 20, 64
    kv = torch.randn(rows, 1, DIM, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, rows, (T, K), generator=gen).to(torch.int32)
    idx[torch.rand(T, K, generator=gen) < 0.15] = -1
    idx[:, 3] = idx[:, 2]  # duplicates
    idx[0, 5] = rows + 3  # outside the buffer: skipped
    lens = torch.tensor([48, 30, 0, 1, 47], dtype=torch.int32)
    q = torch.randn(T, padded, DIM, generator=gen).to(torch.bfloat16)
    sink = torch.full((padded,), float("-inf"))
    sink[:H] = torch.randn(H, generator=gen)
    scale = DIM ** -0.5
    out = torch.full((T, padded, DIM), float("nan"), dtype=torch.bfloat16).to(device)
    mla.sparse_mla_prefill(q.to(device), kv.to(device), idx.view(T, 1, K).to(device),
                           lens.to(device), out, scale, attn_sink=sink.to(device),
                           num_heads=H)
    keys = []
    for t in range(T):
        sel = [int(i) for i in idx[t, :int(lens[t])] if 0 <= int(i) < rows]
        keys.append(kv[sel, 0].double() if sel else torch.zeros(0, DIM, dtype=torch.float64))
    ref = reference(q, keys, scale, sink, H)
    check(out, ref, H)


def test_no_sink_and_all_empty(mla, device):
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(8, DIM, generator=gen).to(torch.bfloat16)
    idx = torch.full((2, 16), -1, dtype=torch.int32)
    idx[1, :4] = torch.tensor([1, 2, 2, 7], dtype=torch.int32)
    lens = torch.tensor([16, 4], dtype=torch.int32)
    q = torch.randn(2, 16, DIM, generator=gen).to(torch.bfloat16)
    out = torch.full((2, 16, DIM), float("nan"), dtype=torch.bfloat16).to(device)
    mla.sparse_mla_prefill(q.to(device), kv.to(device), idx.to(device), lens.to(device),
                           out, 0.06, attn_sink=None, num_splits=2)
    keys = [torch.zeros(0, DIM, dtype=torch.float64), kv[[1, 2, 2, 7]].double()]
    check(out, reference(q, keys, 0.06, None, 16), 16)
    assert (out[0] == 0).all()


# What compiling every launch configuration for sm_120a prints: each compile's ptxas -v
# log (TRITON_DUMP_PTXAS_LOG, captured per compile; TRITON_ALWAYS_COMPILE so that ptxas
# runs even when Triton's cache holds the kernel) and its PTX, beside the module's own
# shared-memory report, from the one compile that report makes.
_REPORT_SCRIPT = """
import contextlib, importlib.util, io, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
kept = []
_compile = triton.compile
def compile_and_keep(*args, **kwargs):
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        kernel = _compile(*args, **kwargs)
    kept.append((log.getvalue(), kernel.asm["ptx"]))
    return kernel
triton.compile = compile_and_keep
spec = importlib.util.spec_from_file_location("k", sys.argv[1])
k = importlib.util.module_from_spec(spec)
spec.loader.exec_module(k)
report = k.shared_memory_report(GPUTarget("cuda", 120, 32))
assert len(report) == len(kept), (len(report), len(kept))
builds = [{"name": name, "shared": shared, "registers": re.findall(r"Used (\\d+) registers", log),
           "spills": [int(n) for n in re.findall(r"(\\d+) bytes spill (?:stores|loads)", log)],
           "mma": sorted(set(re.findall(r"\\bmma\\.[\\w.]+", ptx)))}
          for (name, shared), (log, ptx) in zip(report, kept)]
sm12x = sorted({cfg for (_, _, on_sm12x), cfg in k._CONFIGS.items() if on_sm12x})
print(json.dumps({"limit": k.SM120_MAX_SHARED_BYTES, "builds": builds, "sm12x": sm12x}))
"""

MMA_SM120 = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"


@pytest.fixture(scope="module")
def sm120_builds():
    """Every launch configuration compiled for sm_120a (no GPU needed) in a fresh process
    without the interpreter: Triton's own metadata, ptxas's report and the PTX."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DUMP_PTXAS_LOG="1", TRITON_ALWAYS_COMPILE="1")
    proc = subprocess.run(
        [sys.executable, "-c", _REPORT_SCRIPT, str(KERNEL_FILE)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["builds"], "no configurations reported"
    return data


def _launched_on_sm12x(data) -> list[dict]:
    suffixes = [f"BLOCK_H={h} BLOCK_N={n} warps={w} stages={s}" for h, n, w, s in data["sm12x"]]
    return [b for b in data["builds"] if b["name"].endswith(tuple(suffixes))]


def test_configs_fit_sm120_shared_memory(sm120_builds):
    """Every launch configuration compiled for sm_120 fits 99 KiB of shared memory."""
    assert sm120_builds["limit"] == 99 * 1024
    for build in sm120_builds["builds"]:
        assert 0 < build["shared"] <= sm120_builds["limit"], f"{build['name']}: {build['shared']} bytes"


def test_sm12x_configs_spill_nothing(sm120_builds):
    """Every configuration the wrappers can launch on SM12x, in every kernel variant,
    spills 0 bytes by ptxas's own report for sm_120a."""
    launched = _launched_on_sm12x(sm120_builds)
    assert len(launched) == 5 * len(sm120_builds["sm12x"]) > 0  # five variants each
    for build in launched:
        name, spills = build["name"], build["spills"]
        assert build["registers"] and len(spills) == 2, f"{name}: no ptxas report"
        assert max(spills) == 0, f"{name}: spills {max(spills)} bytes"


def test_main_loop_uses_tensor_cores(sm120_builds):
    """Every attention configuration compiled for sm_120a issues mma.sync for its dots
    (the merge kernel has none)."""
    for build in sm120_builds["builds"]:
        if not build["name"].startswith("merge"):
            assert MMA_SM120 in build["mma"], f"{build['name']}: {build['mma']}"


@pytest.mark.parametrize("capability, more_heads", [((12, 0), (16, 16, 4, 1)), ((12, 1), (16, 16, 4, 1)),
                                                     ((9, 0), (64, 32, 8, 1)), ((10, 0), (64, 32, 8, 1))])
def test_sm12x_gets_spill_free_configs(mla, monkeypatch, capability, more_heads):
    """On SM12x every choice is the configuration that ptxas builds for sm_120a
    without spills; elsewhere the H200 sweep's pick by heads, and at batch 1 (few
    programs) the 16-head configuration."""
    monkeypatch.delenv("VLLM_TRITON_MLA_SPARSE_KERNEL_CONFIG", raising=False)
    monkeypatch.setattr(mla.torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(mla.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(mla, "_sm12x_cache", {})
    monkeypatch.setattr(mla, "_sm_count_cache", {0: 132})
    gpu = torch.device("cuda", 0)
    small = (16, 16, 4, 1) if capability[0] == 12 else (16, 32, 4, 1)
    assert mla._pick_config("decode", 64, gpu, num_tokens=64) == more_heads
    assert mla._pick_config("decode", 128, gpu, num_tokens=1) == small
    assert mla._pick_config("decode", 16, gpu, num_tokens=256) == small
    sm12x = {cfg for (_, _, on_sm12x), cfg in mla._CONFIGS.items() if on_sm12x}
    assert sm12x == {(16, 16, 4, 1)}
    assert mla._pick_config("prefill", 128, torch.device("cpu"))[2] == 8  # host tensors: not SM12x


@pytest.mark.parametrize("tokens, head_blocks, keys, warps, splits", [
    (1, 4, 640, 4, 10), (1, 1, 2176, 4, 16), (64, 1, 2176, 4, 4), (64, 1, 2176, 8, 2),
    (64, 2, 640, 8, 1), (256, 1, 2176, 4, 1), (3, 1, 200, 4, 4)])
def test_split_policy(mla, monkeypatch, tokens, head_blocks, keys, warps, splits):
    """The split count the H200 sweep found best: SMs filled once (eight warps) or
    twice (four warps), rounding down; two key blocks of 32 per split at least; 16 at most."""
    monkeypatch.delenv("VLLM_TRITON_MLA_SPARSE_MAX_SPLITS", raising=False)
    assert mla.choose_num_splits(tokens, head_blocks, keys, 32, 132, warps) == splits
