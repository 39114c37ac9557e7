"""AWM (imagerl/algorithms/awm.py) against the official code, github.com/scxue/advantage_weighted_matching at be51372:
the loss and its gradient against a float64 transcription of advantage_weighted_matching/scripts/train_sd3_awm.py
(compute_log_prob_awm, lines 210-252; the exp_first surrogate and the KL terms, lines 1293-1354), the gradient
against its closed form, the stratified timestep draw (lines 1197-1205), the config checks, and one whole update on
the tiny model (zero advantages: no gradient; negated advantages: the negated gradient)."""

import math

import pytest
import torch

from conftest import tiny_config
from algorithm_probe import first_update
from imagerl.algorithms.awm import awm_loss, awm_timestep_indices, awm_update, scaled_advantages
from imagerl.validation import validate

AWM_ARGS = ["train.algorithm=awm", "sample.prompts_per_rollout=2", "sample.group_size=2", "sample.batch_size=2",
            "sample.height=64", "sample.width=64"]


def _upstream_loss(model_output, random_noise, clean_latents, timestep, advantages, ref_output, ema_output, beta,
                   ema_beta, power, adv_clip_max=5.0, advantage_max=1.0, clip_range=1.0):
    """train_sd3_awm.py, transcribed in float64: rows are the T x B (timestep, sample) pairs of one micro-batch."""
    log_prob = -(model_output.double() - (random_noise.double() - clean_latents.double())) ** 2   # line 237
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))                                  # line 238
    log_prob = -(torch.pow(-log_prob + 1e-10, power)                                              # ghuber, 248
                 - torch.pow(torch.tensor(1e-10, dtype=log_prob.dtype), power)) * timestep.view(-1) / power
    old_log_prob = log_prob.detach()                                                              # on-policy, 1284
    adv = torch.clamp(advantages, -adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max    # lines 1293-1299
    ratio = torch.exp(log_prob - old_log_prob.detach())                                           # exp_first, 1309
    unclipped = -adv * ratio                                                                      # line 1318
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped, clipped))                                   # line 1325
    kl = ((model_output.double() - ref_output.double()) ** 2).mean(dim=tuple(range(1, model_output.ndim)))
    ema_kl = ((model_output.double() - ema_output.double()) ** 2).mean(dim=tuple(range(1, model_output.ndim)))
    return policy_loss + beta * kl.mean() + ema_beta * ema_kl.mean()                              # line 1345


@pytest.mark.parametrize("power, beta, ema_beta", [(0.25, 0.003, 1.0), (0.5, 0.0001, 0.3)])
def test_loss_and_gradient_equal_a_float64_transcription_of_the_official_code(power, beta, ema_beta):
    g = torch.Generator().manual_seed(0)
    T, B, N, C = 3, 4, 5, 6
    v = torch.randn(T * B, N, C, generator=g, dtype=torch.float64, requires_grad=True)
    eps, x0 = torch.randn(T * B, N, C, generator=g), torch.randn(T * B, N, C, generator=g)
    v_ref, v_ema = torch.randn(T * B, N, C, generator=g), torch.randn(T * B, N, C, generator=g)
    t = torch.rand(T * B, generator=g)
    adv = torch.tensor([7.0, -2.0, 0.5, -6.5]).repeat(T)  # beyond the clip on both sides
    expected = _upstream_loss(v, eps, x0, t, adv, v_ref, v_ema, beta, ema_beta, power)
    (expected_grad,) = torch.autograd.grad(expected, v)
    ours = torch.stack([awm_loss(v[j * B:(j + 1) * B], eps[j * B:(j + 1) * B], x0[j * B:(j + 1) * B],
                                 v_ref[j * B:(j + 1) * B],
                                 v_ema[j * B:(j + 1) * B], t[j * B:(j + 1) * B], scaled_advantages(adv[:B], 5.0),
                                 "ghuber", power, beta, ema_beta).loss.mean() for j in range(T)]).mean()
    (grad,) = torch.autograd.grad(ours, v)
    assert ours.item() == pytest.approx(expected.item(), rel=1e-13, abs=1e-15)
    assert torch.allclose(grad, expected_grad, rtol=1e-12, atol=1e-18)


def test_the_policy_gradient_is_the_advantage_weighted_flow_matching_gradient():
    """d policy / dv = A' t (mse + 1e-10)^(p - 1) 2 (v - u) / numel: the ratio scaffolding adds nothing on-policy."""
    g = torch.Generator().manual_seed(1)
    v = torch.randn(3, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    u, t, p = torch.randn(3, 4, 5, generator=g, dtype=torch.float64), torch.tensor([0.9, 0.5, 0.2]), 0.25
    a = torch.tensor([1.0, -0.4, 0.25])
    terms = awm_loss(v, u, torch.zeros_like(u), None, None, t, a, "ghuber", p, 0.0, 0.0)
    (grad,) = torch.autograd.grad(terms.policy.sum(), v)
    mse = ((v - u) ** 2).mean(dim=(1, 2)).detach()
    closed = (a.double() * t.double() * (mse + 1e-10) ** (p - 1)).view(-1, 1, 1) * 2 * (v - u).detach() / 20
    assert torch.allclose(grad, closed, rtol=1e-12, atol=0)
    assert torch.equal(terms.policy.detach(), -a.double())  # the surrogate's value: -A' (ratio exactly 1)
    uniform = awm_loss(v, u, torch.zeros_like(u), None, None, t, a, "uniform", p, 0.0, 0.0)
    (grad_u,) = torch.autograd.grad(uniform.policy.sum(), v)
    assert torch.allclose(grad_u, a.double().view(-1, 1, 1) * 2 * (v - u).detach() / 20, rtol=1e-12, atol=0)


def test_timestep_indices_fill_the_official_strata():
    """14 steps, fraction 0.9, 6 indices (the official configs): strata {1} {2,3} {4,5} {6,7} {8,9} {10,11} with
    discrete_wo_init (skip_first), {0,1} ... {10,11} with discrete; index 12 and 13 never."""
    skip = awm_timestep_indices(0, 3, list(range(400)), 14, 6, 0.9, True)
    keep = awm_timestep_indices(0, 3, list(range(400)), 14, 6, 0.9, False)
    assert [sorted(set(skip[:, k].tolist())) for k in range(6)] == [[1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert [sorted(set(keep[:, k].tolist())) for k in range(6)] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    # keyed by the sample's global index: the same rows whatever else is drawn beside them (any number of ranks)
    assert torch.equal(awm_timestep_indices(0, 3, [17, 5], 14, 6, 0.9, True), skip[[17, 5]])


def test_advantages_are_clipped_and_scaled_as_the_official_code():
    a = torch.tensor([-9.0, -5.0, -1.0, 0.0, 2.5, 12.0], dtype=torch.float64)
    assert scaled_advantages(a, 5.0).tolist() == [-1.0, -1.0, -0.2, 0.0, 0.5, 1.0]


def test_config_validation(tiny_checkpoint, tmp_path):
    validate(tiny_config(tiny_checkpoint, tmp_path, *AWM_ARGS))
    for override, message in [("awm.solver=heun", "awm.solver must be one of"),
                              ("awm.weighting=huber", "awm.weighting must be 'ghuber' or 'uniform'"),
                              ("awm.ghuber_power=0", "awm.ghuber_power must be > 0"),
                              ("awm.kl_weight=-1", "awm.kl_weight must be a finite number >= 0"),
                              ("awm.ema_kl_decay_cap=1", r"awm.ema_kl_decay_cap must be in \[0, 1\)"),
                              ("awm.timestep_fraction=0.1", "must leave at least one index after the first"),
                              ("train.ema=true", "train.ema is Flow-GRPO's"),
                              ("sample.same_initial_noise=true", "identical images")]:
        with pytest.raises(ValueError, match=message):
            validate(tiny_config(tiny_checkpoint, tmp_path, *AWM_ARGS, override))


def _update_grads(cfg, advantages):
    """One awm_update at lr 0 on the tiny model; the gradients its optimizer step saw, and the stats."""
    grads, stats, *_ = first_update(cfg, advantages, lambda adapter, algo, rollout, a, optimizer, world: awm_update(
        adapter, rollout, a, optimizer, cfg, world, algo.states, 0, 0))
    return grads, stats


def test_a_whole_update_at_the_fresh_lora_is_odd_in_the_advantages(tiny_checkpoint, tmp_path):
    """With the fresh LoRA (B = 0) the policy, the reference and the KL anchor predict the same velocity bit for bit:
    both KL terms and their gradients are 0, and the policy term's gradient is linear in A'. Zero advantages give an
    exactly zero gradient, negated advantages the exactly negated one; the mean |A'| is A's clipped and scaled."""
    cfg = tiny_config(tiny_checkpoint, tmp_path, *AWM_ARGS, "train.num_optimizer_steps=1", "awm.kl_weight=1.0",
                      "awm.timestep_fraction=1.0", "awm.num_timesteps=3")
    zero, stats = _update_grads(cfg, torch.zeros(4))
    assert stats.kl_loss == 0.0 and stats.ema_kl_loss == 0.0 and stats.advantage_abs_mean == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in zero)
    a = torch.tensor([2.5, -2.5, 10.0, -1.25])  # A' = 0.5, -0.5, 1, -0.25: dyadic, exact
    plus, stats = _update_grads(cfg, a)
    minus, _ = _update_grads(cfg, -a)
    assert stats.advantage_abs_mean == pytest.approx(0.5625) and stats.policy_loss == pytest.approx(-0.1875)
    assert math.isfinite(stats.flow_mse) and stats.flow_mse > 0 and stats.trained_timesteps == 3
    assert any(g.abs().max() > 0 for g in plus)
    assert all(torch.equal(g, -h) for g, h in zip(plus, minus))
