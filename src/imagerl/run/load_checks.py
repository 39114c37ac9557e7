"""Checks on the files imagerl loads from a checkpoint or an adapter, before their values reach a model or an
optimizer. Each problem is a ValueError that names the file (and the tensor or key) and says what to do.

  read_json            JSON that parses and nests at most MAX_JSON_DEPTH deep: json.loads recurses, and so does the
                       code that walks a config or a state tree, so a deeper document would end in a RecursionError
  safetensors_header,  the safetensors library's header errors (a header of 2^62 bytes, one past the end of the
  read_tensors         file, a truncated file, a header that is not JSON) with the file named; each tensor's dtype
                       checked from the header before any tensor is read: complex and integer tensors where the
                       model has floats would be cast (complex with a warning, its imaginary part dropped)
  read_lora_dir,       a PEFT adapter: its config (rank, alpha, target modules) and its tensors agree, every tensor
  check_lora_matches   is a finite float, and once the model has its LoRA layers, every LoRA tensor the model has is
                       present with its shape and there is no other (an empty file would leave the base model)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_JSON_DEPTH = 64  # imagerl's own files nest about 6 deep (the trainer state tree, a config's sections)
PEFT_PREFIX = "base_model.model."

# dtype names as safetensors headers spell them
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
INT_DTYPES = {"I64", "I32", "I16", "I8", "U8"}


def parse_json(text: str, where: str):
    """The JSON value in `text`; ValueError naming `where` when it is not JSON or nests past MAX_JSON_DEPTH."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} cannot be read: not valid JSON ({e})") from None
    except RecursionError:
        too_deep = True
    else:
        too_deep = _too_deep(value)
    if too_deep:
        raise ValueError(f"{where} cannot be read: it nests lists or objects more than {MAX_JSON_DEPTH} deep, which no "
                         "file imagerl writes does")
    return value


def read_json(path: Path):
    """parse_json of a file (UTF-8); ValueError naming it when it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} cannot be read: not UTF-8 text ({e})") from None
    return parse_json(text, str(path))


def _too_deep(value) -> bool:
    stack = [(value, 1)]
    while stack:  # iterative: the point is not to recurse
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def safetensors_header(path: Path, hint: str) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str]]:
    """{key: (dtype as the header spells it, shape)} and the metadata of a safetensors file, reading its header only;
    `hint` (what to do) ends the message of a damaged one."""
    from safetensors import SafetensorError, safe_open

    if not Path(path).is_file():
        raise ValueError(f"{path} is missing; {hint}")
    try:
        with safe_open(str(path), "pt") as f:
            entries = {k: (f.get_slice(k).get_dtype(), list(f.get_slice(k).get_shape())) for k in f.keys()}
            return entries, f.metadata() or {}
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}): it is damaged or was not written by "
                         f"imagerl; {hint}") from None


def check_dtypes(path: Path, header: dict[str, tuple[str, list[int]]], allowed, hint: str) -> None:
    """ValueError naming the first tensor whose dtype is not in allowed(key) (a set of header dtype names)."""
    for key, (dtype, _) in sorted(header.items()):
        if dtype not in allowed(key):
            kind = ("complex" if dtype.startswith("C") else "integer" if dtype in INT_DTYPES
                    else "floating-point" if dtype in FLOAT_DTYPES else "neither float nor integer")
            raise ValueError(f"{path}: tensor {key} is {dtype} ({kind}); imagerl holds "
                             f"{'/'.join(sorted(allowed(key)))} there, so the file was altered or not written by "
                             f"imagerl; {hint}")


def read_tensors(path: Path, allowed, hint: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file after check_dtypes on its header (allowed(key): the dtype names that key
    may have); read errors name the file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    check_dtypes(path, safetensors_header(path, hint)[0], allowed, hint)
    try:
        return load_file(path)
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}); {hint}") from None


def floats_only(key: str) -> set[str]:
    return FLOAT_DTYPES


def first_non_finite(tensors: dict[str, torch.Tensor]) -> tuple[str | None, int]:
    """The first key (sorted) whose tensor holds a NaN or an infinity, and how many tensors do."""
    bad = sorted(k for k, t in tensors.items()
                 if (t.is_floating_point() or t.is_complex()) and not torch.isfinite(t).all())
    return (bad[0] if bad else None), len(bad)


def check_weights_dir(folder: Path, hint: str) -> None:
    """Every .safetensors file of a saved model folder (a full fine-tune's transformer/) holds finite floats only."""
    for file in sorted(Path(folder).glob("*.safetensors")):
        first, count = first_non_finite(read_tensors(file, floats_only, hint))
        if first is not None:
            raise ValueError(f"{file}: {first} is not finite (NaN or inf)"
                             + (f", and {count - 1} more tensors" if count > 1 else "") + f"; {hint}")


# ---------------------------------------------------------------- LoRA adapters (PEFT directories)


@dataclass
class LoraFiles:
    """A PEFT adapter directory, read and checked: what add_lora needs and the tensors in PEFT naming."""

    directory: Path
    rank: int
    alpha: float
    target_modules: list[str]
    state: dict[str, torch.Tensor]  # keys without PEFT_PREFIX, e.g. transformer_blocks.0.attn.to_q.lora_A.weight

    @property
    def weights_file(self) -> Path:
        return self.directory / "adapter_model.safetensors"

    @property
    def config_file(self) -> Path:
        return self.directory / "adapter_config.json"


LORA_HINT = "use an adapter imagerl wrote (the lora/ folder of a checkpoint), or train one"


def read_lora_dir(directory: Path) -> LoraFiles:
    """Read and check a PEFT adapter directory (everything that can be checked without the model): the config's
    rank, alpha and target modules; real floating, finite tensors; at least one; the rank of each lora_A / lora_B
    the config's."""
    directory = Path(directory)
    config_file, weights = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        hint = ("" if directory.is_dir() else " (it does not exist)") + (
            f"; its lora/ folder is {directory / 'lora'}" if (directory / "lora" / "adapter_config.json").is_file()
            else "")
        raise ValueError(f"--lora {directory}: expected adapter_config.json and adapter_model.safetensors "
                         f"(the lora/ folder of an imagerl checkpoint){hint}")
    rank, alpha, targets = _lora_config(config_file)
    tensors = read_tensors(weights, floats_only, LORA_HINT)
    if not tensors:
        raise ValueError(f"{weights} holds no tensors: an adapter that would leave the base model as it is; "
                         f"{LORA_HINT}")
    first, count = first_non_finite(tensors)
    if first is not None:
        raise ValueError(f"{weights}: {first} is not finite (NaN or inf)"
                         + (f", and {count - 1} more tensors" if count > 1 else "") + f"; {LORA_HINT}")
    for key, t in sorted(tensors.items()):
        row = 0 if key.endswith("lora_A.weight") else 1 if key.endswith("lora_B.weight") else None
        if row is not None and (t.dim() != 2 or t.shape[row] != rank):
            raise ValueError(f"{config_file}: 'r' is {rank}, but {weights} holds {key} of shape {tuple(t.shape)} "
                             f"(rank {t.shape[row] if t.dim() == 2 else '?'}): the config and the tensors belong to "
                             f"different adapters; {LORA_HINT}")
    return LoraFiles(directory, rank, alpha, targets, {k.removeprefix(PEFT_PREFIX): v for k, v in tensors.items()})


def _lora_config(file: Path) -> tuple[int, float, list[str]]:
    """(r, lora_alpha, target_modules) of a PEFT adapter_config.json, each checked; features imagerl's loader does not
    apply (DoRA, rsLoRA's scale, per-module ranks or alphas) refused rather than silently dropped."""
    from imagerl.config import _short

    config = read_json(file)
    if not isinstance(config, dict):
        raise ValueError(f"{file} must hold a JSON object (a PEFT LoRA config), got {_short(config)}")
    rank = config.get("r")
    if type(rank) is not int or rank < 1:
        raise ValueError(f"{file}: 'r' (the LoRA rank) must be a positive integer, got {_short(rank)}")
    alpha = config.get("lora_alpha")
    if type(alpha) not in (int, float) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"{file}: 'lora_alpha' must be a finite number > 0, got {_short(alpha)}")
    targets = config.get("target_modules")
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) and t for t in targets):
        raise ValueError(f"{file}: 'target_modules' must be a non-empty list of module names, got {_short(targets)}")
    for key in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise ValueError(f"{file}: {key}={_short(config[key])}: imagerl loads plain LoRA adapters (one rank and "
                             f"alpha, no DoRA or rsLoRA scaling); {LORA_HINT}")
    return rank, alpha, targets


def check_lora_matches(transformer, lora: LoraFiles) -> None:
    """After the LoRA layers are added to `transformer`: the adapter has a tensor for every LoRA parameter, of its
    shape, and none the model lacks."""
    from peft.utils import get_peft_model_state_dict

    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(transformer).items()}
    given = {k: tuple(v.shape) for k, v in lora.state.items()}
    hint = "the adapter was trained for another model or other LoRA settings"
    missing, unknown = sorted(set(expected) - set(given)), sorted(set(given) - set(expected))
    if missing:
        raise ValueError(f"{lora.weights_file}: no tensor for {PEFT_PREFIX}{missing[0]} ({len(missing)} of this "
                         f"model's {len(expected)} LoRA tensors missing); {hint}")
    if unknown:
        raise ValueError(f"{lora.weights_file}: {PEFT_PREFIX}{unknown[0]} is not a LoRA tensor of this model "
                         f"({len(unknown)} such); {hint}")
    for key in sorted(expected):
        if given[key] != expected[key]:
            raise ValueError(f"{lora.weights_file}: {PEFT_PREFIX}{key} has shape {given[key]}, this model's LoRA "
                             f"{expected[key]}; {hint}")
