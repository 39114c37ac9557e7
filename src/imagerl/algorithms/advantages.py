"""Group-relative advantages (flow_grpo `PerPromptStatTracker`, type 'grpo').

A_i = (R_i - mean(R_g(i))) / (std + eps), std = population std (ddof 0) of the sample's own group
(global_std=False) or of all rewards of the rollout (global_std=True, the Qwen-Image recipe);
eps = 1e-4. Size-1 and all-equal groups get advantage 0. Statistics in float64.
Clipping to +-adv_clip_max happens in the loss, as in flow_grpo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, inverse = torch.unique(torch.as_tensor(group_ids), return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and population std (float64)."""
    r = rewards.to(torch.float64)
    idx, num_groups = _group_index(group_ids)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, idx, r) / count
    var = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, idx, (r - mean[idx]) ** 2) / count
    return mean[idx], var.sqrt()[idx]


def group_advantages(rewards: torch.Tensor, group_ids, *, global_std: bool, eps: float = 1e-4) -> torch.Tensor:
    """Advantages (same shape/dtype as rewards, 1-D) from rewards and a group id per sample."""
    rewards = torch.as_tensor(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    group_ids = torch.as_tensor(group_ids)
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; drop or repair those samples before computing advantages")
    mean, group_std = _group_stats(rewards, group_ids)
    std = rewards.to(torch.float64).std(correction=0) if global_std else group_std
    adv = (rewards.to(torch.float64) - mean) / (std + eps)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


@dataclass
class GroupStats:
    zero_std_ratio: float  # fraction of groups whose rewards are all equal (no learning signal)
    reward_std_mean: float  # mean within-group std
    num_groups: int


def group_stats(rewards: torch.Tensor, group_ids) -> GroupStats:
    group_ids = torch.as_tensor(group_ids)
    _, std = _group_stats(torch.as_tensor(rewards), group_ids)
    _, first = _unique_first(group_ids)
    std_g = std[first]
    return GroupStats(float((std_g == 0).double().mean()), float(std_g.mean()), int(std_g.numel()))


def _unique_first(group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique ids and the index of each one's first occurrence."""
    idx, num_groups = _group_index(group_ids)
    positions = torch.arange(idx.numel())
    first = torch.full((num_groups,), idx.numel(), dtype=torch.long).scatter_reduce_(0, idx, positions, "amin")
    return idx, first
