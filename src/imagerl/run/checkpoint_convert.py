"""`imagerl convert-checkpoint`: a format-1 checkpoint (torch.distributed.checkpoint in dcp/) rewritten in format 2
(trainer/: safetensors + JSON, checkpoint_tensors.py), in place.

Format 1's dcp/.metadata and its non-tensor optimizer entries are Python pickles: reading them can run code, so
imagerl's resume refuses them and only this command, run knowingly on a checkpoint the user trusts, reads them
(with torch.distributed.checkpoint's own loader, the one imagerl 0.1.0 used): convert_checkpoint needs
trust_pickle=True (the CLI: --trust-pickle, or a yes on a terminal), and everything that can be checked without
unpickling (check_convertible) is checked first. Everything else (lora/, rng/, the
config) is kept; the checksums are recomputed over the new files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from imagerl.run.checkpoint import _checksums, _swap_into_place, read_state, verify_files
from imagerl.run.checkpoint_tensors import FORMAT, flatten, non_finite, write_trainer_files

# format 1 stored the algorithm's tensors beside "model" and "optim" at the top of the DCP state
_TRAINER_KEYS = ("model", "optim")


def check_convertible(path: Path) -> dict:
    """What can be checked of a format-1 checkpoint without unpickling anything: state.json, the format, dcp/ and
    every file's checksum (a modified checkpoint is not converted: its checksums are the writer's). Its state.json."""
    path = Path(path)
    state = read_state(path)
    if state.get("format", 1) == FORMAT:
        raise ValueError(f"{path} is already in format {FORMAT}; nothing to convert")
    if not (path / "dcp" / ".metadata").is_file():
        raise ValueError(f"{path} has no dcp/.metadata: not a format-1 imagerl checkpoint")
    verify_files(path, state)
    return state


def convert_checkpoint(path: Path, trust_pickle: bool = False) -> Path:
    """Convert the format-1 checkpoint at `path` in place; return it. ValueError if it is not one, or corrupt, and,
    before anything is read, unless trust_pickle (its pickles can run code)."""
    path = Path(path)
    state = check_convertible(path)
    if not trust_pickle:
        raise ValueError(f"{path}: converting reads format 1's pickles, which can run code; pass trust_pickle=True "
                         "(imagerl convert-checkpoint --trust-pickle) only for checkpoints you trust")
    loaded = _read_dcp(path / "dcp")
    tree = {k: loaded[k] for k in _TRAINER_KEYS if k in loaded}
    extra = {k: v for k, v in loaded.items() if k not in _TRAINER_KEYS}
    if "nft" in extra and "optimizer_steps" not in extra["nft"]:  # format 2 counts DiffusionNFT's optimizer steps;
        # format 1 derived them as rollouts x train.num_optimizer_steps, which is what they were
        steps = state["step"] * state.get("config", {}).get("train", {}).get("num_optimizer_steps", 1)
        extra["nft"] = {**extra["nft"], "optimizer_steps": torch.tensor(steps, dtype=torch.int64)}
    if extra:
        tree["extra"] = extra
    structure, tensors = flatten(tree)
    bad = non_finite(tensors)
    if bad:
        raise ValueError(f"{path}: {bad[0]} is not finite (NaN or inf); not converting it")

    tmp = path.with_name(path.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    shutil.copytree(path, tmp, symlinks=True, ignore=shutil.ignore_patterns("dcp", "state.json"))
    write_trainer_files(tmp / "trainer", structure, tensors)
    state = {**state, "format": FORMAT, "sha256": _checksums(tmp)}
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    _swap_into_place(tmp, path)
    return path


def _read_dcp(directory: Path) -> dict:
    """The whole DCP state as nested dicts (CPU tensors): torch.distributed.checkpoint's loader, which unpickles."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    _load_state_dict(state, storage_reader=FileSystemReader(str(directory)), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    return state
