"""Qwen-Image's rotary embedding in real arithmetic for compiled blocks (parallel.compile).

diffusers applies RoPE as a complex product (transformer_qwenimage.apply_rotary_emb_qwen, use_real=False):
view_as_complex(x.float()) * freqs_cis, back to real, cast to x's dtype. Inductor has no code generation for
complex tensors ("Torchinductor does not support code generation for complex operators"), so in a compiled
block each of the 4 rotations (image/text query/key) runs as aten fallbacks around the fused kernels: x
materialised in float32, a complex-multiply kernel, a cast back; about 18 bytes moved per q/k element, i.e.
~3.8 GB per block for 32 rows x 1072 tokens x 2 x 3072 (bf16), about 1 ms of a ~17 ms block on an H200.

Here the compiled blocks receive the RoPE table as real (cos, sin) pairs (a view: torch.view_as_real of the
complex table, made outside the compiled region by a forward hook on the transformer's pos_embed) and rotate
with the products c10::complex's operator* computes, in float32:
    (a + ib)(c + id) = (a c - b d) + i (a d + b c)
so Inductor fuses them into the q/k RMSNorm kernel. Compiled code only: an eager forward (no compile) turns
the pairs back into the complex table (view_as_complex, also a view) and runs diffusers' own function, so
eager results stay diffusers' bit for bit. Compiled, the products may contract into FMAs differently from the
complex kernel (1 float32 ulp, before the cast to bf16), the same kind of rounding change as any Inductor
fusion; the rollout and the training replay run the same compiled graph, so the replay stays exact.
"""

from __future__ import annotations

import torch

_ORIGINAL = "_imagerl_original_apply_rotary_emb_qwen"
_HOOK = "_imagerl_real_rope_hook"


def rotate_pairs(x_BSHD: torch.Tensor, freqs_SD2: torch.Tensor) -> torch.Tensor:
    """x (B, S, H, D) rotated by a real (S, D/2, 2) table of (cos, sin): diffusers' complex RoPE in float32,
    returned in x's dtype."""
    table = freqs_SD2.unsqueeze(1)  # (S, 1, D/2, 2), broadcast over heads
    cos, sin = table[..., 0], table[..., 1]
    pairs = x_BSHD.float().unflatten(-1, (-1, 2))  # (B, S, H, D/2, 2): (real, imag) as view_as_complex reads them
    re, im = pairs[..., 0], pairs[..., 1]
    return torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(3).type_as(x_BSHD)


def _apply_rotary_emb_qwen(x, freqs_cis, use_real=True, use_real_unbind_dim=-1):
    """Stands in for diffusers' function: real (cos, sin) tables rotate in real arithmetic when compiled."""
    original = getattr(_module(), _ORIGINAL)
    if use_real or torch.is_complex(freqs_cis):
        return original(x, freqs_cis, use_real, use_real_unbind_dim)
    if torch.compiler.is_compiling():
        return rotate_pairs(x, freqs_cis)
    return original(x, torch.view_as_complex(freqs_cis), use_real, use_real_unbind_dim)


def _module():
    import diffusers.models.transformers.transformer_qwenimage as module

    return module


def _real_tables(pos_embed, args, output):
    return tuple(torch.view_as_real(f) if torch.is_complex(f) else f for f in output)


def install_real_rope(transformer: torch.nn.Module) -> None:
    """The transformer's blocks get real RoPE tables, and diffusers' rotation handles them (idempotent)."""
    module = _module()
    if not hasattr(module, _ORIGINAL):
        setattr(module, _ORIGINAL, module.apply_rotary_emb_qwen)
        module.apply_rotary_emb_qwen = _apply_rotary_emb_qwen
    if getattr(transformer, _HOOK, None) is None:
        setattr(transformer, _HOOK, transformer.pos_embed.register_forward_hook(_real_tables))


def remove_real_rope(transformer: torch.nn.Module) -> None:
    """Back to diffusers' complex tables for this transformer (the function stays: it passes complex ones through)."""
    hook = getattr(transformer, _HOOK, None)
    if hook is not None:
        hook.remove()
        setattr(transformer, _HOOK, None)
