"""Resumable checkpoints, written atomically, by one process or many (torchrun, FSDP2).

<run>/checkpoints/step_000012/
  lora/adapter_model.safetensors + adapter_config.json   PEFT format (keys base_model.model.<module>.lora_A.weight),
                                                         full tensors gathered on rank 0: a plain PEFT adapter
  lora/pytorch_lora_weights.safetensors                  diffusers format: QwenImagePipeline.load_lora_weights(dir)
  dcp/                                                   torch.distributed.checkpoint: the trainable params
                                                         ("model", LoRA) and AdamW state ("optim"), by FQN,
                                                         each rank writing its shards; loads on any world size
  rng/rank_00000.pt ...                                  torch / python / numpy / cuda RNG states of each rank
  state.json                                             rollout step, world size, config (written last)
Full fine-tuning (`imagerl sft` with lora_rank=0) writes, instead of lora/ and dcp/'s "model":
  model/                                                 a complete diffusers-format checkpoint: the base
                                                         checkpoint's other components as symlinks, the
                                                         trained transformer/ (float32 master weights)
Older checkpoints (optimizer.pt + rng.pt instead of dcp/ + rng/) still load.

A checkpoint is built in <name>.tmp by all ranks; after a barrier rank 0 writes state.json and renames
it into place, so a crash never leaves a checkpoint under a final name (latest_checkpoint also ignores
directories without state.json). Multi-node runs need the run directory on a shared filesystem. Every
random stream of a run is derived from (seed, step, ...) (distributed/rng.py) and the prompt sampler's
position from the step, so resuming from step n reproduces the uninterrupted run, on any world size.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from imagerl.distributed.parallel import World

PEFT_PREFIX = "base_model.model."


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def save_lora(adapter, directory: Path, state: dict[str, torch.Tensor] | None = None) -> None:
    """PEFT and diffusers copies of the adapter (with rank/alpha metadata so diffusers scales by alpha/r).
    `state`: the adapter's full LoRA tensors (adapter.lora_state_dict(), gathered on every rank under FSDP)."""
    import diffusers

    directory.mkdir(parents=True, exist_ok=True)
    state = adapter.lora_state_dict() if state is None else state
    save_file({PEFT_PREFIX + k: v for k, v in state.items()}, directory / "adapter_model.safetensors")
    adapter.lora_config.save_pretrained(str(directory))
    metadata = adapter.lora_config.to_dict()
    metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
    pipeline = getattr(diffusers, adapter.pipeline_class_name)  # its load_lora_weights reads this file
    pipeline.save_lora_weights(directory, transformer_lora_layers=state, transformer_lora_adapter_metadata=metadata)


def load_lora(adapter, directory: Path) -> None:
    """Add the adapter described by a PEFT directory (adapter_config.json + adapter_model.safetensors)."""
    config_file, weights = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_file.is_file() or not weights.is_file():
        raise ValueError(f"--lora {directory}: expected adapter_config.json and adapter_model.safetensors "
                         "(the lora/ folder of an imagerl checkpoint)")
    config = json.loads(config_file.read_text())
    adapter.add_lora(config["r"], config["lora_alpha"], True, config["target_modules"])
    state = load_file(weights)
    adapter.load_lora_state_dict({k.removeprefix(PEFT_PREFIX): v for k, v in state.items()})


def save_checkpoint(run_dir: Path, step: int, adapter, optimizer, config: dict, keep: int,
                    world: World | None = None, lora_state: dict | None = None, extra: dict | None = None) -> Path:
    """Every rank calls this (the LoRA is gathered and the shards written collectively); rank 0 writes lora/.
    lora_state: the tensors to export in lora/ (default: the policy's; DiffusionNFT exports its EMA); extra:
    an algorithm's further tensors by name (DiffusionNFT's old and EMA LoRA states), saved in dcp/ with the
    trainable params."""
    world = world or _ONE
    final, tmp = _begin(run_dir, step, world)
    state = adapter.lora_state_dict() if lora_state is None else lora_state  # a collective under FSDP
    if world.is_main:
        save_lora(adapter, tmp / "lora", state)
    return _commit(run_dir, step, final, tmp, adapter.transformer, optimizer, config, keep, world, with_model=True,
                   extra=extra)


def save_full_checkpoint(run_dir: Path, step: int, transformer, base: Path, optimizer, config: dict,
                         keep: int, world: World | None = None) -> Path:
    """Like save_checkpoint for a fully fine-tuned transformer: model/ is `base` with this transformer (its
    float32 master weights), the other components symlinked, so `--model <checkpoint>/model` loads it.
    One process only (the transformer is saved with save_pretrained)."""
    world = world or _ONE
    final, tmp = _begin(run_dir, step, world)
    if world.is_main:
        save_model_dir(base, transformer, tmp / "model", link=True)
    return _commit(run_dir, step, final, tmp, transformer, optimizer, config, keep, world, with_model=False)


_ONE = World(0, 1, torch.device("cpu"))


def _begin(run_dir: Path, step: int, world: World) -> tuple[Path, Path]:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if world.is_main:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    world.barrier()
    return final, tmp


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _options(strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # setting: not strict, the frozen base weights are not in the state (dcp.load above checked the LoRA keys)
    return StateDictOptions(ignore_frozen_params=True, strict=strict)


def _commit(run_dir: Path, step: int, final: Path, tmp: Path, module, optimizer, config: dict, keep: int,
            world: World, with_model: bool, extra: dict | None = None) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"optim": get_optimizer_state_dict(module, optimizer, options=_options())}
    if with_model:
        state["model"] = get_model_state_dict(module, options=_options())
    state.update(extra or {})
    dcp.save(state, checkpoint_id=str(tmp / "dcp"), no_dist=not _distributed())
    (tmp / "rng").mkdir(exist_ok=True)
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               tmp / "rng" / f"rank_{world.rank:05d}.pt")
    world.barrier()  # every rank's files are complete before the checkpoint becomes valid
    if world.is_main:
        (tmp / "state.json").write_text(json.dumps({"step": step, "world_size": world.size, "config": config},
                                                   indent=1))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        _prune(run_dir, keep)
    world.barrier()
    return final


def save_model_dir(base: Path, transformer, out: Path, link: bool) -> Path:
    """A complete diffusers-format checkpoint at `out`: every entry of the checkpoint directory `base` but its
    transformer/ (symlinked when `link`, else copied, links followed), and `transformer` saved with
    save_pretrained (in its current dtype) as transformer/."""
    base = Path(base).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for entry in sorted(base.iterdir()):
        if entry.name == "transformer" or entry.name.startswith("."):
            continue
        target = out / entry.name
        if link:
            target.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
        elif entry.is_dir():
            shutil.copytree(entry.resolve(), target)
        else:
            shutil.copy2(entry.resolve(), target)
    transformer.save_pretrained(out / "transformer", safe_serialization=True)
    return out


def _prune(run_dir: Path, keep: int) -> None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old)


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*")
                  if not p.name.endswith(".tmp") and (p / "state.json").is_file())
    return done[-1] if done else None


def check_resume_algorithm(path: Path, algorithm: str) -> None:
    """A checkpoint resumes only the train.algorithm that wrote it (their states differ)."""
    try:
        saved = json.loads((path / "state.json").read_text())["config"]["train"].get("algorithm", "flow_grpo")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--resume {path}: cannot read state.json ({type(e).__name__}: {e})") from e
    if saved != algorithm:
        raise ValueError(f"--resume {path}: the checkpoint was written by train.algorithm={saved}, this run is "
                         f"train.algorithm={algorithm}; resume with train.algorithm={saved} or start a new run")


def resolve_resume(resume: str, run_dir: Path) -> Path:
    """`latest` (in this run's directory), a run directory, or a checkpoint directory."""
    path = run_dir if resume == "latest" else Path(resume)
    if (path / "state.json").is_file():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise ValueError(f"--resume {resume}: no checkpoint found under {path} (expected checkpoints/step_*/state.json)")
    return found


def load_checkpoint(path: Path, adapter, optimizer, world: World | None = None, extra: dict | None = None) -> int:
    """Restore LoRA, optimizer and RNG (every rank; any world size); return the rollout step the checkpoint
    was taken after. extra: tensors saved with save_checkpoint(extra=...), loaded into in place."""
    if (path / "dcp").is_dir():
        _load_distributed(path, adapter.transformer, optimizer, with_model=True, extra=extra)
    else:  # an older single-process checkpoint
        state = load_file(path / "lora" / "adapter_model.safetensors")
        adapter.load_lora_state_dict({k.removeprefix(PEFT_PREFIX): v for k, v in state.items()})
    return _restore(path, optimizer, world or _ONE)


def load_full_checkpoint(path: Path, transformer, optimizer) -> int:
    """Restore a save_full_checkpoint: the transformer's weights (in place, float32), optimizer and RNG; return
    the step."""
    if not (path / "model" / "transformer").is_dir():
        raise ValueError(f"{path} is not a full fine-tuning checkpoint (no model/transformer/); it was written by "
                         "a LoRA run: resume with the same lora_rank")
    saved = type(transformer).from_pretrained(path / "model", subfolder="transformer", torch_dtype=torch.float32)
    transformer.load_state_dict(saved.state_dict())
    del saved
    if (path / "dcp").is_dir():
        _load_distributed(path, transformer, optimizer, with_model=False)
    return _restore(path, optimizer, _ONE)


def merged_lora_transformer(base: Path, lora_dir: Path):
    """The base checkpoint's transformer (float32, CPU) with the PEFT LoRA of `lora_dir` merged into its weights
    (diffusers fuse_lora, then the LoRA layers removed): a plain transformer with no adapter."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    index = json.loads((Path(base) / "model_index.json").read_text())
    cls = getattr(diffusers, index["transformer"][1])
    transformer = cls.from_pretrained(base, subfolder="transformer", torch_dtype=torch.float32)
    transformer.add_adapter(LoraConfig.from_pretrained(str(lora_dir)))
    state = load_file(lora_dir / "adapter_model.safetensors")
    result = set_peft_model_state_dict(transformer, {k.removeprefix(PEFT_PREFIX): v for k, v in state.items()})
    if getattr(result, "unexpected_keys", []):
        raise ValueError(f"{lora_dir}: LoRA keys the base transformer does not have: {result.unexpected_keys[:3]}")
    transformer.fuse_lora()
    transformer.unload_lora()
    return transformer


def _load_distributed(path: Path, module, optimizer, with_model: bool, extra: dict | None = None) -> None:
    """dcp.load into this rank's (possibly sharded) state dicts: DCP reshards between world sizes."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    state = {"optim": get_optimizer_state_dict(module, optimizer, options=_options())}
    if with_model:
        state["model"] = get_model_state_dict(module, options=_options())
        dcp.load({"model": state["model"]}, checkpoint_id=str(path / "dcp"), no_dist=not _distributed())
    if extra:  # in place into the caller's (possibly sharded) tensors
        dcp.load(extra, checkpoint_id=str(path / "dcp"), no_dist=not _distributed())
    # the target's AdamW state is initialised for every trainable param; params that never got a gradient
    # (e.g. the last block's unused text-stream output) have no state in the checkpoint and keep it empty-ish:
    # AdamW skips params without a gradient, so they are never touched either way
    dcp.load({"optim": state["optim"]}, checkpoint_id=str(path / "dcp"), no_dist=not _distributed(),
             planner=DefaultLoadPlanner(allow_partial_load=True))
    if with_model:
        set_model_state_dict(module, state["model"], options=_options(strict=False))
    set_optimizer_state_dict(module, optimizer, state["optim"], options=_options())


def _restore(path: Path, optimizer, world: World) -> int:
    if not (path / "dcp").is_dir():  # an older single-process checkpoint
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    # this rank's RNG, else rank 0's (resuming on more ranks; no stream of a run depends on it, see rng.py)
    files = [path / "rng" / f"rank_{world.rank:05d}.pt", path / "rng" / "rank_00000.pt", path / "rng.pt"]
    rng = torch.load(next((f for f in files if f.is_file()), files[-1]), weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads((path / "state.json").read_text())["step"]
