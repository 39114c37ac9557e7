"""One denoising step of the flow ODE / flow-SDE / CPS sampler with its Gaussian log-prob.

Convention (flow matching, as diffusers' Qwen-Image): x_sigma = (1 - sigma) x0 + sigma * eps, the model
predicts v = eps - x0, and sampling integrates sigma from 1 to 0, so dt = sigma_next - sigma < 0.

`sde` (flow_grpo `sde_step_with_logprob`, sde_type="sde"; the marginal-preserving SDE of Flow-GRPO):
  std_dev_t = a * sqrt(sigma / (1 - sigma'))      sigma' = sigma, except sigma == 1 -> sigma_max (= sigmas[1])
  mean      = x (1 + std_dev_t^2 dt / (2 sigma)) + v (1 + std_dev_t^2 (1 - sigma) / (2 sigma)) dt
  x_next    = mean + std_dev_t sqrt(-dt) * eps,   eps ~ N(0, I)
`cps` (coefficients-preserving sampling, flow_grpo sde_type="cps"):
  std_dev_t = sigma_next sin(a pi / 2);  x0_hat = x - sigma v;  x1_hat = x + (1 - sigma) v
  mean      = (1 - sigma_next) x0_hat + sqrt(sigma_next^2 - std_dev_t^2) x1_hat;  x_next = mean + std_dev_t eps
  log-prob (cps_log_prob): "flow_grpo" (default): -(x_next - mean)^2, flow_grpo's cps branch, without the
  variance and constants, so that flow_grpo's cps clip ranges carry over; "gaussian": the full Gaussian
  log-density, a true density ratio, which scales each step's log-ratio by 1 / (2 std_dev_t^2); std_dev_t =
  sigma_next sin(a pi / 2) shrinks with sigma_next, so late steps' ratios dominate and clip ranges do not carry over.

log_prob (sde; cps with "gaussian"): Gaussian log-density of x_next; either kind is averaged (not summed) over all
non-batch elements, the flow_grpo convention that PPO clip ranges such as 1e-4 are calibrated to. All math in float32.
At noise_level 0 the step is exactly the Euler step x + dt * v (bit for bit: the coefficients are
exactly 1), no noise is drawn, and log_prob is NaN (the density is degenerate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass
class SDEStepOutput:
    """prev_sample, mean: like `sample` (float32); log_prob_B: (B,); std: scalar or (B, 1, ...) noise std
    of the transition; std_dev_t: flow_grpo's std_dev_t (std without the sqrt(-dt) factor for `sde`)."""

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    std_dev_t: torch.Tensor


def _per_sample(value, like: torch.Tensor) -> torch.Tensor:
    """A float or (B,) tensor as float32 broadcastable over `like` (B, ...)."""
    t = torch.as_tensor(value, dtype=torch.float32, device=like.device)
    if t.ndim == 0:
        return t
    return t.reshape(-1, *([1] * (like.ndim - 1)))


def _gaussian_noise(shape, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    gen_device = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float32).to(device)


def flow_sde_step(
    sample: torch.Tensor,
    velocity: torch.Tensor,
    sigma,
    sigma_next,
    *,
    noise_level: float,
    sigma_max,
    sde_type: str = "sde",
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    cps_log_prob: str = "flow_grpo",
) -> SDEStepOutput:
    """Step from sigma to sigma_next; with `prev_sample` given, only evaluate its log-prob.

    `noise` (standard normal, like `sample`) replaces the draw from `generator`, so that callers can
    key each image's noise to its own seed, independent of batching.
    """
    if sde_type not in ("sde", "cps"):
        raise ValueError(f"sde_type must be 'sde' or 'cps', got {sde_type!r}")
    if noise_level < 0:
        raise ValueError(f"noise_level must be >= 0, got {noise_level}")
    x = sample.float()
    v = velocity.float()
    sigma = _per_sample(sigma, x)
    sigma_next = _per_sample(sigma_next, x)
    dt = sigma_next - sigma

    if sde_type == "sde":
        # At noise_level 0 both coefficients are exactly 1.0, so mean == x + v * dt bit for bit.
        sigma_max = _per_sample(sigma_max, x)
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_dev_t * torch.sqrt(-1 * dt)
    elif noise_level == 0:
        # The cps mean is only algebraically Euler at a = 0; take the Euler step itself.
        std_dev_t = torch.zeros_like(sigma)
        mean = x + v * dt
        std = std_dev_t
    else:
        std_dev_t = sigma_next * math.sin(noise_level * math.pi / 2)
        x0_hat = x - sigma * v
        x1_hat = x + v * (1 - sigma)
        mean = x0_hat * (1 - sigma_next) + x1_hat * torch.sqrt(sigma_next**2 - std_dev_t**2)
        std = std_dev_t

    if noise_level == 0:  # the ODE step: deterministic, no noise drawn, density degenerate
        nan_B = torch.full((x.shape[0],), float("nan"), device=x.device)
        out = prev_sample.float() if prev_sample is not None else mean
        return SDEStepOutput(out, nan_B, mean, std, std_dev_t)

    if prev_sample is None:
        if noise is None:
            noise = _gaussian_noise(x.shape, generator, x.device)
        prev_sample = mean + std * noise.to(x.device, torch.float32)
    else:
        prev_sample = prev_sample.float()
    if sde_type == "cps" and cps_log_prob == "flow_grpo":
        log_prob = -((prev_sample.detach() - mean) ** 2)  # flow_grpo sd3_sde_with_logprob.py, sde_type == "cps"
    elif sde_type == "sde" or cps_log_prob == "gaussian":
        log_prob = -((prev_sample.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    else:
        raise ValueError(f"cps_log_prob must be 'flow_grpo' or 'gaussian', got {cps_log_prob!r}")
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return SDEStepOutput(prev_sample, log_prob, mean, std, std_dev_t)
