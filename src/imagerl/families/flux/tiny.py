"""A tiny random FLUX.1 checkpoint in the hub layout, built from the libraries' own classes.

`build(dir)` writes what `black-forest-labs/FLUX.1-dev` ships (model_index.json, transformer/, vae/, scheduler/,
text_encoder/ + tokenizer/ (CLIP-L), text_encoder_2/ + tokenizer_2/ (T5)) through `FluxPipeline.save_pretrained`,
with random weights small enough for a CPU. The tokenizers are trained on the bundled prompts by the SD3 builder's
helpers (families/sd3/tiny.py: a CLIP byte-pair encoding with "</w>" word ends, a T5 unigram model).
The scheduler is FLUX.1-dev's (scheduler/scheduler_config.json: dynamic shifting, base_shift 0.5, max_shift 1.15
between 256 and 4096 image tokens); the VAE has FLUX.1-dev's 16 latent channels, scaling and shift factors and its
8x downsampling (4 levels, vae/config.json). The transformer is guidance-distilled as FLUX.1-dev
(guidance_embeds=True; `guidance_embeds=False` builds a FLUX.1-schnell-like one).
Dimensions: CLIP width 16 (its pooled output = the transformer's pooled_projection_dim), T5 width 32 (the
transformer's joint_attention_dim), 2 double-stream + 2 single-stream blocks of 2 heads x 16, RoPE axes (4, 6, 6)
(summing to the head dim, as FLUX.1's (16, 56, 56) sum to 128). 64 px -> an 8 x 8 latent -> 16 packed tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

# black-forest-labs/FLUX.1-dev, scheduler/scheduler_config.json (FLUX.1-schnell: shift 1.0, no dynamic shifting)
FLUX_DEV_SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
                             "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}
TEXT_WIDTH = 32
POOLED_WIDTH = 16


def build(directory: str | Path, seed: int = 0, guidance_embeds: bool = True) -> Path:
    """Write the tiny checkpoint to `directory` (created) and return it."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from imagerl.families.sd3.tiny import (
        _corpus,
        build_clip_tokenizer,
        build_t5_tokenizer,
    )

    corpus = _corpus()
    clip_tokenizer, t5_tokenizer = build_clip_tokenizer(corpus), build_t5_tokenizer(corpus)
    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tokenizer), hidden_size=POOLED_WIDTH, intermediate_size=2 * POOLED_WIDTH,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=77,
        bos_token_id=clip_tokenizer.bos_token_id, eos_token_id=clip_tokenizer.eos_token_id,
        pad_token_id=clip_tokenizer.pad_token_id))
    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=TEXT_WIDTH, d_kv=8, d_ff=64, num_layers=2,
                                 num_heads=2))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH, pooled_projection_dim=POOLED_WIDTH, guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[8, 8, 16, 16], layers_per_block=1,
        latent_channels=16, norm_num_groups=4, sample_size=64, scaling_factor=0.3611, shift_factor=0.1159,
        use_quant_conv=False, use_post_quant_conv=False)  # FLUX.1-dev's VAE factors (vae/config.json)
    pipe = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG), vae=vae, text_encoder=clip,
        tokenizer=clip_tokenizer, text_encoder_2=t5, tokenizer_2=t5_tokenizer, transformer=transformer)
    directory = Path(directory)
    pipe.save_pretrained(directory)
    return directory
