"""Compiled blocks that never run cuDNN attention (QwenImage21Family.prepare_compile).

On the GPU (torch 2.11, H100/H200) the regionally compiled Qwen-Image 2.1 backward faulted with "an illegal
memory access" after another model had run in the process. With every launch synchronous
(CUDA_LAUNCH_BLOCKING=1) the failing call is Inductor's
`aten._scaled_dot_product_cudnn_attention_backward` of the masked joint attention at symbolic sequence lengths
("Expected mha_graph.execute(...).is_good()"), not a generated Triton kernel (benchmarks/RESULTS.md, issue 22
run Y). The eager path and the compiled qwen_image blocks never failed.

Here each block's forward runs under `torch.nn.attention.sdpa_kernel` with the backends enabled at wrap time
minus cuDNN: with a key mask that is the memory-efficient kernel, without one flash. Dynamo traces the context
(its SDPAKernelVariable), so the choice is part of every graph the block compiles, recompiles included, and
the backward is the chosen forward's own. Backends disabled at wrap time stay disabled: under
parallel.deterministic (set before apply_parallelism) that leaves the math backend alone.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

_ENABLED = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
            SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
            SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled}


def backends_without_cudnn() -> list[SDPBackend]:
    """The SDPA backends enabled now, cuDNN excluded; the math backend if nothing else is left."""
    return [backend for backend, enabled in _ENABLED.items() if enabled()] or [SDPBackend.MATH]


def exclude_cudnn_attention(blocks: list[torch.nn.Module], grad_only: bool = False) -> list[SDPBackend]:
    """Run each block's forward under sdpa_kernel(backends_without_cudnn()); once per block. Returns the
    backends used. grad_only: only the forwards that run with grad enabled (whose backward may follow); a forward
    under no grad (a merged off-window rollout step, evaluation) keeps the process's backends, cuDNN's included:
    only cuDNN's backward faulted (flux, RESULTS.md runs AS-AU). Dynamo guards on the grad mode, so a compiled
    block holds one graph of each."""
    backends = backends_without_cudnn()
    for block in blocks:
        if getattr(block, "_imagerl_sdpa_backends", None) is not None:
            continue
        forward = block.forward

        @functools.wraps(forward)
        def forward_without_cudnn(*args, _forward=forward, **kwargs):
            if grad_only and not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            with sdpa_kernel(backends):
                return _forward(*args, **kwargs)

        block.forward = forward_without_cudnn
        block._imagerl_sdpa_backends = list(backends)
    return backends
