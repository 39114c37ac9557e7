"""ppo_clip_loss and grpo_guard_loss against float64 transcriptions of the published code: values and gradients at
ratios 1 +- eps/2 (inside the clip range) and 1 +- 1.5 eps (outside it), for positive and negative advantages,
inside and beyond adv_clip_max. The references are written out here element by element in Python floats; nothing of
imagerl computes them.

Sources (read at these commits; line numbers are of those files):
  flow_grpo (github.com/yifan123/flow_grpo, commit 9745241, November 2025)
    scripts/train_sd3.py:886-898 and scripts/train_qwenimage.py:881-894 (the same lines):
      advantages = clamp(A, -adv_clip_max, adv_clip_max); ratio = exp(log_prob - old_log_prob)
      unclipped = -advantages * ratio; clipped = -advantages * clamp(ratio, 1 - clip_range, 1 + clip_range)
      policy_loss = mean(maximum(unclipped, clipped))
  GRPO-Guard: verl-omni (github.com/verl-project/verl-omni, commit a1139baf), docs/algo/grpo_guard.md and
    verl_omni/trainer/diffusion/diffusion_algos.py:527-549 (GRPOGuardLoss.compute_loss):
      sigma_t = mean(std_dev_t); scale = mean(sqrt_dt) * sigma_t
      bias = mean over non-batch dims (mu - mu_old)^2 / (2 scale^2)
      ratio = exp((log_prob - old_log_prob + bias) * scale)
      loss = mean(maximum(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps))) / mean(sqrt_dt)^2
    flow_grpo's scripts/train_sd3_GRPO_Guard.py:915-932 (commit 9745241) is the same formula except its bias line 917,
    `.mean(dim=tuple(range(1, log_prob.ndim)))`: log_prob is (B,), so dim=() and torch reduces over every dimension,
    a batch-mean bias (the same for every sample of the batch; equal to verl-omni's per-sample bias only for a batch of
    one). imagerl follows verl-omni's per-sample bias, which is what is transcribed here.
"""

import math

import pytest
import torch

from imagerl.algorithms.flow_grpo import grpo_guard_loss, ppo_clip_loss

EPS = 0.02
ADV_CLIP = 5.0
RATIOS = [1 - 1.5 * EPS, 1 - EPS / 2, 1.0, 1 + EPS / 2, 1 + 1.5 * EPS]
ADVANTAGES = [0.7, -0.7, 8.0, -8.0]  # +-8: clipped to +-adv_clip_max


def _clamp(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def _flow_grpo_surrogate(ratio: float, adv: float, eps: float, adv_max: float) -> float:
    """train_sd3.py:886-898 for one element, in Python floats."""
    a = _clamp(adv, -adv_max, adv_max)
    return max(-a * ratio, -a * _clamp(ratio, 1 - eps, 1 + eps))


def _flow_grpo_surrogate_dratio(ratio: float, adv: float, eps: float, adv_max: float) -> float:
    """d surrogate / d ratio: -A where the unclipped term is the maximum, 0 where the clipped one is (it is constant in
    the ratio outside [1 - eps, 1 + eps]). Inside the range the two terms are equal and both give -A."""
    a = _clamp(adv, -adv_max, adv_max)
    if 1 - eps <= ratio <= 1 + eps:
        return -a
    return -a if -a * ratio >= -a * _clamp(ratio, 1 - eps, 1 + eps) else 0.0


def _grid():
    pairs = [(r, a) for r in RATIOS for a in ADVANTAGES]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def test_reference_derivative_is_the_finite_difference_of_the_reference():
    """The piecewise derivative above (used as the gradient reference) against central differences of the transcribed
    surrogate: none of the grid's ratios sits on a kink."""
    for r, a in zip(*_grid()):
        h = 1e-7
        fd = (_flow_grpo_surrogate(r + h, a, EPS, ADV_CLIP) - _flow_grpo_surrogate(r - h, a, EPS, ADV_CLIP)) / (2 * h)
        assert fd == pytest.approx(_flow_grpo_surrogate_dratio(r, a, EPS, ADV_CLIP), abs=1e-6), (r, a)


def test_ppo_clip_loss_values_and_gradients_are_flow_grpos():
    ratios, advs = _grid()
    old = torch.linspace(-1.4, -0.6, len(ratios), dtype=torch.float64)
    log_prob = (old + torch.log(torch.tensor(ratios, dtype=torch.float64))).requires_grad_(True)
    loss, ratio = ppo_clip_loss(log_prob, old, torch.tensor(advs, dtype=torch.float64), EPS, ADV_CLIP)
    loss.sum().backward()
    expected = [_flow_grpo_surrogate(r, a, EPS, ADV_CLIP) for r, a in zip(ratios, advs)]
    # d loss / d log_prob = d loss / d ratio * ratio
    expected_grad = [_flow_grpo_surrogate_dratio(r, a, EPS, ADV_CLIP) * r for r, a in zip(ratios, advs)]
    assert torch.allclose(ratio, torch.tensor(ratios, dtype=torch.float64), rtol=1e-13, atol=0)
    assert torch.allclose(loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0), (loss, expected)
    assert torch.allclose(log_prob.grad, torch.tensor(expected_grad, dtype=torch.float64), rtol=1e-12, atol=0), \
        (log_prob.grad, expected_grad)
    # the grid exercises every branch: both clips act (zero gradient) and both are passed (non-zero gradient)
    by_case = {(r, a): g for r, a, g in zip(ratios, advs, expected_grad)}
    assert by_case[(1 + 1.5 * EPS, 0.7)] == 0 and by_case[(1 - 1.5 * EPS, -0.7)] == 0
    assert by_case[(1 - 1.5 * EPS, 0.7)] != 0 and by_case[(1 + 1.5 * EPS, -0.7)] != 0
    assert by_case[(1.0, 8.0)] == -ADV_CLIP  # the advantage clip: -min(A, adv_clip_max) * ratio


# ------------------------------------------------------------------------------------------------ GRPO-Guard


def _guard_reference(lp, old, mu, mu_old, std_dev_t, sqrt_dt, adv, eps, adv_max):
    """verl-omni diffusion_algos.py:527-549 per sample in Python floats: (loss, ratio, dloss/dlp, dloss/dmu)."""
    out = []
    for b in range(len(lp)):
        scale = sqrt_dt * std_dev_t
        diff = [m - o for m, o in zip(mu[b], mu_old[b])]
        n = len(diff)
        bias = sum(d * d for d in diff) / n / (2 * scale * scale)
        ratio = math.exp((lp[b] - old[b] + bias) * scale)
        loss = _flow_grpo_surrogate(ratio, adv[b], eps, adv_max) / sqrt_dt**2
        dl_dratio = _flow_grpo_surrogate_dratio(ratio, adv[b], eps, adv_max) / sqrt_dt**2
        dratio_du = ratio  # u = (lp - old + bias) scale, ratio = exp(u)
        d_lp = dl_dratio * dratio_du * scale
        # d bias / d mu_k = (mu_k - mu_old_k) / (n scale^2)
        d_mu = [dl_dratio * dratio_du * scale * d / (n * scale * scale) for d in diff]
        out.append((loss, ratio, d_lp, d_mu))
    return out


@pytest.mark.parametrize("eps", [2e-6, 0.02])  # verl-omni's recommended 2e-6, and a wide range
def test_grpo_guard_loss_values_and_gradients_are_verl_omnis(eps):
    g = torch.Generator().manual_seed(0)
    std_dev_t, sqrt_dt = 2.175, 0.3055
    scale = sqrt_dt * std_dev_t
    targets = [1 - 1.5 * eps, 1 - eps / 2, 1 + eps / 2, 1 + 1.5 * eps]
    ratios = [r for r in targets for _ in ADVANTAGES]
    advs = ADVANTAGES * len(targets)
    B, N, C = len(ratios), 6, 4
    mu_old = torch.randn(B, N, C, generator=g, dtype=torch.float64)
    mu = (mu_old + 0.01 * torch.randn(B, N, C, generator=g, dtype=torch.float64)).requires_grad_(True)
    old = -torch.rand(B, generator=g, dtype=torch.float64)
    bias = ((mu.detach() - mu_old) ** 2).flatten(1).mean(1) / (2 * scale**2)
    # log-probs that put the guarded ratio at the targets
    lp = (old - bias + torch.log(torch.tensor(ratios, dtype=torch.float64)) / scale).requires_grad_(True)
    loss, ratio = grpo_guard_loss(lp, old, mu, mu_old, torch.tensor(std_dev_t, dtype=torch.float64),
                                  torch.tensor(sqrt_dt, dtype=torch.float64), torch.tensor(advs, dtype=torch.float64),
                                  eps, ADV_CLIP)
    loss.sum().backward()
    ref = _guard_reference(lp.tolist(), old.tolist(), mu.detach().flatten(1).tolist(), mu_old.flatten(1).tolist(),
                           std_dev_t, sqrt_dt, advs, eps, ADV_CLIP)
    f64 = dict(dtype=torch.float64)
    assert torch.allclose(ratio, torch.tensor([r[1] for r in ref], **f64), rtol=1e-12, atol=0)
    assert torch.allclose(ratio, torch.tensor(ratios, **f64), rtol=1e-9, atol=0)  # the targets were hit
    assert torch.allclose(loss, torch.tensor([r[0] for r in ref], **f64), rtol=1e-11, atol=0)
    assert torch.allclose(lp.grad, torch.tensor([r[2] for r in ref], **f64), rtol=1e-10, atol=0)
    ref_mu = torch.tensor([r[3] for r in ref], **f64).reshape(B, N, C)
    assert torch.allclose(mu.grad, ref_mu, rtol=1e-9, atol=1e-14 * float(ref_mu.abs().max()))
    clipped = [i for i, r in enumerate(ref) if r[2] == 0]
    assert clipped and len(clipped) < B  # both clipped (no gradient) and unclipped samples
    assert all(mu.grad[i].abs().max() == 0 for i in clipped)
