"""GenEval's folder layout (github.com/djghosh13/geneval, README "Evaluation: image generation"): one folder per
prompt, numbered in the order of evaluation_metadata.jsonl with 5 digits, holding that prompt's metadata line and
its images,

    <outdir>/00000/metadata.jsonl        the prompt's record, one JSON line (tag, include, exclude, prompt)
    <outdir>/00000/samples/0000.png      its images, numbered with 4 digits
    <outdir>/00000/grid.png              (optional in GenEval; not written)

so that GenEval's `evaluation/evaluate_images.py <outdir>` scores them where its detector is installed. imagerl
computes no GenEval score itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image


def prompt_dir(outdir: Path, index: int) -> Path:
    return Path(outdir) / f"{index:05d}"


def write_image(outdir: Path, index: int, record: dict, k: int, image_3HW: torch.Tensor) -> Path:
    """Prompt `index`'s metadata line (the same for each of its images) and its image k (float [0, 1]) as a PNG."""
    folder = prompt_dir(outdir, index)
    (folder / "samples").mkdir(parents=True, exist_ok=True)
    (folder / "metadata.jsonl").write_text(json.dumps(record) + "\n")
    array = (image_3HW.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    path = folder / "samples" / f"{k:04d}.png"
    Image.fromarray(np.ascontiguousarray(array)).save(path)
    return path
