"""Tiny random Qwen-Image checkpoints in the exact hub layout, built from the libraries' own classes.

`make_tiny_qwen_image(dir)` writes what `Qwen/Qwen-Image` ships (model_index.json, transformer/, vae/,
scheduler/, text_encoder/, tokenizer/) with random weights small enough for a laptop CPU, through
`QwenImagePipeline.save_pretrained`, so that it loads through the same code path as the real weights.

The tokenizer is a byte-level BPE trained on the Qwen-Image prompt template plus the bundled prompts,
wrapped in transformers' `Qwen2Tokenizer` (same pre-tokenizer regex as Qwen2.5). It is trained until
the template prefix (system turn + "<|im_start|>user\\n") encodes to exactly 34 tokens, the
`prompt_template_encode_start_idx` hard-coded in diffusers' QwenImagePipeline, so that dropping 34
tokens removes exactly the template there too (checked in tests/test_tiny_checkpoint.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# Qwen-Image's released scheduler_config.json (Qwen/Qwen-Image, scheduler/; the class
# defaults differ: use_dynamic_shifting False, max_shift 1.15, max_image_seq_len 4096, no terminal).
QWEN_IMAGE_SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
    base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    invert_sigmas=False, use_karras_sigmas=False, use_exponential_sigmas=False, use_beta_sigmas=False,
    stochastic_sampling=False,
)

QWEN_IMAGE_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
QWEN_IMAGE_TEMPLATE_DROP = 34

# Special tokens of the Qwen2.5-VL tokenizer that the pipelines and processors refer to.
SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]

TINY_TEXT_DIM = 32  # text-encoder hidden size == transformer joint_attention_dim
TINY_Z_DIM = 4  # VAE latent channels; transformer in_channels = 4 * z_dim after 2x2 packing


def _bundled_prompts() -> list[str]:
    from imagerl.data.prompts import load_prompts, bundled_prompt_file

    return load_prompts(bundled_prompt_file())


def build_tiny_tokenizer(vocab_size: int = 1024, template: str = QWEN_IMAGE_TEMPLATE, model_max_length: int = 32768,
                         extra_corpus: list[str] = ()):
    """A Qwen2Tokenizer whose BPE is trained on a prompt template, the bundled prompts and `extra_corpus`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, Regex
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    corpus = [template.format(p) for p in [*_bundled_prompts(), *extra_corpus]]
    corpus += [template.format("")] * 64  # make every template word a single token
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    spec = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=spec["vocab"], merges=merges)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    tokenizer.model_max_length = model_max_length
    return tokenizer


def template_prefix_length(tokenizer) -> int:
    """Tokens of the template before the prompt (what QwenImagePipeline drops)."""
    prefix = QWEN_IMAGE_TEMPLATE.split("{}")[0]
    return len(tokenizer(prefix).input_ids)


def build_tiny_text_encoder(vocab_size: int, seed: int = 0):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(seed)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=TINY_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TINY_TEXT_DIM,
                           fullatt_block_indexes=[0]),
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def build_tiny_transformer(seed: int = 0):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(seed)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * TINY_Z_DIM, out_channels=TINY_Z_DIM, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=TINY_TEXT_DIM, axes_dims_rope=(4, 6, 6),
    )


def build_tiny_vae(seed: int = 0):
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    # Non-trivial latent statistics so that de-normalisation before decode is exercised.
    mean = (torch.randn(TINY_Z_DIM, generator=gen) * 0.5).tolist()
    std = (torch.rand(TINY_Z_DIM, generator=gen) + 0.75).tolist()
    return AutoencoderKLQwenImage(
        base_dim=16, z_dim=TINY_Z_DIM, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=mean, latents_std=std,
    )


def make_tiny_qwen_image(directory: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen-Image checkpoint (diffusers/hub layout) to `directory`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    directory = Path(directory)
    tokenizer = build_tiny_tokenizer()
    prefix = template_prefix_length(tokenizer)
    if prefix != QWEN_IMAGE_TEMPLATE_DROP:
        raise RuntimeError(f"tiny tokenizer encodes the template prefix to {prefix} tokens, expected 34")
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        vae=build_tiny_vae(seed),
        text_encoder=build_tiny_text_encoder(len(tokenizer), seed),
        tokenizer=tokenizer,
        transformer=build_tiny_transformer(seed),
    )
    tmp = directory.with_name(directory.name + ".partial")
    pipe.save_pretrained(tmp, safe_serialization=True)
    if directory.exists():
        raise FileExistsError(f"{directory} already exists; remove it or choose another directory")
    tmp.rename(directory)
    return directory
