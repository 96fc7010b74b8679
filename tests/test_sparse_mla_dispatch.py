"""When the 0.33.0 lane's DeepSeek V4 layer takes the Triton fallback.

``dispatch.py`` (patches/fixes/triton-sparse-mla-fallback/new/...) is loaded by
path; it needs neither torch nor vLLM. FlashInfer's own dispatch information is
read from the real flashinfer-python 0.7.2.post1 wheel (the release vLLM 0.33.0
pins). Importing it is impossible here (its ``flashinfer.mla`` needs
``tvm_ffi`` and a CUDA build), so the test parses, with ``ast``, the static
table its ``supported_sparse_mla_sm120_configs()`` is built from
(``_sparse_mla_sm120/_policy.py``) and builds the dsv4 entry the way
``_api.py`` does; the prefill facts the module keeps are checked against the
C++ sources in the same wheel. The wheel is a test input (tests/data/test-inputs.json,
pinned by sha256): scripts/test fetches it into the tool's cache, and the fixture fetches it
there itself when a plain ``pytest`` run finds it missing.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import types
import zipfile
from pathlib import Path

import pytest
import testinputs
from lanekit import lane_tree  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
DISPATCH_FILE = REPO / (
    "patches/fixes/triton-sparse-mla-fallback/new/vllm/v1/attention/ops/sm12x_sparse_mla/dispatch.py"
)
WHEEL_NAME = "flashinfer_python-0.7.2.post1-py3-none-any.whl"
POLICY = "flashinfer/mla/_sparse_mla_sm120/_policy.py"
PLAN_HEADER = "flashinfer/data/include/flashinfer/attention/sparse_mla_sm120/execution/attention_plan.h"
RESOLVE = "flashinfer/data/csrc/sparse_mla_sm120/attention_resolve.cu"


@pytest.fixture(scope="module")
def dispatch():
    spec = importlib.util.spec_from_file_location("sm12x_sparse_mla_dispatch", DISPATCH_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    path = testinputs.needed("flashinfer-python")
    assert path.name == WHEEL_NAME
    return zipfile.ZipFile(path)


def _literal(node, names):
    """Evaluate a constant expression of the policy file, names resolved."""
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "frozenset":
        return frozenset(_literal(node.args[0], names)) if node.args else frozenset()
    return ast.literal_eval(node)


def _dsv4_config_from_policy(source: str):
    """FlashInfer's dsv4 ``SparseMLASm120DecodeConfig``, from its static table."""
    tree = ast.parse(source)
    names, defaults, envelope = {}, {}, None
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            wanted = name.startswith("_MODEL_TYPE_") or name in ("_DECODE_MAX_TOKENS", "_DECODE_MAX_HEADS")
            if wanted and isinstance(node.value, ast.Constant):
                names[name] = node.value.value
        if isinstance(node, ast.ClassDef) and node.name == "_StaticFamilyEnvelope":
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and item.value is not None:
                    defaults[item.target.id] = item.value
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "_STATIC_DECODE_ENVELOPE":
            for key, value in zip(node.value.keys, node.value.values):
                if key.id == "_MODEL_TYPE_DSV4":
                    envelope = value
    fields = {k: _literal(v, names) for k, v in defaults.items()}
    fields.update({kw.arg: _literal(kw.value, names) for kw in envelope.keywords})
    # As supported_sparse_mla_sm120_configs() builds the "dsv4" entry (_api.py).
    return types.SimpleNamespace(
        page_block_size=fields["page_block_size"],
        page_block_sizes=fields["page_block_sizes"],
        page_block_size_is_runtime=fields["page_block_size_is_runtime"],
        max_num_tokens=names["_DECODE_MAX_TOKENS"],
        topks=frozenset({128, 192, 256, 512, 1024}),
        topk_is_runtime=True,
        min_topk=fields["min_topk"],
        max_num_heads=fields["max_num_heads"],
        head_counts=None,
        bytes_per_token=fields["bytes_per_token"],
    )


@pytest.fixture(scope="module")
def flashinfer(wheel, dispatch):
    config = _dsv4_config_from_policy(wheel.read(POLICY).decode())
    return dispatch.entries_from_config(config, dispatch.PINNED_FLASHINFER)


def test_prefill_facts_match_the_flashinfer_sources(wheel, dispatch):
    """The prefill envelope the module keeps is the one in 0.7.2.post1's C++."""
    header = wheel.read(PLAN_HEADER).decode()
    body = header[header.index("PrefillLaunchResult visit_prefill_heads") :]
    body = body[: body.index("#undef HEAD")]
    heads = set()
    for block in re.findall(r"if constexpr \(([^{]*)\)\s*\{([^}]*)\}", body):
        condition, heads_in = block
        if "mg && " in condition and "ModelType::DSV4)" in condition.replace(" ", ""):
            heads.update(int(h) for h in re.findall(r"HEAD\((\d+)\)", heads_in))
    facts = dispatch._PREFILL_FACTS[dispatch.PINNED_FLASHINFER]
    assert heads == facts["heads"]
    assert f"m.topk % {facts['topk_multiple']} == 0" in wheel.read(RESOLVE).decode()


def test_flashinfer_table_as_read(flashinfer):
    assert flashinfer.bytes_per_token == 584
    assert (flashinfer.max_heads, flashinfer.head_counts, flashinfer.min_topk) == (128, None, 1)
    assert flashinfer.topks is None and flashinfer.page_sizes is None
    assert flashinfer.max_decode_tokens == 64


def _shape(dispatch, heads=64, topks=(128, 512), pages=(64, 64), tokens=1, bpt=584):
    return dispatch.LayerShape(heads, tuple(topks), tuple(pages), tokens, bpt)


# The operators' DeepSeek V4 shapes, read against flashinfer 0.7.2.post1's own information.
ISSUE_SHAPES = {
    "vllm#56837 heads 64 top-k 1152": dict(heads=64, topks=(128, 1152)),
    "flashinfer#5323 page_block_size 32": dict(pages=(64, 32)),
    "vllm#50720/#52499 DSpark 4 tokens per request": dict(topks=(192, 512), tokens=4),
    "flashinfer#4850 H 32 top-k 512 dual-cache prefill": dict(heads=32, topks=(128, 512)),
}


@pytest.mark.parametrize("issue", sorted(ISSUE_SHAPES))
def test_issue_shapes_have_entries_in_0_7_2_post1(dispatch, flashinfer, issue):
    """0.7.2.post1 declares entries for these shapes: no fallback for them."""
    shape = _shape(dispatch, **ISSUE_SHAPES[issue])
    assert dispatch.flashinfer_gaps(shape, flashinfer) == []
    assert dispatch.decide(shape, None, flashinfer).use_triton is False


GAPS = {
    # Vision prefill widens the SWA rows by the image tokens: 128 + 1000.
    "vision SWA width 1128": (dict(heads=32, topks=(128, 1128, 512)), "top-k 1128 (not a multiple of 64)"),
    "DSpark width 200": (dict(topks=(200, 512), tokens=4), "top-k 200"),
    "72 heads": (dict(heads=72), "no prefill kernel for 72 heads"),
    "256 heads": (dict(heads=256), "no decode kernel for 256 heads"),
    "65 tokens per request": (dict(tokens=65), "65 tokens per request"),
}


@pytest.mark.parametrize("case", sorted(GAPS))
def test_fallback_engages_at_each_gap(dispatch, flashinfer, case):
    fields, reason = GAPS[case]
    decision = dispatch.decide(_shape(dispatch, **fields), None, flashinfer)
    assert decision.use_triton is True
    assert reason in decision.reason and "0.7.2.post1" in decision.reason


COVERED = [
    dict(heads=16, topks=(128, 512)),
    dict(heads=64, topks=(128, 2048), pages=(64, 2)),
    dict(heads=128, topks=(128, 1024), tokens=2),
    dict(heads=8, topks=(128,), pages=(64,)),
]


@pytest.mark.parametrize("fields", COVERED, ids=str)
def test_covered_shapes_stay_on_flashinfer(dispatch, flashinfer, fields):
    assert dispatch.decide(_shape(dispatch, **fields), None, flashinfer).use_triton is False


def test_forced_on_and_off(dispatch, flashinfer):
    covered, gap = _shape(dispatch), _shape(dispatch, heads=72)
    assert dispatch.decide(covered, True, flashinfer).use_triton is True
    assert dispatch.decide(gap, False, flashinfer).use_triton is False
    assert dispatch.decide(gap, False, None, "x").use_triton is False


def test_no_table_is_decided_safe_and_said(dispatch):
    decision = dispatch.decide(_shape(dispatch), None, None, "FlashInfer 0.8.0 is installed")
    assert decision.use_triton is True
    assert decision.reason.startswith("FlashInfer 0.8.0 is installed")


def test_other_flashinfer_release_has_no_prefill_facts(dispatch, wheel):
    config = _dsv4_config_from_policy(wheel.read(POLICY).decode())
    assert dispatch.entries_from_config(config, "0.7.3") is None


def test_installed_flashinfer_missing_is_a_sentence(dispatch, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    entries, why = dispatch.read_installed_flashinfer()
    assert entries is None and "cannot be imported" in why


@pytest.mark.parametrize("forced", [True, None])
def test_cache_layout_the_kernel_cannot_read_is_refused(dispatch, flashinfer, forced):
    """DeepSeek V4.1's 528-byte rows: refused with a sentence at init."""
    shape = _shape(dispatch, heads=72, bpt=528)
    with pytest.raises(dispatch.UnreadableCacheLayout, match="reads only the 584-byte fp8_ds_mla cache"):
        dispatch.decide(shape, forced, flashinfer)
    # Left alone when FlashInfer keeps the layer (=0).
    assert dispatch.decide(shape, False, flashinfer).use_triton is False


# ------------------------------------------------ the patched 0.33.0 layer's own code

LAYER_FILE = "vllm/models/deepseek_v4/nvidia/flashinfer_sparse.py"


class _Log:
    def __init__(self):
        self.lines = []

    def info_once(self, msg):
        self.lines.append(msg)


@pytest.fixture(scope="module")
def layer_decision(lane_tree, dispatch, flashinfer):
    """The patched layer's ``_use_triton_sparse_mla``, parsed out of the lane's
    patched file and run with this module's dispatch, the FlashInfer table read
    from the wheel and a ``vllm.envs`` holding only the knob."""
    source = (lane_tree("0.33.0", "patched") / LAYER_FILE).read_text()
    wanted = ("_sm120_layer_shape", "_use_triton_sparse_mla")
    defs = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert [d.name for d in defs] == list(wanted)
    log, env = _Log(), types.SimpleNamespace(VLLM_TRITON_MLA_SPARSE=None)
    installed = types.SimpleNamespace(**vars(dispatch))
    installed.read_installed_flashinfer = lambda: (flashinfer, f"FlashInfer {flashinfer.version}")
    stubs = {"vllm": types.SimpleNamespace(envs=env), "vllm.envs": env,
             "vllm.v1.attention.ops.sm12x_sparse_mla.dispatch": installed}
    for name in ("vllm.v1", "vllm.v1.attention", "vllm.v1.attention.ops", "vllm.v1.attention.ops.sm12x_sparse_mla"):
        stubs[name] = types.ModuleType(name)
    namespace = {"logger": log, "VllmConfig": object}
    exec(compile(ast.Module(body=defs, type_ignores=[]), LAYER_FILE, "exec"), namespace)

    def run(layer, config, required_topk, forced=None):
        env.VLLM_TRITON_MLA_SPARSE = forced
        saved = {k: sys.modules.get(k) for k in stubs}
        sys.modules.update(stubs)
        try:
            return namespace["_use_triton_sparse_mla"](layer, config, required_topk), log.lines[-1]
        finally:
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v

    return run


def _layer(heads=32, ratio=4, image_tokens=0, cache_dtype="fp8_ds_mla"):
    ns = types.SimpleNamespace
    torch_dtype = ns(itemsize=1)  # the plain-row fp8 cache: one byte an element
    return ns(padded_heads=heads, window_size=128, max_image_tokens=image_tokens, compress_ratio=ratio,
              swa_cache_layer=ns(block_size=64), kv_cache_dtype=cache_dtype, head_dim=512,
              kv_cache_torch_dtype=torch_dtype)


def _config(block_size=256, spec_tokens=None, index_topk=512):
    ns = types.SimpleNamespace
    spec = None if spec_tokens is None else ns(num_speculative_tokens=spec_tokens)
    return ns(model_config=ns(hf_config=ns(index_topk=index_topk)), cache_config=ns(block_size=block_size),
              speculative_config=spec)


def test_layer_reads_its_shapes(layer_decision):
    """The operators' DeepSeek V4 configurations through the patched layer: FlashInfer 0.7.2.post1 keeps them."""
    cases = [
        (_layer(heads=64), _config(index_topk=1152), 128),  # vllm#56837
        (_layer(), _config(block_size=128), 128),  # flashinfer#5323: compressed page 32
        (_layer(), _config(spec_tokens=3), 192),  # DSpark: width 128 + 3 aligned to 64
        (_layer(image_tokens=1024), _config(), 128),  # vision prefill width 1152
    ]
    for layer, config, required_topk in cases:
        use_triton, line = layer_decision(layer, config, required_topk)
        assert use_triton is False, line
        assert line.startswith("DeepSeek V4 sparse MLA on SM120: FlashInfer (FlashInfer 0.7.2.post1 has entries")
    _, line = layer_decision(_layer(), _config(block_size=128, spec_tokens=3), 192)
    assert "topks=(192, 128, 512), page_block_sizes=(64, 32), tokens_per_request=4" in line


def test_layer_takes_the_fallback_at_a_gap(layer_decision):
    use_triton, line = layer_decision(_layer(image_tokens=1000), _config(), 128)
    assert use_triton is True
    assert "Triton fallback (FlashInfer 0.7.2.post1: no prefill kernel for top-k 1128" in line


def test_layer_forced_and_refused(layer_decision, dispatch):
    assert layer_decision(_layer(), _config(), 128, forced=True)[0] is True
    assert layer_decision(_layer(image_tokens=1000), _config(), 128, forced=False)[0] is False
    with pytest.raises(dispatch.UnreadableCacheLayout, match="not this layer's 512-byte rows"):
        layer_decision(_layer(cache_dtype="fp8"), _config(), 128, forced=True)
