"""Image-caption data for `imagerl sft`: reading, checking, resizing, and the (seed, step) batch order.

Two layouts:
  * a JSONL file, one object per line: {"image": path (relative to the file, or absolute), "prompt": text}
    ("caption" is accepted for "prompt"); blank lines are skipped.
  * a folder of images (.png .jpg .jpeg .webp .bmp, not recursive), each with a caption file of the same
    name and suffix .txt (cat.png + cat.txt).
Every problem (missing file, missing or empty caption, unreadable image, no examples) is a ValueError that
names the line or file, raised before any model is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from imagerl.distributed.rng import make_generator

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


@dataclass(frozen=True)
class Example:
    image: Path
    caption: str


def load_examples(data: str | Path) -> list[Example]:
    """The (image, caption) pairs of a JSONL file or an image folder, checked."""
    path = Path(data).expanduser()
    if not str(data):
        raise ValueError("data is empty: give a JSONL file ({\"image\": ..., \"prompt\": ...} per line) or an image folder")
    if path.is_dir():
        examples = _from_folder(path)
    elif path.is_file():
        examples = _from_jsonl(path)
    else:
        raise ValueError(f"data={str(data)!r} does not exist (expected a .jsonl file or a folder of images + .txt)")
    if not examples:
        raise ValueError(f"data={str(data)!r} holds no examples")
    return examples


def _caption(value, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: missing or empty caption (a non-empty \"prompt\" or \"caption\" string)")
    return value.strip()


def _from_jsonl(path: Path) -> list[Example]:
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from e
        except RecursionError:  # json recurses into nested lists and objects
            raise ValueError(f"{where}: nested too deeply to be an image-caption record") from None
        if not isinstance(record, dict) or not isinstance(record.get("image"), str) or not record["image"]:
            raise ValueError(f"{where}: expected an object with an \"image\" path and a \"prompt\" (or \"caption\")")
        image = (path.parent / record["image"]).expanduser()
        if not image.is_file():
            raise ValueError(f"{where}: image file {image} does not exist")
        out.append(Example(image, _caption(record.get("prompt", record.get("caption")), where)))
    return out


def _from_folder(folder: Path) -> list[Example]:
    out = []
    for image in sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()):
        text = image.with_suffix(".txt")
        if not text.is_file():
            raise ValueError(f"{image}: no caption file {text.name} next to it")
        out.append(Example(image, _caption(text.read_text(), str(text))))
    return out


def load_image(path: Path, height: int, width: int) -> torch.Tensor:
    """(3, height, width) float32 in [0, 1]: transparency composited over white, resized so the image covers
    height x width (aspect kept, bicubic), center-cropped."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()
            rgba = im.convert("RGBA")
    except (OSError, UnidentifiedImageError) as e:
        raise ValueError(f"cannot read image {path}: {e}") from e
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    rgb = Image.alpha_composite(white, rgba).convert("RGB")
    scale = max(height / rgb.height, width / rgb.width)
    size = (max(width, round(rgb.width * scale)), max(height, round(rgb.height * scale)))
    if size != rgb.size:
        rgb = rgb.resize(size, Image.Resampling.BICUBIC)
    left, top = (rgb.width - width) // 2, (rgb.height - height) // 2
    rgb = rgb.crop((left, top, left + width, top + height))
    return torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8).view(height, width, 3).permute(2, 0, 1).float() / 255


def batch_indices(seed: int, step: int, batch_size: int, num_examples: int) -> list[int]:
    """Example indices of optimizer step `step` (0-based): epochs are permutations keyed by (seed, epoch), read
    consecutively, so every example is seen once per epoch and the batch depends only on (seed, step)."""
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, offset = divmod(position, num_examples)
        out.append(_permutation(seed, epoch, num_examples)[offset])
    return out


_PERMUTATIONS: dict[tuple[int, int, int], list[int]] = {}


def _permutation(seed: int, epoch: int, n: int) -> list[int]:
    key = (seed, epoch, n)
    if key not in _PERMUTATIONS:
        if len(_PERMUTATIONS) > 8:
            _PERMUTATIONS.clear()
        _PERMUTATIONS[key] = torch.randperm(n, generator=make_generator(seed, "sft/order", epoch)).tolist()
    return _PERMUTATIONS[key]
