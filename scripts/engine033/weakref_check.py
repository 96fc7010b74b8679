"""The torch stand-in's ``weak_ref_tensor`` where CUDA graph capture uses it, on the GPU.

    python3 scripts/engine033/weakref_check.py OUT.json

Run with a prepared 0.33.0 install first on PYTHONPATH (scripts/gpu-engine-033.sh, graphs
mode). vLLM's CUDAGraphWrapper calls ``weak_ref_tensors`` on a graph's output inside
``torch.cuda.graph(...)`` and again after it (compilation/cuda_graph.py:314-337), so the
stand-in must work during a capture and its result must follow the graph's replays. This
captures a small graph the same way (a private pool, the output referenced weakly inside
the capture), replays it on new inputs, and writes what held to OUT.json; exit 0 when all
of it held.
"""

from __future__ import annotations

import json
import sys
import traceback
import weakref


def check() -> dict:
    import torch

    import vllm._C_stable_libtorch  # noqa: F401  (registers torch.ops._C, the stand-in or the real module)
    from vllm.utils.torch_utils import weak_ref_tensor

    facts = {"module": vllm._C_stable_libtorch.__file__}
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # warm-up before the capture, as torch.cuda.graph wants
        torch.relu(x * 2 + 1)
    torch.cuda.synchronize()
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool=pool):
        out = torch.relu(x * 2 + 1)
        inside = weak_ref_tensor(out)
    after = weak_ref_tensor(out)
    probe = weakref.ref(out)
    del out
    facts["output_released"] = probe() is None
    for step in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        expected = torch.relu(x * 2 + 1)
        facts[f"replay_{step}_inside_equal"] = bool(torch.equal(inside, expected))
        facts[f"replay_{step}_after_equal"] = bool(torch.equal(after, expected))
    facts["ok"] = all(v for k, v in facts.items() if k != "module")
    return facts


def main(argv: list[str]) -> int:
    try:
        facts = check()
    except BaseException as exc:  # noqa: BLE001  (the record says what failed)
        facts = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    with open(argv[0], "w") as f:
        json.dump(facts, f, indent=2)
        f.write("\n")
    print(json.dumps(facts))
    return 0 if facts["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
