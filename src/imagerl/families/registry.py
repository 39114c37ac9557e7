"""Family registry: name -> adapter class; resolution from a checkpoint (longest name pattern wins).

Resolution order: explicit `model.family`; the pipeline class in model_index.json; the checkpoint
path's name matched against each family's patterns, longest match first (so "Qwen-Image-2.1" would
pick a 2.1 family over "qwen-image"). No match is an error that says to set model.family.
"""

from __future__ import annotations

import json
from pathlib import Path

FAMILIES: dict[str, type] = {}


def register_family(cls):
    FAMILIES[cls.name] = cls
    return cls


def _import_builtin() -> None:
    from imagerl.families import qwen_image  # noqa: F401


def resolve_family(path: str | Path, family: str = "auto") -> type:
    _import_builtin()
    if family != "auto":
        if family not in FAMILIES:
            raise ValueError(f"unknown model.family {family!r}; available: {', '.join(sorted(FAMILIES))}")
        return FAMILIES[family]
    if not Path(path).is_dir():
        raise ValueError(f"model.path={str(path)!r} is not a directory; point it at a local diffusers-format checkpoint")
    index = Path(path) / "model_index.json"
    if index.is_file():
        try:
            pipeline = json.loads(index.read_text()).get("_class_name", "")
        except json.JSONDecodeError:
            pipeline = ""
        for cls in FAMILIES.values():
            if cls.pipeline_class_name == pipeline:
                return cls
    name = str(path).lower()
    matches = [(len(p), cls) for cls in FAMILIES.values() for p in cls.name_patterns if p in name]
    if not matches:
        raise ValueError(
            f"cannot tell the model family of {path}; set model.family to one of {', '.join(sorted(FAMILIES))}"
        )
    return max(matches, key=lambda m: m[0])[1]
