"""scripts/engine033/c_stable_shim.py: the torch stand-in for vLLM 0.33.0's compiled
_C_stable_libtorch that scripts/gpu-engine-033.sh puts into a source tree.

Its ops must have 0.33.0's own schemas (csrc/torch_bindings.cpp: vLLM's Python calls them by
those argument lists) and compute what 0.33.0's own native code computes (the functions are
read out of the pinned sdist with ast and run here on CPU, next to the stand-in's ops).
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "_sm12x_shim_test"


@pytest.fixture(scope="module")
def tree(default_context) -> Path:
    return default_context.source("0.33.0").root


@pytest.fixture(scope="module")
def shim():
    spec = importlib.util.spec_from_file_location("c_stable_shim", REPO / "scripts/engine033/c_stable_shim.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ops(shim):
    lib = shim.register(NAMESPACE, keys=("CPU",))
    yield getattr(torch.ops, NAMESPACE)
    lib._destroy()


def bindings(tree: Path) -> dict[str, str]:
    """name -> schema of every ``ops.def("...")`` in csrc/torch_bindings.cpp (literals joined)."""
    text = (tree / "csrc/torch_bindings.cpp").read_text()
    found = {}
    for call in re.finditer(r'ops\.def\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+)', text):
        schema = " ".join("".join(re.findall(r'"((?:[^"\\]|\\.)*)"', call.group(1))).split())
        found.setdefault(schema.split("(", 1)[0], schema)
    return found


def native(tree: Path, rel: str, name: str, cls: str | None = None, env: dict | None = None):
    """A function of the tree's own source, its decorators dropped, run in ``env``."""
    module = ast.parse((tree / rel).read_text())
    body = next(n.body for n in module.body if isinstance(n, ast.ClassDef) and n.name == cls) if cls else module.body
    fn = next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)
    fn.decorator_list = []
    scope = {"torch": torch, "F": F, "Tensor": torch.Tensor, **(env or {})}
    exec(compile(ast.Module([fn], []), rel, "exec"), scope)
    return scope[name]


def test_the_schemas_are_0_33_0s(shim, tree):
    theirs = bindings(tree)
    for name, schema in shim.SCHEMAS.items():
        assert " ".join(schema.split()) == theirs[name], name


def test_silu_and_mul_is_siluandmul_forward_native(ops, tree):
    x = torch.randn(5, 2 * 48, dtype=torch.bfloat16)
    out = torch.empty(5, 48, dtype=torch.bfloat16)
    ops.silu_and_mul(out, x)
    ref = native(tree, "vllm/model_executor/layers/activation.py", "forward_native", cls="SiluAndMul")(x)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_is_the_ir_ops_native_impl(ops, tree, with_weight):
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    weight = torch.randn(64, dtype=torch.bfloat16) if with_weight else None
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-5)
    assert torch.equal(out, native(tree, "vllm/ir/ops/layernorm.py", "rms_norm")(x, weight, 1e-5))


def test_fused_add_rms_norm_is_the_ir_ops_native_impl_in_place(ops, tree):
    x, residual = torch.randn(7, 64, dtype=torch.bfloat16), torch.randn(7, 64, dtype=torch.bfloat16)
    weight = torch.randn(64, dtype=torch.bfloat16)
    ref_out, ref_residual = native(tree, "vllm/ir/ops/layernorm.py", "fused_add_rms_norm")(x, residual, weight, 1e-5)
    ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(x, ref_out) and torch.equal(residual, ref_residual)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_embedding_is_forward_static_in_place(ops, tree, is_neox, rotary_dim):
    rel = "vllm/model_executor/layers/rotary_embedding/"
    apply = staticmethod(native(tree, rel + "common.py", "forward_static", cls="ApplyRotaryEmb"))
    forward_static = native(tree, rel + "base.py", "forward_static", cls="RotaryEmbedding",
                            env={"ApplyRotaryEmb": type("ApplyRotaryEmb", (), {"forward_static": apply})})
    head, tokens = 64, 9
    positions = torch.randint(0, 100, (tokens,))
    cache = torch.randn(128, rotary_dim, dtype=torch.bfloat16)
    query, key = torch.randn(tokens, 4 * head, dtype=torch.bfloat16), torch.randn(tokens, 2 * head, dtype=torch.bfloat16)
    ref_q, ref_k = forward_static(positions, query, key, head, rotary_dim, cache, is_neox)
    ops.rotary_embedding(positions, query, key, head, cache, is_neox)
    assert torch.equal(query, ref_q) and torch.equal(key, ref_k)


def test_rotary_embedding_without_a_key(ops):
    query = torch.randn(3, 128, dtype=torch.float32)
    before = query.clone()
    ops.rotary_embedding(torch.zeros(3, dtype=torch.long), query, None, 64, torch.cat([torch.ones(8, 32), torch.zeros(8, 32)], -1), True)
    assert torch.equal(query, before)  # position 0: cos 1, sin 0


def test_the_host_view_refuses_memory_that_is_not_pinned(shim):
    with pytest.raises(RuntimeError, match="must be pinned"):
        shim.get_cuda_view_from_cpu_tensor(torch.zeros(4))


def test_the_cutlass_capability_checks_answer_no(ops, shim):
    # 0.33.0 asks one of them at import (quantization/utils/w8a8_utils.py:41); the stand-in
    # has no CUTLASS kernels, so every answer is False and vLLM keeps to its other paths.
    assert shim.CAPABILITY_CHECKS and all(getattr(ops, name)(90) is False for name in shim.CAPABILITY_CHECKS)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(24, dtype=torch.bfloat16).view(4, 6),
    lambda: torch.arange(60, dtype=torch.float32).view(5, 12)[1:, 2:9:3],  # an offset, a stride
    lambda: torch.arange(30, dtype=torch.int64).view(5, 6).t(),
])
def test_a_weak_reference_sees_the_memory_and_keeps_nothing_alive(ops, make):
    import gc
    import weakref

    tensor = make()
    view = ops.weak_ref_tensor(tensor)
    assert (view.shape, view.stride(), view.dtype, view.data_ptr()) == (
        tensor.shape, tensor.stride(), tensor.dtype, tensor.data_ptr())
    assert torch.equal(view, tensor)
    tensor.add_(1)  # a write through the original is seen through the reference
    assert torch.equal(view, tensor)
    alive = weakref.ref(tensor)
    base = tensor._base
    del tensor
    gc.collect()
    assert alive() is None  # the reference held nothing of the tensor itself
    assert base is None or sys.getrefcount(base) == 2  # nor of the tensor it views


def test_a_weak_reference_to_nothing_is_the_tensor_itself(ops):
    empty = torch.empty(0, 3)
    assert ops.weak_ref_tensor(empty) is empty or ops.weak_ref_tensor(empty).numel() == 0
