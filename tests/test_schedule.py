"""flow_sigmas / flow_timesteps / calculate_shift against diffusers' own QwenImagePipeline scheduling code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift as diffusers_calculate_shift

from imagerl.families.qwen_image.tiny import QWEN_IMAGE_SCHEDULER_CONFIG
from imagerl.sampling import calculate_shift, flow_sigmas, flow_timesteps

QWEN = dict(QWEN_IMAGE_SCHEDULER_CONFIG)


def diffusers_schedule(num_steps: int, image_seq_len: int, config: dict):
    """What QwenImagePipeline.__call__ does: its own calculate_shift, then set_timesteps(sigmas=..., mu=...)."""
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    cfg = scheduler.config
    mu = diffusers_calculate_shift(
        image_seq_len,
        cfg.get("base_image_seq_len", 256),
        cfg.get("max_image_seq_len", 4096),
        cfg.get("base_shift", 0.5),
        cfg.get("max_shift", 1.15),
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    return scheduler, mu


CASES = {
    "qwen_512px_10steps": (10, 1024, QWEN),
    "qwen_1024px_50steps": (50, 4096, QWEN),
    "qwen_512px_20steps": (20, 1024, QWEN),
    "qwen_512px_50steps": (50, 1024, QWEN),
    "qwen_tiny_64tokens": (10, 64, QWEN),
    "qwen_tiny_64tokens_4steps": (4, 64, QWEN),
    "qwen_above_max_seq_len": (8, 16384, QWEN),  # mu is not clamped
    "static_shift_3": (10, 1024, {**QWEN, "use_dynamic_shifting": False, "shift": 3.0}),
    "static_shift_3_no_terminal": (
        28, 1024, {**QWEN, "use_dynamic_shifting": False, "shift": 3.0, "shift_terminal": None}),
    "no_shift_terminal": (10, 1024, {**QWEN, "shift_terminal": None}),
    "linear_time_shift": (10, 1024, {**QWEN, "time_shift_type": "linear"}),
    "class_defaults_dynamic": (10, 1024, {"use_dynamic_shifting": True}),  # diffusers' fallback values
    "class_defaults": (10, 1024, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sigmas_and_timesteps_bit_identical_to_diffusers(case):
    num_steps, seq_len, config = CASES[case]
    scheduler, _ = diffusers_schedule(num_steps, seq_len, config)
    # Pass the scheduler's full config, as a pipeline would (includes diffusers' defaults for absent keys).
    for cfg in (config, dict(scheduler.config)):
        sigmas = flow_sigmas(num_steps, seq_len, cfg)
        assert sigmas.dtype == torch.float32
        assert sigmas.shape == (num_steps + 1,)
        assert torch.equal(sigmas, scheduler.sigmas), (sigmas - scheduler.sigmas).abs().max()
        timesteps = flow_timesteps(sigmas, cfg)
        assert timesteps.dtype == torch.float32
        assert torch.equal(timesteps, scheduler.timesteps)


@pytest.mark.parametrize("seq_len", [64, 1024, 4096, 16384])
@pytest.mark.parametrize("config", [QWEN, {}], ids=["qwen", "fallbacks"])
def test_mu_equals_diffusers_calculate_shift(seq_len, config):
    _, mu = diffusers_schedule(10, seq_len, {**config, "use_dynamic_shifting": True})
    assert calculate_shift(seq_len, config) == mu


def test_sigmas_of_flow_grpos_qwen_image_setting_512px_10_steps():
    """flow_grpo's Qwen-Image rollout setting (config/grpo.py:692-703 at commit 9745241, pickscore_qwenimage:
    resolution 512, i.e. 1024 image tokens, and sample.num_steps 10) under Qwen-Image's scheduler_config.

    Where the 5-digit table comes from: flow_grpo publishes no such numbers. The table was written into this test in
    the project's first commit (2618503), taken from diffusers 0.42.1's QwenImagePipeline schedule as recorded in that
    session's note reference/diffusers_qwenimage.md section 3.1 (not kept in the repository). So that it is not a bare
    copy of anyone's output, it is checked here against the formula in float64 (as the 50-step test below): mu =
    0.5 + (0.9 - 0.5) / (8192 - 256) (L - 256), sigma = e^mu / (e^mu + 1/s - 1) on s = linspace(1, 1/n, n),
    stretched so that the last is shift_terminal = 0.02, then 0 appended."""
    n = 10
    s = np.linspace(1.0, 1 / n, n)
    mu64 = 0.5 + (0.9 - 0.5) / (8192 - 256) * (1024 - 256)
    shifted = np.exp(mu64) / (np.exp(mu64) + (1 / s - 1))
    derived = np.append(1 - (1 - shifted) * (1 - 0.02) / (1 - shifted[-1]), 0.0)
    table = [1.0, 0.92897, 0.85148, 0.76662, 0.67328, 0.57012, 0.45550, 0.32740, 0.18330, 0.02, 0.0]
    assert np.allclose(derived, table, rtol=0, atol=1e-5)  # the table is the formula's, to its 5 digits
    mu = calculate_shift(1024, QWEN)
    assert abs(mu - 0.538710) < 1e-6
    # independent float64 derivation: mu = b + m L
    m = (0.9 - 0.5) / (8192 - 256)
    assert abs(mu - (0.5 + m * (1024 - 256))) < 1e-12
    sigmas = flow_sigmas(10, 1024, QWEN)
    assert torch.allclose(sigmas.double(), torch.tensor(table, dtype=torch.float64), rtol=0, atol=1e-5)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert abs(float(sigmas[-2]) - 0.02) < 1e-7  # shift_terminal
    assert torch.equal(flow_timesteps(sigmas, QWEN)[[0, 3]], sigmas[[0, 3]] * 1000)


def test_float64_formula_agrees_to_float32_precision():
    """A from-scratch float64 version of the §3.1 formulas, for the 1024px/50-step schedule."""
    n, seq_len = 50, 4096
    s = np.linspace(1.0, 1 / n, n)
    m = (0.9 - 0.5) / (8192 - 256)
    mu = 0.5 + m * (seq_len - 256)
    shifted = np.exp(mu) / (np.exp(mu) + (1 / s - 1))
    stretched = 1 - (1 - shifted) * (1 - 0.02) / (1 - shifted[-1])
    ref = torch.from_numpy(np.append(stretched, 0.0))
    sigmas = flow_sigmas(n, seq_len, QWEN)
    assert torch.allclose(sigmas.double(), ref, rtol=0, atol=1e-6)
    assert bool((sigmas[1:] < sigmas[:-1]).all())  # strictly decreasing


@pytest.mark.parametrize("num_steps", [0, -3])
def test_num_steps_below_one_raises(num_steps):
    with pytest.raises(ValueError, match="num_steps"):
        flow_sigmas(num_steps, 1024, QWEN)


@pytest.mark.parametrize("key", ["use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas"])
def test_sigma_conversions_the_pipeline_never_uses_are_rejected(key):
    with pytest.raises(ValueError, match=key):
        flow_sigmas(10, 1024, {**QWEN, key: True})
