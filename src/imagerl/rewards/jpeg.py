"""JPEG (in)compressibility, flow_grpo's scale (flow_grpo/rewards.py, from ddpo-pytorch).

Images -> uint8 (round(x * 255)) -> JPEG quality 95 -> size in kB (bytes / 1000).
jpeg_incompressibility = size_kB; jpeg_compressibility = -size_kB / 500.
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from imagerl.rewards.registry import register_reward


def to_uint8_hwc(images_B3HW: torch.Tensor) -> np.ndarray:
    return (images_B3HW.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def jpeg_sizes_kb(images_B3HW: torch.Tensor, quality: int = 95) -> torch.Tensor:
    sizes = []
    for image in to_uint8_hwc(images_B3HW):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float64)


@register_reward("jpeg_incompressibility")
class JpegIncompressibility:
    def __init__(self, cfg=None, device=None):
        pass

    def __call__(self, images_B3HW, prompts, metadata):
        return jpeg_sizes_kb(images_B3HW)


@register_reward("jpeg_compressibility")
class JpegCompressibility:
    def __init__(self, cfg=None, device=None):
        pass

    def __call__(self, images_B3HW, prompts, metadata):
        return -jpeg_sizes_kb(images_B3HW) / 500
