"""Check here, without a GPU, what scripts/gpu-engine-033.sh will ask of a prepared 0.33.0 install.

    PYTHONPATH=INSTALL python3 scripts/engine033/cpu_check.py [--native] [--graphs]

INSTALL: a folder laid out as prepare.py writes it (``vllm/`` with the stand-ins, and the
dist-info); the cumem extension may be missing here. The Python must have torch and the
packages the device gets (the payload's, at their versions, and transformers 5.17). Steps:
1. the CUDA platform is forced (an H100's capability, NVML off, cumem taken as available)
   and triton's NVIDIA driver reported active, so the import-time branches the GPU machine
   takes are taken here;
2. every module of the engine path is imported (vllm.entrypoints.llm, the engine core, both
   model runners, the worker, the Llama model, TRITON_ATTN, the dummy loader, the sampler);
3. the engine config is made from probe.py's keyword arguments (0.33.0's defaults, or
   --native, or --graphs: the cudagraph mode it resolves to is printed), and the Llama is built on the meta device under it (a gloo group of one);
   what each layer dispatches to is printed.
Exit 0 when every step passed. The GPU machine alone can say whether the engine runs.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULES = ("vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor",
           "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner",
           "vllm.v1.worker.gpu.model_runner", "vllm.model_executor.models.llama",
           "vllm.v1.attention.backends.triton_attn", "vllm.model_executor.model_loader.dummy_loader",
           "vllm.device_allocator.cumem", "vllm.kernels", "vllm.v1.sample.sampler",
           "vllm.model_executor.models.registry")


def force_cuda() -> None:
    import triton.backends

    triton.backends.backends["nvidia"].driver.is_active = staticmethod(lambda: True)
    import vllm.platforms as platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class H100Here(NonNvmlCudaPlatform):
        get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))
        get_device_name = classmethod(lambda cls, device_id=0: "NVIDIA H100 80GB HBM3")
        get_device_total_memory = classmethod(lambda cls, device_id=0: 80 << 30)
        is_cumem_allocator_available = classmethod(lambda cls: True)

    platforms._current_platform = H100Here()


def imports() -> int:
    failed = 0
    for name in MODULES:
        try:
            importlib.import_module(name)
            print("import ok  ", name)
        except Exception as exc:
            failed += 1
            print("import FAIL", name, f"{type(exc).__name__}: {exc}"[:400])
    return failed


def build(native: bool, graphs: bool) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    import probe
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.engine.arg_utils import EngineArgs

    model = Path("/tmp/sm12x-engine033-cpu-model")
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(__import__("json").dumps(probe.CONFIG))
    kwargs = {k: v for k, v in probe.engine_kwargs(model, native, graphs).items() if k != "seed"}
    cfg = EngineArgs(**kwargs).create_engine_config()
    cc = cfg.compilation_config
    print("config: mode", cc.mode, "cudagraph_mode", cc.cudagraph_mode, "custom_ops", cc.custom_ops,
          "runner v2", cfg.use_v2_model_runner, "attention", cfg.attention_config.backend)
    with set_current_vllm_config(cfg):
        init_distributed_environment(1, 0, "tcp://127.0.0.1:29533", 0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        from vllm.model_executor.models.llama import LlamaForCausalLM

        cfg.kernel_config.ir_op_priority.set_default()
        with torch.device("meta"):
            m = LlamaForCausalLM(vllm_config=cfg, prefix="")
    from vllm import ir

    layer = m.model.layers[0]
    print("built: SiluAndMul ->", layer.mlp.act_fn._forward_method.__name__, "| rotary ->",
          layer.self_attn.rotary_emb._forward_method.__name__, "| IR rms_norm ->", ir.ops.rms_norm.get_priority(),
          "| custom ops on", dict(cc.enabled_custom_ops), "off", dict(cc.disabled_custom_ops))


def main(argv: list[str]) -> int:
    force_cuda()
    if imports():
        return 1
    build("--native" in argv, "--graphs" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
