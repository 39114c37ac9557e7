"""CLIPScore, flow_grpo's variant (flow_grpo/clip_scorer.py, after imscore).

CLIP ViT-L/14 (openai/clip-vit-large-patch14, local directory reward.clip_model). score =
logits_per_image.diagonal() / 30 = exp(logit_scale) * cos(image, text) / 30 (~0.8-1.1; the classic
CLIPScore is 2.5 * max(cos, 0), torchmetrics' is 100 * cos).

Preprocessing is flow_grpo's, which differs from the processor's: the float images (no uint8
rounding) go through torchvision-style tensor transforms built from the processor config: Resize of the
shortest edge (bilinear with antialiasing, torchvision's tensor default, not the processor's bicubic),
CenterCrop, Normalize. Prompts are padded to 77 tokens and truncated. reward.dtype bfloat16 runs CLIP
in bf16; normalisation, the cosine and exp(logit_scale) stay in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from imagerl.config import RewardConfig
from imagerl.rewards.clip_common import (
    check_processor_files, image_embeds, load_clip_model, load_clip_processor, model_dtype, require_dir,
    unique_text_embeds,
)
from imagerl.rewards.registry import register_reward

CLIP = "openai/clip-vit-large-patch14"
SCALE = 30.0


def _size(size) -> int | tuple[int, int]:
    """torchvision Resize/CenterCrop argument from a processor size dict (flow_grpo's get_size)."""
    if isinstance(size, int):
        return (size, size)
    if "height" in size and "width" in size:
        return (size["height"], size["width"])
    if "shortest_edge" in size:
        return size["shortest_edge"]
    raise ValueError(f"unsupported image processor size {size!r}")


def resize_shortest_edge(x: torch.Tensor, size: int | tuple[int, int]) -> torch.Tensor:
    """torchvision.transforms.Resize(size) on a float NCHW tensor (bilinear, antialias=True)."""
    h, w = x.shape[-2:]
    if isinstance(size, int):
        short, long = (w, h) if w <= h else (h, w)
        new_short, new_long = size, int(size * long / short)
        size = (new_long, new_short) if w <= h else (new_short, new_long)
    if tuple(size) == (h, w):
        return x
    return F.interpolate(x, size=list(size), mode="bilinear", align_corners=False, antialias=True)


def center_crop(x: torch.Tensor, size: int | tuple[int, int]) -> torch.Tensor:
    """torchvision.transforms.CenterCrop(size) for images at least `size` large."""
    ch, cw = (size, size) if isinstance(size, int) else size
    h, w = x.shape[-2:]
    if ch > h or cw > w:
        raise ValueError(f"image {h}x{w} is smaller than the crop {ch}x{cw}")
    top, left = int(round((h - ch) / 2.0)), int(round((w - cw) / 2.0))
    return x[..., top:top + ch, left:left + cw]


@register_reward("clipscore")
class ClipScore:
    reads_float_pixels = True  # resizes the float image itself (no uint8 step): a reward server sends it float32

    @classmethod
    def check_config(cls, cfg: RewardConfig) -> None:
        check_processor_files(require_dir(cfg.clip_model, "clip_model", CLIP), "clip_model", CLIP)
        model_dtype(cfg)

    def __init__(self, cfg: RewardConfig, device: torch.device):
        path = require_dir(cfg.clip_model, "clip_model", CLIP)
        self.processor = load_clip_processor(path, "clip_model", CLIP)
        self.model, self.logit_scale = load_clip_model(path, device, model_dtype(cfg))
        self.device = device
        ip = self.processor.image_processor
        self.resize = _size(ip.size) if ip.do_resize else None
        self.crop = _size(ip.crop_size) if ip.do_center_crop else None
        self.mean = torch.tensor(ip.image_mean, dtype=torch.float32).view(1, 3, 1, 1) if ip.do_normalize else None
        self.std = torch.tensor(ip.image_std, dtype=torch.float32).view(1, 3, 1, 1) if ip.do_normalize else None

    def preprocess(self, images_B3HW: torch.Tensor) -> torch.Tensor:
        x = images_B3HW.to(self.device, torch.float32)
        if self.resize is not None:
            x = resize_shortest_edge(x, self.resize)
        if self.crop is not None:
            x = center_crop(x, self.crop)
        if self.mean is not None:
            x = (x - self.mean.to(x.device)) / self.std.to(x.device)
        return x

    @torch.no_grad()
    def __call__(self, images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        image = image_embeds(self.model, self.preprocess(images_B3HW))
        text = unique_text_embeds(self.model, self.processor.tokenizer, prompts, padding="max_length")
        return (self.logit_scale * (image * text).sum(-1) / SCALE).double().cpu()
