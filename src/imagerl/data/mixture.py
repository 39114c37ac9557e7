"""data.mixture: several prompt sets, each with its own rewards and its share of every rollout.

Composition: the P = sample.prompts_per_rollout prompts of a rollout are split over the sets by share with the
largest-remainder method: set s gets floor(P * share_s / total share), and the sets with the largest remainders one
more each (ties: the earlier set). Every set needs at least one prompt. A rollout's global prompt list is set 0's
prompts, then set 1's, ...; set s's prompts at rollout `step` are slots [step * c_s, (step + 1) * c_s) of its own
seeded permutations (one per pass over the set, keyed (seed, "prompt_order:<name>", pass)), so a resumed run draws
the same prompts. Rank r keeps its contiguous slice of the global list, as GroupSampler does: a group (one prompt's
K images) never spans ranks, and never mixes sets.

Scoring: each prompt's metadata carries MIXTURE_KEY, its set's name. The Scorer (rewards.registry) scores an image
with its set's rewards only (the other components are NaN for it) and weights them by its set's weights. Advantages
are computed set by set (advantages.rollout_advantages): a set's samples are normalised by their own statistics, so
one set's reward spread does not scale another's advantages.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from imagerl.data.prompts import PromptGroups, PromptSet, load_prompt_set, permuted_slots, repeat_prompts, \
    resolve_prompt_file
from imagerl.rewards.registry import MIXTURE_KEY

_NAME = re.compile(r"[A-Za-z0-9_-]+")


def set_counts(shares: list[float], total: int) -> list[int]:
    """Prompts per set: `total` split in proportion to `shares` by the largest remainder (ties: the earlier set)."""
    whole = sum(shares)
    exact = [total * s / whole for s in shares]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


def check_mixture(cfg) -> None:
    """ValueError for a bad data.mixture (names, shares, rewards, a set left without prompts), before any file or
    model loads; then reward.weights becomes the union of the sets' rewards (what the Scorer loads)."""
    from imagerl.rewards.registry import check_reward_names

    sets, data = cfg.data.mixture, cfg.data
    if not sets:
        return
    names = [s.name for s in sets]
    for i, s in enumerate(sets):
        where = f"data.mixture[{i}]"
        if not _NAME.fullmatch(s.name or ""):
            raise ValueError(f"{where}.name must be letters, digits, '_' or '-' (it names the set's metrics), got "
                             f"{s.name!r}")
        if names.count(s.name) > 1:
            raise ValueError(f"{where}.name {s.name!r} is used by two sets; give each set its own name")
        if not s.prompts:
            raise ValueError(f"{where} ({s.name}): prompts is empty; give a .txt/.jsonl file or a shipped set")
        if not (math.isfinite(s.share) and s.share > 0):
            raise ValueError(f"{where} ({s.name}): share must be > 0, got {s.share}")
        if not s.rewards:
            raise ValueError(f"{where} ({s.name}): rewards is empty; e.g. rewards: {{ocr: 1.0}}")
        try:
            check_reward_names(s.rewards, cfg.reward)
        except ValueError as e:
            raise ValueError(f"{where} ({s.name}).rewards: {e}") from None
    counts = set_counts([s.share for s in sets], cfg.sample.prompts_per_rollout)
    if 0 in counts:
        empty = sets[counts.index(0)]
        raise ValueError(f"data.mixture: set {empty.name!r} (share {empty.share:g}) gets no prompt of the "
                         f"{cfg.sample.prompts_per_rollout} per rollout (split {dict(zip(names, counts))}); raise its "
                         "share or sample.prompts_per_rollout")
    if data.test_prompts:
        raise ValueError("data.mixture: held-out prompts come from each set's test_prompts (scored by that set's "
                         f"rewards); remove data.test_prompts={data.test_prompts!r} (on the command line: "
                         "data.test_prompts= with nothing after '='; in YAML: test_prompts: '')")
    cfg.reward.weights = {name: 1.0 for s in sets for name in s.rewards}


def set_weights(cfg) -> dict[str, dict[str, float]] | None:
    """{set name: its reward weights} for the Scorer, or None without a mixture."""
    return {s.name: dict(s.rewards) for s in cfg.data.mixture} or None


def _tagged(prompt_set: PromptSet, name: str) -> PromptSet:
    return PromptSet(list(prompt_set.prompts), [{**m, MIXTURE_KEY: name} for m in prompt_set.metadata])


def _concat(sets: list[PromptSet]) -> PromptSet:
    return PromptSet([p for s in sets for p in s.prompts], [m for s in sets for m in s.metadata])


def _interleaved(sets: list[PromptSet], k: int) -> PromptSet:
    """The sets' entries in runs of k (one prompt's k samples), taking a run from each set in turn while it has
    one: eval.max_prompts' first N entries then hold every set's first prompts, not the first set's alone."""
    runs = [[(s.prompts[i:i + k], s.metadata[i:i + k]) for i in range(0, len(s), k)] for s in sets]
    prompts, metadata = [], []
    for turn in range(max(len(r) for r in runs)):
        for r in runs:
            if turn < len(r):
                prompts += r[turn][0]
                metadata += r[turn][1]
    return PromptSet(prompts, metadata)


def load_mixture(data_cfg) -> tuple[PromptSet, PromptSet | None]:
    """(every set's training prompts, tagged with its name, in set order; the sets' held-out prompts likewise, each
    repeated data.test_samples_per_prompt times and interleaved prompt by prompt across the sets, or None when no
    set has any)."""
    train, test = [], []
    k = data_cfg.test_samples_per_prompt
    for i, s in enumerate(data_cfg.mixture):
        train.append(_tagged(load_prompt_set(resolve_prompt_file(s.prompts), key=f"data.mixture[{i}].prompts"), s.name))
        if s.test_prompts:
            held_out = load_prompt_set(resolve_prompt_file(s.test_prompts), key=f"data.mixture[{i}].test_prompts")
            test.append(repeat_prompts(_tagged(held_out, s.name), k))
    return _concat(train), (_interleaved(test, k) if test else None)


@dataclass
class MixtureSampler:
    """GroupSampler's contract (groups_for(step) -> this rank's PromptGroups) over the sets of a mixture."""

    prompt_set: PromptSet  # load_mixture's tagged training prompts
    names: list[str]
    counts: list[int]  # prompts per rollout of each set (set_counts)
    seed: int
    rank: int = 0
    world_size: int = 1

    def __post_init__(self):
        total = sum(self.counts)
        if total % self.world_size:
            raise ValueError(f"prompts_per_rollout={total} must be divisible by world_size={self.world_size}")
        tags = [m[MIXTURE_KEY] for m in self.prompt_set.metadata]
        self.members = {name: [i for i, t in enumerate(tags) if t == name] for name in self.names}

    def _set_indices(self, name: str, count: int, step: int) -> list[int]:
        members = self.members[name]
        slots = range(step * count, (step + 1) * count)
        return [members[i] for i in permuted_slots(len(members), slots, self.seed, f"prompt_order:{name}")]

    def global_indices(self, step: int) -> list[int]:
        """Every rank's prompts of rollout `step`, set by set (indices into prompt_set)."""
        return [i for name, c in zip(self.names, self.counts) for i in self._set_indices(name, c, step)]

    def groups_for(self, step: int) -> PromptGroups:
        per_rank = sum(self.counts) // self.world_size
        mine = self.global_indices(step)[self.rank * per_rank : (self.rank + 1) * per_rank]
        return PromptGroups([self.prompt_set.prompts[i] for i in mine], [self.prompt_set.metadata[i] for i in mine],
                            list(range(self.rank * per_rank, (self.rank + 1) * per_rank)))


def make_sampler(cfg, train_set: PromptSet, world):
    """The rollout's prompt sampler: MixtureSampler with data.mixture, else GroupSampler."""
    from imagerl.data.prompts import GroupSampler

    sets = cfg.data.mixture
    if not sets:
        return GroupSampler(train_set, cfg.sample.prompts_per_rollout, cfg.run.seed, world.rank, world.size)
    return MixtureSampler(train_set, [s.name for s in sets],
                          set_counts([s.share for s in sets], cfg.sample.prompts_per_rollout), cfg.run.seed,
                          world.rank, world.size)


def sample_weights(metadata: list[dict], weights: dict[str, float], per_set: dict | None) -> dict:
    """Each reward's weight per sample (float64 (B,)): its set's weight, 0 where its set does not use it; without a
    mixture, the plain weights."""
    if not per_set:
        return weights
    return {name: torch.tensor([per_set[m[MIXTURE_KEY]].get(name, 0.0) for m in metadata], dtype=torch.float64)
            for name in weights}


def set_ids(metadata: list[dict], names: list[str]) -> torch.Tensor | None:
    """Each sample's set index in `names` (the config's sets, (B,) long), or None without a mixture: the advantages
    are then computed set by set (advantages.rollout_advantages)."""
    if not names:
        return None
    index = {name: i for i, name in enumerate(names)}
    return torch.tensor([index[m[MIXTURE_KEY]] for m in metadata], dtype=torch.long)


def set_metrics(prefix: str, names: list[str], metadata: list[dict], total_B, valid_B, components: dict,
                world) -> dict[str, float]:
    """<prefix>/set/<name>/raw_mean (the set's valid totals) and <prefix>/set/<name>/<reward>_mean (the finite
    values) for each set in `names` (the config's, the same on every rank), over all ranks: one all-reduce."""
    if not names:
        return {}
    tags = [m.get(MIXTURE_KEY) for m in metadata]
    total, valid = total_B.detach().cpu().double(), valid_B.detach().cpu().bool()
    sums = []
    for name in names:
        mask = torch.tensor([t == name for t in tags], dtype=torch.bool)
        sums += [total[mask & valid].sum().item(), (mask & valid).sum().item()]
        for values in components.values():
            values = values.detach().cpu().double()
            finite = mask & torch.isfinite(values)
            sums += [values[finite].sum().item(), finite.sum().item()]
    reduced = world.all_reduce_mean_(torch.tensor(sums, dtype=torch.float64, device=world.device)).cpu().tolist()
    out, k = {}, 0
    for name in names:
        for key in ["raw_mean", *(f"{c}_mean" for c in components)]:
            if reduced[k + 1]:
                out[f"{prefix}/set/{name}/{key}"] = reduced[k] / reduced[k + 1]
            k += 2
    return out
