"""train.advantage=per_reward against GDPO's own code, and data.mixture's advantages set by set.

The reference is a float64 transcription of NVlabs/GDPO trl-GDPO/trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py at
b080e63 (2026-01-09), lines 1222-1248: per reward, (r - group mean) / (group std + 1e-4) over `num_generations`
consecutive samples; the weighted sum over rewards (nansum); then (A - mean(A)) / (std(A) + 1e-4) over the batch.
torch's .std() there is the unbiased std. imagerl's group std is flow_grpo's population std (the sum mode's): with
equal groups of K that is a common factor sqrt((K-1)/K) that the batch normalisation removes, up to eps.
"""

import math

import pytest
import torch

from imagerl.algorithms.advantages import group_advantages, per_reward_advantages, rollout_advantages
from imagerl.distributed.parallel import World

K = 8


def gdpo_reference(rewards_per_func: torch.Tensor, reward_weights: torch.Tensor, num_generations: int,
                   group_correction: int = 1) -> torch.Tensor:
    """grpo_trainer.py lines 1222-1248 at b080e63, float64; group_correction=0 swaps only the group std for the
    population std (imagerl's convention)."""
    rewards_per_func = torch.nan_to_num(rewards_per_func.double())
    all_reward_advantage = []
    for i in range(len(reward_weights)):
        reward_i = rewards_per_func[:, i]
        mean = reward_i.view(-1, num_generations).mean(dim=1).repeat_interleave(num_generations, dim=0)
        std = reward_i.view(-1, num_generations).std(dim=1, correction=group_correction)
        std = std.repeat_interleave(num_generations, dim=0)
        all_reward_advantage.append((reward_i - mean) / (std + 1e-4))
    combined = torch.stack(all_reward_advantage, dim=1)
    pre_bn = (combined * reward_weights.double().unsqueeze(0)).nansum(dim=1)
    return (pre_bn - pre_bn.mean()) / (pre_bn.std() + 1e-4)


def _three_rewards(seed=0, groups=6):
    gen = torch.Generator().manual_seed(seed)
    n = groups * K
    rewards = torch.stack([torch.rand(n, generator=gen, dtype=torch.float64),             # a score in [0, 1]
                           50 * torch.randn(n, generator=gen, dtype=torch.float64),       # a large spread
                           (torch.rand(n, generator=gen) > 0.5).double()], dim=1)          # a pass/fail reward
    return rewards, torch.arange(n) // K, torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)


def _ours(rewards, group_ids, weights, global_std=False):
    names = ["a", "b", "c"]
    return per_reward_advantages({n: rewards[:, i] for i, n in enumerate(names)},
                                 {n: weights[i].item() for i, n in enumerate(names)}, group_ids, global_std=global_std)


def test_per_reward_advantages_equal_gdpos_code_with_the_population_group_std():
    rewards, group_ids, weights = _three_rewards()
    torch.testing.assert_close(_ours(rewards, group_ids, weights),
                               gdpo_reference(rewards, weights, K, group_correction=0), rtol=0, atol=1e-12)


def test_per_reward_advantages_match_gdpos_code_verbatim_up_to_its_eps():
    """GDPO's unbiased group std scales every group advantage by sqrt(K/(K-1)); the batch normalisation removes it
    up to the 1e-4 terms."""
    rewards, group_ids, weights = _three_rewards(seed=1)
    torch.testing.assert_close(_ours(rewards, group_ids, weights), gdpo_reference(rewards, weights, K),
                               rtol=0, atol=1e-3)


def test_per_reward_advantages_keep_unit_scale_with_three_rewards():
    """Without the batch normalisation the weighted sum of three unit-scale advantages has std ~2.2 here."""
    rewards, group_ids, weights = _three_rewards(seed=2)
    adv = _ours(rewards, group_ids, weights)
    assert adv.std().item() == pytest.approx(1.0, abs=1e-3)
    assert abs(adv.mean().item()) < 1e-12


def test_one_reward_falls_back_to_grpo_on_the_weighted_reward():
    """GDPO applies only `if self.apply_gdpo and len(self.reward_weights) > 1`; else GRPO on the weighted sum."""
    rewards, group_ids, _ = _three_rewards(seed=3)
    got = per_reward_advantages({"a": rewards[:, 1]}, {"a": 0.5}, group_ids, global_std=True)
    torch.testing.assert_close(got, group_advantages(0.5 * rewards[:, 1], group_ids, global_std=True).double(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("advantage", ["sum", "per_reward"])
def test_a_mixture_normalises_each_set_on_its_own(advantage):
    """Two sets under global_std: set 0's reward spreads 0.01, set 1's 10. Pooled over both sets (the code before
    this test), set 0's mean |A| was ~0.001; each set on its own gives both unit scale."""
    gen = torch.Generator().manual_seed(4)
    n = 4 * K
    set_ids = torch.tensor([0] * (n // 2) + [1] * (n // 2))
    group_ids = torch.arange(n) // K
    small = 0.01 * torch.randn(n, generator=gen, dtype=torch.float64)
    large = 10 * torch.randn(n, generator=gen, dtype=torch.float64)
    a = torch.where(set_ids == 0, small, math.nan)
    b = torch.where(set_ids == 1, large, math.nan)
    total = torch.where(set_ids == 0, small, large)
    world = World(0, 1, torch.device("cpu"))
    components = {"a": a, "b": b} if advantage == "per_reward" else None
    weights = {"a": (set_ids == 0).double(), "b": (set_ids == 1).double()} if advantage == "per_reward" else None
    adv, _ = rollout_advantages(total, torch.ones(n, dtype=torch.bool), group_ids, world, True, components, weights,
                                set_ids)
    for s in (0, 1):  # global std: the within-group share of the set's variance, at most 1
        std = adv[set_ids == s].double().std(correction=0).item()
        assert 0.5 < std <= 1.0 + 1e-6, (s, std)
    # and each set equals its advantages computed alone
    alone = group_advantages(small[: n // 2], group_ids[: n // 2], global_std=True)
    torch.testing.assert_close(adv[: n // 2], alone.float(), rtol=1e-6, atol=1e-6)
