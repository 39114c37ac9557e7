"""Qwen-Image 2.1's RoPE as real pairs (families/layers/rope_pairs.py) against diffusers' complex product."""

import pytest
import torch
from diffusers.models.transformers import transformer_qwenimage21 as t21

from imagerl.families.qwen_image21 import QwenImage21Family
from imagerl.families.layers.rope_pairs import rope_product
from imagerl.families.qwen_image21.tiny import make_tiny_qwen_image21


def _diffusers_rope():
    from imagerl.families.layers import rope_pairs

    return rope_pairs._DIFFUSERS_ROPE  # diffusers' function as imported, whether or not replaced since


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_pairs_give_the_complex_product_bit_for_bit(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 37, 3, 16).to(dtype)
    angles = torch.randn(37, 8) * 10
    freqs = torch.polar(torch.ones_like(angles), angles)  # what the rope module returns
    expected = _diffusers_rope()(x, freqs, use_real=False)
    ours = rope_product(x, torch.view_as_real(freqs).contiguous(), use_real=False)
    assert ours.dtype == dtype and torch.equal(ours, expected)
    assert torch.equal(rope_product(x, freqs, use_real=False), expected)  # complex input: diffusers' own function


def test_prepared_2_1_model_predicts_the_same_velocity(tmp_path):
    adapter = QwenImage21Family.from_pretrained(make_tiny_qwen_image21(tmp_path / "tiny21"), torch.device("cpu"),
                                               torch.float32)
    text = adapter.encode_prompts(['A neon sign that says "OPEN"', "a cat"])
    cond = adapter.conditioning(text, None, 1.0)
    torch.manual_seed(1)
    x = torch.randn(2, adapter.image_seq_len(64, 64), adapter.latent_channels)
    t = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        before = adapter.velocity(x, t, cond, 64, 64)
        adapter.prepare_compile()
        adapter.prepare_compile()  # idempotent: one hook
        assert len(adapter.transformer.pos_embed._forward_hooks) == 1
        after = adapter.velocity(x, t, cond, 64, 64)
    assert t21.apply_rotary_emb_qwen is rope_product
    assert torch.equal(after, before)


def test_prepared_2_1_model_with_the_prefix_kv_cache_predicts_the_same_velocity(tmp_path):
    """The cached steps slice the rope to the target tokens (rotary_emb[prefix_len:]): the real pairs slice alike."""
    adapter = QwenImage21Family.from_pretrained(make_tiny_qwen_image21(tmp_path / "tiny21"), torch.device("cpu"),
                                               torch.float32)
    emb = adapter.encode_prompts(['A neon sign that says "OPEN"', "a cat"])
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, adapter.image_seq_len(64, 64), adapter.latent_channels, generator=gen) for _ in range(3)]
    ts = [torch.full((2,), t) for t in (980.0, 510.0, 120.0)]

    def run():
        cond = adapter.conditioning(emb, None, 1.0, kv_cache=True)
        with torch.no_grad():
            return [adapter.velocity(x, t, cond, 64, 64) for x, t in zip(xs, ts)]

    complex_product = run()
    adapter.prepare_compile()
    for a, b in zip(run(), complex_product):
        assert torch.equal(a, b)
