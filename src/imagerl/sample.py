"""`imagerl sample`: plain inference (ODE; size, steps and guidance from the flags, else the model's
imagerl_defaults.json, else the family's), optionally with a trained LoRA."""

from __future__ import annotations

from pathlib import Path

import torch

from imagerl.run.checkpoint import check_lora_dir, load_lora
from imagerl.components import resolve_dtype, resolve_model_path
from imagerl.distributed.parallel import resolve_device
from imagerl.distributed.rng import make_generator
from imagerl.families.registry import family_class
from imagerl.families.model_defaults import model_defaults
from imagerl.rollout import ode_sample


def sample_images(model: str, prompts: list[str], *, family: str = "auto", lora: str | None = None,
                  num_steps: int | None = None, seed: int = 0, guidance_scale: float | None = None,
                  height: int | None = None, width: int | None = None, negative_prompt: str = " ",
                  device: str = "auto", dtype: str = "auto", log=None) -> torch.Tensor:
    """RGB images (B, 3, H, W) in [0, 1]; image i's noise comes from (seed, i), independent of batching.

    model: a checkpoint directory or a shipped name (quickstart / tiny / tiny21). Settings left None come from
    the model's imagerl_defaults.json, else the family's defaults; log(line), if given, reports the ones used."""
    if not prompts:
        raise ValueError("give at least one --prompt")
    for flag, value in (("--steps", num_steps), ("--height", height), ("--width", width)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    checked = check_lora_dir(Path(lora)) if lora else None  # read and checked before the model loads
    path = resolve_model_path(model)
    cls = family_class(path, family)
    defaults = model_defaults(path)
    h, w, steps, guidance = defaults.sampling(cls, height=height, width=width, num_steps=num_steps,
                                              guidance_scale=guidance_scale)
    dev = resolve_device(device)
    adapter = cls.from_pretrained(path, dev, resolve_dtype(dtype, dev))
    if checked is not None:
        load_lora(adapter, checked)
    if log is not None:
        log(f"{h}x{w} px, {steps} steps, guidance {guidance:g}"
            + (f" (defaults: the model's {defaults.source.name})" if defaults.source else ""))
    noise = torch.cat([adapter.initial_noise([make_generator(seed, "sample", i)], h, w) for i in range(len(prompts))])
    latents = ode_sample(adapter, prompts, num_steps=steps, guidance_scale=guidance, height=h, width=w,
                         initial_noise_BNC=noise, negative_prompt=negative_prompt)
    return adapter.decode(latents, h, w).cpu()


def check_image_path(out: str) -> None:
    """ValueError unless PIL can write `out` by its extension (checked before sampling, which takes minutes)."""
    from PIL import Image

    Image.init()
    suffix = Path(out).suffix.lower()
    if suffix not in Image.registered_extensions() or Image.registered_extensions()[suffix] not in Image.SAVE:
        raise ValueError(f"--out {out}: give an image file name ending in .png (or .jpg, .webp), e.g. --out "
                         f"{Path(out).with_suffix('.png')}")


def save_images(images_B3HW: torch.Tensor, out: str) -> list[Path]:
    """One PNG per image: `out` itself for one image, out_0.png, out_1.png ... for several."""
    from PIL import Image

    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    arrays = (images_B3HW.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    paths = [out_path] if len(arrays) == 1 else [out_path.with_name(f"{out_path.stem}_{i}{out_path.suffix}")
                                                  for i in range(len(arrays))]
    for array, path in zip(arrays, paths):
        Image.fromarray(array).save(path)
    return paths
