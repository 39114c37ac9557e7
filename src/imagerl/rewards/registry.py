"""Reward registry and the weighted scorer.

A reward is a class registered with `@register_reward("name")`, constructed as `cls(cfg, device)`
(cfg: the RewardConfig; device: where its model runs) and called as
`reward(images_B3HW, prompts_B, metadata_B) -> (B,) floats`, images float in [0, 1] on the CPU. The
scorer calls it on chunks of at most reward.batch_size images. Optional hooks, both classmethods so
that they run before any model is loaded:

* `check_config(cfg)`: raise ValueError for a setting the reward cannot work with (e.g. a missing
  weights directory, or a bad value among its own settings, cfg.options[name]);
* `validate_prompts(prompts, metadata)`: raise ValueError naming the first prompt it cannot score
  (e.g. an OCR prompt without a quoted target), so that a bad prompt file fails when it is loaded
  instead of giving zeros in the middle of a run.

Rewards come from imagerl, from reward.plugins and installed entry points (imagerl.rewards.plugins), or from a
reward server (reward.remote: imagerl.rewards.remote). The scorer never turns a failure into a number: an exception becomes a RewardError naming the reward,
and a NaN/inf value makes the sample invalid (valid_B False); reward.on_error decides what happens next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from imagerl.config import RewardConfig
from imagerl.rewards.plugins import load_entry_points, load_plugins

MIXTURE_KEY = "mixture_set"  # data.mixture: the metadata key naming an image's prompt set

REWARDS: dict[str, Callable] = {}


class RewardError(RuntimeError):
    pass


def register_reward(name: str):
    def deco(cls):
        old = REWARDS.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(f"reward {name!r} is registered twice: by {old.__module__}.{old.__qualname__} and by "
                             f"{cls.__module__}.{cls.__qualname__}; rename one")
        REWARDS[name] = cls
        return cls

    return deco


def check_reward_names(weights, cfg: RewardConfig | None = None) -> None:
    """ValueError for a name that is neither registered nor served (cfg.remote); cfg's plugins are imported first."""
    _import_builtin()
    if cfg is not None:
        load_plugins(cfg.plugins)
    remote = cfg.remote if cfg is not None else {}
    unknown = [n for n in weights if n not in REWARDS and n not in remote]
    if unknown:
        hint = "" if cfg is None or cfg.plugins else (" (a reward of your own: name the module that registers it in "
                                                      "reward.plugins, or serve it: reward.remote)")
        raise ValueError(f"unknown reward(s) {unknown} in reward.weights; available: {', '.join(sorted(REWARDS))}"
                         f"{hint}")


def check_reward_config(cfg: RewardConfig) -> None:
    """Plugins, names, reward.options, then each weighted local reward's own settings (paths, options, ...), without
    loading any model. A served reward (reward.remote) is checked by its server when the Scorer connects."""
    from imagerl.rewards.remote import check_remote_config

    check_reward_names(cfg.weights, cfg)
    check_remote_config(cfg)
    for name, options in cfg.options.items():
        if name in cfg.remote:
            raise ValueError(f"reward.options.{name}: {name} is served by {cfg.remote[name]}; give its options to the "
                             f"server (imagerl reward-server --reward {name} reward.options.{name}.KEY=VALUE)")
        if name not in REWARDS:
            raise ValueError(f"reward.options.{name}: no reward {name!r} is registered (available: "
                             f"{', '.join(sorted(REWARDS))})")
        if not isinstance(options, dict):
            raise ValueError(f"reward.options.{name} must be a mapping of settings, got {options!r}")
    for name in cfg.weights:
        check = getattr(REWARDS.get(name), "check_config", None)
        if check is not None and name not in cfg.remote:
            check(cfg)


def validate_prompts(names, prompts: list[str], metadata: list[dict] | None = None,
                     cfg: RewardConfig | None = None) -> None:
    """Run the `validate_prompts` hook of each named local reward (class-level, no model loaded); a served reward's
    server checks the prompts when the Scorer connects (Scorer.validate_prompts)."""
    check_reward_names({n: 1.0 for n in names}, cfg)
    for name in names:
        if cfg is None or name not in cfg.remote:
            _validate_with(name, REWARDS[name], prompts, metadata)


def _validate_with(name: str, reward, prompts: list[str], metadata: list[dict] | None) -> None:
    hook = getattr(reward, "validate_prompts", None)
    if hook is None:
        return
    metadata = [{} for _ in prompts] if metadata is None else metadata
    from imagerl.rewards.remote import RemoteRewardError

    try:
        hook(prompts, metadata)
    except RemoteRewardError:
        raise  # its server failed: not the prompts
    except ValueError as e:
        raise ValueError(f"reward {name!r} cannot score these prompts: {e}") from e


def _import_builtin() -> None:
    # registration is an import side effect; the heavy libraries are imported only when a reward is built
    from imagerl.rewards import aesthetic, clipscore, jpeg, ocr, pickscore  # noqa: F401
    from imagerl.rewards import shapes  # noqa: F401

    load_entry_points()  # installed plugins (entry-point group imagerl.rewards)


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


def _build(name: str, cfg: RewardConfig, device: torch.device):
    """The reward's model: its registered class, or a client of the server that serves it (reward.remote)."""
    if name in cfg.remote:
        from imagerl.rewards.remote import RemoteReward

        return RemoteReward(name, cfg.remote[name], cfg)
    return REWARDS[name](cfg, device)


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
        self.models = {name: _build(name, cfg, self.device) for name in self.weights}

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
            chunk = max(len(idx), 1) if getattr(model, "scores_whole_batch", False) else step  # a server: its own
            for lo in range(0, len(idx), chunk):
                hi = min(lo + chunk, len(idx))
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
