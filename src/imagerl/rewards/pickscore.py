"""PickScore, flow_grpo's scale (flow_grpo/pickscore_scorer.py).

Model yuvalkirstain/PickScore_v1 (a CLIP ViT-H/14 CLIPModel), processor of
laion/CLIP-ViT-H-14-laion2B-s32B-b79K, both from local directories (reward.pickscore_model,
reward.pickscore_processor; the processor defaults to the model directory).
Images float [0, 1] -> uint8 round(x * 255) -> PIL -> CLIP processor (resize 224 bicubic, center crop,
normalise); prompts tokenised padded (to the longest) and truncated to 77 tokens. With e_i, e_t the
L2-normalised projected embeddings: score = exp(logit_scale) * <e_t, e_i> / 26 (flow_grpo: "norm to
0-1"; raw PickScores are ~21-23.5, so this is ~0.8-0.9). reward.dtype bfloat16 runs the towers in
bf16; normalisation, the cosine and exp(logit_scale) stay in float32.
"""

from __future__ import annotations

import torch

from imagerl.config import RewardConfig
from imagerl.rewards.clip_common import (
    check_processor_files, clip_pixels, image_embeds, load_clip_model, load_clip_processor, model_dtype, require_dir,
    unique_text_embeds,
)
from imagerl.rewards.registry import register_reward

MODEL = "yuvalkirstain/PickScore_v1"
PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
SCALE = 26.0


def _paths(cfg: RewardConfig):
    model = require_dir(cfg.pickscore_model, "pickscore_model", MODEL)
    if cfg.pickscore_processor:
        processor = require_dir(cfg.pickscore_processor, "pickscore_processor", PROCESSOR, must_contain=None)
    else:
        processor = model  # a PickScore_v1 copy that also holds the processor files
    check_processor_files(processor, "pickscore_processor", PROCESSOR)
    return model, processor


@register_reward("pickscore")
class PickScore:
    @classmethod
    def check_config(cls, cfg: RewardConfig) -> None:
        _paths(cfg)
        model_dtype(cfg)

    def __init__(self, cfg: RewardConfig, device: torch.device):
        model_path, processor_path = _paths(cfg)
        self.processor = load_clip_processor(processor_path, "pickscore_processor", PROCESSOR)
        self.model, self.logit_scale = load_clip_model(model_path, device, model_dtype(cfg))

    @torch.no_grad()
    def __call__(self, images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        pixels = clip_pixels(self.processor.image_processor, images_B3HW)
        image = image_embeds(self.model, pixels)
        text = unique_text_embeds(self.model, self.processor.tokenizer, prompts, padding=True)
        return (self.logit_scale * (image * text).sum(-1) / SCALE).double().cpu()
