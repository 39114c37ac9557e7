"""flow_grpo_update against flow_grpo's objective written out in float64: the LoRA gradients of two optimizer steps,
with beta > 0 and the PPO clip acting in the second, equal autograd of an explicit float64 mean over (sample, trained
step) of the clipped surrogate plus beta * KL; the weights after each step equal an SGD step on those gradients.

What flow_grpo minimises per optimizer step (github.com/yifan123/flow_grpo, commit 9745241):
  scripts/train_qwenimage.py
    :837       gradient_accumulation_steps = train.gradient_accumulation_steps * num_train_timesteps
    :881-894   policy_loss = mean_batch(max(-A ratio, -A clamp(ratio, 1 - eps, 1 + eps))), A clamped to adv_clip_max
    :895, 899  policy_loss and kl_loss each divided by gradient_accumulation_steps
    :897-900   kl_loss = mean_batch(mean_elements (mean - mean_ref)^2 / (2 std_dev_t^2)); loss = policy + beta kl
    :870, 936-940  loss.backward() per (batch, step); clip and optimizer.step once per accumulation window
  scripts/train_sd3.py
    :360       Accelerator(gradient_accumulation_steps = train.gradient_accumulation_steps * num_train_timesteps):
               accelerator.backward (:938) divides each loss by it
    :886-902   the same policy_loss / kl_loss / loss lines
so one optimizer step's gradient is that of (1 / (batches x trained steps)) sum over its batches and steps of
(mean_batch surrogate + beta mean_batch KL): with equal batches, the mean over (sample, trained step) of
surrogate + beta KL. The step's log-prob and mean are flow_grpo's sde_step_with_logprob
(flow_grpo/diffusers_patch/sd3_sde_with_logprob.py:44-68), the guided velocity train_qwenimage.py:217-231 (one CFG
forward of cond and uncond rows, norm rescale), the reference the same forward with the LoRA disabled
(train_sd3.py:882-883).

The reference below runs a float64 copy of the tiny transformer on the rollout's recorded trajectory (its latents,
sampled next latents and old log-probs are the data). It never calls imagerl's loss, log-prob, KL or update code.
The rollout's second half repeats its first half (the same samples), so the first optimizer step moves those
samples' ratios in the direction of their advantages and the second step's clip acts at both ends; train.clip_range
is chosen so that one positive-advantage ratio sits between 1 + eps and 1 + 2 eps (a clip moved to 1 + 2 eps must
change the gradient) and no ratio is near a boundary (float32 and float64 agree on which are clipped).
"""

import copy
import dataclasses
import math

import pytest
import torch

from conftest import tiny_config
from imagerl.algorithms.flow_grpo import flow_grpo_update
from imagerl.components import load_adapter, resolve_family_defaults
from imagerl.data.prompts import GroupSampler, bundled_prompt_file, load_prompt_set
from imagerl.distributed.parallel import World
from imagerl.rollout import generate
from imagerl.sampling import sde_window

LR = 10.0  # plain SGD: large enough that the first step moves the second step's ratios by ~1e-2
BETA = 10.0  # beta * KL's gradient is ~20 % of the policy gradient's (asserted below)
EPS = 1e-2
LORA_INIT_STD = 0.2  # a LoRA away from zero: the policy differs from the reference, so KL and its gradient are not 0
ADVANTAGES = [1.5, -2.0, 7.0, -0.5]  # per sample of the first half (7: clipped to adv_clip_max = 5); repeated


@pytest.fixture
def one_thread():
    """The tiny model's matmuls are too small for threads; under CPU contention two threads spin (100x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class RecordingSGD(torch.optim.SGD):
    """SGD that records each step's gradients (what the update accumulated, after its clipping) and the weights
    after."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.grads, self.after = [], []

    @torch.no_grad()
    def step(self, closure=None):
        params = self.param_groups[0]["params"]
        self.grads.append(torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).flatten() for p in params]))
        super().step(closure)
        self.after.append(torch.cat([p.detach().flatten() for p in params]))


def _rollout(cfg):
    adapter = load_adapter(cfg, World(0, 1, torch.device("cpu")))
    resolve_family_defaults(cfg, adapter)
    g = torch.Generator().manual_seed(0)
    for p in adapter.trainable_parameters():
        p.data.normal_(0, LORA_INIT_STD, generator=g)
    s = cfg.sample
    groups = GroupSampler(load_prompt_set(bundled_prompt_file()), s.prompts_per_rollout, cfg.run.seed).groups_for(0)
    window = sde_window(s.num_sde_steps, tuple(s.sde_window_range), s.sde_window_start, seed=cfg.run.seed,
                        rollout_step=0)
    r = generate(adapter, groups, cfg, 0, window)
    idx = list(range(len(r))) * 2  # the second half repeats the first: optimizer step 2 trains the same samples again
    pick = lambda rows: [rows[i] for i in idx]  # noqa: E731
    return adapter, dataclasses.replace(
        r, prompts_B=pick(r.prompts_B), metadata_B=pick(r.metadata_B), group_ids_B=r.group_ids_B[idx],
        text_B=pick(r.text_B), latents_BSNC=r.latents_BSNC[idx], next_latents_BSNC=r.next_latents_BSNC[idx],
        log_probs_BS=r.log_probs_BS[idx], images_B3HW=r.images_B3HW[idx])


class Reference:
    """flow_grpo's per-step objective in float64 on a copy of the transformer."""

    def __init__(self, adapter, rollout, cfg):
        self.model = copy.deepcopy(adapter.transformer).double()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.r, self.s, self.t = rollout, cfg.sample, cfg.train

    def set_params(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.params:
            p.data = flat[offset: offset + p.numel()].view_as(p).clone()
            offset += p.numel()

    def velocity(self, i: int, j: int) -> torch.Tensor:
        """train_qwenimage.py:217-231: cond and uncond rows in one forward, v = u + s (c - u), rescaled to ||c||."""
        rows = [self.r.text_B[i].double(), self.r.negative.double()]
        length = max(row.shape[0] for row in rows)
        embeds = torch.zeros(2, length, rows[0].shape[1], dtype=torch.float64)
        mask = torch.zeros(2, length, dtype=torch.bool)
        for k, row in enumerate(rows):
            embeds[k, : row.shape[0]], mask[k, : row.shape[0]] = row, True
        x = self.r.latents_BSNC[i: i + 1, j].double()
        h = self.s.height // 16
        pred = self.model(hidden_states=x.repeat(2, 1, 1), timestep=self.r.timesteps_S[j].double().repeat(2) / 1000,
                          encoder_hidden_states=embeds, encoder_hidden_states_mask=None if mask.all() else mask,
                          img_shapes=[[(1, h, h)]] * 2, return_dict=False)[0]
        c, u = pred.chunk(2)
        comb = u + self.s.guidance_scale * (c - u)
        return comb * (c.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))

    def sde_step(self, i: int, j: int, v: torch.Tensor):
        """sd3_sde_with_logprob.py:44-68 (sde_type "sde"): the log-prob of the recorded next latent, the mean and
        std_dev_t."""
        x = self.r.latents_BSNC[i: i + 1, j].double()
        prev = self.r.next_latents_BSNC[i: i + 1, j].double()
        sigma, sigma_next = float(self.r.sigmas_S[j]), float(self.r.sigmas_next_S[j])
        dt = sigma_next - sigma
        std_dev_t = math.sqrt(sigma / (1 - (float(self.r.sigma_max) if sigma == 1 else sigma))) * self.s.noise_level
        mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        std = std_dev_t * math.sqrt(-dt)
        log_prob = (-((prev - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))).mean()
        return log_prob, mean, std_dev_t

    def terms(self, samples, advantages):
        """Per (sample, trained step): the clipped surrogate (train_qwenimage.py:881-894), the KL (:897), the ratio."""
        surrogate, kl, ratios = [], [], []
        for i in samples:
            for j in range(self.r.latents_BSNC.shape[1]):
                log_prob, mean, std_dev_t = self.sde_step(i, j, self.velocity(i, j))
                with torch.no_grad():
                    self.model.disable_adapters()
                    _, mean_ref, _ = self.sde_step(i, j, self.velocity(i, j))
                    self.model.enable_adapters()
                a = min(max(float(advantages[i]), -self.t.adv_clip_max), self.t.adv_clip_max)
                ratio = torch.exp(log_prob - float(self.r.log_probs_BS[i, j]))
                eps = self.t.clip_range
                surrogate.append(torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps, 1 + eps)))
                kl.append(((mean - mean_ref) ** 2).mean() / (2 * std_dev_t**2))
                ratios.append((float(ratio.detach()), a))
        return torch.stack(surrogate), torch.stack(kl), ratios

    def grad(self, value: torch.Tensor) -> torch.Tensor:
        grads = torch.autograd.grad(value, self.params, retain_graph=True, allow_unused=True)
        return torch.cat([(torch.zeros_like(p) if g is None else g).flatten() for p, g in zip(self.params, grads)])


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = 2e-5) -> None:
    err = float((actual.double() - expected).norm() / expected.norm())
    assert err < rtol, f"{what}: relative error {err:.2e}, norm {float(expected.norm()):.6e}"


def test_two_optimizer_steps_follow_flow_grpos_float64_objective(tiny_checkpoint, tmp_path, one_thread):
    cfg = tiny_config(tiny_checkpoint, tmp_path, "sample.prompts_per_rollout=2", "sample.group_size=2",
                      "sample.batch_size=2", "train.num_optimizer_steps=2", f"train.beta={BETA}",
                      f"train.clip_range={EPS}", "train.max_grad_norm=1e9",  # no grad-norm clipping
                      "train.shuffle_batches=false", "train.drop_zero_advantage=false")  # train_qwenimage.py's order
    adapter, rollout = _rollout(cfg)
    half = len(rollout) // 2
    advantages = torch.tensor(ADVANTAGES * 2)
    assert rollout.batches() == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]  # 2 batches per optimizer step
    assert rollout.latents_BSNC.shape[1] == 2  # 2 trained steps: the mean is over 4 samples x 2 steps per opt step

    ref = Reference(adapter, rollout, cfg)
    p0 = torch.cat([p.detach().double().flatten() for p in adapter.trainable_parameters()])
    # optimizer step 1 (samples 0-3, on-policy: every ratio is 1 up to float64-vs-float32 rounding)
    ref.set_params(p0)
    sur1, kl1, ratios1 = ref.terms(range(half), advantages)
    g_policy, g_kl = ref.grad(sur1.mean()), ref.grad(kl1.mean())
    g1 = g_policy + BETA * g_kl
    assert all(abs(r - 1) < 1e-6 for r, _ in ratios1)
    assert 0.05 < float((BETA * g_kl).norm() / g_policy.norm()) < 20  # the KL term matters, so must its sign
    p1 = p0 - LR * g1
    # optimizer step 2 (the same samples again, at the weights after step 1)
    ref.set_params(p1)
    sur2, kl2, ratios2 = ref.terms(range(half, 2 * half), advantages)
    g2 = ref.grad(sur2.mean() + BETA * kl2.mean())
    p2 = p1 - LR * g2
    # the second step's ratios: clipped at both ends, one positive-advantage ratio between 1 + eps and 1 + 2 eps,
    # and none within 2 % of eps of a clip boundary
    deviations = [(r - 1, a) for r, a in ratios2]
    assert any(EPS < d < 2 * EPS and a > 0 for d, a in deviations), deviations
    assert any(d > EPS and a > 0 for d, a in deviations) and any(d < -EPS and a < 0 for d, a in deviations)
    assert any(abs(d) < EPS for d, _ in deviations), deviations  # and some unclipped
    assert all(min(abs(abs(d) - EPS), abs(abs(d) - 2 * EPS)) > 0.02 * EPS for d, _ in deviations), deviations

    optimizer = RecordingSGD(adapter.trainable_parameters(), LR)
    stats = flow_grpo_update(adapter, rollout, advantages, optimizer, cfg, World(0, 1, torch.device("cpu")))

    assert len(optimizer.grads) == 2
    _close(optimizer.grads[0], g1, "gradient of optimizer step 1")
    _close(optimizer.after[0], p1, "weights after step 1", rtol=1e-6)
    _close(optimizer.grads[1], g2, "gradient of optimizer step 2")
    _close(optimizer.after[1], p2, "weights after step 2", rtol=1e-6)
    # the step's change itself, not only the weights (which the change moves by ~1e-2 of their norm)
    _close(optimizer.after[1].double() - optimizer.after[0].double(), p2 - p1, "step 2's change of the weights")
    # the logged metrics: means over every (sample, trained step) of both optimizer steps
    clipped = sum(abs(r - 1) > EPS for r, _ in ratios1 + ratios2) / (len(ratios1) + len(ratios2))
    assert stats.clipfrac == clipped and stats.clipfrac > 0
    assert stats.log_prob_mean_abs_diff == 0.0  # the first step replays the rollout exactly
    assert stats.policy_loss == pytest.approx(float(torch.cat([sur1, sur2]).mean().detach()), rel=1e-4, abs=1e-7)
    assert stats.kl_loss == pytest.approx(float(torch.cat([kl1, kl2]).mean().detach()), rel=1e-4)
