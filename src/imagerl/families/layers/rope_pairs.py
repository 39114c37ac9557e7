"""Qwen-Image 2.1's rotary embedding as real (cos, sin) pairs, for compiled blocks (QwenImage21Family.prepare_compile).

diffusers applies the RoPE as a complex product: view_as_complex(x) * freqs_cis, then view_as_real. Inductor
generates no code for complex operators ("does not support code generation for complex operators": it falls back
to ATen between generated kernels), and the one compiled-2.1 kernel that failed on the GPU was a fused
`..._view_as_complex` kernel of the RoPE backward (benchmarks/LOG.md runs F, V, W). Here the rope module's
complex output is turned into its real pairs (S, D/2, 2) float32 before the blocks see it, and the product is
written out in real arithmetic:
    (a + ib)(c + id) = (ac - bd) + i(ad + bc)
with (a, b) the interleaved pairs of x's last dim (as view_as_complex reads them) and (c, d) = (cos, sin) of the
angle. float32 throughout, like diffusers' x.float(); on the CPU the result equals the complex product bit for
bit (tests/test_rope_pairs.py), and rollout and training run the same function, so the replay stays exact.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers import transformer_qwenimage21 as _t21

_DIFFUSERS_ROPE = _t21.apply_rotary_emb_qwen  # bound at import, before use_real_rope_pairs replaces it


def rope_product(x: torch.Tensor, freqs: torch.Tensor, use_real: bool = True, use_real_unbind_dim: int = -1):
    """diffusers' apply_rotary_emb_qwen with one more input form: `freqs` as real pairs (S, D/2, 2). Complex
    `freqs` (or use_real=True) go to diffusers' own function unchanged."""
    if use_real or freqs.is_complex():
        return _DIFFUSERS_ROPE(x, freqs, use_real, use_real_unbind_dim)
    a, b = x.float().reshape(*x.shape[:-1], -1, 2).unbind(-1)  # (B, S, H, D/2)
    c, d = freqs.unsqueeze(1).unbind(-1)  # (S, 1, D/2): broadcast over heads
    return torch.stack([a * c - b * d, a * d + b * c], dim=-1).flatten(3).type_as(x)


def _real_pairs(module, args, output):
    """Forward hook of the rope module: complex (S, D/2) -> real (S, D/2, 2), contiguous."""
    return torch.view_as_real(output).contiguous() if output.is_complex() else output


def use_real_rope_pairs(transformer: torch.nn.Module) -> None:
    """From now on this transformer's blocks get the RoPE as real pairs. diffusers' 2.1 attention looks
    `apply_rotary_emb_qwen` up in its module at each call: it is replaced (once per process) by rope_product,
    which computes diffusers' own result for complex frequencies, so other 2.1 models in the process are
    unaffected."""
    _t21.apply_rotary_emb_qwen = rope_product
    if not getattr(transformer.pos_embed, "_imagerl_real_pairs", False):
        transformer.pos_embed.register_forward_hook(_real_pairs)
        transformer.pos_embed._imagerl_real_pairs = True
