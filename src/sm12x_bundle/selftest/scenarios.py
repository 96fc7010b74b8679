"""The allocator scenarios by name, and the probe every target runs first.

Each scenario takes (torch, the tree's cumem module, the planned sizes) and returns
``measure.outcome(kind, reason, **figures)``; it runs in the child (child.py) against a
tree's own cumem.py on a real GPU. plan.py numbers and describes them.
"""

from __future__ import annotations

import sys

from .engines import first_sleep, rotation
from .ranks import ranks
from .frees import inflight_free, stale_error
from .measure import driver_version, outcome, pin_memory
from .sleeping import failing_sleep, moe_churn
from .speed import speed
from .stress import fault_stress, stress
from .waking import double_wake, foreign_process, partial_wake

def probe(torch, loaded) -> dict:
    import vllm.platforms

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    free, total = torch.cuda.mem_get_info()
    return outcome(
        "pass",
        "cumem is available",
        gpu=props.name,
        capability=f"{props.major}.{props.minor}",
        driver=driver_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=sys.version.split()[0],
        free_bytes=free,
        total_bytes=total,
        cumem_py=loaded.cumem.__file__,
        extension=loaded.extension,
        vllm_file=loaded.vllm_file,
        placeholders=loaded.placeholders,
        # A source tree has no installed metadata, so vLLM's CUDA platform plugin
        # (which reads the installed version) does not activate; cumem.py asks the
        # platform only is_rocm() and is_pin_memory_available().
        platform=type(vllm.platforms.current_platform).__name__,
        pin_memory=pin_memory(loaded.cumem),
        vllm_version=getattr(sys.modules["vllm"], "__version__", None),
    )


RUNNERS = {
    "inflight-free": inflight_free,
    "stale-error": stale_error,
    "partial-wake": partial_wake,
    "stress": stress,
    "speed": speed,
    "double-wake": double_wake,
    "failing-sleep": failing_sleep,
    "moe-churn": moe_churn,
    "foreign-process": foreign_process,
    "fault-stress": fault_stress,
    "first-sleep": first_sleep,
    "rotation": rotation,
    "ranks": ranks,
}
