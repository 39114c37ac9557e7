"""The analytic Qwen-Image FLOP count (imagerl.perf.flops, the basis of MFU) equals what
torch.utils.flop_counter counts on real diffusers modules, with and without LoRA, and reproduces the
reference's 20B numbers."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from imagerl.families.qwen_image import QwenImageFamily
from imagerl.perf.flops import QwenImageDims, qwen_image_forward_flops, training_flops

TINY = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
            joint_attention_dim=32, axes_dims_rope=(4, 6, 6))


def _measured(model, image_hw: tuple[int, int], text_tokens: int, batch: int = 1) -> int:
    h, w = image_hw
    config = model.config
    hidden = torch.randn(batch, h * w, config.in_channels)
    text = torch.randn(batch, text_tokens, config.joint_attention_dim)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:  # the math kernel's matmuls are counted
        model(hidden_states=hidden, timestep=torch.full((batch,), 0.5), encoder_hidden_states=text,
              encoder_hidden_states_mask=torch.ones(batch, text_tokens), img_shapes=[[(1, h, w)]] * batch,
              return_dict=False)
    return counter.get_total_flops()


@pytest.mark.parametrize("image_hw,text_tokens", [((4, 4), 7), ((8, 6), 13)])
def test_forward_flops_equal_the_flop_counter(image_hw, text_tokens):
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel(**TINY).eval()
    dims = QwenImageDims.from_config(model.config)
    expected = qwen_image_forward_flops(dims, image_hw[0] * image_hw[1], text_tokens)
    assert _measured(model, image_hw, text_tokens) == expected
    assert _measured(model, image_hw, text_tokens, batch=3) == 3 * expected


def test_full_size_qwen_image_matches_the_reference_numbers():
    # reference/diffusers_qwenimage.md section 6, measured on the 20B model: 512 px (1024 image tokens)
    # with L = 100 / 200 / 300 text tokens -> 16.22 / 17.76 / 19.31 TFLOP per forward
    dims = QwenImageDims(num_layers=60, dim=3072, in_channels=64, out_channels=64, joint_attention_dim=3584)
    for text, tflop in [(100, 16.22), (200, 17.76), (300, 19.31)]:
        assert qwen_image_forward_flops(dims, 1024, text) / 1e12 == pytest.approx(tflop, abs=0.006)


def test_training_flops_rule():
    assert training_flops(10, full_fine_tune=False, recompute=True) == 30  # LoRA + checkpointing: 3x forward
    assert training_flops(10, full_fine_tune=True, recompute=False) == 30
    assert training_flops(10, full_fine_tune=False, recompute=False) == 20
    assert training_flops(10, full_fine_tune=False, recompute=0.5) == 25  # every other block recomputed


def test_iteration_flops_count_rollout_and_training():
    from imagerl.perf.flops import flow_grpo_iteration_flops, mfu

    dims = QwenImageDims.from_config(TINY)
    fwd = qwen_image_forward_flops(dims, 16, 9)
    out = flow_grpo_iteration_flops(dims, 16, 9, samples=8, num_steps=10, num_sde_steps=2, true_cfg=True)
    assert out["rollout"] == 8 * 10 * 2 * fwd  # every step, cond + uncond rows
    assert out["train"] == 8 * 2 * 3 * 2 * fwd  # window steps x (forward + backward + recompute) x CFG rows
    assert out["total"] == out["rollout"] + out["train"]
    no_cfg = flow_grpo_iteration_flops(dims, 16, 9, samples=8, num_steps=10, num_sde_steps=2, true_cfg=False,
                                       recompute=False)
    assert no_cfg["train"] == 8 * 2 * 2 * fwd
    assert mfu(5e14, 2.0, 1e15) == 0.25
    with pytest.raises(ValueError, match="positive"):
        mfu(1.0, 0.0, 1.0)


def test_measured_matmul_rate_is_a_rate():
    from imagerl.perf.flops import measure_matmul_flops_per_s

    rate = measure_matmul_flops_per_s("cpu", torch.float32, size=128, iterations=3)
    assert 1e6 < rate < 1e14  # a CPU core does between a MFLOP/s and 100 TFLOP/s


TINY21 = dict(num_layers=2, attention_head_dim=16, num_attention_heads=2, in_channels=16, out_channels=16,
              context_in_dim=32, axes_dims_rope=(4, 6, 6))


def _measured21(model, image_hw: tuple[int, int], text_tokens: int, batch: int = 1) -> int:
    h, w = image_hw
    config = model.config
    # the pipeline's VLM mask: a 0 per text token, a 1 per slot of 4 image tokens
    img_mask = torch.cat([torch.zeros(batch, text_tokens, dtype=torch.bool),
                          torch.ones(batch, h * w // 4, dtype=torch.bool)], 1)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        model(hidden_states=torch.randn(batch, h * w, config.in_channels), timestep=torch.full((batch,), 0.5),
              encoder_hidden_states=torch.randn(batch, text_tokens, config.context_in_dim),
              img_shapes=[[(1, h, w)]] * batch, img_mask=img_mask, return_dict=False)
    return counter.get_total_flops()


@pytest.mark.parametrize("image_hw,text_tokens", [((4, 4), 7), ((6, 8), 13)])
def test_qwen_image21_forward_flops_equal_the_flop_counter(image_hw, text_tokens):
    from diffusers import QwenImage21Transformer2DModel

    from imagerl.perf.flops import QwenImage21Dims, qwen_image21_forward_flops

    model = QwenImage21Transformer2DModel(**TINY21).eval()
    dims = QwenImage21Dims.from_config(model.config)
    tokens = image_hw[0] * image_hw[1]
    assert _measured21(model, image_hw, text_tokens) == qwen_image21_forward_flops(dims, tokens, text_tokens)
    assert _measured21(model, image_hw, text_tokens, batch=2) == qwen_image21_forward_flops(dims, tokens, text_tokens,
                                                                                           batch=2)


@pytest.mark.parametrize("family", ["qwen_image", "qwen_image21"])
def test_lora_flops_equal_the_flop_counter(family):
    from diffusers import QwenImage21Transformer2DModel, QwenImageTransformer2DModel
    from peft import LoraConfig

    from imagerl.families.qwen_image21 import QwenImage21Family
    from imagerl.perf.flops import QwenImage21Dims, qwen_image21_forward_flops

    model_class, config, adapter, dims_class, count, measure = {
        "qwen_image": (QwenImageTransformer2DModel, TINY, QwenImageFamily, QwenImageDims, qwen_image_forward_flops,
                       _measured),
        "qwen_image21": (QwenImage21Transformer2DModel, TINY21, QwenImage21Family, QwenImage21Dims,
                         qwen_image21_forward_flops, _measured21),
    }[family]
    model = model_class(**config).eval()
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=list(adapter.lora_target_modules)))
    dims = dims_class.from_config(model.config)
    assert measure(model, (4, 4), 9) == count(dims, 16, 9, lora_rank=4, lora_targets=adapter.lora_target_modules)


def test_full_size_qwen_image21_matches_the_reference_numbers():
    # reference/diffusers_qwenimage.md section 6: 512 px (1024 image tokens), L = 100 / 200 / 300 text tokens:
    # 16.31 / 17.78 / 19.26 TFLOP per full (prefill, training) forward, 14.90 / 14.97 / 15.03 per KV-cached step
    from diffusers import QwenImage21Transformer2DModel

    from imagerl.perf.flops import QwenImage21Dims, qwen_image21_forward_flops

    released = dict(num_layers=32, num_attention_heads=32, attention_head_dim=128, in_channels=64, out_channels=64,
                    context_in_dim=4096, mlp_ratio=3)  # QwenImage21Transformer2DModel's defaults
    assert all(QwenImage21Transformer2DModel(num_layers=1, num_attention_heads=1).config[k] == v
               for k, v in released.items() if k not in ("num_layers", "num_attention_heads"))
    dims = QwenImage21Dims.from_config(released)
    for text, full, cached in [(100, 16.31, 14.90), (200, 17.78, 14.97), (300, 19.26, 15.03)]:
        assert qwen_image21_forward_flops(dims, 1024, text) / 1e12 == pytest.approx(full, abs=0.01)
        assert qwen_image21_forward_flops(dims, 1024, text, cached=True) / 1e12 == pytest.approx(cached, abs=0.01)
