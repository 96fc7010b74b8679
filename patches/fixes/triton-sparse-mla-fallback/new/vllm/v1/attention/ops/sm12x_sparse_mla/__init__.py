# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Triton fallbacks for DeepSeek V4 sparse MLA on GPUs without FlashMLA (SM12x).

The modules here import only torch and triton; the layer imports them lazily
when the fallback is selected (see ``vllm.v1.attention.ops.sm12x_sparse_mla.
selection``).
"""
