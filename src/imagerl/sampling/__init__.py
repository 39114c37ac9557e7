"""Schedules, flow-SDE / CPS / ODE steps with log-prob, SDE-window strategies."""

from imagerl.sampling.schedule import flow_sigmas, flow_timesteps, calculate_shift
from imagerl.sampling.sde import SDEStepOutput, flow_sde_step
from imagerl.sampling.window import SDEWindow, sde_window

__all__ = [
    "flow_sigmas", "flow_timesteps", "calculate_shift", "SDEStepOutput", "flow_sde_step", "SDEWindow", "sde_window",
]
