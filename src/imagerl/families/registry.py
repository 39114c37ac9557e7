"""Family registry: name -> adapter class; resolution from a checkpoint or a model name.

Resolution order: explicit `--family` / `model.family`; the pipeline class in a local checkpoint's
model_index.json (the checkpoint says what it is); the name matched against each family's
case-insensitive patterns, longest match first ("Qwen/Qwen-Image-2.1" -> qwen_image21, although
"qwen-image" matches too). No match is an error that lists the families and the override.
"""

from __future__ import annotations

import json
from pathlib import Path

FAMILIES: dict[str, type] = {}


def register_family(cls):
    FAMILIES[cls.name] = cls
    return cls


def _import_builtin() -> None:
    from imagerl.families import flux, qwen_image, qwen_image21, sd3  # noqa: F401  (registration on import)


def tiny_families() -> dict[str, type]:
    """model.path names of tiny random checkpoints ("tiny", "tiny21", ...) -> their family class."""
    _import_builtin()
    return {cls.tiny_name: cls for cls in FAMILIES.values() if cls.tiny_name}


def _unknown(name: str) -> ValueError:
    return ValueError(
        f"cannot tell the model family of {name!r}; pass --family (or model.family=) with one of: "
        f"{', '.join(sorted(FAMILIES))}"
    )


def family_from_name(name: str) -> str:
    """Case-insensitive name patterns, longest match wins ('Qwen/Qwen-Image-2.1' -> qwen_image21)."""
    _import_builtin()
    lowered = str(name).lower()
    matches = [(len(p), cls.name) for cls in FAMILIES.values() for p in cls.name_patterns if p in lowered]
    if not matches:
        raise _unknown(str(name))
    return max(matches)[1]


def resolve_family(name_or_path: str | Path, family: str = "auto") -> str:
    """The family name: explicit `family`; else a local checkpoint's model_index.json pipeline class;
    else the name patterns. ValueError (listing the families and the override) when unknown."""
    _import_builtin()
    if family != "auto":
        if family not in FAMILIES:
            raise ValueError(f"unknown family {family!r}; available: {', '.join(sorted(FAMILIES))}")
        return family
    index = Path(name_or_path) / "model_index.json"
    if index.is_file():
        try:
            pipeline = json.loads(index.read_text()).get("_class_name", "")
        except json.JSONDecodeError:
            pipeline = ""
        for cls in FAMILIES.values():
            if cls.pipeline_class_name == pipeline:
                return cls.name
    return family_from_name(str(name_or_path))


def family_class(path: str | Path, family: str = "auto") -> type:
    """The adapter class for a local checkpoint directory. With family "auto" the directory must exist and hold
    a readable model_index.json (said before any question of the family: an empty or mistyped directory is not
    a family problem); an explicit family leaves these checks to the adapter's from_pretrained."""
    from imagerl.families.base import read_model_index

    _import_builtin()
    if family == "auto":
        read_model_index(Path(path))
    return FAMILIES[resolve_family(path, family)]
