"""LAION improved aesthetic predictor v2, as flow_grpo uses it (flow_grpo/aesthetic_scorer.py, from
christophschuhmann/improved-aesthetic-predictor).

CLIP ViT-L/14 (openai/clip-vit-large-patch14, local directory reward.clip_model) image embedding,
L2-normalised -> MLP 768-1024-128-64-16-1 (linear layers only, with dropouts between the first four:
`layers.{0,2,4,6,7}` in the state dict) whose weights are reward.aesthetic_head
(sac+logos+ava1-l14-linearMSE.pth, or the same tensors as .safetensors). Images float [0, 1] ->
uint8 round(x * 255) -> CLIP processor (resize 224 bicubic, center crop, normalise). Scores are ~1-10
(SD3.5-M on DrawBench ~5.4). reward.dtype bfloat16 runs CLIP in bf16; the head runs in float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from imagerl.config import RewardConfig
from imagerl.rewards.clip_common import (
    check_processor_files, clip_pixels, image_embeds, load_clip_model, load_clip_processor, model_dtype, require_dir,
)
from imagerl.rewards.registry import register_reward

CLIP = "openai/clip-vit-large-patch14"
HEAD = "the LAION aesthetic head sac+logos+ava1-l14-linearMSE.pth"


class AestheticMLP(nn.Module):
    """The original layout: Linear/Dropout pairs, no activations (the ReLUs are commented out upstream)."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(input_size, 1024),
            nn.Dropout(0.2),
            nn.Linear(1024, 128),
            nn.Dropout(0.2),
            nn.Linear(128, 64),
            nn.Dropout(0.1),
            nn.Linear(64, 16),
            nn.Linear(16, 1),
        )

    def forward(self, embed: torch.Tensor) -> torch.Tensor:
        return self.layers(embed)


def _head_path(cfg: RewardConfig) -> Path:
    if not cfg.aesthetic_head:
        raise ValueError(f"reward.aesthetic_head is empty: set it to a local copy of {HEAD} (or a .safetensors "
                         "with the same tensors)")
    path = Path(cfg.aesthetic_head).expanduser()
    if not path.is_file():
        raise ValueError(f"reward.aesthetic_head={cfg.aesthetic_head!r} is not a file: set it to a local copy "
                         f"of {HEAD}")
    if path.suffix not in (".pth", ".pt", ".safetensors"):
        raise ValueError(f"reward.aesthetic_head={cfg.aesthetic_head!r}: expected a .pth/.pt or .safetensors file")
    return path


def load_aesthetic_head(path: Path, input_size: int = 768) -> AestheticMLP:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    head = AestheticMLP(input_size)
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{path} does not hold the aesthetic MLP {input_size}-1024-128-64-16-1 "
                         f"(layers.0/2/4/6/7 .weight/.bias): {e}") from e
    return head.float().eval().requires_grad_(False)


@register_reward("aesthetic")
class Aesthetic:
    @classmethod
    def check_config(cls, cfg: RewardConfig) -> None:
        check_processor_files(require_dir(cfg.clip_model, "clip_model", CLIP), "clip_model", CLIP)
        _head_path(cfg)
        model_dtype(cfg)

    def __init__(self, cfg: RewardConfig, device: torch.device):
        clip_path = require_dir(cfg.clip_model, "clip_model", CLIP)
        head_path = _head_path(cfg)
        self.processor = load_clip_processor(clip_path, "clip_model", CLIP)
        self.model, _ = load_clip_model(clip_path, device, model_dtype(cfg))
        dim = self.model.config.projection_dim
        self.head = load_aesthetic_head(head_path, dim).to(device)

    @torch.no_grad()
    def __call__(self, images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        pixels = clip_pixels(self.processor.image_processor, images_B3HW)
        return self.head(image_embeds(self.model, pixels)).squeeze(1).double().cpu()
