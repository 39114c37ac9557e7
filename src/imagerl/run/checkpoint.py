"""Resumable checkpoints, written atomically, by one process or many (torchrun, FSDP2).

<run>/checkpoints/step_000012/
  lora/adapter_model.safetensors + adapter_config.json   PEFT format (keys base_model.model.<module>.lora_A.weight),
                                                         full tensors gathered on rank 0: a plain PEFT adapter
  lora/pytorch_lora_weights.safetensors                  diffusers format: QwenImagePipeline.load_lora_weights(dir)
  trainer/tensors.safetensors + structure.json           the trainable params, AdamW's state and the algorithm's
                                                         tensors (full, by FQN) in safetensors; hyperparameters and
                                                         step counts in JSON (checkpoint_tensors.py); loads on any
                                                         world size
  rng/rank_00000.safetensors ...                         torch / python / numpy / cuda RNG states of each rank
                                                         (tensors + JSON metadata)
  state.json                                             format 2, rollout step, world size, config and the SHA-256
                                                         of every other file (written last)
Full fine-tuning (`imagerl sft` with lora_rank=0) writes, instead of lora/ and trainer's "model":
  model/                                                 a complete diffusers-format checkpoint: the base
                                                         checkpoint's other components as symlinks, the
                                                         trained transformer/ (float32 master weights)
Loading unpickles nothing: safetensors and JSON only. Every file's checksum is verified and every restored tensor
checked finite, so a corrupt checkpoint is refused with the file or tensor named. Format 1 (torch.distributed.
checkpoint, whose .metadata and optimizer entries are pickles) is refused; `imagerl convert-checkpoint` converts it.

A checkpoint is built in <name>.tmp by all ranks; after a barrier rank 0 writes state.json and renames
it into place (an existing one renamed aside as .old first), so a crash never leaves a checkpoint under a final
name half-written; the next run, once it holds the run directory's lock, finishes a swap a kill interrupted
(recover_interrupted). Only step_<digits> directories with a state.json are checkpoints (latest_checkpoint also
skips one whose state.json does not read); a symbolic link among them is refused, never followed. Multi-node runs
need the run directory on a shared filesystem. Every
random stream of a run is derived from (seed, step, ...) (distributed/rng.py) and the prompt sampler's
position from the step, so resuming from step n reproduces the uninterrupted run, on any world size.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from imagerl.run.checkpoint_tensors import (FORMAT, NonFiniteStateError, check_trainer_files, load_trainer_state,
                                             save_trainer_state)
from imagerl.run.load_checks import (FLOAT_DTYPES, PEFT_PREFIX, LoraFiles, check_dtypes, check_lora_matches,
                                     check_weights_dir, parse_json, read_json, read_lora_dir, read_tensors,
                                     safetensors_header)
from imagerl.distributed.parallel import World
from imagerl.run.lock import CHECKPOINT_NAME, continue_command, link_refusal


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


def check_lora_dir(directory: Path) -> LoraFiles:
    """The PEFT adapter in `directory` (adapter_config.json + adapter_model.safetensors), read and checked as far as
    it can be without the model (load_checks.read_lora_dir), so callers check it before loading a model and pass
    the result to load_lora. ValueError names the file."""
    return read_lora_dir(Path(directory))


def load_lora(adapter, lora: Path | LoraFiles) -> None:
    """Add the adapter of a PEFT directory (or its check_lora_dir) to the model: refused unless it has every LoRA
    tensor the model's layers take, of their shapes, and no other."""
    lora = lora if isinstance(lora, LoraFiles) else check_lora_dir(lora)
    try:
        adapter.add_lora(lora.rank, lora.alpha, True, lora.target_modules)
    except ValueError as e:  # PEFT: target modules the model does not have
        raise ValueError(f"{lora.config_file}: {e}") from e
    check_lora_matches(adapter.transformer, lora)
    adapter.load_lora_state_dict(lora.state)


def save_checkpoint(run_dir: Path, step: int, adapter, optimizer, config: dict, keep: int,
                    world: World | None = None, lora_state: dict | None = None, extra: dict | None = None) -> Path:
    """Every rank calls this (the LoRA is gathered and the shards written collectively); rank 0 writes lora/.
    lora_state: the tensors to export in lora/ (default: the policy's; DiffusionNFT exports its EMA); extra:
    an algorithm's further tensors by name (DiffusionNFT's old and EMA LoRA states), saved in trainer/ with
    the trainable params."""
    world = world or _ONE
    final, tmp = _begin(run_dir, step, world)
    state = adapter.lora_state_dict() if lora_state is None else lora_state  # a collective under FSDP
    return _commit(run_dir, step, final, tmp, adapter.transformer, optimizer, config, keep, world, with_model=True,
                   extra=extra, write_main=lambda: save_lora(adapter, tmp / "lora", state))


def save_full_checkpoint(run_dir: Path, step: int, transformer, base: Path, optimizer, config: dict,
                         keep: int, world: World | None = None) -> Path:
    """Like save_checkpoint for a fully fine-tuned transformer: model/ is `base` with this transformer (its
    float32 master weights), the other components symlinked, so `--model <checkpoint>/model` loads it.
    One process only (the transformer is saved with save_pretrained)."""
    world = world or _ONE
    final, tmp = _begin(run_dir, step, world)
    return _commit(run_dir, step, final, tmp, transformer, optimizer, config, keep, world, with_model=False,
                   write_main=lambda: save_model_dir(base, transformer, tmp / "model", link=True))


_ONE = World(0, 1, torch.device("cpu"))


def _begin(run_dir: Path, step: int, world: World) -> tuple[Path, Path]:
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    for path in (final.parent, final, tmp, final.with_name(final.name + ".old")):  # every rank alike
        if path.is_symlink():  # writing or removing through it would change what it points to
            raise ValueError(link_refusal(path))
    if world.is_main:
        if tmp.exists():
            _rmtree(tmp)
        tmp.mkdir(parents=True)
    world.barrier()
    return final, tmp


def _commit(run_dir: Path, step: int, final: Path, tmp: Path, module, optimizer, config: dict, keep: int,
            world: World, with_model: bool, extra: dict | None = None, write_main=None) -> Path:
    """Write the trainer state and RNG into tmp (and `write_main()` on rank 0), then state.json, then swap it
    into place. A non-finite tensor or a full disk removes tmp and raises one line; the last checkpoint stays."""
    try:
        if world.is_main and write_main is not None:
            write_main()
        save_trainer_state(tmp / "trainer", module, optimizer, extra, world, with_model=with_model)
        (tmp / "rng").mkdir(exist_ok=True)
        _save_rng(tmp / "rng" / f"rank_{world.rank:05d}.safetensors")
        world.barrier()  # every rank's files are complete before the checkpoint becomes valid
        if world.is_main:
            state = {"format": FORMAT, "step": step, "world_size": world.size, "config": config,
                     "sha256": _checksums(tmp)}
            (tmp / "state.json").write_text(json.dumps(state, indent=1))
    except NonFiniteStateError as e:
        _discard(tmp, world)
        raise NonFiniteStateError(f"not writing checkpoint {final.name}: {e}; {_last_intact(run_dir)}") from e
    except Exception as e:
        if not _is_disk_full(e):
            raise
        needed = _size_needed(run_dir, tmp, module, optimizer, extra, with_model)  # measured before tmp goes
        _discard(tmp, world)
        raise DiskFullError(f"no space left on the device of {run_dir} while writing checkpoint {final.name} "
                            f"(it needs about {needed}, {_free(run_dir)} free) into {final.parent}; "
                            f"{after_disk_full(run_dir)}") from None
    if world.is_main:
        _swap_into_place(tmp, final)
        prune_checkpoints(run_dir, keep)
    world.barrier()
    return final


class DiskFullError(OSError):
    """ENOSPC / EDQUOT while a checkpoint was written: the partial checkpoint is removed, the last one is intact."""


def _is_disk_full(e: BaseException | None) -> bool:
    import errno

    while e is not None:  # safetensors and others wrap the OSError; its text survives
        if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left on device" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def _discard(tmp: Path, world: World) -> None:
    if world.is_main:
        _rmtree(tmp, ignore_errors=True)


def _last_intact(run_dir: Path) -> str:
    done = _complete(run_dir)
    return f"the last checkpoint, {done[-1]}, is intact" if done else "no earlier checkpoint exists"


def after_disk_full(run_dir: Path) -> str:
    """What to do once a full disk stopped the run: continue from the last checkpoint, or start over before the
    first one (--resume would find nothing)."""
    done = _complete(run_dir)
    if done:
        return (f"the last checkpoint, {done[-1]}, is intact. Free space, then continue with "
                f"`{continue_command(run_dir)}`")
    return ("no checkpoint exists yet, so there is nothing to resume: free space, then start the run over "
            "(imagerl train: the same command with --overwrite)")


def _checkpoint_dirs(run_dir: Path) -> list[tuple[Path, str]]:
    """(path, '' | '.tmp' | '.old') of each entry of checkpoints/ named as imagerl names checkpoints, by step; other
    names are not imagerl's. A symbolic link among them (or checkpoints/ itself) is a ValueError naming it."""
    ckpts = Path(run_dir) / "checkpoints"
    found = []
    if ckpts.is_symlink():
        raise ValueError(link_refusal(ckpts))
    for p in ckpts.iterdir() if ckpts.is_dir() else []:
        match = CHECKPOINT_NAME.fullmatch(p.name)
        if match and p.is_symlink():
            raise ValueError(link_refusal(p))
        if match:
            found.append((int(match[1]), match[2] or "", p))
    return [(p, suffix) for _, suffix, p in sorted(found)]


def _is_complete(path: Path) -> bool:
    return path.is_dir() and (path / "state.json").is_file()


def _complete(run_dir: Path) -> list[Path]:
    """The checkpoints, oldest first: step_<digits> directories with a state.json."""
    return [p for p, suffix in _checkpoint_dirs(run_dir) if not suffix and _is_complete(p)]


def _size_needed(run_dir: Path, tmp: Path, module, optimizer, extra: dict | None, with_model: bool) -> str:
    """A checkpoint is about as large as the previous one. The first: the tensors it holds (the trainable params in
    trainer/ and, for a LoRA, twice more in lora/; AdamW's moments; the algorithm's tensors), or what was written of
    it if that is more."""
    done = _complete(run_dir)
    if done:
        return _size(_bytes_below(done[-1]))
    params = _nbytes([p for p in module.parameters() if p.requires_grad])
    estimate = params * (3 if with_model else 1) + _nbytes(list(optimizer.state.values())) + _nbytes(extra)
    return _size(max(estimate, _bytes_below(tmp)))


def _nbytes(tree) -> int:
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(_nbytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_nbytes(v) for v in tree)
    return 0


def _bytes_below(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file() and not f.is_symlink())


def _free(run_dir: Path) -> str:
    return _size(shutil.disk_usage(run_dir).free)


def _size(n: int) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{max(1, round(n / 2**10))} KB"  # a tiny model's checkpoint is not "0.0 MB"


def _rmtree(path: Path, ignore_errors: bool = False) -> None:
    """shutil.rmtree, but a symbolic link where a checkpoint directory belongs is named, not followed or removed."""
    if Path(path).is_symlink():
        raise ValueError(f"{path} is a symbolic link where imagerl keeps its own checkpoint directories (it removes "
                         "old ones as the run goes); move the link out of checkpoints/ and resume")
    shutil.rmtree(path, ignore_errors=ignore_errors)


def _swap_into_place(tmp: Path, final: Path) -> None:
    """tmp -> final without a moment in which neither is complete: an existing final is renamed aside first and
    removed last. A kill in between leaves a complete step_N.tmp or step_N.old that recover_interrupted finishes."""
    old = final.with_name(final.name + ".old")
    if old.exists():
        _rmtree(old)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        _rmtree(old)


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
    missing or unlisted, and that it is in the current format (format 1 holds pickles: refused with the command
    that converts it). ValueError names the first bad file."""
    state = read_state(path)
    check_format(path, state)
    verify_files(path, state)
    return state


def verify_files(path: Path, state: dict) -> None:
    """Every file listed in state.json has its SHA-256; none is missing or unlisted."""
    expected = state.get("sha256")
    if expected is None:
        raise ValueError(f"{path}: state.json has no checksums (a checkpoint from an older imagerl, or edited); "
                         "imagerl only resumes checksummed checkpoints")
    if not isinstance(expected, dict) or not all(isinstance(v, str) for v in expected.values()):
        raise ValueError(f"{path / 'state.json'}: 'sha256' must map each file to its checksum; the file was edited")
    actual = _checksums(path)
    for name in sorted(set(expected) | set(actual)):
        if name not in actual:
            raise ValueError(f"{path}: {name} is missing (listed in state.json); the checkpoint is incomplete")
        if name not in expected:
            raise ValueError(f"{path}: {name} is not part of the checkpoint (not in state.json's checksums)")
        if actual[name] != expected[name]:
            raise ValueError(f"{path}: {name} does not match its checksum: the file is corrupt or was modified; "
                             "resume from an earlier checkpoint (--resume <run>/checkpoints/step_N)")


def check_format(path: Path, state: dict) -> None:
    """Refuse format 1 (torch.distributed.checkpoint: pickles) with the command that converts it."""
    if state.get("format", 1) == FORMAT:
        return
    if state.get("format", 1) == 1 and (path / "dcp").is_dir():
        raise ValueError(f"{path} is in imagerl's checkpoint format 1 (torch.distributed.checkpoint, imagerl 0.1.0 "
                         "before 2026-12-06), whose metadata and optimizer entries are Python pickles that run code "
                         "when loaded; imagerl no longer loads it. If you trust its origin, convert it (this "
                         f"unpickles it once): imagerl convert-checkpoint --trust-pickle {path}")
    raise ValueError(f"{path}: state.json says format {state.get('format')!r}; this imagerl reads format {FORMAT}")


def read_state(path: Path) -> dict:
    """A checkpoint's state.json, with errors that name the file: 'step' (the rollouts done) a non-negative
    integer (not a bool, which json's true would be), 'config' a mapping."""
    file = path / "state.json"
    try:
        state = read_json(file)  # its ValueErrors name the file
    except OSError as e:
        raise ValueError(f"{file} cannot be read ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or type(state.get("step")) is not int:
        raise ValueError(f"{file} is not an imagerl checkpoint state (no integer 'step')")
    if state["step"] < 0:
        raise ValueError(f"{file}: 'step' is {state['step']}; it counts the rollouts done, never negative: the file "
                         "was edited; resume from another checkpoint")
    if not isinstance(state.get("config", {}), dict):
        raise ValueError(f"{file}: 'config' must be a mapping of settings; the file was edited")
    return state


def check_checkpoint(path: Path) -> dict:
    """Everything about a checkpoint that can be checked before a model loads, so that a bad one is refused in
    seconds, not after the model (minutes at 20 B): state.json, the format (format 1's pickles are never opened),
    every file's checksum, the trainer state's structure and its tensors' dtypes (read from the header), the RNG
    files. Returns state.json."""
    state = verify_checkpoint(path)
    check_trainer_files(path / "trainer")
    for file in sorted((path / "rng").glob("*.safetensors")):
        _read_rng(file)
    if (path / "model" / "transformer").is_dir():  # a full fine-tune's weights: their dtypes, from the headers
        for file in sorted((path / "model" / "transformer").glob("*.safetensors")):
            check_dtypes(file, safetensors_header(file, _RESUME_HINT)[0], lambda key: FLOAT_DTYPES, _RESUME_HINT)
    return state


_RESUME_HINT = "resume from an earlier checkpoint (--resume <run>/checkpoints/step_N)"


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


def _read_rng(file: Path) -> dict:
    """A process's RNG file, checked by setting each state on a generator of its own (not the process's): ValueError
    naming the file unless every state is there with the form its generator takes."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{file}: {what}; the RNG file is damaged or was not written by imagerl: {_RESUME_HINT}")

    meta = safetensors_header(file, _RESUME_HINT)[1]
    tensors = read_tensors(file, lambda key: {"I64"} if key == "numpy_keys" else {"U8"}, _RESUME_HINT)
    torch_state, keys = tensors.get("torch"), tensors.get("numpy_keys")
    if torch_state is None or torch_state.shape != torch.get_rng_state().shape:
        raise bad(f"no CPU generator state 'torch' of {torch.get_rng_state().numel()} bytes")
    if keys is None or keys.shape != (624,) or keys.min() < 0 or keys.max() >= 2**32:
        raise bad("'numpy_keys' must hold numpy's 624 32-bit key words")
    try:
        python = parse_json(meta["python"], f"{file}: metadata 'python'")
        numpy_meta = parse_json(meta["numpy"], f"{file}: metadata 'numpy'")
    except KeyError as e:
        raise bad(f"no {e} metadata") from None
    if not (isinstance(python, list) and len(python) == 3 and isinstance(python[1], list)
            and all(type(w) is int for w in python[1])):
        raise bad("metadata 'python' must be random.getstate()'s [version, [625 integers], gauss]")
    if not (isinstance(numpy_meta, list) and len(numpy_meta) == 4 and isinstance(numpy_meta[0], str)
            and all(type(v) in (int, float) for v in numpy_meta[1:])):
        raise bad("metadata 'numpy' must be numpy's [kind, pos, has_gauss, cached_gaussian]")
    state = {"torch": torch_state, "python": (python[0], tuple(python[1]), python[2]),
             "numpy": (numpy_meta[0], keys.numpy().astype(np.uint32), *numpy_meta[1:]),
             "cuda": [tensors[f"cuda_{i}"] for i in range(len(tensors)) if f"cuda_{i}" in tensors]}
    try:
        random.Random().setstate(state["python"])
        np.random.RandomState().set_state(state["numpy"])
    except (TypeError, ValueError, OverflowError) as e:
        raise bad(f"a state its generator does not take ({e})") from None
    try:
        torch.Generator().set_state(torch_state)
    except RuntimeError as e:  # torch's check of the bytes
        raise bad(f"the CPU generator state is invalid ({e})") from None
    return state


def _load_rng(file: Path) -> None:
    state = _read_rng(file)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"][:torch.cuda.device_count()])


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


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Remove all but the latest `keep` checkpoints and run.keep_best's (rank 0). Only complete step_<digits>
    directories count and go; a user's step_000002_keep_me or step_notes.txt stays."""
    done = _complete(run_dir)
    from imagerl.run.best_checkpoint import read_best

    best = read_best(run_dir)  # run.keep_best: the best checkpoint stays beside the latest `keep`
    for old in done[:-keep] if keep > 0 else []:
        if best is None or old.name != best["checkpoint"]:
            _rmtree(old)


def _recovery(run_dir: Path) -> tuple[list[Path], list[tuple[Path, Path]], list[Path]]:
    """How the swaps a kill interrupted (_swap_into_place) are finished, step by step: with step_N gone (moved
    aside), a complete step_N.tmp (the newer checkpoint) becomes step_N, else a complete step_N.old goes back; a
    step_N.old beside a complete step_N is the checkpoint it replaced, and goes. Returns (each step's complete
    checkpoint where it is now, oldest first; the renames; the removals). Reads only."""
    by_name: dict[str, dict[str, Path]] = {}
    for p, suffix in _checkpoint_dirs(run_dir):
        by_name.setdefault(p.name.removesuffix(suffix), {})[suffix] = p
    current, renames, removals = [], [], []
    for name, entries in by_name.items():
        final, tmp, old = entries.get(""), entries.get(".tmp"), entries.get(".old")
        if final is None:
            final = next((p for p in (tmp, old) if p is not None and _is_complete(p)), None)
            if final is not None:
                renames.append((final, final.with_name(name)))
        if final is not None and _is_complete(final):
            current.append(final)
            if old is not None and old != final:
                removals.append(old)
    return current, renames, removals


def recover_interrupted(run_dir: Path) -> None:
    """Finish the checkpoint swaps that kills interrupted (_recovery says how). Call only holding the run
    directory's lock (rank 0), before resolving a resume: a run that is refused must not change a live one."""
    _, renames, removals = _recovery(run_dir)
    for source, target in renames:
        source.rename(target)
    for old in removals:  # after the renames: a kill in between leaves step_N and step_N.old, finished next time
        _rmtree(old)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint whose state.json reads (a broken one is skipped with a warning naming it), where it is
    now: a step_N.tmp or .old that recover_interrupted will rename. Reads only."""
    import warnings

    for p in reversed(_recovery(run_dir)[0]):
        try:
            read_state(p)
            return p
        except ValueError as e:
            warnings.warn(f"skipping checkpoint {p}: {e}", stacklevel=2)
    return None


# settings a resumed run cannot change: the LoRA's shape, the algorithm's state, the random streams, the groups
FIXED_ON_RESUME = ("train.algorithm", "train.ema", "run.seed", "model.path", "model.family", "model.lora_rank",
                   "model.lora_alpha", "model.lora_init", "model.lora_target_modules", "sample.prompts_per_rollout",
                   "sample.group_size")


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
    # run.output_dir: where the run is now (resolved, or moved) is not a setting the resumed run changes
    return sorted(k for k in now if k in saved and saved[k] != now[k] and k not in ("recipe", "run.output_dir"))


def resolve_resume(resume: str, run_dir: Path) -> Path:
    """`latest` (in this run's directory), a run directory, or a checkpoint directory."""
    path = run_dir if resume == "latest" else Path(resume)
    if (path / "state.json").is_file():
        read_state(path)  # a named checkpoint must read; "latest" falls back past broken ones
        found = path
    else:
        found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise ValueError(f"--resume {resume}: no checkpoint found under {path} (expected checkpoints/step_*/state.json)")
    for root, dirs, files in os.walk(found):  # links not followed
        for name in dirs + files:
            link = Path(root) / name
            # checksums skip links, so a linked file would be read unverified; a full fine-tune's model/<component>
            # links to the base model are imagerl's own
            if link.is_symlink() and link.parent != found / "model":
                raise ValueError(link_refusal(link))
    return found


def load_checkpoint(path: Path, adapter, optimizer, world: World | None = None, extra: dict | None = None) -> int:
    """Restore LoRA, optimizer and RNG (every rank; any world size); return the rollout step the checkpoint
    was taken after. extra: tensors saved with save_checkpoint(extra=...), loaded into in place."""
    verify_checkpoint(path)
    load_trainer_state(path / "trainer", adapter.transformer, optimizer, extra)
    return _restore(path, optimizer, world or _ONE)


def load_full_checkpoint(path: Path, transformer, optimizer) -> int:
    """Restore a save_full_checkpoint: the transformer's weights (in place, float32), optimizer and RNG; return
    the step."""
    if not (path / "model" / "transformer").is_dir():
        raise ValueError(f"{path} is not a full fine-tuning checkpoint (no model/transformer/); it was written by "
                         "a LoRA run: resume with the same lora_rank")
    verify_checkpoint(path)
    check_weights_dir(path / "model" / "transformer", _RESUME_HINT)  # finite floats, before they become the weights
    saved = type(transformer).from_pretrained(path / "model", subfolder="transformer", torch_dtype=torch.float32)
    transformer.load_state_dict(saved.state_dict())
    del saved
    load_trainer_state(path / "trainer", transformer, optimizer, with_model=False)
    return _restore(path, optimizer, _ONE)


def merged_lora_transformer(base: Path, lora: Path | LoraFiles):
    """The base checkpoint's transformer (float32, CPU) with the PEFT LoRA of `lora` (a directory or its
    check_lora_dir) merged into its weights (diffusers fuse_lora, then the LoRA layers removed): a plain transformer
    with no adapter. The adapter is checked as load_lora checks it."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    lora = lora if isinstance(lora, LoraFiles) else check_lora_dir(lora)
    index = json.loads((Path(base) / "model_index.json").read_text())
    cls = getattr(diffusers, index["transformer"][1])
    transformer = cls.from_pretrained(base, subfolder="transformer", torch_dtype=torch.float32)
    try:
        transformer.add_adapter(LoraConfig(r=lora.rank, lora_alpha=lora.alpha, target_modules=lora.target_modules,
                                           lora_dropout=0.0))
    except ValueError as e:  # PEFT: target modules the model does not have
        raise ValueError(f"{lora.config_file}: {e}") from e
    check_lora_matches(transformer, lora)
    set_peft_model_state_dict(transformer, lora.state)
    transformer.fuse_lora()
    transformer.unload_lora()
    return transformer


def _restore(path: Path, optimizer, world: World) -> int:
    # this rank's RNG, else rank 0's (resuming on more ranks; no stream of a run depends on it, see rng.py)
    files = [path / "rng" / f"rank_{world.rank:05d}.safetensors", path / "rng" / "rank_00000.safetensors"]
    _load_rng(next((f for f in files if f.is_file()), files[-1]))
    return read_state(path)["step"]
