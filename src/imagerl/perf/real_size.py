"""Released-size Qwen-Image components with random weights (no download), for benchmarks.

The transformer classes' defaults are the released configs (Qwen-Image 20.4 B, Qwen-Image 2.1 7.1 B);
the text encoders are the real classes at the released sizes of Qwen2.5-VL-7B (28 layers, hidden 3584)
and Qwen3-VL-8B (36 layers, hidden 4096) with their real vocabulary sizes (a 1-layer, 64-wide vision tower:
text-to-image never calls it); the VAEs are the real architectures. The tokenizer is a BPE trained on the
benchmark prompts (the test tokenizer, larger vocabulary), so prompt lengths are those of a real BPE.
Weights are created directly on the device in bf16 (VAE fp32). `layers` shrinks the transformer (also to 2
heads) and the text encoder to that many layers for a CPU dry run of the same code path; `blocks` builds that many
transformer blocks at the released dims (the text encoder shrunk as for `layers`), for a card too small for the
released model (benchmarks/depth_bench.py).
"""

from __future__ import annotations

import contextlib

import torch

QWEN25_VL_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                    num_key_value_heads=4, vocab_size=152064)
QWEN3_VL_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                   num_key_value_heads=8, head_dim=128, vocab_size=151936)
# PickScore_v1 = CLIP ViT-H/14 (laion/CLIP-ViT-H-14-laion2B-s32B-b79K)
CLIP_VIT_H = dict(
    vision=dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120, patch_size=14,
                hidden_act="gelu"),
    text=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096, hidden_act="gelu"),
    projection_dim=1024, image_size=224,
)
DRY_CLIP = dict(vision=dict(hidden_size=32, patch_size=8), text=dict(hidden_size=32), projection_dim=32, image_size=32)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _transformer_spec(layers: int | None, blocks: int | None) -> dict:
    """The released transformer (the class defaults), (dry run) `layers` layers of 2 heads (width 256), or
    `blocks` blocks of the released dims."""
    if layers is not None:
        return {"num_layers": layers, "num_attention_heads": 2}
    return {} if blocks is None else {"num_layers": blocks}


def _text_spec(spec: dict, layers: int | None, vocab_size: int) -> dict:
    """The released text-encoder size, or (dry run) `layers` layers with a small MLP and the tokenizer's
    vocabulary; the hidden size stays (the transformer's joint_attention_dim)."""
    if layers is None:
        return dict(spec)
    return dict(spec, num_hidden_layers=layers, intermediate_size=512, vocab_size=vocab_size)


def build_qwen_image(device, prompts: list[str], layers: int | None = None, blocks: int | None = None):
    """(transformer bf16, vae fp32, text_encoder bf16, tokenizer) of Qwen-Image at the released size."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from imagerl.families.qwen_image.tiny import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer(vocab_size=8192, extra_corpus=prompts)
    text = _text_spec(QWEN25_VL_7B, blocks if layers is None else layers, len(tokenizer))
    rope = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}
    with torch.device(device), _default_dtype(torch.bfloat16):
        transformer = QwenImageTransformer2DModel(**_transformer_spec(layers, blocks))
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(text, rope_parameters=rope, bos_token_id=None, eos_token_id=None),
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2,
                               out_hidden_size=text["hidden_size"], fullatt_block_indexes=[0])))
    with torch.device(device):
        vae = AutoencoderKLQwenImage()
    return transformer, vae, text_encoder, tokenizer


def build_qwen_image21(device, prompts: list[str], layers: int | None = None, blocks: int | None = None):
    """(transformer bf16, vae fp32, text_encoder bf16, processor) of Qwen-Image 2.1 at the released size."""
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from imagerl.families.qwen_image21.tiny import build_tiny_processor

    processor = build_tiny_processor()
    text = _text_spec(QWEN3_VL_8B, blocks if layers is None else layers, len(processor.tokenizer))
    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_interleaved": True,
            "mrope_section": [24, 20, 20]}
    with torch.device(device), _default_dtype(torch.bfloat16):
        transformer = QwenImage21Transformer2DModel(**_transformer_spec(layers, blocks))
        text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config=dict(text, rope_parameters=rope),
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2,
                               out_hidden_size=text["hidden_size"], deepstack_visual_indexes=[])))
    with torch.device(device):
        vae = AutoencoderKLQwenImage21()
    return transformer, vae, text_encoder, processor


def save_pickscore_size_clip(path, device, dry: bool = False) -> None:
    """A random CLIPModel of PickScore_v1's size (ViT-H/14) with its processor files, in the Hub layout, so the
    real `pickscore` reward loads it (reward.pickscore_model=path)."""
    from imagerl.rewards.tiny_clip import save_random_clip

    spec = DRY_CLIP if dry else CLIP_VIT_H
    save_random_clip(path, text=spec["text"], vision=spec["vision"], projection_dim=spec["projection_dim"],
                     image_size=spec["image_size"], init_device=str(device))
