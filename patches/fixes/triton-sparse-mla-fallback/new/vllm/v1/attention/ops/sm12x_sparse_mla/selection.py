# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""When DeepSeek V4 attention uses the Triton sparse MLA fallback."""

import vllm.envs as envs
from vllm.platforms import current_platform


def use_triton_sparse_mla() -> bool:
    """True on SM12x unless VLLM_TRITON_MLA_SPARSE=0; always with =1 (CUDA).

    Decided on the device capability, not on whether FlashMLA imports: an
    image can ship FlashMLA built for sm90/sm100 that imports on SM12x but
    has no kernel for it.
    """
    if not current_platform.is_cuda():
        return False
    forced = envs.VLLM_TRITON_MLA_SPARSE
    if forced is not None:
        return forced
    return current_platform.is_device_capability_family(120)
