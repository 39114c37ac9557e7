"""A tiny random Stable Diffusion 3 checkpoint in the hub layout, built from the libraries' own classes.

`build(dir)` writes what `stabilityai/stable-diffusion-3.5-medium` ships (model_index.json, transformer/, vae/,
scheduler/, text_encoder/ + tokenizer/ (CLIP-L), text_encoder_2/ + tokenizer_2/ (CLIP-G), text_encoder_3/ +
tokenizer_3/ (T5)) through `StableDiffusion3Pipeline.save_pretrained`, with random weights small enough for a CPU.
The tokenizers are trained here on the bundled prompts: the two CLIP ones are byte-pair encodings with CLIP's
"</w>" word ends, the T5 one a unigram model, each wrapped in its transformers class. The scheduler is SD3.5's
(FlowMatchEulerDiscreteScheduler, shift 3.0); the VAE has SD3's scaling and shift factors at 4 latent channels.
Dimensions: both CLIP widths 16 (pooled 16 + 16 = the transformer's pooled_projection_dim 32), T5 width 32 (the
transformer's joint_attention_dim; the CLIP sequence is zero-padded to it), 2 MMDiT layers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SD3_SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0)  # stable-diffusion-3.5-medium, scheduler/
TEXT_WIDTH = 32


def _corpus() -> list[str]:
    from imagerl.data.prompts import bundled_prompt_file, load_prompts

    return load_prompts(bundled_prompt_file()) + ["a red circle above a blue square", "a photo of a cat"]


def build_clip_tokenizer(corpus: list[str], vocab_size: int = 512):
    """A CLIPTokenizer whose BPE (lower-cased, "</w>" word ends) is trained on `corpus`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import CLIPTokenizer

    bpe = Tokenizer(models.BPE(end_of_word_suffix="</w>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|startoftext|>", "<|endoftext|>"],
                                  end_of_word_suffix="</w>", show_progress=False)
    bpe.train_from_iterator([c.lower() for c in corpus], trainer)
    spec = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tokenizer = CLIPTokenizer(vocab=spec["vocab"], merges=merges)
    tokenizer.model_max_length = 77
    return tokenizer


def build_t5_tokenizer(corpus: list[str], vocab_size: int = 300):
    """A T5Tokenizer whose unigram model is trained on `corpus`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import T5Tokenizer

    unigram = Tokenizer(models.Unigram())
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    unigram.train_from_iterator(corpus, trainer)
    vocab = [tuple(v) for v in json.loads(unigram.to_str())["model"]["vocab"]]
    tokenizer = T5Tokenizer(vocab=vocab, extra_ids=0)
    tokenizer.model_max_length = 512
    return tokenizer


def build(directory: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint to `directory` (created) and return it."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    corpus = _corpus()
    clip_tokenizers = [build_clip_tokenizer(corpus), build_clip_tokenizer(corpus)]
    t5_tokenizer = build_t5_tokenizer(corpus)
    torch.manual_seed(seed)

    def clip(tokenizer, hidden: int = 16):
        return CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=hidden,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))

    t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=TEXT_WIDTH, d_kv=8, d_ff=64, num_layers=2,
                                 num_heads=2))
    transformer = SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=TEXT_WIDTH, caption_projection_dim=16, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm")  # as SD3.5-Medium: attn2, RMS q/k norm
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 2,
        up_block_types=["UpDecoderBlock2D"] * 2, block_out_channels=[8, 16], layers_per_block=1, latent_channels=4,
        norm_num_groups=4, sample_size=32, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
        use_post_quant_conv=False)  # SD3's VAE factors (stable-diffusion-3.5-medium, vae/config.json)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG), vae=vae,
        text_encoder=clip(clip_tokenizers[0]), tokenizer=clip_tokenizers[0],
        text_encoder_2=clip(clip_tokenizers[1]), tokenizer_2=clip_tokenizers[1],
        text_encoder_3=t5, tokenizer_3=t5_tokenizer)
    directory = Path(directory)
    pipe.save_pretrained(directory)
    return directory
