"""Resumable checkpoints, written atomically, by one process or many (torchrun, FSDP2).

<run>/checkpoints/step_000012/
  lora/adapter_model.safetensors + adapter_config.json   PEFT format (keys base_model.model.<module>.lora_A.weight),
                                                         full tensors gathered on rank 0: a plain PEFT adapter
  lora/pytorch_lora_weights.safetensors                  diffusers format: QwenImagePipeline.load_lora_weights(dir)
  dcp/                                                   torch.distributed.checkpoint: the trainable params
                                                         ("model", LoRA) and AdamW state ("optim"), by FQN,
                                                         each rank writing its shards; loads on any world size
  rng/rank_00000.safetensors ...                         torch / python / numpy / cuda RNG states of each rank
                                                         (tensors + JSON metadata: nothing is unpickled)
  state.json                                             rollout step, world size, config and the SHA-256 of
                                                         every other file (written last)
Full fine-tuning (`imagerl sft` with lora_rank=0) writes, instead of lora/ and dcp/'s "model":
  model/                                                 a complete diffusers-format checkpoint: the base
                                                         checkpoint's other components as symlinks, the
                                                         trained transformer/ (float32 master weights)
Loading verifies every file's checksum and reads DCP's pickled .metadata with an unpickler that builds only
checkpoint-metadata types, so a corrupt or crafted checkpoint is refused before anything in it runs or trains.

A checkpoint is built in <name>.tmp by all ranks; after a barrier rank 0 writes state.json and renames
it into place (an existing one renamed aside first), so a crash never leaves a checkpoint under a final name
half-written, and resume recovers a complete .tmp or .old (latest_checkpoint also ignores directories without
a readable state.json). Multi-node runs need the run directory on a shared filesystem. Every
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
    _save_rng(tmp / "rng" / f"rank_{world.rank:05d}.safetensors")
    world.barrier()  # every rank's files are complete before the checkpoint becomes valid
    if world.is_main:
        state = {"step": step, "world_size": world.size, "config": config, "sha256": _checksums(tmp)}
        (tmp / "state.json").write_text(json.dumps(state, indent=1))
        _swap_into_place(tmp, final)
        _prune(run_dir, keep)
    world.barrier()
    return final


def _swap_into_place(tmp: Path, final: Path) -> None:
    """tmp -> final without a moment in which neither is complete: an existing final is renamed aside first and
    removed last. A kill in between leaves a complete step_N.tmp or step_N.old that resolve_resume recovers."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


def _checksums(directory: Path) -> dict[str, str]:
    """SHA-256 of every file below `directory` (but state.json, which holds them), by relative path."""
    import hashlib

    import os

    files = [Path(root) / name for root, _, names in os.walk(directory) for name in names]  # links not followed
    sums = {}
    # symlinks (a full fine-tuning checkpoint's links to the base model's components) are not the checkpoint's
    for path in sorted(p for p in files if not p.is_symlink() and p.name != "state.json"):
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                digest.update(chunk)
        sums[path.relative_to(directory).as_posix()] = digest.hexdigest()
    return sums


def verify_checkpoint(path: Path) -> dict:
    """The checkpoint's state.json, after checking that every file it lists has its SHA-256, that no file is
    missing or unlisted, and that dcp/.metadata unpickles to torch.distributed.checkpoint's metadata types only
    (torch's loader unpickles it: a crafted one could run code). ValueError names the first bad file."""
    state = read_state(path)
    expected = state.get("sha256")
    if expected is None:
        raise ValueError(f"{path}: state.json has no checksums (a checkpoint from an older imagerl, or edited); "
                         "imagerl only resumes checksummed checkpoints")
    actual = _checksums(path)
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            raise ValueError(f"{path}: {name} is missing (listed in state.json); the checkpoint is incomplete")
        if name not in expected:
            raise ValueError(f"{path}: {name} is not part of the checkpoint (not in state.json's checksums)")
        if actual[name] != expected[name]:
            raise ValueError(f"{path}: {name} does not match its checksum: the file is corrupt or was modified; "
                             "resume from an earlier checkpoint (--resume <run>/checkpoints/step_N)")
    if (path / "dcp" / ".metadata").is_file():
        _check_dcp_metadata(path / "dcp" / ".metadata")
    return state


# what torch.distributed.checkpoint's .metadata pickle may construct (read off its files with pickletools): the
# metadata dataclasses, torch sizes, dtypes and layouts, paths; nothing that can call out
_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"  # dataclasses and enums only
_DCP_METADATA_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                         ("torch.serialization", "_get_layout"), ("torch", "Size"),
                         ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
                         ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset")}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)}


def _check_dcp_metadata(path: Path) -> None:
    """Unpickle DCP's .metadata with an unpickler that constructs only checkpoint-metadata types (no callable
    outside them, e.g. os.system): a crafted file is refused before torch's own loader unpickles it."""
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module == _DCP_METADATA_MODULE or (module, name) in _DCP_METADATA_GLOBALS
                    or (module == "torch" and name in _DTYPES)):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")

    try:
        with open(path, "rb") as f:
            metadata = Restricted(f).load()
    except Exception as e:  # any failure: not the metadata torch.distributed.checkpoint writes
        raise ValueError(f"{path} is not a torch.distributed.checkpoint metadata file ({type(e).__name__}: {e}); "
                         "refusing to load it") from e
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not checkpoint metadata; refusing to load it")


def read_state(path: Path) -> dict:
    """A checkpoint's state.json, with errors that name the file."""
    file = path / "state.json"
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{file} cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise ValueError(f"{file} is not an imagerl checkpoint state (no integer 'step')")
    return state


def _save_rng(file: Path) -> None:
    """This process's RNG states as tensors (safetensors) and JSON metadata: nothing that loads by unpickling."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors.update({f"cuda_{i}": state for i, state in enumerate(torch.cuda.get_rng_state_all())})
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    version, internal, gauss = random.getstate()
    save_file(tensors, file, metadata={"python": json.dumps([version, list(internal), gauss]),
                                       "numpy": json.dumps([kind, int(pos), int(has_gauss), float(cached)])})


def _load_rng(file: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    torch.set_rng_state(tensors["torch"])
    version, internal, gauss = json.loads(meta["python"])
    random.setstate((version, tuple(internal), gauss))
    kind, pos, has_gauss, cached = json.loads(meta["numpy"])
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    cuda = [tensors[f"cuda_{i}"] for i in range(len(tensors)) if f"cuda_{i}" in tensors]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])


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


def recover_interrupted(run_dir: Path) -> None:
    """Finish a swap that a kill interrupted (_swap_into_place): step_N.tmp with its state.json written (complete)
    becomes step_N when step_N is gone; a step_N.old with no step_N goes back."""
    ckpts = run_dir / "checkpoints"
    for suffix in (".tmp", ".old"):
        for p in sorted(ckpts.glob(f"step_*{suffix}")) if ckpts.is_dir() else []:
            final = p.with_name(p.name.removesuffix(suffix))
            if not final.exists() and (p / "state.json").is_file():
                p.rename(final)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose state.json reads; a broken one is skipped with a warning naming it."""
    import warnings

    recover_interrupted(run_dir)
    done = sorted(p for p in (run_dir / "checkpoints").glob("step_*")
                  if not p.name.endswith((".tmp", ".old")) and (p / "state.json").is_file())
    for p in reversed(done):
        try:
            read_state(p)
            return p
        except ValueError as e:
            warnings.warn(f"skipping checkpoint {p}: {e}", stacklevel=2)
    return None


# settings a resumed run cannot change: the LoRA's shape, the algorithm's state, the random streams, the groups
FIXED_ON_RESUME = ("train.algorithm", "run.seed", "model.path", "model.family", "model.lora_rank", "model.lora_alpha",
                   "model.lora_init", "model.lora_target_modules", "sample.prompts_per_rollout", "sample.group_size")


def _flat(config: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in config.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) and k != "weights" else {f"{prefix}{k}": v})
    return out


def check_resume_config(path: Path, config: dict) -> list[str]:
    """Compare this run's config with the checkpoint's: a changed FIXED_ON_RESUME key is refused (ValueError naming
    it); return the other changed keys, which the resumed run applies (train.py sets the optimizer's
    hyperparameters from the config after loading its state)."""
    saved, now = _flat(read_state(path).get("config", {})), _flat(config)
    for key in FIXED_ON_RESUME:
        if key in saved and saved[key] != now.get(key):
            raise ValueError(f"--resume {path}: the checkpoint was written by {key}={saved[key]}, this run has "
                             f"{key}={now.get(key)}; a resumed run keeps {key}: drop the override or start a new run")
    return sorted(k for k in now if k in saved and saved[k] != now[k] and k != "recipe")


def resolve_resume(resume: str, run_dir: Path) -> Path:
    """`latest` (in this run's directory), a run directory, or a checkpoint directory."""
    path = run_dir if resume == "latest" else Path(resume)
    if (path / "state.json").is_file():
        read_state(path)  # a named checkpoint must read; "latest" falls back past broken ones
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise ValueError(f"--resume {resume}: no checkpoint found under {path} (expected checkpoints/step_*/state.json)")
    return found


def load_checkpoint(path: Path, adapter, optimizer, world: World | None = None, extra: dict | None = None) -> int:
    """Restore LoRA, optimizer and RNG (every rank; any world size); return the rollout step the checkpoint
    was taken after. extra: tensors saved with save_checkpoint(extra=...), loaded into in place."""
    verify_checkpoint(path)
    if not (path / "dcp").is_dir():
        raise ValueError(f"{path} has no dcp/ (a checkpoint from an older imagerl, whose optimizer and RNG files "
                         "are pickles, which imagerl no longer loads); start a new run from its lora/ instead")
    _load_distributed(path, adapter.transformer, optimizer, with_model=True, extra=extra)
    bad = [name for name, p in adapter.transformer.named_parameters()
           if p.requires_grad and not torch.isfinite(p.detach()).all()]
    if bad:
        raise ValueError(f"{path}: the LoRA weight {bad[0]} (and {len(bad) - 1} more) is not finite; resume from "
                         "an earlier checkpoint")
    return _restore(path, optimizer, world or _ONE)


def load_full_checkpoint(path: Path, transformer, optimizer) -> int:
    """Restore a save_full_checkpoint: the transformer's weights (in place, float32), optimizer and RNG; return
    the step."""
    if not (path / "model" / "transformer").is_dir():
        raise ValueError(f"{path} is not a full fine-tuning checkpoint (no model/transformer/); it was written by "
                         "a LoRA run: resume with the same lora_rank")
    verify_checkpoint(path)
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
    # this rank's RNG, else rank 0's (resuming on more ranks; no stream of a run depends on it, see rng.py)
    files = [path / "rng" / f"rank_{world.rank:05d}.safetensors", path / "rng" / "rank_00000.safetensors"]
    _load_rng(next((f for f in files if f.is_file()), files[-1]))
    return read_state(path)["step"]
