"""Resumable checkpoints, written atomically.

<run>/checkpoints/step_000012/
  lora/adapter_model.safetensors + adapter_config.json   PEFT format (keys base_model.model.<module>.lora_A.weight)
  lora/pytorch_lora_weights.safetensors                  diffusers format: QwenImagePipeline.load_lora_weights(dir)
  optimizer.pt                                           AdamW state
  rng.pt                                                 torch / python / numpy global RNG states
  state.json                                             rollout step, config
A checkpoint is built in a temporary sibling directory and renamed into place, so a crash never
leaves a half-written checkpoint under a final name. Every random stream of a run is derived from
(seed, step, ...) (distributed/rng.py), so resuming from step n reproduces the uninterrupted run.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

PEFT_PREFIX = "base_model.model."


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def save_lora(adapter, directory: Path) -> None:
    """PEFT and diffusers copies of the adapter (with rank/alpha metadata so diffusers scales by alpha/r)."""
    import diffusers

    directory.mkdir(parents=True, exist_ok=True)
    state = adapter.lora_state_dict()
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


def save_checkpoint(run_dir: Path, step: int, adapter, optimizer, config: dict, keep: int) -> Path:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_lora(adapter, tmp / "lora")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": config}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _prune(run_dir, keep)
    return final


def _prune(run_dir: Path, keep: int) -> None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*") if not p.name.endswith(".tmp"))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(old)


def latest_checkpoint(run_dir: Path) -> Path | None:
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*")
                  if not p.name.endswith(".tmp") and (p / "state.json").is_file())
    return done[-1] if done else None


def resolve_resume(resume: str, run_dir: Path) -> Path:
    """`latest` (in this run's directory), a run directory, or a checkpoint directory."""
    path = run_dir if resume == "latest" else Path(resume)
    if (path / "state.json").is_file():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise ValueError(f"--resume {resume}: no checkpoint found under {path} (expected checkpoints/step_*/state.json)")
    return found


def load_checkpoint(path: Path, adapter, optimizer) -> int:
    """Restore LoRA, optimizer and RNG; return the rollout step the checkpoint was taken after."""
    state = load_file(path / "lora" / "adapter_model.safetensors")
    adapter.load_lora_state_dict({k.removeprefix(PEFT_PREFIX): v for k, v in state.items()})
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads((path / "state.json").read_text())["step"]
