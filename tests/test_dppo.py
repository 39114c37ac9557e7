"""Flow-DPPO (imagerl/algorithms/dppo.py) against verl-omni at a1139ba, verl_omni/trainer/diffusion/diffusion_algos.py
FlowDPPOLoss.compute_loss (lines 376-442), transcribed in float64 below: the loss value and its gradient, the mask's
four cases, and one whole update on the tiny model, which in a rollout's first (on-policy) optimizer step must equal
Flow-GRPO's update exactly (ratio 1 and divergence 0: nothing masked, nothing clipped)."""

import pytest
import torch

from conftest import tiny_config
from algorithm_probe import first_update
from imagerl.algorithms.dppo import dppo_loss
from imagerl.validation import validate


def _verl_omni_loss(old_log_prob, log_prob, advantages, old_prev_sample_mean, prev_sample_mean, std_dev_t, sqrt_dt,
                    kl_mask_threshold):
    """FlowDPPOLoss.compute_loss with add_kl_coefficient=True and no rollout_is_weights, in float64."""
    advantages = advantages.detach()
    log_ratio = log_prob - old_log_prob                                                       # line 397
    ratio = torch.exp(log_ratio)
    unclipped_loss = -advantages * ratio                                                      # line 399
    mean_diff_sq = (prev_sample_mean - old_prev_sample_mean).pow(2)                           # line 401
    sigma_t = std_dev_t * sqrt_dt.reshape(sqrt_dt.shape[0], *([1] * (std_dev_t.ndim - 1)))   # lines 403, 369-372
    kl_per_elem = mean_diff_sq / (2 * sigma_t.pow(2))                                         # line 404
    kl_per_sample = kl_per_elem.mean(dim=tuple(range(1, kl_per_elem.ndim)))                   # line 408
    high_kl_mask = kl_per_sample >= kl_mask_threshold                                         # lines 412-413
    pos_rm_mask = high_kl_mask & (ratio > 1.0) & (advantages > 0)
    neg_rm_mask = high_kl_mask & (ratio < 1.0) & (advantages < 0)
    keep_mask = (~(pos_rm_mask | neg_rm_mask)).detach()
    zero = torch.zeros((), dtype=unclipped_loss.dtype)
    return torch.mean(torch.where(keep_mask, unclipped_loss, zero)), keep_mask               # lines 420-423


def test_loss_mask_and_gradient_equal_a_float64_transcription_of_verl_omni():
    g = torch.Generator().manual_seed(0)
    B, N, C = 8, 6, 4
    # the four mask cases at high and low divergence: (ratio > 1, A > 0) and (ratio < 1, A < 0) are dropped when far
    log_ratio = torch.tensor([0.2, 0.2, -0.2, -0.2, 0.2, -0.2, 0.2, -0.2], dtype=torch.float64)
    advantages = torch.tensor([1.5, -1.5, 1.5, -1.5, 2.0, -2.0, 6.0, -7.0], dtype=torch.float64)  # 6, -7: no clamp
    old_lp = torch.randn(B, generator=g, dtype=torch.float64)
    lp = (old_lp + log_ratio).requires_grad_(True)
    old_mean = torch.randn(B, N, C, generator=g, dtype=torch.float64)
    far = torch.tensor([1, 1, 1, 1, 0, 0, 1, 1], dtype=torch.float64).view(-1, 1, 1)  # samples 4, 5: near
    mean = (old_mean + far * 1e-2 * torch.randn(B, N, C, generator=g, dtype=torch.float64)).requires_grad_(True)
    std_dev_t, sqrt_dt = torch.full((B, 1, 1), 0.9, dtype=torch.float64), torch.full((B,), 0.3, dtype=torch.float64)
    expected, keep = _verl_omni_loss(old_lp, lp, advantages, old_mean, mean, std_dev_t, sqrt_dt, 1e-5)
    terms = dppo_loss(lp, old_lp, mean, old_mean, torch.tensor(0.9, dtype=torch.float64),
                      torch.tensor(0.3, dtype=torch.float64), advantages, 1e-5)
    assert keep.tolist() == [False, True, True, False, True, True, False, False]  # the cases the code names
    assert torch.equal(terms.dropped, ~keep)
    ours = terms.loss.mean()
    assert ours.item() == pytest.approx(expected.item(), rel=1e-14)
    (g_expected,) = torch.autograd.grad(expected, lp)
    (g_ours,) = torch.autograd.grad(ours, lp)
    assert torch.allclose(g_ours, g_expected, rtol=1e-14, atol=0)
    assert g_ours[[0, 3, 6, 7]].abs().sum() == 0 and g_ours[[1, 2, 4, 5]].abs().min() > 0
    assert terms.divergence[4] < 1e-5 <= terms.divergence[:4].min()


def test_config_validation(tiny_checkpoint, tmp_path):
    base = ["train.algorithm=dppo"]
    validate(tiny_config(tiny_checkpoint, tmp_path, *base))
    for override, message in [("sample.sde_type=cps", "set sample.sde_type=sde"),
                              ("train.ratio=grpo_guard", "Flow-DPPO has no ratio clip"),
                              ("dppo.kl_threshold=0", "dppo.kl_threshold must be > 0")]:
        with pytest.raises(ValueError, match=message):
            validate(tiny_config(tiny_checkpoint, tmp_path, *base, override))


def test_the_on_policy_step_is_flow_grpos_update(tiny_checkpoint, tmp_path):
    """In a rollout's first optimizer step the ratio is 1 and the divergence 0: Flow-DPPO's gradient is Flow-GRPO's
    (advantages inside its clamp), whose float64 reference is tests/test_flow_grpo_update_reference.py."""
    common = ["train.num_optimizer_steps=1", "train.beta=0"]
    a = torch.tensor([1.5, -2.0, 4.0, -0.5])
    dppo, stats, rollout, *_ = first_update(tiny_config(tiny_checkpoint, tmp_path, "train.algorithm=dppo", *common), a)
    grpo, *_ = first_update(tiny_config(tiny_checkpoint, tmp_path, *common), a)
    assert rollout.means_BSNC is not None and stats.clipfrac == 0.0 and stats.log_prob_mean_abs_diff == 0.0
    assert any(x.abs().max() > 0 for x in dppo)
    assert all(torch.allclose(x, y, rtol=1e-6, atol=1e-12) for x, y in zip(dppo, grpo))
