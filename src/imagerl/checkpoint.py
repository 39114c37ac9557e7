"""Resumable checkpoints, written atomically.

<run>/checkpoints/step_000012/
  lora/adapter_model.safetensors + adapter_config.json   PEFT format (keys base_model.model.<module>.lora_A.weight)
  lora/pytorch_lora_weights.safetensors                  diffusers format: QwenImagePipeline.load_lora_weights(dir)
  optimizer.pt                                           AdamW state
  rng.pt                                                 torch / python / numpy global RNG states
  state.json                                             rollout step, config
Full fine-tuning (`imagerl sft` with lora_rank=0) writes, instead of lora/:
  model/                                                 a complete diffusers-format checkpoint: the base
                                                         checkpoint's other components as symlinks, the
                                                         trained transformer/ (float32 master weights)
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
    final, tmp = _begin(run_dir, step)
    save_lora(adapter, tmp / "lora")
    return _commit(run_dir, step, final, tmp, optimizer, config, keep)


def save_full_checkpoint(run_dir: Path, step: int, transformer, base: Path, optimizer, config: dict,
                         keep: int) -> Path:
    """Like save_checkpoint for a fully fine-tuned transformer: model/ is `base` with this transformer (its
    float32 master weights), the other components symlinked, so `--model <checkpoint>/model` loads it."""
    final, tmp = _begin(run_dir, step)
    save_model_dir(base, transformer, tmp / "model", link=True)
    return _commit(run_dir, step, final, tmp, optimizer, config, keep)


def _begin(run_dir: Path, step: int) -> tuple[Path, Path]:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    return final, tmp


def _commit(run_dir: Path, step: int, final: Path, tmp: Path, optimizer, config: dict, keep: int) -> Path:
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, "config": config}, indent=1))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _prune(run_dir, keep)
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
    return _restore(path, optimizer)


def load_full_checkpoint(path: Path, transformer, optimizer) -> int:
    """Restore a save_full_checkpoint: the transformer's weights (in place, float32), optimizer and RNG; return
    the step."""
    if not (path / "model" / "transformer").is_dir():
        raise ValueError(f"{path} is not a full fine-tuning checkpoint (no model/transformer/); it was written by "
                         "a LoRA run: resume with the same lora_rank")
    saved = type(transformer).from_pretrained(path / "model", subfolder="transformer", torch_dtype=torch.float32)
    transformer.load_state_dict(saved.state_dict())
    del saved
    return _restore(path, optimizer)


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


def _restore(path: Path, optimizer) -> int:
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False))
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    return json.loads((path / "state.json").read_text())["step"]
