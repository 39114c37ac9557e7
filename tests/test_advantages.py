"""Group-relative advantages and group statistics against a numpy float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from imagerl.algorithms.advantages import group_advantages, group_stats


def ref_advantages(rewards, group_ids, global_std, eps=1e-4):
    """flow_grpo PerPromptStatTracker ('grpo'): (r - mean_g) / (np.std(.) + eps), np.std = population std."""
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(group_ids)
    adv = np.empty_like(r)
    for gid in np.unique(g):
        sel = g == gid
        std = np.std(r) if global_std else np.std(r[sel])
        adv[sel] = (r[sel] - np.mean(r[sel])) / (std + eps)
    return adv


def ref_stats(rewards, group_ids):
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(group_ids)
    groups = [r[g == gid] for gid in np.unique(g)]
    zero = [x.max() == x.min() for x in groups]  # "all rewards equal", robust to float rounding of the mean
    return float(np.mean(zero)), float(np.mean([np.std(x) for x in groups])), len(groups)


def shuffled_groups(num_groups, k, seed, ids=None):
    """Interleaved, non-contiguous group ids: `ids` (default 10*i + 3) each repeated k times, permuted."""
    torch.manual_seed(seed)
    ids = torch.as_tensor(ids if ids is not None else [10 * i + 3 for i in range(num_groups)])
    return ids.repeat_interleave(k)[torch.randperm(num_groups * k)]


@pytest.mark.parametrize("global_std", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_groups,k", [(4, 8), (3, 2), (16, 16)])
def test_matches_numpy_reference(global_std, dtype, num_groups, k):
    g = shuffled_groups(num_groups, k, seed=num_groups * k)
    r = (torch.randn(num_groups * k, dtype=torch.float64) * 2 + 5).to(dtype)
    adv = group_advantages(r, g, global_std=global_std)
    assert adv.dtype == dtype and adv.shape == r.shape
    ref = ref_advantages(r.double().numpy(), g.numpy(), global_std)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    np.testing.assert_allclose(adv.double().numpy(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("eps", [1e-4, 0.5, 0.0])
def test_eps_and_population_std(eps):
    # one group {0, 2}: mean 1, population std 1 (sample std would be sqrt 2)
    adv = group_advantages(torch.tensor([0.0, 2.0], dtype=torch.float64), [0, 0], global_std=False, eps=eps)
    assert torch.allclose(adv, torch.tensor([-1.0, 1.0], dtype=torch.float64) / (1 + eps), rtol=1e-14)


def test_global_std_uses_all_rewards():
    r = torch.tensor([0.0, 1.0, 10.0, 11.0], dtype=torch.float64)
    g = [5, 5, 9, 9]
    std_all = float(np.std(r.numpy()))  # 5.0249...
    adv = group_advantages(r, g, global_std=True)
    assert torch.allclose(adv, torch.tensor([-0.5, 0.5, -0.5, 0.5], dtype=torch.float64) / (std_all + 1e-4))
    adv_local = group_advantages(r, g, global_std=False)
    assert torch.allclose(adv_local, torch.tensor([-0.5, 0.5, -0.5, 0.5], dtype=torch.float64) / (0.5 + 1e-4))


@pytest.mark.parametrize("global_std", [False, True])
def test_size_one_groups_get_zero(global_std):
    torch.manual_seed(0)
    r = torch.randn(7, dtype=torch.float64)
    g = torch.tensor([4, 1, 1, 9, 1, 2, 2])  # groups 4 and 9 have one sample
    adv = group_advantages(r, g, global_std=global_std)
    assert adv[0] == 0 and adv[3] == 0
    np.testing.assert_allclose(adv.numpy(), ref_advantages(r.numpy(), g.numpy(), global_std), rtol=1e-12, atol=1e-15)
    all_single = group_advantages(r, torch.arange(7), global_std=global_std)
    assert torch.equal(all_single, torch.zeros(7, dtype=torch.float64))


@pytest.mark.parametrize("global_std", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_all_equal_group_gets_exactly_zero(global_std, dtype):
    torch.manual_seed(1)
    for k in (2, 3, 5, 7, 16, 24):
        for _ in range(20):
            value = torch.rand((), dtype=torch.float64)  # arbitrary float64: sum/k need not round back to it
            r = torch.cat([value.repeat(k), torch.randn(k, dtype=torch.float64)]).to(dtype)
            g = torch.tensor([1] * k + [0] * k)
            adv = group_advantages(r, g, global_std=global_std)
            assert torch.equal(adv[:k], torch.zeros(k, dtype=dtype)), (k, float(value), adv[:k])
            stats = group_stats(r, g)
            assert stats.zero_std_ratio == 0.5 and stats.num_groups == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_mean_within_each_group(dtype):
    g = shuffled_groups(8, 12, seed=2, ids=[100, -3, 7, 0, 55, 56, 1, 2])
    r = (torch.rand(96, dtype=torch.float64) * 10).to(dtype)
    adv = group_advantages(r, g, global_std=False).double()
    for gid in g.unique():
        sel = g == gid
        assert abs(float(adv[sel].mean())) < 1e-6
        assert abs(float(adv[sel].std(correction=0)) - 1) < 1e-3  # std / (std + 1e-4) ~ 1
    adv_global = group_advantages(r, g, global_std=True).double()
    for gid in g.unique():
        assert abs(float(adv_global[g == gid].mean())) < 1e-6


def test_group_id_labels_do_not_matter():
    torch.manual_seed(3)
    r = torch.randn(12, dtype=torch.float64)
    g = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2])
    relabelled = torch.tensor([99, -5, 7])[g]
    for global_std in (False, True):
        assert torch.allclose(group_advantages(r, g, global_std=global_std),
                              group_advantages(r, relabelled, global_std=global_std), rtol=0, atol=1e-15)
    # python lists are accepted for both
    adv = group_advantages(r.tolist(), relabelled.tolist(), global_std=False)
    np.testing.assert_allclose(adv.double().numpy(), ref_advantages(r.numpy(), g.numpy(), False), rtol=1e-6)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_rewards_raise(bad):
    r = torch.tensor([0.1, bad, 0.3, 0.4])
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(r, [0, 0, 1, 1], global_std=False)


def test_shape_mismatch_and_non_1d_raise():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(4), [0, 0, 1], global_std=False)
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long), global_std=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_stats_matches_numpy(dtype):
    torch.manual_seed(4)
    sizes = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9, 15])  # unequal: per-group, not per-sample, averages
    g = (torch.arange(10) * 10 + 3).repeat_interleave(sizes)
    g = g[torch.randperm(g.numel())]
    r = torch.rand(g.numel(), dtype=torch.float64)
    # all-equal rewards: a size-1 group, a binary-reward-like group and two arbitrary float64 values
    for gid, value in [(3, 0.25), (43, 1.0), (73, 0.1), (93, 0.7310585786300049)]:
        r[g == gid] = value
    r = r.to(dtype)
    stats = group_stats(r, g)
    zero_ratio, std_mean, num_groups = ref_stats(r.double().numpy(), g.numpy())
    assert num_groups == 10 and stats.num_groups == 10
    assert stats.zero_std_ratio == zero_ratio == 0.4
    assert abs(stats.reward_std_mean - std_mean) < 1e-12


def test_group_stats_no_zero_std_groups():
    torch.manual_seed(5)
    r = torch.randn(16)
    g = torch.arange(4).repeat(4)
    stats = group_stats(r, g)
    zero_ratio, std_mean, _ = ref_stats(r.double().numpy(), g.numpy())
    assert stats.zero_std_ratio == zero_ratio == 0.0
    assert abs(stats.reward_std_mean - std_mean) < 1e-12


def test_group_ids_may_be_prompt_strings_ints_or_tensors_as_flow_grpo_groups_by_prompt():
    from imagerl import group_advantages as exported

    rewards = torch.tensor([1.0, 3.0, 2.0, 6.0], dtype=torch.float64)
    by_tensor = group_advantages(rewards, torch.tensor([0, 0, 1, 1]), global_std=True)
    for ids in (["a", "a", "b", "b"], [7, 7, 3, 3], [torch.tensor(5), torch.tensor(5), torch.tensor(2), torch.tensor(2)],
                ("x", "x", ("t", 1), ("t", 1))):
        assert torch.equal(exported(rewards, ids, global_std=True), by_tensor)
        assert torch.equal(group_advantages(rewards, ids, global_std=False),
                           group_advantages(rewards, torch.tensor([0, 0, 1, 1]), global_std=False))
    # a prompt twice in one rollout is one group of 2K, as flow_grpo's per-prompt tracker
    assert torch.equal(group_advantages(rewards, ["p", "q", "p", "q"], global_std=True),
                       group_advantages(rewards, torch.tensor([0, 1, 0, 1]), global_std=True))
    with pytest.raises(ValueError, match="hashable"):
        group_advantages(rewards, [[1], [1], [2], [2]], global_std=True)


def _direct_group_advantages(values, groups, global_std, eps=1e-4):
    """flow_grpo's per-prompt normalisation written out with Python floats (population std)."""
    out = []
    all_mean = sum(values) / len(values)
    all_std = (sum((v - all_mean) ** 2 for v in values) / len(values)) ** 0.5
    for v, g in zip(values, groups):
        members = [x for x, h in zip(values, groups) if h == g]
        mean = sum(members) / len(members)
        std = all_std if global_std else (sum((x - mean) ** 2 for x in members) / len(members)) ** 0.5
        out.append((v - mean) / (std + eps) if len(set(members)) > 1 else 0.0)
    return out


@pytest.mark.parametrize("global_std", [False, True])
def test_per_reward_advantages_are_the_weighted_sum_of_each_rewards_own_advantage(global_std):
    """GDPO: a reward with a 100x spread (jpeg) cannot drown the other (shapes) as it does in the sum."""
    from imagerl.algorithms.advantages import per_reward_advantages

    groups = [0, 0, 0, 1, 1, 1]
    shapes = [0.2, 0.5, 0.8, 0.1, 0.1, 0.4]
    jpeg = [30.0, -10.0, 50.0, 20.0, -40.0, 0.0]
    weights = {"shapes": 1.0, "jpeg": 0.5}
    got = per_reward_advantages({"shapes": torch.tensor(shapes, dtype=torch.float64),
                                 "jpeg": torch.tensor(jpeg, dtype=torch.float64)}, weights, torch.tensor(groups),
                                global_std=global_std)
    a, b = _direct_group_advantages(shapes, groups, global_std), _direct_group_advantages(jpeg, groups, global_std)
    pre = [1.0 * x + 0.5 * y for x, y in zip(a, b)]
    # GDPO's batch normalisation: (P - mean) / (std + 1e-4), std with Bessel's correction
    mean = sum(pre) / len(pre)
    std = (sum((p - mean) ** 2 for p in pre) / (len(pre) - 1)) ** 0.5
    expected = [(p - mean) / (std + 1e-4) for p in pre]
    assert got.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    summed = group_advantages(torch.tensor([s + 0.5 * j for s, j in zip(shapes, jpeg)], dtype=torch.float64),
                              torch.tensor(groups), global_std=global_std)
    # in the sum the shapes reward barely moves the ranking: sample 0 (shapes 0.2) outranks sample 1 (0.5) there,
    # while its own normalised shapes advantage is negative
    assert summed[0] > summed[1] and a[0] < 0


def test_per_reward_training_runs_on_two_rewards(tiny_checkpoint, tmp_path):
    import json

    from conftest import tiny_config
    from imagerl.train import train

    train(tiny_config(tiny_checkpoint, tmp_path, "train.advantage=per_reward", "train.num_rollouts=1",
                      "reward.weights={jpeg_compressibility: 1.0, jpeg_incompressibility: 0.5}"))
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and record["rollout/advantage_abs_mean"] > 0
