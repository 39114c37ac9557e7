"""Group-relative advantages (flow_grpo `PerPromptStatTracker`, type 'grpo').

A_i = (R_i - mean(R_g(i))) / (std + eps), std = population std (ddof 0) of the sample's own group
(global_std=False) or of all rewards of the rollout (global_std=True, the Qwen-Image recipe);
eps = 1e-4. Size-1 and all-equal groups get advantage 0. Statistics in float64.
Clipping to +-adv_clip_max happens in the loss, as in flow_grpo.

train.advantage=per_reward (GDPO, group reward-decoupled normalization for several rewards, NVIDIA 2026; NVlabs/GDPO
trl-GDPO/trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py at b080e63, lines 1222-1248): each reward component's advantage is
normalised on its own as above, their weighted sum is taken, and the sum is normalised over the batch,
  P_i = sum_n w_n (R_n,i - mean(R_n,g(i))) / (std_n + eps),   A_i = (P_i - mean(P)) / (std(P) + 1e-4),
std(P) with Bessel's correction (torch's default, as GDPO), so that a reward with a large spread cannot drown the
others and the advantage keeps unit scale whatever the number of rewards. With one reward GDPO falls back to GRPO on
the weighted reward (its `len(self.reward_weights) > 1` test), and so does this. Where imagerl differs: the group
std is the population std (flow_grpo's, as in the sum mode; GDPO: torch's unbiased std) and may be global
(global_std); with equal group sizes that is a common factor sqrt((K-1)/K) that the batch normalisation removes, up
to eps.

data.mixture: every set's advantages are computed over that set's samples alone (its own global std, its own batch
normalisation), so a set whose rewards spread little is not scaled down by another's; each set's advantages have
unit scale. A reward's weight is then the set's weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def as_group_ids(group_ids) -> torch.Tensor:
    """Group ids as a 1-D integer tensor: a tensor or array as it is; any other sequence of hashable ids (prompt
    strings as flow_grpo groups by, ints, 0-d tensors) coded by first appearance (equal ids, equal codes)."""
    if isinstance(group_ids, torch.Tensor):
        return group_ids
    if type(group_ids).__module__ == "numpy":
        return torch.as_tensor(group_ids)
    codes: dict = {}
    try:
        return torch.tensor([codes.setdefault(g.item() if isinstance(g, torch.Tensor) else g, len(codes))
                             for g in group_ids], dtype=torch.long)
    except TypeError as e:  # an unhashable id (a list, a multi-element tensor)
        raise ValueError(f"group ids must be hashable (str, int, 0-d tensor) or one integer tensor: {e}") from e


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    _, inverse = torch.unique(torch.as_tensor(group_ids), return_inverse=True)
    return inverse, int(inverse.max()) + 1 if inverse.numel() else 0


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and population std (float64)."""
    r = rewards.to(torch.float64)
    idx, num_groups = _group_index(group_ids)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, idx, torch.ones_like(r))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, idx, r) / count
    # sum/count of K equal float64 values can be off by an ulp (std ~1e-17, not 0): use the value itself.
    lo = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce_(0, idx, r, "amin")
    hi = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, idx, r, "amax")
    mean = torch.where(lo == hi, lo, mean)
    var = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, idx, (r - mean[idx]) ** 2) / count
    return mean[idx], var.sqrt()[idx]


def group_advantages(rewards: torch.Tensor, group_ids, *, global_std: bool, eps: float = 1e-4) -> torch.Tensor:
    """Advantages (same shape/dtype as rewards, 1-D) from rewards and a group id per sample."""
    rewards = torch.as_tensor(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
    group_ids = as_group_ids(group_ids)
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids shape {tuple(group_ids.shape)} != rewards shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; drop or repair those samples before computing advantages")
    mean, group_std = _group_stats(rewards, group_ids)
    std = rewards.to(torch.float64).std(correction=0) if global_std else group_std
    adv = (rewards.to(torch.float64) - mean) / (std + eps)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def batch_normalised(adv: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GDPO's last step (grpo_trainer.py lines 1244-1248 at b080e63): (A - mean(A)) / (std(A) + 1e-4), std with
    Bessel's correction as torch's default. Fewer than two samples: zeros (GDPO's std would be NaN)."""
    adv = adv.to(torch.float64)
    if adv.numel() < 2:
        return torch.zeros_like(adv)
    return (adv - adv.mean()) / (adv.std() + eps)


def per_reward_advantages(components: dict[str, torch.Tensor], weights: dict[str, float | torch.Tensor], group_ids,
                          *, global_std: bool, eps: float = 1e-4) -> torch.Tensor:
    """GDPO's advantages (float64, 1-D; module docstring): the weighted sum of each component's own group advantage,
    normalised over the batch; with one scored component, the group advantage of the weighted reward.

    A weight may be a per-sample tensor, and a component NaN on samples that it did not score (data.mixture); each
    component's advantage is computed over the samples it scored (their groups, their global std) and adds 0
    elsewhere."""
    if not components:
        raise ValueError("per-reward advantages need at least one reward component")
    group_ids = as_group_ids(group_ids)
    parts = []
    for name, values in components.items():
        values = torch.as_tensor(values, dtype=torch.float64)
        scored = torch.isfinite(values)
        if scored.any():
            parts.append((name, values, scored))
    if not parts:
        return torch.zeros(group_ids.shape, dtype=torch.float64)

    def scored_advantages(values: torch.Tensor, scored: torch.Tensor) -> torch.Tensor:  # 0 where not scored
        adv = torch.zeros_like(values)
        adv[scored] = group_advantages(values[scored], group_ids[scored], global_std=global_std,
                                       eps=eps).to(torch.float64)
        return adv

    if len(parts) == 1:  # GDPO: `if self.apply_gdpo and len(self.reward_weights) > 1`, else GRPO on the weighted sum
        name, values, scored = parts[0]
        return scored_advantages(torch.as_tensor(weights[name], dtype=torch.float64) * values, scored)
    total = torch.zeros_like(parts[0][1])
    for name, values, scored in parts:
        total = total + torch.as_tensor(weights[name], dtype=torch.float64) * scored_advantages(values, scored)
    return batch_normalised(total)


@dataclass
class GroupStats:
    zero_std_ratio: float  # fraction of groups whose rewards are all equal (no learning signal)
    reward_std_mean: float  # mean within-group std
    num_groups: int


def group_stats(rewards: torch.Tensor, group_ids) -> GroupStats:
    group_ids = as_group_ids(group_ids)
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


def rollout_advantages(reward_B: torch.Tensor, valid_B: torch.Tensor, group_ids_B: torch.Tensor, world,
                       global_std: bool, components_B: dict[str, torch.Tensor] | None = None,
                       weights: dict[str, float] | None = None,
                       set_ids_B: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """This rank's advantages from rewards gathered over all ranks, plus reward metrics. With components_B and
    weights (train.advantage=per_reward) each component is normalised on its own (per_reward_advantages). With
    set_ids_B (data.mixture: each sample's set index) each set's advantages are computed over its samples alone.

    Samples whose reward is not finite (valid_B False) get advantage 0 and are left out of every
    statistic; the caller decides whether they are allowed (reward.on_error).
    """
    device = world.device
    reward_all = world.all_gather(reward_B.to(device, torch.float64)).cpu()
    valid_all = world.all_gather(valid_B.to(device)).cpu()
    groups_all = world.all_gather(group_ids_B.to(device)).cpu()
    sets_all = (world.all_gather(set_ids_B.to(device)).cpu() if set_ids_B is not None
                else torch.zeros_like(groups_all))
    adv_all = torch.zeros_like(reward_all)
    kept = reward_all[valid_all]
    if kept.numel() and components_B is not None:
        parts = {n: world.all_gather(v.to(device, torch.float64)).cpu() for n, v in components_B.items()}
        weights = {n: world.all_gather(w.to(device, torch.float64)).cpu() if isinstance(w, torch.Tensor)
                   else w for n, w in weights.items()}  # data.mixture: each sample's set's weight
    for s in torch.unique(sets_all[valid_all]).tolist():
        rows = valid_all & (sets_all == s)
        if components_B is not None:
            adv_all[rows] = per_reward_advantages(
                {n: v[rows] for n, v in parts.items()},
                {n: w[rows] if isinstance(w, torch.Tensor) else w for n, w in weights.items()},
                groups_all[rows], global_std=global_std)
        else:
            adv_all[rows] = group_advantages(reward_all[rows], groups_all[rows], global_std=global_std)
    n = reward_B.numel()
    stats = group_stats(kept, groups_all[valid_all]) if kept.numel() else GroupStats(float("nan"), float("nan"), 0)
    metrics = {
        "rollout/reward/raw_mean": kept.mean().item() if kept.numel() else float("nan"),
        "rollout/reward/raw_std": kept.std(correction=0).item() if kept.numel() else float("nan"),
        "rollout/reward/failed_count": int((~valid_all).sum()),
        "rollout/zero_std_ratio": stats.zero_std_ratio,
        "rollout/reward_std_mean": stats.reward_std_mean,
        "rollout/num_groups": stats.num_groups,
        "rollout/advantage_abs_mean": adv_all.abs().mean().item(),
    }
    return adv_all[world.rank * n : (world.rank + 1) * n].float(), metrics
