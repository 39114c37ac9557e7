"""Reward registry and the weighted scorer.

A reward is a callable `(images_B3HW, prompts_B, metadata_B) -> (B,) float tensor`, images float in
[0, 1] on the CPU. Register with `@register_reward("name")` on a class whose constructor takes the
device. The scorer never turns a failure into a number: an exception becomes a RewardError naming
the reward, and NaN/inf values are either an error or dropped with a count (reward.on_nan).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

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


def _import_builtin() -> None:
    from imagerl.rewards import jpeg  # noqa: F401  (registration is an import side effect)


@dataclass
class RewardBatch:
    """total_B: weighted sum (NaN where any component is not finite); components: name -> (B,) raw values;
    valid_B: bool, finite total."""

    total_B: torch.Tensor
    components: dict[str, torch.Tensor]
    valid_B: torch.Tensor


class Scorer:
    def __init__(self, weights: dict[str, float], device: torch.device | str = "cpu"):
        check_reward_names(weights)
        self.weights = dict(weights)
        self.models = {name: REWARDS[name](device) for name in weights}

    def score(self, images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict]) -> RewardBatch:
        n = images_B3HW.shape[0]
        components = {}
        total = torch.zeros(n, dtype=torch.float64)
        for name, model in self.models.items():
            try:
                values = torch.as_tensor(model(images_B3HW, prompts, metadata), dtype=torch.float64).reshape(-1)
            except Exception as e:  # noqa: BLE001 - re-raised with the reward's name
                raise RewardError(f"reward {name!r} failed: {type(e).__name__}: {e}") from e
            if values.numel() != n:
                raise RewardError(f"reward {name!r} returned {values.numel()} values for {n} images")
            components[name] = values
            total += self.weights[name] * values
        return RewardBatch(total, components, torch.isfinite(total))
