"""Prompt files and the group-complete distributed prompt sampler.

Prompt files: `.txt` (one prompt per line, blank lines skipped) or `.jsonl` (one JSON object per
line with a "prompt" field; the whole record is kept as metadata for rewards that need it).

The sampler is stateless: the prompts of rollout `step` are a pure function of (seed, step), so all
ranks agree on them without communication, and a resumed run draws exactly what an uninterrupted
run would have drawn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from imagerl.distributed.rng import make_generator

BUNDLED_PROMPTS = "ocr_prompts_128.txt"  # first 128 lines of flow_grpo's OCR test prompts (MIT)


def bundled_prompt_file() -> Path:
    return Path(str(resources.files("imagerl") / "assets" / BUNDLED_PROMPTS))


@dataclass
class PromptSet:
    prompts: list[str]
    metadata: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompt_set(path: str | Path) -> PromptSet:
    """Read a prompt file; every problem is a ValueError that names the file and line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist (set data.train_prompts to a .txt or .jsonl file)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"prompt file {path} is not UTF-8 text: {e}") from e
    prompts, metadata = [], []
    if path.suffix == ".jsonl":
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
                raise ValueError(f'{path}:{lineno}: each line must be a JSON object with a non-empty "prompt" string')
            prompts.append(record["prompt"].strip())
            metadata.append(record)
    elif path.suffix in (".txt", ""):
        for line in text.splitlines():
            if line.strip():
                prompts.append(line.strip())
                metadata.append({})
    else:
        raise ValueError(f"prompt file {path}: unknown extension {path.suffix!r}; use .txt (one per line) or .jsonl")
    if not prompts:
        raise ValueError(f"prompt file {path} contains no prompts")
    return PromptSet(prompts, metadata)


def load_prompts(path: str | Path) -> list[str]:
    return load_prompt_set(path).prompts


@dataclass
class PromptGroups:
    """This rank's share of one rollout: G complete groups of K samples.

    prompts_G / metadata_G: the G prompts; group_ids_G: global group index (0..P-1), unique per rollout.
    """

    prompts_G: list[str]
    metadata_G: list[dict]
    group_ids_G: list[int]


class GroupSampler:
    """Hands each rank complete prompt groups; all ranks agree on the global list.

    Prompts are drawn without replacement from a permutation per epoch, seeded by (seed, epoch).
    Rollout `step` takes global prompt slots [step*P, (step+1)*P); rank r keeps slots
    [r*P/W, (r+1)*P/W) of them, so every group lives on one rank.
    """

    def __init__(self, prompt_set: PromptSet, prompts_per_rollout: int, seed: int, rank: int = 0, world_size: int = 1):
        if prompts_per_rollout % world_size:
            raise ValueError(f"prompts_per_rollout={prompts_per_rollout} must be divisible by world_size={world_size}")
        self.prompt_set, self.num_prompts, self.seed = prompt_set, prompts_per_rollout, seed
        self.rank, self.world_size = rank, world_size

    def _permutation(self, epoch: int) -> list[int]:
        gen = make_generator(self.seed, "prompt_order", epoch)
        return torch.randperm(len(self.prompt_set), generator=gen).tolist()

    def groups_for(self, step: int) -> PromptGroups:
        n = len(self.prompt_set)
        per_rank = self.num_prompts // self.world_size
        first = step * self.num_prompts + self.rank * per_rank
        perms: dict[int, list[int]] = {}
        indices = []
        for slot in range(first, first + per_rank):
            epoch, pos = divmod(slot, n)
            if epoch not in perms:
                perms[epoch] = self._permutation(epoch)
            indices.append(perms[epoch][pos])
        group_ids = list(range(self.rank * per_rank, (self.rank + 1) * per_rank))
        return PromptGroups(
            [self.prompt_set.prompts[i] for i in indices], [self.prompt_set.metadata[i] for i in indices], group_ids
        )
