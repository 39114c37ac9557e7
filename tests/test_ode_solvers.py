"""ODE sampler steps (imagerl.sampling.ode) against independent references.

References: `flow_sde_step` at noise level 0 (euler); diffusers' DPMSolverMultistepScheduler configured for
flow matching (dpm2); the closed-form flow of a Gaussian data distribution (convergence order).

diffusers 0.42.1: `set_timesteps` accepts no sigma grid, and with use_flow_sigmas its own grid never starts at
sigma = 1. We call set_timesteps(N) (fixing len(timesteps), which drives its lower-order-final logic), then
replace `sched.sigmas` with our grid and set_begin_index(0). Both diffusers' native grid and a grid from
sigma = 1 are compared (diffusers handles sigma = 1 through log(0) = -inf, finitely). `step` casts the sample
to float32; for the float64 comparison the module's `torch` is swapped for a proxy whose float32 is float64.

Gaussian data x0 ~ N(mu, s^2) (per coordinate), eps ~ N(0, 1), x_t = (1 - t) x0 + t eps:
  x_t ~ N(m_t, V_t),  m_t = (1 - t) mu,  V_t = (1 - t)^2 s^2 + t^2
  v(x, t) = E[eps - x0 | x_t = x] = -mu + (t - (1 - t) s^2) / V_t * (x - m_t)    (= m_t' + V_t'/(2 V_t) (x - m_t))
  the ODE flow keeps the standardized coordinate: x_t = m_t + sqrt(V_t) * x_1, so x_0 = mu + s * x_1.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler
from diffusers.schedulers import scheduling_dpmsolver_multistep as dpm_module

from imagerl.sampling import flow_sde_step, flow_sigmas
from imagerl.sampling.ode import ODE_SOLVERS, ODESolverState, ode_step

QWEN_CFG = {"use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
            "max_image_seq_len": 8192, "shift_terminal": 0.02, "time_shift_type": "exponential"}


def gaussian_velocity(x, t, mu, s):
    t = torch.as_tensor(t, dtype=x.dtype)
    m_t = (1 - t) * mu
    var_t = (1 - t) ** 2 * s**2 + t**2
    return -mu + (t - (1 - t) * s**2) / var_t * (x - m_t)


def nonlinear_velocity(x, t, mu, s):
    """Gaussian flow plus a nonlinear term, so that the data prediction is not linear in x."""
    return gaussian_velocity(x, t, mu, s) + 0.3 * torch.sin(3 * x) * (1 - float(t))


def field_params(dtype, n=64):
    g = torch.Generator().manual_seed(1)
    mu = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    s = (0.3 + torch.rand(n, generator=g, dtype=torch.float64)).to(dtype)
    x1 = torch.randn(2, n, generator=g, dtype=torch.float64).to(dtype)
    return mu, s, x1


def run_ode(solver, sigmas, x, velocity):
    state = ODESolverState()
    for i in range(len(sigmas) - 1):
        x = ode_step(solver, x, velocity(x, sigmas[i]), sigmas, i, state)
    return x


def test_euler_bit_identical_to_flow_sde_step():
    sigmas = flow_sigmas(10, 1024, QWEN_CFG)
    assert sigmas[0] == 1 and sigmas[-1] == 0
    mu, s, x1 = field_params(torch.float32)
    vel = lambda x, t: nonlinear_velocity(x, t, mu, s)  # noqa: E731
    x_ref = x_ours = x1
    for i in range(10):
        x_ref = flow_sde_step(x_ref, vel(x_ref, sigmas[i]), sigmas[i], sigmas[i + 1], noise_level=0.0,
                              sigma_max=sigmas[1]).prev_sample
        x_ours = ode_step("euler", x_ours, vel(x_ours, sigmas[i]), sigmas, i, ODESolverState())
        assert x_ours.dtype == torch.float32 and torch.equal(x_ours, x_ref), f"step {i}"
    assert not torch.equal(x_ours, x1)


class _Float64Torch(types.SimpleNamespace):
    """Stands in for `torch` inside the diffusers scheduler module: `step` upcasts the sample with
    `sample.to(torch.float32)`, which would drop float64 inputs to float32; here float32 means float64."""

    float32 = torch.float64

    def __getattr__(self, name):
        return getattr(torch, name)


def diffusers_dpm2(sigmas, x, velocity, float64=False):
    """diffusers' DPM-Solver++(2M) over the grid `sigmas` (N + 1 values ending in 0)."""
    n = len(sigmas) - 1
    sched = DPMSolverMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction",
                                        algorithm_type="dpmsolver++", solver_order=2, solver_type="midpoint",
                                        lower_order_final=True, final_sigmas_type="zero")
    sched.set_timesteps(n)  # set_timesteps takes no sigma grid: it fixes the step count, then we swap the grid in
    assert len(sched.timesteps) == n
    sched.sigmas = sigmas.clone()
    sched.set_begin_index(0)
    with pytest.MonkeyPatch.context() as mp:
        if float64:
            mp.setattr(dpm_module, "torch", _Float64Torch())
        for i, t in enumerate(sched.timesteps):
            x = sched.step(velocity(x, sigmas[i]), t, x).prev_sample
    return x


def diffusers_native_grid(n, shift):
    sched = DPMSolverMultistepScheduler(use_flow_sigmas=True, flow_shift=shift, prediction_type="flow_prediction",
                                        final_sigmas_type="zero")
    sched.set_timesteps(n)
    # float32; starts at shift u / (1 + (shift - 1) u), u = 1 - 1/num_train_timesteps (0.99967 here) < 1; ends in 0
    return sched.sigmas.clone()


@pytest.mark.parametrize("grid", ["diffusers_native", "qwen_from_1"])
def test_dpm2_matches_diffusers_float64(grid):
    sigmas = diffusers_native_grid(10, 3.0) if grid == "diffusers_native" else flow_sigmas(10, 1024, QWEN_CFG)
    assert (sigmas[0] < 1) if grid == "diffusers_native" else (sigmas[0] == 1)
    sigmas64 = sigmas.double()
    mu, s, x1 = field_params(torch.float64)
    vel = lambda x, t: nonlinear_velocity(x, t, mu, s)  # noqa: E731
    ref = diffusers_dpm2(sigmas64, x1, vel, float64=True)
    ours = run_ode("dpm2", sigmas64, x1, vel)
    assert ref.dtype == ours.dtype == torch.float64
    assert torch.isfinite(ours).all()
    assert (ours - ref).abs().max() < 1e-10
    euler = run_ode("euler", sigmas, x1.float(), lambda x, t: vel(x.double(), t).float())
    assert (euler.double() - ref).abs().max() > 1e-3  # the comparison can tell the solvers apart


def test_dpm2_matches_diffusers_float32():
    """Production dtype: both in float32 (diffusers unpatched), with the grid that starts at sigma = 1."""
    sigmas = flow_sigmas(10, 1024, QWEN_CFG)
    mu, s, x1 = field_params(torch.float32)
    vel = lambda x, t: nonlinear_velocity(x, t, mu, s)  # noqa: E731
    ref = diffusers_dpm2(sigmas, x1, vel)
    ours = run_ode("dpm2", sigmas, x1, vel)
    assert ours.dtype == torch.float32 and (ours - ref.float()).abs().max() < 1e-5


def test_dpm2_first_step_from_sigma_1():
    """From sigma = 1 (alpha = 0, lambda = -inf): x_next = sigma' x + (1 - sigma') (x - v) = x - (1 - sigma') v."""
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.0], dtype=torch.float64)
    x = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    v = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    state = ODESolverState()
    out = ode_step("dpm2", x, v, sigmas, 0, state)
    assert torch.isfinite(out).all()
    assert (out - (0.8 * x + 0.2 * (x - v))).abs().max() < 1e-14
    # step 2: lambda_0 = -inf makes the 2M correction vanish, so it is the first-order step as well
    v2 = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out2 = ode_step("dpm2", out, v2, sigmas, 1, state)
    assert (out2 - (out - 0.3 * v2)).abs().max() < 1e-14
    # step 3 to sigma = 0: first order, returns the data prediction x0_hat
    v3 = torch.randn(3, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ode_step("dpm2", out2, v3, sigmas, 2, state), out2 - 0.5 * v3)


def test_dpm2_second_order_step_float64_derivation():
    """A 2M step away from the endpoints against the formula written out with logs (paper Alg. 2)."""
    sigmas = torch.tensor([0.9, 0.7, 0.4, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    x0, v0, v1 = (torch.randn(4, dtype=torch.float64, generator=g) for _ in range(3))
    state = ODESolverState()
    x1 = ode_step("dpm2", x0, v0, sigmas, 0, state)
    x2 = ode_step("dpm2", x1, v1, sigmas, 1, state)
    lam = [math.log((1 - sg) / sg) for sg in (0.9, 0.7, 0.4)]
    h, h0 = lam[2] - lam[1], lam[1] - lam[0]
    m_prev, m = x0 - 0.9 * v0, x1 - 0.7 * v1
    d = (1 + h / (2 * h0)) * m - h / (2 * h0) * m_prev
    expected = 0.4 / 0.7 * x1 - 0.6 * (math.exp(-h) - 1) * d
    assert (x2 - expected).abs().max() < 1e-14


def gaussian_flow(t, mu, s, x1):
    """Exact ODE solution through x_1 at sigma = 1."""
    return (1 - t) * mu + ((1 - t) ** 2 * s**2 + t**2) ** 0.5 * x1


def endpoint_error(solver, sigmas, dtype):
    """Max error at sigmas[-1], starting from the exact solution at sigmas[0]."""
    sigmas = sigmas.to(dtype)
    mu, s, x1 = field_params(torch.float64)
    t0, t1 = sigmas[0].double(), sigmas[-1].double()
    x = run_ode(solver, sigmas, gaussian_flow(t0, mu, s, x1).to(dtype),
                lambda x, t: gaussian_velocity(x, t, mu.to(dtype), s.to(dtype)))
    return (x.double() - gaussian_flow(t1, mu, s, x1)).abs().max().item()


def test_convergence_order_interior_grid():
    """sigma 0.9 -> 0.1 (bounded log-SNR): error x 1/4 per doubling for dpm2 (order 2), x 1/2 for euler."""
    ns = (10, 20, 40, 80)
    grid = lambda n: torch.linspace(0.9, 0.1, n + 1, dtype=torch.float64)  # noqa: E731
    e_dpm = [endpoint_error("dpm2", grid(n), torch.float64) for n in ns]
    e_eul = [endpoint_error("euler", grid(n), torch.float32) for n in ns]  # euler is float32 (flow_sde_step)
    assert all(3.5 < a / b < 4.6 for a, b in zip(e_dpm, e_dpm[1:])), e_dpm
    assert all(1.8 < a / b < 2.2 for a, b in zip(e_eul, e_eul[1:])), e_eul


def test_convergence_full_trajectory_1_to_0():
    """sigma 1 -> 0, ending with the first-order step to 0 (its result is x0_hat).

    Near sigma = 1 and sigma = 0 a uniform sigma grid does not refine in log-SNR (lambda_k ~ +-log(k / N)),
    so DPM-Solver++(2M) converges like log(N) / N^2 there, not N^2: the ratio per doubling approaches 4
    from below (measured 3.09 for 40 -> 80, 3.34 for 80 -> 160), while euler stays at 2.
    """
    ns = (40, 80, 160)
    e_dpm = [endpoint_error("dpm2", flow_sigmas(n, 256, {}), torch.float64) for n in ns]
    e_eul = [endpoint_error("euler", flow_sigmas(n, 256, {}), torch.float32) for n in ns]
    assert all(2.8 < a / b < 4.4 for a, b in zip(e_dpm, e_dpm[1:])), e_dpm
    assert all(1.8 < a / b < 2.2 for a, b in zip(e_eul, e_eul[1:])), e_eul
    c = [e * n**2 / math.log(n) for e, n in zip(e_dpm, ns)]
    assert max(c) < 1.2 * min(c), c  # error ~ C log(N) / N^2
    # 10 steps: dpm2 beats euler (float64 and float32). Measured max errors euler / dpm2: uniform 0.361 / 0.027,
    # shift 3 0.454 / 0.229 (the last step 0.25 -> 0 is first order), Qwen grid 0.399 / 0.352: its step
    # 0.183 -> 0.02 spans 2.4 in log-SNR (r = 0.32) and the 2M extrapolation overshoots there.
    for cfg, gain in (({}, 8.0), ({"shift": 3.0}, 1.6), (QWEN_CFG, 1.05)):
        sigmas = flow_sigmas(10, 1024, cfg)
        e_eul10 = endpoint_error("euler", sigmas, torch.float32)
        assert endpoint_error("dpm2", sigmas, torch.float64) * gain < e_eul10, cfg
        assert endpoint_error("dpm2", sigmas, torch.float32) * gain < e_eul10, cfg


def test_dpm2_restarts_when_steps_were_skipped():
    """A state whose step index does not precede i (e.g. SDE steps in between) gives a first-order step."""
    sigmas = torch.tensor([1.0, 0.8, 0.6, 0.4, 0.2, 0.0], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(4, dtype=torch.float64, generator=g), torch.randn(4, dtype=torch.float64, generator=g)
    state = ODESolverState()
    for i in range(2):
        ode_step("dpm2", x, v, sigmas, i, state)
    assert state.step == 1
    assert (ode_step("dpm2", x, v, sigmas, 3, state) - (x - 0.2 * v)).abs().max() < 1e-15  # 0.4 -> 0.2
    assert (ode_step("dpm2", x, v, sigmas, 2, ODESolverState()) - (x - 0.2 * v)).abs().max() < 1e-15


def test_solver_name_and_state_errors():
    sigmas = flow_sigmas(4, 256, {})
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match="euler, dpm2"):
        ode_step("heun", x, x, sigmas, 0, ODESolverState())
    with pytest.raises(ValueError, match="ODESolverState"):
        ode_step("dpm2", x, x, sigmas, 0, None)
    assert ODE_SOLVERS == ("euler", "dpm2")
