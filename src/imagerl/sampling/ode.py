"""Deterministic ODE sampler steps for flow matching: Euler and DPM-Solver++(2M).

Convention: x_sigma = (1 - sigma) x0 + sigma eps, the model predicts v = eps - x0, sigma goes 1 -> 0.

`euler`: x_next = x + (sigma_next - sigma) v, i.e. `flow_sde_step` at noise_level 0 (bit for bit).

`dpm2`: DPM-Solver++(2M) (Lu et al. 2022, arXiv:2211.01095, Alg. 2; diffusers' DPMSolverMultistepScheduler
with algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint", final_sigmas_type="zero"),
for the flow schedule alpha = 1 - sigma, lambda = log(alpha / sigma):
  data prediction   m_i = x_i - sigma_i v_i                    (one velocity evaluation per step)
  1st order         x_next = (s'/s) x + alpha'(1 - e^-h) m_i,   h = lambda' - lambda
  2nd order         x_next = (s'/s) x + alpha'(1 - e^-h) (m_i + (m_i - m_{i-1}) / (2 r)),
                    r = h_prev / h,  h_prev = lambda_i - lambda_{i-1}
(s = sigma_i, s' = sigma_next, alpha' = 1 - s'). Since e^-h = alpha s' / (alpha' s), the weight is
  alpha'(1 - e^-h) = alpha' - alpha s'/s = 1 - s'/s,
which is finite at sigma_i = 1 (alpha = 0, lambda = -inf): the step from sigma = 1 is
x_next = s' x + (1 - s') m_0. The first-order step equals Euler algebraically (not bit for bit).
First order is used at the first step, at the last step to sigma = 0 (there the result is m_i,
diffusers' lower_order_final / final_sigmas_type="zero"), and right after sigma = 1 (lambda_{i-1} =
-inf makes 1/r = 0, the limit diffusers computes too). Only r needs logarithms.
A uniform sigma grid does not refine in lambda near sigma = 1 and 0 (lambda ~ +-log(k/N)), so over a
full 1 -> 0 trajectory the error shrinks like log(N)/N^2; grids with one huge lambda step (e.g. Qwen's
0.18 -> 0.02 with shift_terminal) make the 2M extrapolation overshoot there (tests/test_ode_solvers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from imagerl.sampling.sde import flow_sde_step

ODE_SOLVERS = ("euler", "dpm2")


@dataclass
class ODESolverState:
    """What dpm2 carries between steps: the last data prediction x0_hat, its sigma and step index.

    Create one fresh ODESolverState() per trajectory. A step index that does not follow the stored one
    (e.g. after SDE steps that bypass `ode_step`) restarts dpm2 with a first-order step.
    """

    x0_hat: torch.Tensor | None = None
    sigma: float | None = None
    step: int | None = None


def _lambda(sigma: torch.Tensor) -> torch.Tensor:
    """log-SNR log((1 - sigma) / sigma); -inf at sigma = 1."""
    return torch.log1p(-sigma) - torch.log(sigma)


def ode_step(solver: str, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int,
             state: ODESolverState | None = None) -> torch.Tensor:
    """One deterministic step from sigmas[i] to sigmas[i + 1], given the velocity v at (x, sigmas[i]).

    Math in float32 (float64 inputs stay float64); `state` (required for dpm2) is updated in place.
    """
    if solver not in ODE_SOLVERS:
        raise ValueError(f"unknown ODE solver {solver!r}; valid solvers: {', '.join(ODE_SOLVERS)}")
    if solver == "euler":
        return flow_sde_step(x, v, sigmas[i], sigmas[i + 1], noise_level=0.0, sigma_max=sigmas[1]).prev_sample
    if state is None:
        raise ValueError("the dpm2 solver is multistep: pass an ODESolverState() and reuse it for every step")

    dtype = torch.promote_types(x.dtype, torch.float32)
    x, v = x.to(dtype), v.to(dtype)
    sig = sigmas.to(device=x.device, dtype=dtype)
    s, s_next = sig[i], sig[i + 1]
    m0 = x - s * v  # data prediction x0_hat
    ratio = s_next / s
    out = ratio * x + (1 - ratio) * m0  # first order (= m0 when s_next = 0)

    s_f, s_next_f = float(sigmas[i]), float(sigmas[i + 1])
    follows = state.x0_hat is not None and i > 0 and state.step == i - 1
    if follows and s_next_f > 0 and state.sigma < 1:
        s_prev = torch.as_tensor(state.sigma, dtype=dtype, device=x.device)
        lam = _lambda(s)
        h = _lambda(s_next) - lam
        r = (lam - _lambda(s_prev)) / h
        m1 = state.x0_hat.to(dtype)
        out = out + (1 - ratio) * (m0 - m1) / (2 * r)

    state.x0_hat, state.sigma, state.step = m0, s_f, i
    return out
