"""Sampling defaults a model recommends: `imagerl_defaults.json` beside model_index.json.

    {"height": 64, "width": 64, "num_steps": 10, "guidance_scale": 1.0, "rewards": ["shapes"]}

Every key is optional (height and width go together). `imagerl sample`, `imagerl eval` and `imagerl sft`
take each setting from, in this order: the command line, the model's imagerl_defaults.json, the family's
class defaults (default_resolution, default_num_steps, default_guidance_scale). `rewards` is the reward
`imagerl eval` scores with when no --reward is given. The hub checkpoints have no such file; the shipped
quickstart model has one (its training size, 10 steps, no CFG, the shapes reward).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

DEFAULTS_FILE = "imagerl_defaults.json"
KEYS = ("height", "width", "num_steps", "guidance_scale", "rewards")


@dataclass(frozen=True)
class ModelDefaults:
    """The settings of a model's imagerl_defaults.json; None where the file (or the key) is absent."""

    height: int | None = None
    width: int | None = None
    num_steps: int | None = None
    guidance_scale: float | None = None
    rewards: tuple[str, ...] | None = None
    source: Path | None = None  # the file read

    def sampling(self, family_cls, *, height: int | None = None, width: int | None = None,
                 num_steps: int | None = None, guidance_scale: float | None = None) -> tuple[int, int, int, float]:
        """(height, width, num_steps, guidance_scale): each given value, else this file's, else the family's."""
        return (_first(height, self.height, family_cls.default_resolution),
                _first(width, self.width, family_cls.default_resolution),
                _first(num_steps, self.num_steps, family_cls.default_num_steps),
                float(_first(guidance_scale, self.guidance_scale, family_cls.default_guidance_scale)))


def _first(*values):
    return next(v for v in values if v is not None)


def model_defaults(model_dir: str | Path) -> ModelDefaults:
    """Read `model_dir`/imagerl_defaults.json (no file, or no directory: all None). Every problem is a
    ValueError naming the file and the key."""
    path = Path(model_dir) / DEFAULTS_FILE
    if not path.is_file():
        return ModelDefaults()
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object, e.g. {{\"height\": 64, \"width\": 64, \"num_steps\": 10}}")
    for key, value in raw.items():
        if key not in KEYS:
            raise ValueError(f"{path}: unknown key {key!r}; valid: {', '.join(KEYS)}")
        if key in ("height", "width", "num_steps") and (type(value) is not int or value < 1):
            raise ValueError(f"{path}: {key!r} must be a positive integer, got {value!r}")
        if key == "guidance_scale" and (type(value) not in (int, float) or not math.isfinite(value) or value < 1):
            raise ValueError(f"{path}: 'guidance_scale' must be a number >= 1 (1: no CFG), got {value!r}")
        if key == "rewards" and (not isinstance(value, list) or not value
                                 or not all(isinstance(v, str) and v.strip() for v in value)):
            raise ValueError(f"{path}: 'rewards' must be a non-empty list of reward names, got {value!r}")
    if ("height" in raw) != ("width" in raw):
        raise ValueError(f"{path}: give both 'height' and 'width' (or neither)")
    return ModelDefaults(raw.get("height"), raw.get("width"), raw.get("num_steps"),
                         None if raw.get("guidance_scale") is None else float(raw["guidance_scale"]),
                         tuple(raw["rewards"]) if "rewards" in raw else None, path)


def write_model_defaults(model_dir: str | Path, **settings) -> Path:
    """Write `model_dir`/imagerl_defaults.json (checked by reading it back)."""
    path = Path(model_dir) / DEFAULTS_FILE
    path.write_text(json.dumps(settings, indent=1) + "\n")
    model_defaults(model_dir)
    return path


# `imagerl make-tiny-checkpoint` writes these: a tiny random model samples fast there, and inside its position table
# (tiny SD3: pos_embed_max_size 16 patches x 4 px = 64 px; the family's 1024 px default is past it)
TINY_DEFAULTS = {"height": 64, "width": 64, "num_steps": 10}
