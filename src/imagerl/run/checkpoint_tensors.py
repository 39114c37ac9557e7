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

Every tensor is checked finite when written and when read, and of the dtype its place takes (floats for the
params and the optimizer's moments: a complex or integer tensor would be cast into them); a bad one is refused with
its path and the checkpoint. The params and moments must have this run's shapes, and the optimizer's settings are
this run's: lr, betas, eps and weight_decay come from the config, the others must be AdamW's own (RUN_SETTINGS).
Full tensors load on any world size: each rank reads the file and keeps its own shard
(distribute_tensor without communication), as torch's set_*_state_dict(full_state_dict=True) does.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from imagerl.distributed.parallel import World
from imagerl.run.load_checks import FLOAT_DTYPES, INT_DTYPES, check_dtypes, read_json, read_tensors, safetensors_header

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
    return [k for k, t in tensors.items() if (t.is_floating_point() or t.is_complex()) and not torch.isfinite(t).all()]


_HINT = "resume from an earlier checkpoint (--resume <run>/checkpoints/step_N)"


def _allowed_dtypes(key: str) -> set[str]:
    """The params and the optimizer's moments are floats; an algorithm's tensors may also be integer counters
    (their kind is checked against this run's tensors when loaded)."""
    return FLOAT_DTYPES if key.startswith(("model/", "optim/")) else FLOAT_DTYPES | INT_DTYPES


def _read_structure(directory: Path):
    """structure.json's tree (a dict with 'state'), ValueError naming the file otherwise."""
    file = directory / STRUCTURE
    try:
        header = read_json(file)
    except OSError as e:
        raise ValueError(f"{file} cannot be read ({e}); {_HINT}") from e
    if not isinstance(header, dict) or not isinstance(header.get("state"), dict):
        raise ValueError(f"{file} is not an imagerl trainer state (no 'state' mapping); {_HINT}")
    return header["state"]


def check_trainer_files(directory: Path) -> None:
    """What can be checked of trainer/ without reading its tensors (before a model loads): structure.json, the
    tensor file's header, each tensor's dtype, and that every tensor the structure names is in the file."""
    structure = _read_structure(directory)
    header = safetensors_header(directory / TENSORS, _HINT)[0]
    check_dtypes(directory / TENSORS, header, _allowed_dtypes, _HINT)
    try:
        unflatten(structure, header)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{directory / STRUCTURE} names a tensor {e} that {TENSORS} does not hold; {_HINT}") from None


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
    structure = _read_structure(directory)
    tensors = read_tensors(directory / TENSORS, _allowed_dtypes, _HINT)
    try:
        state = unflatten(structure, tensors)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{directory / STRUCTURE} names a tensor {e} that {TENSORS} does not hold; {_HINT}") from None
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
    params = _trainable(module)
    run_settings = _check_optimizer_state(directory, saved.get("optim"), params, _stepped(module), optimizer)
    if with_model:
        model = saved.get("model")
        if not isinstance(model, dict):
            raise ValueError(f"{directory / STRUCTURE}: no 'model' mapping of the trainable params; {_HINT}")
        missing = sorted(set(params) - set(model))
        if missing:
            raise ValueError(f"{directory.parent}: no saved value for {missing[0]} (and {len(missing) - 1} more); "
                             "the checkpoint was written for another LoRA (rank or target modules)")
        _check_like(directory.parent, "model", model, params)
        set_model_state_dict(module, model, options=_options(full=True, strict=False))
    if extra:
        _load_in_place(extra, saved.get("extra", {}), directory.parent, "extra")
    # params that never got a gradient (e.g. the last block's unused text-stream output) have no AdamW state in
    # the file; torch initialises one for every param (a zero-gradient step), removed again so that the restored
    # state is the saved one exactly (AdamW skips params without a gradient either way)
    set_optimizer_state_dict(module, optimizer, saved["optim"], options=_options(full=True, strict=False))
    for group, settings in zip(optimizer.param_groups, run_settings):  # this run's settings, not the file's
        group.update(settings)
    stateless = set(params) - set(saved["optim"]["state"])
    for name, param in module.named_parameters():
        if name.replace("_orig_mod.", "") in stateless:
            optimizer.state.pop(param, None)


def _stepped(module) -> set[str]:
    """The FQNs of the params the optimizer steps: the trainable state also holds buffers (SD3's pos_embed)."""
    return {name.replace("_orig_mod.", "") for name, p in module.named_parameters() if p.requires_grad}


def _trainable(module) -> dict[str, torch.Tensor]:
    """The trainable params by FQN (DTensor shards under FSDP: their .shape is the full one)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_options(full=False))


def _check_like(checkpoint: Path, where: str, saved: dict, params: dict[str, torch.Tensor]) -> None:
    """Saved params by FQN: none this run lacks, each a tensor of the param's shape (its dtype: _allowed_dtypes)."""
    unknown = sorted(set(saved) - set(params))
    if unknown:
        raise ValueError(f"{checkpoint}: {where}/{unknown[0]} is not a trainable parameter of this run (and "
                         f"{len(unknown) - 1} more); the checkpoint was written for another LoRA or model")
    for name, value in saved.items():
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(params[name].shape):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{checkpoint}: {where}/{name} has shape {shape}, this run's parameter "
                             f"{tuple(params[name].shape)}; the checkpoint was written for another LoRA or model")


# AdamW's param-group settings on resume, key by key. The run's settings are this run's config (a resume may change
# them). How a step is computed (foreach, fused, capturable, differentiable) is this process's choice: the
# optimizer's own is kept. Everything else changes what a step computes and imagerl never sets it (maximize would
# climb the loss): the checkpoint must hold AdamW's own value, and a key AdamW does not have is refused.
RUN_SETTINGS = ("lr", "betas", "eps", "weight_decay")
IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")
ADAM_MOMENTS = {"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"}
OTHER_TORCH = {"decoupled_weight_decay": True}  # AdamW's own value, recorded by torch >= 2.6 only


def _check_optimizer_state(directory: Path, optim, params: dict[str, torch.Tensor], stepped: set[str],
                           optimizer) -> list[dict]:
    """Refuse an optimizer state this run's AdamW could not have written; return each group's settings as this run
    has them (every key but 'params'), which load_trainer_state puts back after loading. params: the trainable
    state by FQN; stepped: the FQNs of the params the optimizer steps."""
    file, checkpoint = directory / STRUCTURE, directory.parent
    if not isinstance(optim, dict) or not isinstance(optim.get("state"), dict) \
            or not isinstance(optim.get("param_groups"), list):
        raise ValueError(f"{file}: no optimizer state ('optim' with 'state' and 'param_groups'); {_HINT}")
    live = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    groups = optim["param_groups"]
    if len(groups) != len(live) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{file}: {len(groups)} optimizer param groups, this run's AdamW has {len(live)}; {_HINT}")
    named = [n for g in groups for n in (g.get("params") if isinstance(g.get("params"), list) else [None])]
    if sorted(map(str, named)) != sorted(stepped):
        raise ValueError(f"{file}: the optimizer's param groups do not list this run's trainable params; {_HINT}")
    for group, own in zip(groups, live):
        for key, value in group.items():
            if key == "params" or key in RUN_SETTINGS or key in IMPLEMENTATION:
                continue
            if key not in own and key in OTHER_TORCH and value == OTHER_TORCH[key]:
                continue  # a checkpoint of a newer torch, the same step
            if key not in own:
                raise ValueError(f"{file}: optimizer setting {key!r} is not one of AdamW's; the file was altered or "
                                 f"not written by imagerl; {_HINT}")
            if value != own[key]:
                raise ValueError(f"{file}: optimizer setting {key}={value!r}, imagerl's AdamW runs with "
                                 f"{key}={own[key]!r}; the file was altered or not written by imagerl; {_HINT}")
    for name, moments in optim["state"].items():
        where = f"optim/state/{name}"
        if name not in stepped or name not in params or not isinstance(moments, dict) \
                or not set(moments) <= ADAM_MOMENTS:
            raise ValueError(f"{checkpoint}: {where} is not AdamW's state of a trainable parameter of this run; "
                             f"{_HINT}")
        for key, moment in moments.items():
            if key != "step" and (not isinstance(moment, torch.Tensor) or moment.shape != params[name].shape):
                shape = tuple(moment.shape) if isinstance(moment, torch.Tensor) else type(moment).__name__
                raise ValueError(f"{checkpoint}: {where}/{key} has shape {shape}, its parameter "
                                 f"{tuple(params[name].shape)}; {_HINT}")
        step = moments.get("step")
        if step is not None and (not isinstance(step, torch.Tensor) or step.numel() != 1 or float(step) < 0
                                 or float(step) != int(float(step))):
            raise ValueError(f"{checkpoint}: {where}/step must be a count of optimizer steps (an integer >= 0), got "
                             f"{step.flatten()[:1].tolist() if isinstance(step, torch.Tensor) else step!r}; {_HINT}")
        for key in ("exp_avg_sq", "max_exp_avg_sq"):  # second moments: their square roots are taken
            if key in moments and (moments[key] < 0).any():
                raise ValueError(f"{checkpoint}: {where}/{key} holds negative values, which a second moment "
                                 f"never has; {_HINT}")
    return live


def _map_tensors(tree, fn):
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    return tree


def _load_in_place(target: dict, saved: dict, checkpoint: Path, path: str) -> None:
    """Copy `saved`'s full tensors into `target`'s (a DTensor keeps its own shard of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(saved, dict):
        raise ValueError(f"{checkpoint}: {path} is not a mapping of tensors; {_HINT}")
    unknown = sorted(set(saved) - set(target))
    if unknown:
        raise ValueError(f"{checkpoint}: {path}/{unknown[0]} is no state of this run's algorithm (written by another "
                         "algorithm setting?)")
    for key, value in target.items():
        where = f"{path}/{key}"
        if key not in saved:
            raise ValueError(f"{checkpoint}: no saved value for {where} (written by another algorithm setting?)")
        if isinstance(value, dict):
            _load_in_place(value, saved[key], checkpoint, where)
            continue
        full = saved[key]
        if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(value.shape):
            shape = tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
            raise ValueError(f"{checkpoint}: {where} has shape {shape}, this run {tuple(value.shape)}")
        if full.is_floating_point() != value.is_floating_point():
            raise ValueError(f"{checkpoint}: {where} is {full.dtype}, this run's {value.dtype}; {_HINT}")
        if not full.is_floating_point() and (full < 0).any():  # an integer here is a count
            raise ValueError(f"{checkpoint}: {where} is a count and holds a negative value; {_HINT}")
        with torch.no_grad():
            if isinstance(value, DTensor):  # this rank's shard of the full tensor, no communication
                shard = distribute_tensor(full.to(value.device, value.dtype), value.device_mesh, value.placements,
                                          src_data_rank=None)
                value._local_tensor.copy_(shard._local_tensor)
            else:
                value.copy_(full)
