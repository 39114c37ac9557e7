"""Compiled blocks that never run cuDNN attention (QwenImage21Family.prepare_compile).

On the GPU (torch 2.11, H100/H200) the regionally compiled Qwen-Image 2.1 backward faulted with "an illegal
memory access" after another model had run in the process. With every launch synchronous
(CUDA_LAUNCH_BLOCKING=1) the failing call is Inductor's
`aten._scaled_dot_product_cudnn_attention_backward` of the masked joint attention at symbolic sequence lengths
("Expected mha_graph.execute(...).is_good()"), not a generated Triton kernel (benchmarks/LOG.md, issue 22
run Y). The eager path and the compiled qwen_image blocks never failed.

Here each block's forward runs under `torch.nn.attention.sdpa_kernel` with the backends enabled at wrap time
minus cuDNN: with a key mask that is the memory-efficient kernel, without one flash. Dynamo traces the context
(its SDPAKernelVariable), so the choice is part of every graph the block compiles, recompiles included, and
the backward is the chosen forward's own. Backends disabled at wrap time stay disabled: under
parallel.deterministic (set before apply_parallelism) that leaves the math backend alone.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

_ENABLED = {SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
            SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
            SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled}


def backends_without_cudnn() -> list[SDPBackend]:
    """The SDPA backends enabled now, cuDNN excluded; the math backend if nothing else is left."""
    return [backend for backend, enabled in _ENABLED.items() if enabled()] or [SDPBackend.MATH]


_UNREPLAYED = False  # True inside unreplayed_forwards()


@contextlib.contextmanager
def unreplayed_forwards():
    """Within: forwards whose outputs are never replayed (the rollout's off-window steps on merged weights,
    MergedLora.applied); blocks wrapped with except_unreplayed=True keep the process's SDPA backends there, cuDNN's
    included. A compiled block reads the flag as a global, which Dynamo guards: one graph of each."""
    global _UNREPLAYED
    saved, _UNREPLAYED = _UNREPLAYED, True
    try:
        yield
    finally:
        _UNREPLAYED = saved


# one code object of the wrapper per block class (see _wrapper_for)
_WRAPPER_CODE: dict[type, types.CodeType] = {}


def _wrapper_for(block_class: type, wrapper):
    """`wrapper` with a code object of its own for `block_class`. A compiled block's first traced frame is its
    forward, here the wrapper, and Dynamo keeps its graphs and counts recompiles per code object: one wrapper
    code for every block class held all classes' graphs in one cache, each guarded on the class of the block it
    wrapped. FLUX.1's two block classes took 7 of that cache's entries in a compiled warm-up (benchmarks/LOG.md run
    BC), each further class adding its own; with a code per class each class keeps its own graphs, as its own
    forward did unwrapped."""
    if block_class not in _WRAPPER_CODE:
        # (a new code object; its name shows in TORCH_LOGS=recompiles)
        _WRAPPER_CODE[block_class] = wrapper.__code__.replace(co_name=f"{wrapper.__name__}_{block_class.__name__}")
    own = types.FunctionType(_WRAPPER_CODE[block_class], wrapper.__globals__, wrapper.__name__,
                             wrapper.__defaults__, wrapper.__closure__)
    own.__kwdefaults__ = wrapper.__kwdefaults__
    return own


def exclude_cudnn_attention(blocks: list[torch.nn.Module], except_unreplayed: bool = False) -> list[SDPBackend]:
    """Run each block's forward under sdpa_kernel(backends_without_cudnn()); once per block. Returns the
    backends used. except_unreplayed: not within unreplayed_forwards() (flux: only cuDNN's backward faulted, and
    its forward ran at 1.9x flash's rate at FLUX.1-dev's shapes, LOG.md run AY). Only there: a forward that a
    replay repeats (a rollout's window step, eager under no grad, and the update's forward under grad) must pick
    the same kernel both times, or the log-probs differ (run AY: 2.7e-6 when no-grad forwards used cuDNN).
    The wrapper's code is one per block class (_wrapper_for): compiled, each class's graphs and recompiles are its
    own, as without the wrapper."""
    backends = backends_without_cudnn()
    for block in blocks:
        if getattr(block, "_imagerl_sdpa_backends", None) is not None:
            continue
        forward = block.forward

        def forward_without_cudnn(*args, _forward=forward, **kwargs):
            if except_unreplayed and _UNREPLAYED:
                return _forward(*args, **kwargs)
            with sdpa_kernel(backends):
                return _forward(*args, **kwargs)

        block.forward = functools.wraps(forward)(_wrapper_for(type(block), forward_without_cudnn))
        block._imagerl_sdpa_backends = list(backends)
    return backends
