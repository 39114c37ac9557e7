"""Reward registry and the weighted scorer.

A reward is a class registered with `@register_reward("name")`, constructed as `cls(cfg, device)`
(cfg: the RewardConfig; device: where its model runs) and called as
`reward(images_B3HW, prompts_B, metadata_B) -> (B,) floats`, images float in [0, 1] on the CPU. The
scorer calls it on chunks of at most reward.batch_size images. Optional hooks, both classmethods so
that they run before any model is loaded:

* `check_config(cfg)`: raise ValueError for a setting the reward cannot work with (e.g. a missing
  weights directory);
* `validate_prompts(prompts, metadata)`: raise ValueError naming the first prompt it cannot score
  (e.g. an OCR prompt without a quoted target), so that a bad prompt file fails when it is loaded
  instead of giving zeros in the middle of a run.

The scorer never turns a failure into a number: an exception becomes a RewardError naming the reward,
and a NaN/inf value makes the sample invalid (valid_B False); reward.on_error decides what happens next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from imagerl.config import RewardConfig

MIXTURE_KEY = "mixture_set"  # data.mixture: the metadata key naming an image's prompt set

REWARDS: dict[str, Callable] = {}


class RewardError(RuntimeError):
    pass


def register_reward(name: str):
    def deco(cls):
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        REWARDS[name] = cls
        return cls

    return deco


def check_reward_names(weights: dict[str, float]) -> None:
    _import_builtin()
    unknown = [n for n in weights if n not in REWARDS]
    if unknown:
        raise ValueError(f"unknown reward(s) {unknown} in reward.weights; available: {', '.join(sorted(REWARDS))}")


def check_reward_config(cfg: RewardConfig) -> None:
    """Names, then each weighted reward's own settings (paths, ...), without loading any model."""
    check_reward_names(cfg.weights)
    for name in cfg.weights:
        check = getattr(REWARDS[name], "check_config", None)
        if check is not None:
            check(cfg)


def validate_prompts(names, prompts: list[str], metadata: list[dict] | None = None) -> None:
    """Run the `validate_prompts` hook of each named reward (class-level, no model loaded)."""
    check_reward_names({n: 1.0 for n in names})
    for name in names:
        _validate_with(name, REWARDS[name], prompts, metadata)


def _validate_with(name: str, reward, prompts: list[str], metadata: list[dict] | None) -> None:
    hook = getattr(reward, "validate_prompts", None)
    if hook is None:
        return
    metadata = [{} for _ in prompts] if metadata is None else metadata
    try:
        hook(prompts, metadata)
    except ValueError as e:
        raise ValueError(f"reward {name!r} cannot score these prompts: {e}") from e


def _import_builtin() -> None:
    # registration is an import side effect; the heavy libraries are imported only when a reward is built
    from imagerl.rewards import aesthetic, clipscore, jpeg, ocr, pickscore  # noqa: F401
    from imagerl.rewards import shapes  # noqa: F401


@dataclass
class RewardBatch:
    """total_B: weighted sum (NaN where any component is not finite); components: name -> (B,) raw values;
    valid_B: bool, finite total."""

    total_B: torch.Tensor
    components: dict[str, torch.Tensor]
    valid_B: torch.Tensor


def reward_device(cfg: RewardConfig, device: torch.device | str) -> torch.device:
    """reward.device, or the given (policy) device when it is "auto"."""
    return torch.device(device) if cfg.device == "auto" else torch.device(cfg.device)


class Scorer:
    """The weighted mixture of cfg.weights. `score` returns every component (for rollout/reward/<name>_mean)
    and their weighted sum."""

    def __init__(self, cfg: RewardConfig, device: torch.device | str = "cpu",
                 set_weights: dict[str, dict[str, float]] | None = None):
        """set_weights (data.mixture, imagerl.data.mixture): {set name: its weights}; an image whose metadata names its
        set (MIXTURE_KEY) is scored by that set's rewards only, weighted by them (its other components
        NaN); an image without a set by cfg.weights. cfg.weights must hold every set's rewards (they load once)."""
        if not isinstance(cfg, RewardConfig):
            raise TypeError(f"Scorer takes the RewardConfig (cfg.reward), got {type(cfg).__name__}")
        if cfg.batch_size < 1:
            raise ValueError(f"reward.batch_size must be >= 1, got {cfg.batch_size}")
        check_reward_config(cfg)
        self.cfg = cfg
        self.weights = dict(cfg.weights)
        self.device = reward_device(cfg, device)
        self.set_weights = set_weights or {}
        missing = {r for w in self.set_weights.values() for r in w} - set(self.weights)
        if missing:
            raise ValueError(f"reward.weights lacks the mixture's rewards {sorted(missing)}")
        self.models = {name: REWARDS[name](cfg, self.device) for name in self.weights}

    def _weights_of(self, metadata: list[dict] | None, n: int) -> list[dict[str, float]]:
        """Each image's reward weights: its set's (data.mixture), else reward.weights."""
        if not self.set_weights:
            return [self.weights] * n
        return [self.set_weights.get((m or {}).get(MIXTURE_KEY), self.weights) for m in (metadata or [{}] * n)]

    def validate_prompts(self, prompts: list[str], metadata: list[dict] | None = None) -> None:
        """ValueError naming the first prompt that one of the rewards cannot score (each reward checks the prompts
        of the sets that use it)."""
        weights = self._weights_of(metadata, len(prompts))
        for name, model in self.models.items():
            idx = [i for i, w in enumerate(weights) if name in w]
            _validate_with(name, model, [prompts[i] for i in idx], [metadata[i] for i in idx] if metadata else None)

    def score(self, images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict]) -> RewardBatch:
        n = images_B3HW.shape[0]
        if len(prompts) != n or len(metadata) != n:
            raise ValueError(f"{n} images but {len(prompts)} prompts and {len(metadata)} metadata records")
        step = self.cfg.batch_size
        weights = self._weights_of(metadata, n)
        components = {}
        total = torch.zeros(n, dtype=torch.float64)
        for name, model in self.models.items():
            idx = [i for i, w in enumerate(weights) if name in w]  # every image without a mixture
            whole = len(idx) == n
            images = images_B3HW if whole else images_B3HW[idx]
            texts, records = (prompts, metadata) if whole else ([prompts[i] for i in idx], [metadata[i] for i in idx])
            parts = []
            for lo in range(0, len(idx), step):
                hi = min(lo + step, len(idx))
                try:
                    values = model(images[lo:hi], texts[lo:hi], records[lo:hi])
                    values = torch.as_tensor(values, dtype=torch.float64).detach().cpu().reshape(-1)
                except Exception as e:  # noqa: BLE001 - re-raised with the reward's name
                    raise RewardError(f"reward {name!r} failed: {type(e).__name__}: {e}") from e
                if values.numel() != hi - lo:
                    raise RewardError(f"reward {name!r} returned {values.numel()} values for {hi - lo} images")
                parts.append(values)
            values = torch.full((n,), float("nan"), dtype=torch.float64)
            if parts:
                values[idx] = torch.cat(parts)
            components[name] = values
            w = torch.tensor([wi.get(name, 0.0) for wi in weights], dtype=torch.float64)
            uses = torch.zeros(n, dtype=torch.bool)
            uses[idx] = True
            total += torch.where(uses, w * values, torch.zeros_like(values))  # a set without it adds 0, not NaN
        return RewardBatch(total, components, torch.isfinite(total))
