"""Tiny random Qwen-Image 2.1 checkpoints in the exact hub layout, built from the libraries' own classes.

`make_tiny_qwen_image21(dir)` writes what `Qwen/Qwen-Image-2.1` ships (model_index.json, transformer/,
vae/, scheduler/, text_encoder/, processor/) with random weights, through
`QwenImage21Pipeline.save_pretrained`, so that it loads through the same code path as the real weights.

Components (as diffusers' Qwen-Image 2.1 classes define them):
  transformer   QwenImage21Transformer2DModel, patch_size 1, in = out = the VAE's z_dim, 2 blocks.
  vae           AutoencoderKLQwenImage21 with a 5-entry dim_mult (the pipeline hard-codes 16x), RGBA in/out,
                non-trivial latents_mean / latents_std so that de-normalisation is exercised.
  text_encoder  Qwen3VLForConditionalGeneration (text hidden 32, 2 layers, mrope_section summing to
                head_dim / 2) with a tiny vision tower; its special-token ids are the tiny tokenizer's.
  processor/    what a Qwen3VLProcessor folder holds: a byte-level BPE (Qwen2Tokenizer, the Qwen2.5/3
                pre-tokenizer regex) trained on the 2.1 prompt template + the bundled prompts, with the Qwen
                special tokens; a Qwen2-VL image processor and a Qwen3-VL video processor config (16 px
                patches, 2x2 merge); and chat_template.jinja with Qwen3-VL's chat format.

torchvision: transformers 5.x cannot build (nor load) a Qwen3VLProcessor without torchvision, because its
video processor needs it; imagerl does not depend on torchvision (and none matches the CPU torch here).
So the processor folder is written file by file (the files Qwen3VLProcessor.save_pretrained writes), the
pipeline's model_index.json names ["transformers", "Qwen3VLProcessor"] as the hub's does, and
`load_processor21` loads it with Qwen3VLProcessor.from_pretrained when torchvision is installed, else builds
a Qwen3VLProcessor without a video processor (text and images only), e.g. for
`QwenImage21Pipeline.from_pretrained(dir, processor=load_processor21(dir / "processor"))`. The imagerl
adapter itself only needs the tokenizer (see qwen_image21.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from imagerl.families.qwen_image21 import PROMPT_TEMPLATE as QWEN_IMAGE21_TEMPLATE
from imagerl.families.qwen_image.tiny import QWEN_IMAGE_SCHEDULER_CONFIG, TINY_TEXT_DIM, build_tiny_tokenizer

TINY21_Z_DIM = 8  # VAE latent channels == transformer in/out channels (2.1 consumes latents unpatched)

# Qwen3-VL's chat format (system / user / assistant turns; text, image and video items), without tools.
CHAT_TEMPLATE = (
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_tokenizer21(vocab_size: int = 1024):
    """A Qwen2Tokenizer whose BPE is trained on the 2.1 template and the bundled prompts."""
    return build_tiny_tokenizer(vocab_size, template=QWEN_IMAGE21_TEMPLATE, model_max_length=262144)


def build_tiny_image_processor21():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    # Qwen3-VL's image preprocessing geometry (16 px patches, 2x2 merge), small pixel budget.
    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256})


def write_processor_folder(folder: Path, tokenizer, image_processor) -> None:
    """The files of a saved Qwen3VLProcessor (legacy hub layout), written without instantiating one."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)  # tokenizer.json, tokenizer_config.json, chat_template.jinja
    image_processor.save_pretrained(folder)  # preprocessor_config.json
    video = dict(video_processor_type="Qwen3VLVideoProcessor", processor_class="Qwen3VLProcessor", patch_size=16,
                 temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                 size={"shortest_edge": 32 * 32, "longest_edge": 256 * 256})
    (folder / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (folder / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}, indent=2) + "\n")


def qwen3vl_processor(tokenizer, image_processor, chat_template: str):
    """A Qwen3VLProcessor without a video processor (text and images only), which transformers' own
    constructor refuses: it checks each sub-processor's class, and the video one needs torchvision."""
    from transformers import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self, name, arg):  # accept the missing video processor only
        return None if (name == "video_processor" and arg is None) else check(self, name, arg)

    ProcessorMixin.check_argument_for_proper_class = lenient
    try:
        return Qwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=None,
                                chat_template=chat_template)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def build_tiny_processor():
    """The tiny processor in memory (tokenizer, image processor, chat template; no video processor)."""
    tokenizer = build_tiny_tokenizer21()
    tokenizer.chat_template = CHAT_TEMPLATE
    return qwen3vl_processor(tokenizer, build_tiny_image_processor21(), CHAT_TEMPLATE)


def load_processor21(folder: str | Path):
    """A Qwen3VLProcessor from a processor/ folder; without torchvision, one without a video processor."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return Qwen3VLProcessor.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return qwen3vl_processor(tokenizer, AutoImageProcessor.from_pretrained(folder), tokenizer.chat_template)


def build_tiny_text_encoder21(tokenizer, seed: int = 0):
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>")]}
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=TINY_TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=4096,
            # mrope_section sums to head_dim / 2 (8B: [24, 20, 20] of 64); interleaved as in Qwen3-VL.
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [4, 2, 2],
                             "mrope_interleaved": True},
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TINY_TEXT_DIM,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        tie_word_embeddings=False, **ids,
    )
    return Qwen3VLForConditionalGeneration(config).eval()


def build_tiny_transformer21(seed: int = 0):
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(seed)
    return QwenImage21Transformer2DModel(
        patch_size=1, in_channels=TINY21_Z_DIM, out_channels=TINY21_Z_DIM, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, context_in_dim=TINY_TEXT_DIM, mlp_ratio=3, axes_dims_rope=(4, 6, 6),
    )


def build_tiny_vae21(seed: int = 0):
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    mean = (torch.randn(TINY21_Z_DIM, generator=gen) * 0.5).tolist()
    std = (torch.rand(TINY21_Z_DIM, generator=gen) + 0.75).tolist()
    return AutoencoderKLQwenImage21(
        base_dim=8, decoder_base_dim=12, z_dim=TINY21_Z_DIM, dim_mult=[1, 2, 4, 8, 8], num_res_blocks=1,
        temperal_downsample=[False, True, True, True], latents_mean=mean, latents_std=std,
    )


def make_tiny_qwen_image21(directory: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Qwen-Image 2.1 checkpoint (diffusers/hub layout) to `directory`."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline
    from diffusers.utils import logging as diffusers_logging

    directory = Path(directory)
    if directory.exists():
        raise FileExistsError(f"{directory} already exists; remove it or choose another directory")
    tmp = directory.with_name(directory.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)  # a crashed earlier build
    tokenizer = build_tiny_tokenizer21()
    write_processor_folder(tmp / "processor", tokenizer, build_tiny_image_processor21())
    pipe = QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG),
        vae=build_tiny_vae21(seed),
        text_encoder=build_tiny_text_encoder21(tokenizer, seed),
        processor=load_processor21(tmp / "processor"),  # __init__ reads its chat template and tokenizer
        transformer=build_tiny_transformer21(seed),
    )
    pipe.register_modules(processor=None)  # already written above; its save_pretrained needs torchvision
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # silence "processor=None cannot be saved"
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    index = json.loads((tmp / "model_index.json").read_text())
    index["processor"] = ["transformers", "Qwen3VLProcessor"]
    (tmp / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    tmp.rename(directory)
    return directory
