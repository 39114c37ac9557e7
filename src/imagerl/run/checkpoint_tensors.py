"""The trainer's state in a checkpoint: tensors in safetensors, everything else in JSON. Loading runs no code.

<checkpoint>/trainer/tensors.safetensors   every tensor, full (gathered from FSDP shards), keyed by its path in the
                                           state tree: model/<fqn> (the trainable LoRA params), optim/state/<fqn>/
                                           exp_avg ..., extra/nft/old/<fqn> ...
<checkpoint>/trainer/structure.json        the tree with each tensor replaced by {"tensor": "<key>"}: the
                                           optimizer's param_groups (lr, betas, eps, ...; params by FQN), step
                                           counts and any other non-tensor value

safetensors reads a JSON header and raw bytes (its format cannot hold code); json builds dicts, lists, strings and
numbers. Neither reaches pickle, unlike torch.distributed.checkpoint's .metadata and its non-tensor entries
(read with torch.load(weights_only=False)), which imagerl's format 1 used (`imagerl convert-checkpoint` converts).

Every tensor is checked finite when written and when read; a non-finite one is refused with its path and the
checkpoint. Full tensors load on any world size: each rank reads the file and keeps its own shard
(distribute_tensor without communication), as torch's set_*_state_dict(full_state_dict=True) does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from imagerl.distributed.parallel import World

FORMAT = 2  # state.json "format": 1 = torch.distributed.checkpoint (dcp/), 2 = this module (trainer/)
TENSORS, STRUCTURE = "tensors.safetensors", "structure.json"


class NonFiniteStateError(ValueError):
    """A tensor of the trainer's state is NaN or inf (writing or reading a checkpoint)."""


def _options(full: bool, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # the frozen base weights are not part of the state; full: gathered to rank 0 (CPU) / distributed from full
    return StateDictOptions(ignore_frozen_params=True, full_state_dict=full, cpu_offload=full, strict=strict)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()  # full_tensor: a collective


def flatten(tree, prefix: str = "") -> tuple[object, dict[str, torch.Tensor]]:
    """(JSON-able structure, tensors by key): each tensor in `tree` replaced by {"tensor": key}, key its path."""
    if isinstance(tree, torch.Tensor):
        return {"tensor": prefix}, {prefix: tree}
    if isinstance(tree, dict):
        out, tensors = {}, {}
        for k, v in tree.items():
            if not isinstance(k, str) or "/" in k:
                raise TypeError(f"checkpoint state key {prefix}/{k!r}: keys must be strings without '/'")
            out[k], sub = flatten(v, f"{prefix}/{k}" if prefix else k)
            tensors.update(sub)
        return out, tensors
    if isinstance(tree, (list, tuple)):
        parts = [flatten(v, f"{prefix}/{i}") for i, v in enumerate(tree)]
        return [p[0] for p in parts], {k: t for _, sub in parts for k, t in sub.items()}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return tree, {}
    raise TypeError(f"checkpoint state {prefix}: a {type(tree).__name__} is neither a tensor nor JSON")


def unflatten(structure, tensors: dict[str, torch.Tensor]):
    if isinstance(structure, dict):
        if set(structure) == {"tensor"} and isinstance(structure["tensor"], str):
            return tensors[structure["tensor"]]
        return {k: unflatten(v, tensors) for k, v in structure.items()}
    if isinstance(structure, list):
        return [unflatten(v, tensors) for v in structure]
    return structure


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [k for k, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]


def save_trainer_state(directory: Path, module, optimizer, extra: dict | None, world: World,
                       with_model: bool = True) -> None:
    """Every rank calls this (the gathers are collectives); rank 0 writes `directory`. A non-finite tensor stops
    every rank with NonFiniteStateError before anything is written."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"optim": get_optimizer_state_dict(module, optimizer, options=_options(full=True))}
    if with_model:
        state["model"] = get_model_state_dict(module, options=_options(full=True))
    if extra:
        state["extra"] = _map_tensors(extra, _full)
    structure, tensors = flatten(state) if world.is_main else (None, {})
    bad = non_finite(tensors)
    flag = torch.tensor([float(len(bad))], device=world.device)
    if world.all_reduce_mean_(flag).item() > 0:  # every rank stops together
        raise NonFiniteStateError(f"{bad[0] if bad else 'a tensor'} is not finite (NaN or inf)"
                                  + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    if world.is_main:
        write_trainer_files(directory, structure, tensors)


def write_trainer_files(directory: Path, structure, tensors: dict[str, torch.Tensor]) -> None:
    """trainer/: the tensors (safetensors) and the structure that places them (JSON), as flatten() gives them."""
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous().clone() for k, t in tensors.items()}, directory / TENSORS)
    (directory / STRUCTURE).write_text(json.dumps({"format": FORMAT, "state": structure}, indent=1))


def read_trainer_state(directory: Path) -> dict:
    """The state tree as saved (full tensors on the CPU), after checking that every tensor is finite."""
    try:
        header = json.loads((directory / STRUCTURE).read_text())
        tensors = load_file(directory / TENSORS)
        state = unflatten(header["state"], tensors)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{directory} is not an imagerl trainer state ({type(e).__name__}: {e})") from e
    bad = non_finite(tensors)
    if bad:
        raise NonFiniteStateError(f"{directory.parent}: {bad[0]} is not finite (NaN or inf)"
                                  + (f", and {len(bad) - 1} more tensors" if len(bad) > 1 else "")
                                  + "; resume from an earlier checkpoint (--resume <run>/checkpoints/step_N)")
    return state


def load_trainer_state(directory: Path, module, optimizer, extra: dict | None = None, with_model: bool = True) -> None:
    """Restore the trainable params, the optimizer and `extra` (tensors loaded into in place) on every rank."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    saved = read_trainer_state(directory)
    if with_model:
        missing = sorted(set(_trainable_names(module)) - set(saved.get("model", {})))
        if missing:
            raise ValueError(f"{directory.parent}: no saved value for {missing[0]} (and {len(missing) - 1} more); "
                             "the checkpoint was written for another LoRA (rank or target modules)")
        set_model_state_dict(module, saved["model"], options=_options(full=True, strict=False))
    if extra:
        _load_in_place(extra, saved.get("extra", {}), directory.parent, "extra")
    # params that never got a gradient (e.g. the last block's unused text-stream output) have no AdamW state in
    # the file; torch initialises one for every param (a zero-gradient step), removed again so that the restored
    # state is the saved one exactly (AdamW skips params without a gradient either way)
    set_optimizer_state_dict(module, optimizer, saved["optim"], options=_options(full=True, strict=False))
    stateless = set(_trainable_names(module)) - set(saved["optim"].get("state", {}))
    for name, param in module.named_parameters():
        if name.replace("_orig_mod.", "") in stateless:
            optimizer.state.pop(param, None)


def _trainable_names(module) -> list[str]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return list(get_model_state_dict(module, options=_options(full=False)))


def _map_tensors(tree, fn):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    return tree


def _load_in_place(target: dict, saved: dict, checkpoint: Path, path: str) -> None:
    """Copy `saved`'s full tensors into `target`'s (a DTensor keeps its own shard of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for key, value in target.items():
        where = f"{path}/{key}"
        if key not in saved:
            raise ValueError(f"{checkpoint}: no saved value for {where} (written by another algorithm setting?)")
        if isinstance(value, dict):
            _load_in_place(value, saved[key], checkpoint, where)
            continue
        full = saved[key]
        if tuple(full.shape) != tuple(value.shape):
            raise ValueError(f"{checkpoint}: {where} has shape {tuple(full.shape)}, this run {tuple(value.shape)}")
        with torch.no_grad():
            if isinstance(value, DTensor):  # this rank's shard of the full tensor, no communication
                shard = distribute_tensor(full.to(value.device, value.dtype), value.device_mesh, value.placements,
                                          src_data_rank=None)
                value._local_tensor.copy_(shard._local_tensor)
            else:
                value.copy_(full)
