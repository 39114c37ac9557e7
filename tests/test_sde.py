"""flow_sde_step against diffusers' Euler step and independent float64 implementations of the formulas."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from imagerl.families.qwen_image.tiny import QWEN_IMAGE_SCHEDULER_CONFIG
from imagerl.sampling import calculate_shift, flow_sde_step, flow_sigmas

QWEN = dict(QWEN_IMAGE_SCHEDULER_CONFIG)
SIGMAS = flow_sigmas(10, 1024, QWEN)  # 512^2, 10 steps (checked against diffusers in test_schedule.py)
SIGMA_MAX = float(SIGMAS[1])
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def ref_sde(x, v, sigma, sigma_next, a, sigma_max):
    """float64 flow-SDE (flow_grpo sde_type='sde'): mean and noise std of x_next."""
    x, v = x.double(), v.double()
    sigma, sigma_next = float(sigma), float(sigma_next)
    dt = sigma_next - sigma
    denom = 1 - (sigma_max if sigma == 1.0 else sigma)
    std_dev_t = a * math.sqrt(sigma / denom)
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t * math.sqrt(-dt), std_dev_t


def ref_cps(x, v, sigma, sigma_next, a):
    x, v = x.double(), v.double()
    sigma, sigma_next = float(sigma), float(sigma_next)
    std = sigma_next * math.sin(a * math.pi / 2)
    mean = (1 - sigma_next) * (x - sigma * v) + math.sqrt(sigma_next**2 - std**2) * (x + (1 - sigma) * v)
    return mean, std, std


def ref_log_prob(x_next, mean, std):
    """Elementwise log N(x_next; mean, std^2) in float64, averaged over the non-batch dims."""
    lp = -((x_next.double() - mean) ** 2) / (2 * std**2) - math.log(std) - LOG_SQRT_2PI
    return lp.flatten(1).mean(1)


def rand_xv(shape=(2, 1024, 64), seed=0):
    torch.manual_seed(seed)
    return torch.randn(shape), torch.randn(shape)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_noise_level_zero_is_diffusers_euler_step_bit_for_bit(sde_type):
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN)
    mu = calculate_shift(1024, QWEN)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 10, 10), mu=mu)
    torch.manual_seed(1)
    x = torch.randn(2, 1024, 64)
    for i, t in enumerate(scheduler.timesteps):  # all 10 steps: sigma = 1 first, sigma_next = 0 last
        v = torch.randn_like(x)
        ref = scheduler.step(v, t, x, return_dict=False)[0]
        sig, sig_next = scheduler.sigmas[i], scheduler.sigmas[i + 1]
        if i % 2:  # python floats and 0-d tensors both
            sig, sig_next = float(sig), float(sig_next)
        out = flow_sde_step(x, v, sig, sig_next, noise_level=0.0, sigma_max=scheduler.sigmas[1], sde_type=sde_type)
        assert torch.equal(out.prev_sample, ref), (i, (out.prev_sample - ref).abs().max())
        assert out.log_prob.shape == (2,) and torch.isnan(out.log_prob).all()
        x = ref
    assert i == 9


@pytest.mark.parametrize(
    "sde_type,step,a", [("sde", 0, 1.2), ("sde", 3, 1.2), ("sde", 9, 0.7), ("cps", 0, 0.8), ("cps", 4, 0.8)]
)
def test_mean_and_noise_statistics(sde_type, step, a):
    x, v = rand_xv((4, 1024, 64), seed=step)  # 262144 elements
    sig, sig_next = SIGMAS[step], SIGMAS[step + 1]
    if sde_type == "sde":
        mean_ref, std_ref, std_dev_ref = ref_sde(x, v, sig, sig_next, a, SIGMA_MAX)
    else:
        mean_ref, std_ref, std_dev_ref = ref_cps(x, v, sig, sig_next, a)
    gen = torch.Generator().manual_seed(123)
    out = flow_sde_step(x, v, sig, sig_next, noise_level=a, sigma_max=SIGMA_MAX, sde_type=sde_type, generator=gen)
    assert out.prev_sample.dtype == torch.float32 and out.prev_sample.shape == x.shape
    assert torch.allclose(out.mean.double(), mean_ref, rtol=1e-6, atol=1e-6)
    assert abs(float(out.std) - std_ref) <= 1e-6 * std_ref
    assert abs(float(out.std_dev_t) - std_dev_ref) <= 1e-6 * std_dev_ref
    resid = (out.prev_sample.double() - mean_ref).flatten()
    n = resid.numel()
    assert abs(float(resid.mean())) < 5 * std_ref / math.sqrt(n)
    assert abs(float(resid.std()) / std_ref - 1) < 5 * math.sqrt(1 / (2 * n)) + 1e-4
    # standardised residuals look standard normal: ~4.55% beyond 2 sigma
    tail = float(((resid / std_ref).abs() > 2).double().mean())
    assert abs(tail - 0.0455) < 0.003


@pytest.mark.parametrize("sde_type,a", [("sde", 1.2), ("cps", 0.8)])
@pytest.mark.parametrize("given", [True, False])
def test_log_prob_matches_float64_gaussian(sde_type, a, given):
    x, v = rand_xv(seed=5)
    step = 3
    sig, sig_next = SIGMAS[step], SIGMAS[step + 1]
    ref = ref_sde if sde_type == "sde" else ref_cps
    mean_ref, std_ref, _ = ref(x, v, sig, sig_next, a, SIGMA_MAX) if sde_type == "sde" else ref(x, v, sig, sig_next, a)
    prev = None
    if given:  # an off-distribution point (2x the std, shifted) so the quadratic term matters
        torch.manual_seed(6)
        prev = (mean_ref + 2 * std_ref * torch.randn(x.shape, dtype=torch.float64) + 0.1).float()
    out = flow_sde_step(x, v, sig, sig_next, noise_level=a, sigma_max=SIGMA_MAX, sde_type=sde_type, prev_sample=prev,
                        cps_log_prob="gaussian")
    if given:
        assert torch.equal(out.prev_sample, prev)
    lp_ref = ref_log_prob(out.prev_sample, mean_ref, std_ref)
    assert out.log_prob.shape == (2,) and out.log_prob.dtype == torch.float32
    assert torch.allclose(out.log_prob.double(), lp_ref, rtol=0, atol=1e-5), (out.log_prob, lp_ref)
    if not given:  # a sample from the step itself: E[log p] = -1/2 - log std - log sqrt(2 pi)
        expected = -0.5 - math.log(std_ref) - LOG_SQRT_2PI
        assert torch.allclose(out.log_prob.double(), torch.full((2,), expected, dtype=torch.float64), atol=0.02)


@pytest.mark.parametrize("step", [0, 4, 8])
def test_cps_log_prob_is_flow_grpos_by_default(step):
    """flow_grpo sd3_sde_with_logprob.py, sde_type == "cps": log_prob = -(prev_sample - prev_sample_mean)^2, averaged
    over the non-batch dims (no variance, no constants), in float64 here."""
    x, v = rand_xv(seed=11 + step)
    sig, sig_next = SIGMAS[step], SIGMAS[step + 1]
    mean_ref, std_ref, _ = ref_cps(x, v, sig, sig_next, 0.8)
    torch.manual_seed(12)
    prev = (mean_ref + 1.5 * std_ref * torch.randn(x.shape, dtype=torch.float64)).float()
    out = flow_sde_step(x, v, sig, sig_next, noise_level=0.8, sigma_max=SIGMA_MAX, sde_type="cps", prev_sample=prev)
    lp_ref = (-((prev.double() - mean_ref) ** 2)).flatten(1).mean(1)
    assert torch.allclose(out.log_prob.double(), lp_ref, rtol=1e-6, atol=1e-9), (out.log_prob, lp_ref)
    gaussian = flow_sde_step(x, v, sig, sig_next, noise_level=0.8, sigma_max=SIGMA_MAX, sde_type="cps",
                             prev_sample=prev, cps_log_prob="gaussian").log_prob
    # the two differ by the 1 / (2 std^2) scale and the constant: gaussian = flow_grpo / (2 std^2) - log std - c
    expected = lp_ref / (2 * std_ref**2) - math.log(std_ref) - LOG_SQRT_2PI
    assert torch.allclose(gaussian.double(), expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="cps_log_prob must be"):
        flow_sde_step(x, v, sig, sig_next, noise_level=0.8, sigma_max=SIGMA_MAX, sde_type="cps", prev_sample=prev,
                      cps_log_prob="full")


@pytest.mark.parametrize("sde_type,a", [("sde", 1.2), ("cps", 0.8)])
def test_per_sample_sigma_tensors(sde_type, a):
    steps = [0, 3, 7]  # different step per batch element, including sigma == 1
    x, v = rand_xv((3, 256, 64), seed=7)
    sig, sig_next = SIGMAS[steps], SIGMAS[[s + 1 for s in steps]]
    torch.manual_seed(8)
    prev = x + 0.3 * torch.randn_like(x)
    out = flow_sde_step(x, v, sig, sig_next, noise_level=a, sigma_max=SIGMA_MAX, sde_type=sde_type, prev_sample=prev,
                        cps_log_prob="gaussian")
    assert out.log_prob.shape == (3,) and out.mean.shape == x.shape
    for b, s in enumerate(steps):
        args = (x[b : b + 1], v[b : b + 1], SIGMAS[s], SIGMAS[s + 1], a)
        mean_ref, std_ref, _ = ref_sde(*args, SIGMA_MAX) if sde_type == "sde" else ref_cps(*args)
        assert torch.allclose(out.mean[b : b + 1].double(), mean_ref, rtol=1e-6, atol=1e-6)
        lp_ref = ref_log_prob(prev[b : b + 1], mean_ref, std_ref)
        assert abs(float(out.log_prob[b]) - float(lp_ref)) < 1e-5
    # sampling with per-sample sigmas: each row has its own std
    out = flow_sde_step(x, v, sig, sig_next, noise_level=a, sigma_max=SIGMA_MAX, sde_type=sde_type)
    for b, s in enumerate(steps):
        args = (x[b], v[b], SIGMAS[s], SIGMAS[s + 1], a)
        mean_ref, std_ref, _ = ref_sde(*args, SIGMA_MAX) if sde_type == "sde" else ref_cps(*args)
        assert abs(float((out.prev_sample[b].double() - mean_ref).std()) / std_ref - 1) < 0.03


def test_sigma_one_uses_sigma_max_and_flow_grpo_table():
    x, v = rand_xv((1, 16, 64))
    a = 1.2
    std_dev_t0 = flow_sde_step(x, v, SIGMAS[0], SIGMAS[1], noise_level=a, sigma_max=SIGMAS[1]).std_dev_t
    expected = a * math.sqrt(1 / (1 - float(SIGMAS[1])))
    assert abs(float(std_dev_t0) - expected) < 1e-5 * expected and math.isfinite(float(std_dev_t0))
    # reference/flow_grpo.md §3.2: step -> (std_dev_t, noise std), 512^2 / 10 steps, a = 1.2
    table = {0: (4.503, 1.200), 1: (4.340, 1.208), 2: (2.873, 0.837), 3: (2.175, 0.665), 4: (1.723, 0.553),
             5: (1.382, 0.468), 9: (0.171, 0.024)}
    for step, (std_dev_t, noise_std) in table.items():
        out = flow_sde_step(x, v, SIGMAS[step], SIGMAS[step + 1], noise_level=a, sigma_max=SIGMAS[1])
        assert abs(float(out.std_dev_t) - std_dev_t) < 1e-3, step
        assert abs(float(out.std) - noise_std) < 1e-3, step


def test_generator_reproducibility():
    x, v = rand_xv((2, 64, 64))
    kw = dict(noise_level=1.0, sigma_max=SIGMA_MAX)
    for sde_type in ("sde", "cps"):
        a = flow_sde_step(x, v, SIGMAS[2], SIGMAS[3], sde_type=sde_type, generator=torch.Generator().manual_seed(3), **kw)
        torch.manual_seed(999)  # the global RNG must not matter when a generator is given
        b = flow_sde_step(x, v, SIGMAS[2], SIGMAS[3], sde_type=sde_type, generator=torch.Generator().manual_seed(3), **kw)
        c = flow_sde_step(x, v, SIGMAS[2], SIGMAS[3], sde_type=sde_type, generator=torch.Generator().manual_seed(4), **kw)
        assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)
        assert not torch.equal(a.prev_sample, c.prev_sample)


@pytest.mark.parametrize("kwargs", [dict(sde_type="ode", noise_level=0.5), dict(sde_type="SDE", noise_level=0.5),
                                    dict(noise_level=-0.1), dict(sde_type="cps", noise_level=-1.0)])
def test_invalid_arguments_raise(kwargs):
    x, v = rand_xv((1, 4, 4))
    with pytest.raises(ValueError):
        flow_sde_step(x, v, SIGMAS[2], SIGMAS[3], sigma_max=SIGMA_MAX, **kwargs)


@pytest.mark.parametrize("sde_type,a", [("sde", 1.2), ("cps", 0.8)])
@pytest.mark.parametrize("given", [True, False])
def test_log_prob_gradient_flows_to_velocity_only(sde_type, a, given):
    x, v0 = rand_xv((2, 32, 16), seed=11)
    sig, sig_next = SIGMAS[4], SIGMAS[5]
    v = v0.clone().requires_grad_(True)
    prev = None
    if given:
        torch.manual_seed(12)
        prev = (x + 0.5 * torch.randn_like(x)).requires_grad_(True)
    out = flow_sde_step(x, v, sig, sig_next, noise_level=a, sigma_max=SIGMA_MAX, sde_type=sde_type, prev_sample=prev)
    out.log_prob.sum().backward()
    if given:
        assert prev.grad is None  # the target point is detached inside the log-prob
    # analytic float64 gradient with the target treated as a constant:
    # d/dv mean_b[log N(y; m(v), s^2)] = (y - m) / s^2 * dm/dv / n (cps, flow_grpo's log-prob: 2 (y - m) dm/dv / n)
    if sde_type == "sde":
        m, s, s_dev = ref_sde(x, v0, sig, sig_next, a, SIGMA_MAX)
        dt = float(sig_next) - float(sig)
        dm_dv = (1 + s_dev**2 * (1 - float(sig)) / (2 * float(sig))) * dt
    else:
        m, s, _ = ref_cps(x, v0, sig, sig_next, a)
        sn = float(sig_next)
        dm_dv = -(1 - sn) * float(sig) + math.sqrt(sn**2 - s**2) * (1 - float(sig))
    y = out.prev_sample.detach().double()
    # sde: the Gaussian's (y - m) / s^2; cps: flow_grpo's -(y - m)^2 differentiates to 2 (y - m)
    grad_ref = (y - m) * (1 / s**2 if sde_type == "sde" else 2.0) * dm_dv / x[0].numel()
    assert v.grad is not None and float(v.grad.abs().max()) > 0
    assert torch.allclose(v.grad.double(), grad_ref, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("sde_type,a", [("sde", 1.2), ("cps", 0.8)])
def test_explicit_noise_replaces_the_draw(sde_type, a):
    x, v = rand_xv((2, 128, 64), seed=13)
    torch.manual_seed(14)
    eps = torch.randn_like(x)
    sig, sig_next = SIGMAS[3], SIGMAS[4]
    if sde_type == "sde":
        mean_ref, std_ref, _ = ref_sde(x, v, sig, sig_next, a, SIGMA_MAX)
    else:
        mean_ref, std_ref, _ = ref_cps(x, v, sig, sig_next, a)
    out = flow_sde_step(x, v, sig, sig_next, noise_level=a, sigma_max=SIGMA_MAX, sde_type=sde_type, noise=eps,
                        generator=torch.Generator().manual_seed(0), cps_log_prob="gaussian")
    assert torch.allclose(out.prev_sample.double(), mean_ref + std_ref * eps.double(), rtol=1e-6, atol=1e-6)
    lp_ref = ref_log_prob(out.prev_sample, mean_ref, std_ref)
    assert torch.allclose(out.log_prob.double(), lp_ref, rtol=0, atol=1e-5)
