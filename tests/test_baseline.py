"""The flow_grpo-style baseline loop (imagerl.perf.baseline) on a tiny random Qwen-Image checkpoint (CPU, fp32)."""

import dataclasses
import math

import pytest
import torch

from imagerl.perf.baseline import BaselineSettings, FlowGRPOBaseline, sde_step_with_logprob

PROMPT = "a red cube on a wooden table"
TINY = BaselineSettings(height=64, width=32, num_steps=4, guidance_scale=4.0, noise_level=1.2, sde_steps=(1, 2),
                        group_size=4, batch_size=2, num_optimizer_steps=2, lr=0.0, lora_rank=2, lora_alpha=4,
                        max_sequence_length=64)


def brightness(images, prompts):
    assert images.dtype == torch.float32 and len(prompts) == images.shape[0]
    return images.mean(dim=(1, 2, 3))


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add synchronisation (10x slower on a busy 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def pipe(tiny_checkpoint):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_checkpoint)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_sde_step_matches_the_flow_grpo_formula():
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.0])
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, 16, generator=gen)
    for i, std_dev_t in [(1, math.sqrt(0.8 / 0.2) * 0.7), (0, math.sqrt(1 / (1 - 0.8)) * 0.7)]:  # sigma 1 -> sigmas[1]
        sigma, dt = sigmas[i].item(), (sigmas[i + 1] - sigmas[i]).item()
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_dev_t * math.sqrt(-dt)
        prev, log_prob = sde_step_with_logprob(sigmas, i, v, x, 0.7, generator=torch.Generator().manual_seed(1))
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(prev, mean + std * noise)
        expected = torch.distributions.Normal(mean, std).log_prob(prev).mean(dim=(1, 2))
        torch.testing.assert_close(log_prob, expected)
        _, again = sde_step_with_logprob(sigmas, i, v, x, 0.7, prev_sample=prev)  # the training-time replay
        torch.testing.assert_close(again, log_prob, atol=0, rtol=0)


def lora_state(baseline):
    return [p.detach().clone() for p in baseline.lora_params]


def base_output(transformer):
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 16, transformer.config.in_channels, generator=gen)
    text = torch.randn(2, 7, transformer.config.joint_attention_dim, generator=gen)
    with torch.no_grad():
        return transformer(hidden_states=latents, encoder_hidden_states=text, encoder_hidden_states_mask=None,
                           timestep=torch.tensor([0.5, 0.7]), img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0]


@pytest.mark.parametrize("dtype, sde_steps", [(torch.float32, (1, 2)), (torch.bfloat16, (0, 2))])
def test_on_policy_with_zero_lr_is_exact(pipe, dtype, sde_steps):
    pipe.transformer.to(dtype)  # bf16 as in the benchmark; step 0 takes the sigma == 1 branch
    baseline = FlowGRPOBaseline(pipe, brightness, dataclasses.replace(TINY, sde_steps=sde_steps), "cpu")
    before = lora_state(baseline)
    assert len(before) == 2 * 12 * 2 and all(p.dtype == torch.float32 for p in before)  # A, B x 12 targets x 2 blocks
    out = baseline.iteration(PROMPT, generator_seed=0)
    assert out["log_prob_mean_abs_diff"] == 0.0
    assert out["ratio_abs_minus_1_max"] == 0.0
    assert out["images"] == 4 and out["text_tokens"] > 0
    assert all(out[k] >= 0 for k in ("rollout_s", "reward_s", "train_s", "total_s"))
    assert all(torch.equal(a, b) for a, b in zip(before, baseline.lora_params))
    baseline.remove()


def test_training_moves_the_lora(pipe):
    seen = []

    def recording_brightness(images, prompts):
        seen.append(images)
        return brightness(images, prompts)

    settings = dataclasses.replace(TINY, lr=1e-2, clip_range=0.2)
    baseline = FlowGRPOBaseline(pipe, recording_brightness, settings, "cpu")
    before = lora_state(baseline)
    out = baseline.iteration(PROMPT, generator_seed=3)
    images = torch.cat(seen)
    assert [x.shape[0] for x in seen] == [2, 2]  # scored per sampling batch
    assert images.shape == (4, 3, 64, 32) and torch.isfinite(images).all()
    assert images.min() >= 0 and images.max() <= 1 and images.std() > 0
    assert out["reward_mean"] == pytest.approx(brightness(images, [PROMPT] * 4).mean().item(), abs=1e-6)
    assert out["log_prob_mean_abs_diff"] == 0.0  # the first optimizer step is still on-policy
    assert out["ratio_abs_minus_1_max"] > 0  # the second one is not: the first step moved the policy
    assert any(not torch.equal(a, b) for a, b in zip(before, baseline.lora_params))
    baseline.remove()


def test_rollout_trajectory_shapes(pipe):
    baseline = FlowGRPOBaseline(pipe, brightness, dataclasses.replace(TINY, group_size=2), "cpu")
    traj = baseline.rollout(PROMPT, torch.Generator().manual_seed(3))
    assert traj["images"].shape == (2, 3, 64, 32)
    assert traj["latents"].shape == traj["next_latents"].shape == (2, 2, 8, 16)  # (n, sde steps, 4x2 tokens, 4x4 ch)
    assert traj["log_probs"].shape == (2, 2) and torch.isfinite(traj["log_probs"]).all()
    assert traj["latents"].dtype == traj["next_latents"].dtype == torch.float32
    # consecutive SDE steps chain: the latents after step 1 are the latents before step 2
    torch.testing.assert_close(traj["next_latents"][:, 0], traj["latents"][:, 1], atol=0, rtol=0)
    baseline.remove()


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_rollout_matches_the_diffusers_pipeline(pipe, guidance):
    settings = dataclasses.replace(TINY, sde_steps=(), guidance_scale=guidance, group_size=2)
    baseline = FlowGRPOBaseline(pipe, brightness, settings, "cpu")
    with torch.no_grad():  # a non-zero LoRA, so that the comparison also covers the adapter being active
        for p in baseline.lora_params:
            p.normal_(0, 0.05)
    ours = baseline.rollout(PROMPT, torch.Generator().manual_seed(5))["images"]
    latents = pipe.prepare_latents(2, 4, 64, 32, torch.float32, "cpu", torch.Generator().manual_seed(5))
    reference = pipe(prompt=[PROMPT] * 2, negative_prompt=[" "] * 2 if guidance > 1 else None, height=64, width=32,
                     num_inference_steps=4, true_cfg_scale=guidance, latents=latents, output_type="pt",
                     max_sequence_length=64).images
    assert ours.shape == reference.shape == (2, 3, 64, 32)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=0)
    baseline.remove()


def test_remove_restores_the_base_model(pipe):
    from peft.tuners.tuners_utils import BaseTunerLayer

    transformer = pipe.transformer
    reference = base_output(transformer)
    baseline = FlowGRPOBaseline(pipe, brightness, dataclasses.replace(TINY, lr=1e-2, clip_range=0.2), "cpu")
    baseline.iteration(PROMPT, generator_seed=7)
    assert not torch.equal(base_output(transformer), reference)  # the trained LoRA is active
    baseline.remove()
    assert not any(isinstance(m, BaseTunerLayer) for m in transformer.modules())
    assert not transformer.is_gradient_checkpointing
    torch.testing.assert_close(base_output(transformer), reference, atol=0, rtol=0)
    # another LoRA can be added to the same transformer afterwards
    again = FlowGRPOBaseline(pipe, brightness, TINY, "cpu", adapter_name="baseline")
    assert len(again.lora_params) == 48
    again.remove()
