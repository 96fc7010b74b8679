"""Stand-in for vLLM 0.33.0's compiled ``vllm._C_stable_libtorch``, written in torch alone.

scripts/gpu-engine-033.sh copies this file into a 0.33.0 source tree's ``vllm/`` as
``_C_stable_libtorch.py`` when the real extension is absent (a source tree has none, and
the wheel's needs torch 2.14 to be installed). vllm/platforms/cuda.py imports that module
unguarded, and a dense Llama touches five of the ``torch.ops._C`` ops it registers even
with custom ops off: ``SiluAndMul.__init__`` reads ``torch.ops._C.silu_and_mul`` on CUDA
(model_executor/layers/activation.py:138), which raises unless the op exists. So the ops a
dense Llama's eager path can reach are defined here, with the schemas of 0.33.0's
csrc/torch_bindings.cpp, and implemented as vLLM's own native paths compute them:

  silu_and_mul          model_executor/layers/activation.py   SiluAndMul.forward_native
  rms_norm              ir/ops/layernorm.py                   rms_norm (the IR op's native impl)
  fused_add_rms_norm    ir/ops/layernorm.py                   fused_add_rms_norm
  rotary_embedding      model_executor/layers/rotary_embedding/base.py forward_static
  get_cuda_view_from_cpu_tensor  csrc/cuda_view.cu: a CUDA tensor over pinned host memory
                        (Model Runner V2's UVA buffers, v1/worker/gpu/buffer_utils.py:38)
  weak_ref_tensor       csrc/ops.h: a tensor over the same memory that does not keep it
                        alive (CUDA graph capture keeps each graph's output this way,
                        compilation/cuda_graph.py:333-337, utils/torch_utils.py:872)

and the four CUTLASS capability checks, which answer False (this stand-in has no CUTLASS
kernels): model_executor/layers/quantization/utils/w8a8_utils.py:41 calls
cutlass_scaled_mm_supports_block_fp8 at import, on the way from the model loader and
the Llama model to vLLM's quantization utilities.

Every other op of the real module is left undefined, so reaching one fails loudly by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SCHEMAS = {
    "silu_and_mul": "silu_and_mul(Tensor! result, Tensor input) -> ()",
    "rms_norm": "rms_norm(Tensor! result, Tensor input, Tensor? weight, float epsilon) -> ()",
    "fused_add_rms_norm": "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor? weight, float epsilon) -> ()",
    "rotary_embedding": (
        "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox, int rope_dim_offset=0, bool inverse=False) -> ()"
    ),
    "get_cuda_view_from_cpu_tensor": "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor",
    "weak_ref_tensor": "weak_ref_tensor(Tensor input) -> Tensor",
}
CAPABILITY_CHECKS = ("cutlass_scaled_mm_supports_fp8", "cutlass_group_gemm_supported",
                     "cutlass_scaled_mm_supports_block_fp8", "cutlass_scaled_mm_supports_fp4")
SCHEMAS.update({name: f"{name}(int cuda_device_capability) -> bool" for name in CAPABILITY_CHECKS})


def no_cutlass(cuda_device_capability: int) -> bool:
    return False


def silu_and_mul(result: torch.Tensor, x: torch.Tensor) -> None:
    d = x.shape[-1] // 2
    result.copy_(F.silu(x[..., :d]) * x[..., d:])


def _rms(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, orig_dtype: torch.dtype) -> torch.Tensor:
    # x is float32 here, as in ir/ops/layernorm.py
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype)


def rms_norm(result: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, epsilon: float) -> None:
    result.copy_(_rms(x.to(torch.float32), weight, epsilon, x.dtype))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float) -> None:
    # In place, as the kernel: residual <- x + residual; x <- rms_norm(x + residual)
    added = x.to(torch.float32) + residual.to(torch.float32)
    residual.copy_(added.to(x.dtype))
    x.copy_(_rms(added, weight, epsilon, x.dtype))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    cos, sin = cos.unsqueeze(-2).to(x.dtype), sin.unsqueeze(-2).to(x.dtype)
    x1, x2 = torch.chunk(x, 2, dim=-1) if is_neox else (x[..., ::2], x[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return torch.cat((o1, o2), dim=-1) if is_neox else torch.stack((o1, o2), dim=-1).flatten(-2)


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox, rope_dim_offset=0, inverse=False):
    positions = positions.flatten()
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    if inverse:
        sin = -sin
    rot = cos_sin_cache.shape[-1]
    for t in (query, key):
        if t is None:
            continue
        heads = t.view(positions.shape[0], -1, head_size)
        part = heads[..., rope_dim_offset:rope_dim_offset + rot]
        part.copy_(_rotate(part, cos, sin, is_neox))


def get_cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor over the pinned host memory of ``cpu_tensor``: with unified virtual
    addressing the device address of cudaHostAlloc'd memory is its host address (what
    cudaHostGetDevicePointer returns in csrc/cuda_view.cu). Built through
    __cuda_array_interface__ as bytes, then viewed as the dtype; the view keeps the host
    tensor alive."""
    if not cpu_tensor.is_pinned():
        raise RuntimeError("get_cuda_view_from_cpu_tensor: the CPU tensor must be pinned")
    if not cpu_tensor.is_contiguous():
        raise RuntimeError("get_cuda_view_from_cpu_tensor (torch stand-in): the CPU tensor must be contiguous")
    nbytes = cpu_tensor.numel() * cpu_tensor.element_size()
    holder = _HostView(cpu_tensor, nbytes)
    raw = torch.as_tensor(holder, device=torch.device("cuda", torch.cuda.current_device()))
    return raw.view(cpu_tensor.dtype).view(cpu_tensor.shape)




def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of the same shape, strides and dtype over ``tensor``'s memory that holds no
    reference to it: its storage is built from the bare address (CUDA: through
    __cuda_array_interface__ without a stream, so nothing is synchronised or enqueued; CPU,
    for the tests: a ctypes buffer), as bytes, then viewed as the dtype and strided. As with
    the compiled op, reading it after ``tensor``'s memory is freed reads whatever is there."""
    if tensor.numel() == 0:
        return tensor
    if any(stride < 0 for stride in tensor.stride()):
        raise RuntimeError("weak_ref_tensor (torch stand-in): negative strides")
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    nbytes = span * tensor.element_size()
    if tensor.is_cuda:
        raw = torch.as_tensor(_Address(tensor.data_ptr(), nbytes), device=tensor.device)
    else:
        import ctypes

        raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(tensor.data_ptr()), dtype=torch.uint8)
    return raw.view(tensor.dtype).as_strided(tensor.shape, tensor.stride())


class _Address:
    """__cuda_array_interface__ of ``nbytes`` bytes at ``ptr``, owning nothing."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


class _HostView(_Address):
    """The same over a host tensor's memory, which it keeps alive as long as the CUDA view."""

    def __init__(self, tensor: torch.Tensor, nbytes: int) -> None:
        super().__init__(tensor.data_ptr() if nbytes else 0, nbytes)
        self.tensor = tensor


IMPLS = {
    "silu_and_mul": silu_and_mul,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "weak_ref_tensor": weak_ref_tensor,
}


def register(namespace: str = "_C", keys: tuple[str, ...] = ("CUDA",)) -> torch.library.Library:
    """Define the ops in ``namespace`` and implement them for ``keys`` (the host view on CPU,
    where its input lives, as csrc/torch_bindings.cpp registers it)."""
    lib = torch.library.Library(namespace, "FRAGMENT")
    for name, schema in SCHEMAS.items():
        lib.define(schema)
    for name, fn in IMPLS.items():
        for key in keys:
            lib.impl(name, fn, key)
    lib.impl("get_cuda_view_from_cpu_tensor", get_cuda_view_from_cpu_tensor, "CPU")
    for name in CAPABILITY_CHECKS:  # no tensor to dispatch on: every backend, as the real module
        lib.impl(name, no_cutlass, "CompositeExplicitAutograd")
    return lib


if __name__ == "vllm._C_stable_libtorch":
    # Kept referenced for the life of the process: the ops go when the Library object does.
    _LIBRARY = register()
