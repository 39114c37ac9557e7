"""What the CLIP-based rewards share: loading a local CLIPModel/CLIPProcessor, the dtype, the
uint8 -> PIL conversion, and the embeddings (as float32, whatever the model dtype).

Nothing is ever downloaded: every path must be a local directory in the Hugging Face layout
(`save_pretrained` / a `huggingface-cli download` copy). The image processor is always the PIL one
(transformers 5 picks the torchvision backend when torchvision is installed, 4.x used PIL): the same
pixels on every machine, and the preprocessing flow_grpo's scores were computed with.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from imagerl.config import RewardConfig

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # Hub repos / transformers 5 save_pretrained
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def model_dtype(cfg: RewardConfig) -> torch.dtype:
    if cfg.dtype not in DTYPES:
        raise ValueError(f"reward.dtype must be float32 or bfloat16, got {cfg.dtype!r}")
    return DTYPES[cfg.dtype]


def require_dir(path: str, key: str, what: str, must_contain: str | None = "config.json") -> Path:
    """The local directory at `path` (holding `must_contain`), or a ValueError telling which setting to fix."""
    if not path:
        raise ValueError(f"reward.{key} is empty: set reward.{key} to a local copy of {what}")
    p = Path(path).expanduser()
    if not p.is_dir():
        raise ValueError(f"reward.{key}={path!r} is not a directory: set reward.{key} to a local copy of {what} "
                         "(model weights are never downloaded)")
    if must_contain and not (p / must_contain).is_file():
        raise ValueError(f"reward.{key}={path!r} has no {must_contain}: it should be a local copy of {what} "
                         "(a directory written by save_pretrained or huggingface-cli download)")
    return p


def check_processor_files(path: Path, key: str, what: str) -> None:
    if not any((path / f).is_file() for f in PROCESSOR_FILES):
        raise ValueError(f"{path} has no {' or '.join(PROCESSOR_FILES)} (no CLIP processor): set reward.{key} to a "
                         f"local copy of {what}")


def load_clip_model(path: Path, device: torch.device, dtype: torch.dtype):
    from transformers import CLIPModel

    model = CLIPModel.from_pretrained(str(path), local_files_only=True, dtype=torch.float32)
    # exp(logit_scale) in float32 before any bf16 cast: in bf16, logit_scale = 4.6052 rounds to 4.5938 and
    # exp() would move every score by ~1 %
    scale = model.logit_scale.detach().float().exp().item()
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False), scale


def load_clip_processor(path: Path, key: str, what: str):
    """CLIPProcessor = the PIL CLIP image processor + the tokenizer saved at `path`."""
    from transformers import AutoTokenizer, CLIPProcessor

    try:
        from transformers import CLIPImageProcessorPil as PilImageProcessor  # transformers >= 5
    except ImportError:  # transformers 4.x: the "slow" processor is the PIL one
        from transformers import CLIPImageProcessor as PilImageProcessor
    check_processor_files(path, key, what)
    try:
        image_processor = PilImageProcessor.from_pretrained(str(path), local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the CLIP processor from {path} ({e}): set reward.{key} to a local copy "
                         f"of {what}") from e
    return CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer)


def to_pil(images_B3HW: torch.Tensor) -> list:
    """float [0, 1] -> uint8 round(x * 255) -> PIL RGB, as flow_grpo does before its processors."""
    from PIL import Image

    arr = (images_B3HW.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(np.ascontiguousarray(a), mode="RGB") for a in arr]


_WORKERS = min(8, os.cpu_count() or 1)
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=_WORKERS, thread_name_prefix="clip-preprocess")
        return _POOL


def clip_pixels(image_processor, images_B3HW: torch.Tensor) -> torch.Tensor:
    """pixel_values of the PIL image processor for to_pil(images), images processed in parallel threads
    (PIL's resize releases the GIL; one image's pixels do not depend on the others)."""
    pils = to_pil(images_B3HW)
    workers = min(len(pils), _WORKERS)
    if workers <= 1:
        return image_processor(images=pils, return_tensors="pt")["pixel_values"]
    step = -(-len(pils) // workers)
    chunks = [pils[i:i + step] for i in range(0, len(pils), step)]
    parts = _pool().map(lambda chunk: image_processor(images=chunk, return_tensors="pt")["pixel_values"], chunks)
    return torch.cat(list(parts))


def _embeds(out) -> torch.Tensor:
    # transformers 5 returns a BaseModelOutputWithPooling whose pooler_output is the projected embedding; 4.x a tensor
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def image_embeds(model, pixel_values: torch.Tensor) -> torch.Tensor:
    """L2-normalised projected image embeddings, float32."""
    param = next(model.parameters())
    emb = _embeds(model.get_image_features(pixel_values=pixel_values.to(device=param.device, dtype=param.dtype)))
    emb = emb.float()
    return emb / emb.norm(p=2, dim=-1, keepdim=True)


def text_embeds(model, tokens) -> torch.Tensor:
    """L2-normalised projected text embeddings, float32."""
    device = next(model.parameters()).device
    out = model.get_text_features(input_ids=tokens["input_ids"].to(device),
                                  attention_mask=tokens["attention_mask"].to(device))
    emb = _embeds(out).float()
    return emb / emb.norm(p=2, dim=-1, keepdim=True)


def unique_text_embeds(model, tokenizer, prompts: list[str], **tok_kwargs) -> torch.Tensor:
    """Text embeddings per prompt, each unique prompt encoded once (a rollout has K copies of every prompt)."""
    unique = list(dict.fromkeys(prompts))
    tokens = tokenizer(unique, truncation=True, max_length=77, return_tensors="pt", **tok_kwargs)
    emb = text_embeds(model, tokens)
    index = {p: i for i, p in enumerate(unique)}
    return emb[torch.tensor([index[p] for p in prompts], device=emb.device)]
