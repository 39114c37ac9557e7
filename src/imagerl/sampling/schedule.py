"""The flow-matching sigma schedule, exactly as diffusers' Qwen-Image pipelines feed their scheduler.

diffusers 0.42.1 (`QwenImagePipeline.__call__` + `FlowMatchEulerDiscreteScheduler.set_timesteps`):
  raw     s_i = linspace(1, 1/N, N)                     (float64, then cast to float32)
  mu          = base_shift + (L - base_seq) * m          (python float64; L = packed image tokens)
  shift       e^mu / (e^mu + (1/s - 1))                  (exponential; float32 numpy arithmetic)
  stretch     1 - (1 - s) / ((1 - s_last) / (1 - shift_terminal))   so the last sigma = shift_terminal
  append      sigma_N = 0
The arithmetic below repeats those operations in the same order and dtypes, so the result is
bit-identical (tests/test_schedule.py compares with the diffusers scheduler itself).
Timesteps are sigma * num_train_timesteps in float32; the transformer receives timestep / 1000.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np
import torch


def calculate_shift(image_seq_len: int, scheduler_config: Mapping) -> float:
    """mu for dynamic shifting: linear in the image token count (no clamping), diffusers' fallbacks."""
    base_seq = scheduler_config.get("base_image_seq_len", 256)
    max_seq = scheduler_config.get("max_image_seq_len", 4096)
    base_shift = scheduler_config.get("base_shift", 0.5)
    max_shift = scheduler_config.get("max_shift", 1.15)
    m = (max_shift - base_shift) / (max_seq - base_seq)
    b = base_shift - m * base_seq
    return image_seq_len * m + b


def flow_sigmas(num_steps: int, image_seq_len: int, scheduler_config: Mapping,
                raw_sigmas: list[float] | None = None) -> torch.Tensor:
    """num_steps + 1 float32 sigmas from 1 down to 0 (last is 0), identical to diffusers' Qwen pipelines.

    raw_sigmas: a fixed grid that replaces linspace(1, 1/N, N) before shifting (QwenImage21Pipeline's
    `sample_sigmas` config); its length must equal num_steps.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if raw_sigmas is not None and len(raw_sigmas) != num_steps:
        raise ValueError(f"this checkpoint fixes {len(raw_sigmas)} sampling steps (sample_sigmas); set sample.num_steps={len(raw_sigmas)}")
    for key in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas"):
        if scheduler_config.get(key):
            raise ValueError(f"scheduler config sets {key}=True, which the Qwen-Image pipelines do not use")
    grid = np.linspace(1.0, 1 / num_steps, num_steps) if raw_sigmas is None else raw_sigmas
    sigmas = np.array(grid).astype(np.float32)
    if scheduler_config.get("use_dynamic_shifting", False):
        mu = calculate_shift(image_seq_len, scheduler_config)
        if scheduler_config.get("time_shift_type", "exponential") == "exponential":
            sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1) ** 1.0)
        else:
            sigmas = mu / (mu + (1 / sigmas - 1) ** 1.0)
    else:
        shift = scheduler_config.get("shift", 1.0)
        sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    terminal = scheduler_config.get("shift_terminal")
    if terminal and num_steps < 2:
        raise ValueError("1 sampling step with shift_terminal stretches 0/0 (diffusers returns NaN); use >= 2 steps")
    if terminal:
        one_minus = 1 - sigmas
        sigmas = 1 - (one_minus / (one_minus[-1] / (1 - terminal)))
    sigmas = torch.from_numpy(np.asarray(sigmas)).to(torch.float32)
    return torch.cat([sigmas, torch.zeros(1)])


def flow_timesteps(sigmas: torch.Tensor, scheduler_config: Mapping) -> torch.Tensor:
    """Scheduler timesteps (float32, one per step): sigma * num_train_timesteps, as diffusers computes them."""
    return sigmas[:-1] * scheduler_config.get("num_train_timesteps", 1000)
