"""Prompt files, the deterministic train/test split, and the group-complete distributed prompt sampler.

Prompt files: `.txt` (one prompt per line, blank lines skipped) or `.jsonl` (one JSON object per
line with a "prompt" field; the whole record is kept as metadata for rewards that need it).

Held-out split (data.test_prompts=split): the distinct prompt texts are ordered by a hash of
(split_seed, text) and the first test_fraction of them are held out, with every record that has
that text. The split depends only on the file's prompts and the seed (not on torch, Python or the
machine), and a prompt repeated in the file (GenEval repeats each prompt 4 times) never lands on
both sides.

The sampler is stateless: the prompts of rollout `step` are a pure function of (seed, step), so all
ranks agree on them without communication, and a resumed run draws exactly what an uninterrupted
run would have drawn.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from imagerl.distributed.rng import make_generator

BUNDLED_PROMPTS = "ocr_prompts_128.txt"  # first 128 lines of flow_grpo's OCR test prompts (MIT)
# Prompt sets shipped in imagerl/assets, by the name data.train_prompts / data.test_prompts accept.
# The shapes sets are the prompts files of `imagerl make-synthetic-data DIR --num-images 4096 --seed 0`
# (the quickstart model's training captions, and 64 captions of held-out scenes: see synthetic.py).
NAMED_PROMPT_SETS = {"bundled": BUNDLED_PROMPTS, "shapes-train": "shapes_prompts_train.txt",
                     "shapes-test": "shapes_prompts_test.txt",
                     # flow_grpo's OCR test prompts and GenEval's 553 prompts (github.com/yifan123/flow_grpo, MIT:
                     # assets/LICENSE-flow_grpo; GenEval: github.com/djghosh13/geneval, evaluation_metadata.jsonl)
                     "ocr-test": "ocr_test_prompts.txt", "geneval": "geneval_prompts.jsonl"}


def bundled_prompt_file(name: str = "bundled") -> Path:
    return Path(str(resources.files("imagerl") / "assets" / NAMED_PROMPT_SETS[name]))


def resolve_prompt_file(spec: str) -> Path:
    """A named prompt set (NAMED_PROMPT_SETS) -> its bundled file; anything else is a path."""
    return bundled_prompt_file(spec) if spec in NAMED_PROMPT_SETS else Path(spec).expanduser()


@dataclass
class PromptSet:
    prompts: list[str]
    metadata: list[dict] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)


def load_prompt_set(path: str | Path, key: str = "data.train_prompts") -> PromptSet:
    """Read a prompt file; every problem is a ValueError that names the file and line (and `key`, the
    setting that named the file)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist (set {key} to a .txt or .jsonl file)")
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
            except RecursionError:  # json recurses into nested lists and objects
                raise ValueError(f"{path}:{lineno}: nested too deeply to be a prompt record") from None
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


def _subset(prompt_set: PromptSet, indices: list[int]) -> PromptSet:
    return PromptSet([prompt_set.prompts[i] for i in indices], [prompt_set.metadata[i] for i in indices])


def _split_key(seed: int, prompt: str) -> bytes:
    return hashlib.sha256(f"imagerl-split:{int(seed)}:{prompt}".encode()).digest()


def split_prompt_set(prompt_set: PromptSet, test_fraction: float, seed: int) -> tuple[PromptSet, PromptSet]:
    """(train, test): hold out round(test_fraction x distinct prompts) distinct prompt texts (at least one,
    and at least one left for training when there are two or more), chosen by a seeded hash order.

    Deterministic (same prompts and seed -> same split), disjoint (by record and by prompt text), and
    together they hold every record; both keep the file order. A set with one distinct prompt gives an
    empty train set."""
    if not 0 < test_fraction < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    if not len(prompt_set):
        raise ValueError("cannot split an empty prompt set")
    distinct = list(dict.fromkeys(prompt_set.prompts))
    n_test = min(max(1, round(len(distinct) * test_fraction)), max(1, len(distinct) - 1))
    held_out = set(sorted(distinct, key=lambda p: _split_key(seed, p))[:n_test])
    test = [i for i, p in enumerate(prompt_set.prompts) if p in held_out]
    train = [i for i, p in enumerate(prompt_set.prompts) if p not in held_out]
    return _subset(prompt_set, train), _subset(prompt_set, test)


def repeat_prompts(prompt_set: PromptSet, k: int) -> PromptSet:
    """Each prompt k times in a row (prompt i becomes entries i*k .. i*k + k - 1: evaluation gives every entry its
    own noise, so these are k samples of one prompt)."""
    if k < 1:
        raise ValueError(f"data.test_samples_per_prompt must be >= 1, got {k}")
    return _subset(prompt_set, [i for i in range(len(prompt_set)) for _ in range(k)])


def rank_block(num_items: int, rank: int, world_size: int) -> range:
    """Rank r's contiguous block of range(num_items) split into world_size parts: the first
    num_items % world_size ranks take one item more. Every item is on exactly one rank."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    base, extra = divmod(num_items, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@dataclass
class PromptGroups:
    """This rank's share of one rollout: G complete groups of K samples.

    prompts_G / metadata_G: the G prompts; group_ids_G: global group index (0..P-1), unique per rollout.
    """

    prompts_G: list[str]
    metadata_G: list[dict]
    group_ids_G: list[int]


def permuted_slots(n: int, slots: range, seed: int, purpose: str) -> list[int]:
    """Indices in [0, n) drawn at consecutive slots: slot s is position s mod n of the permutation of pass s // n,
    seeded by (seed, purpose, pass); without replacement within a pass, and the same from any starting slot (a
    resumed run, another rank)."""
    perms: dict[int, list[int]] = {}
    out = []
    for slot in slots:
        epoch, pos = divmod(slot, n)
        if epoch not in perms:
            perms[epoch] = torch.randperm(n, generator=make_generator(seed, purpose, epoch)).tolist()
        out.append(perms[epoch][pos])
    return out


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

    def groups_for(self, step: int) -> PromptGroups:
        per_rank = self.num_prompts // self.world_size
        first = step * self.num_prompts + self.rank * per_rank
        indices = permuted_slots(len(self.prompt_set), range(first, first + per_rank), self.seed, "prompt_order")
        group_ids = list(range(self.rank * per_rank, (self.rank + 1) * per_rank))
        return PromptGroups(
            [self.prompt_set.prompts[i] for i in indices], [self.prompt_set.metadata[i] for i in indices], group_ids
        )
