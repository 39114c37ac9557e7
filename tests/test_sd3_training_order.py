"""flow_grpo's scripts/train_sd3.py training order and EMA schedule (zhtmike/flow_grpo at 9745241, November 2025),
against float64 transcriptions of that code:

- lines 799-819: samples whose advantage is exactly 0 leave the training set; lines 829-838 shuffle and rebatch the
  rest into num_batches_per_epoch equal batches; lines 880-945 take mean(max(-A r, -A clip(r))) + beta KL per batch and
  timestep, and accelerate divides each micro-step's loss by gradient_accumulation_steps (batches per optimizer step x
  timesteps). (train.drop_zero_advantage, train.shuffle_batches)
- flow_grpo/ema.py EMAModuleWrapper.step(parameters, k): an update when (k + 1) % update_step_interval == 0 with decay
  min((1 + k) / (10 + k), 0.9); train_sd3.py line 959-960 calls it after every training batch with global_step, which
  counts optimizer steps (line 957). (train.ema_update_interval, train.ema_repeats)
"""

import types

import pytest
import torch

from conftest import tiny_config
from imagerl.algorithms import flow_grpo as flow_grpo_module
from imagerl.algorithms.flow_grpo import FlowGRPO, _step_log_prob, flow_grpo_update, training_order
from imagerl.components import load_adapter, resolve_family_defaults
from imagerl.data.prompts import GroupSampler, bundled_prompt_file, load_prompt_set
from imagerl.distributed.parallel import World
from imagerl.rollout import generate
from imagerl.sampling import sde_window

WORLD = World(0, 1, torch.device("cpu"))


class GradientRecorder(torch.optim.Optimizer):
    """Records each optimizer step's gradients and leaves the weights as they are."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
                           for g in self.param_groups for p in g["params"]])


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    # 4 prompts x 2 images, batches of 2: 4 batches, 2 optimizer steps of 2 batches each
    cfg = tiny_config(tiny_checkpoint, tmp_path_factory.mktemp("run"), "sample.prompts_per_rollout=4",
                      "train.num_optimizer_steps=2", "train.beta=0.04", "train.max_grad_norm=1e9",
                      "train.drop_zero_advantage=true")
    adapter = load_adapter(cfg, WORLD)
    resolve_family_defaults(cfg, adapter)
    groups = GroupSampler(load_prompt_set(bundled_prompt_file()), 4, cfg.run.seed).groups_for(0)
    window = sde_window(cfg.sample.num_sde_steps, tuple(cfg.sample.sde_window_range), cfg.sample.sde_window_start,
                        seed=cfg.run.seed, rollout_step=0)
    return cfg, adapter, generate(adapter, groups, cfg, 0, window)


def _upstream_step_loss(adapter, rollout, cfg, samples, advantages, num_batches):
    """train_sd3.py's loss of one optimizer step over the kept `samples`: rebatched into `num_batches` equal batches,
    per batch and timestep mean_b(max(unclipped, clipped)) + beta mean_b(kl), each divided by num_batches x S
    (accelerate's gradient accumulation), summed. Per-sample forwards; float64 arithmetic on the outputs."""
    t, S = cfg.train, rollout.latents_BSNC.shape[1]
    per_batch = len(samples) // num_batches
    assert per_batch * num_batches == len(samples)  # flow_grpo pads with zero-advantage samples otherwise
    total = 0.0
    for b in range(num_batches):
        rows = samples[b * per_batch: (b + 1) * per_batch]
        for j in range(S):
            policy, kl = [], []
            for i in rows:
                one = slice(i, i + 1)
                cond = rollout.conditioning(adapter, one, cfg.sample.guidance_scale)
                out = _step_log_prob(adapter, rollout, one, j, cond, cfg)
                with torch.no_grad(), adapter.lora_disabled():
                    ref = _step_log_prob(adapter, rollout, one, j, cond, cfg)
                adv = torch.tensor(advantages[i], dtype=torch.float64).clamp(-t.adv_clip_max, t.adv_clip_max)
                ratio = torch.exp(out.log_prob.double() - rollout.log_probs_BS[i, j].double())
                unclipped = -adv * ratio
                clipped = -adv * torch.clamp(ratio, 1.0 - t.clip_range, 1.0 + t.clip_range)
                policy.append(torch.maximum(unclipped, clipped).sum())
                kl.append(((out.mean.double() - ref.mean.double()) ** 2).mean() / (2 * out.std_dev_t.double() ** 2))
            loss = torch.stack(policy).mean() + t.beta * torch.stack(kl).mean()
            total = total + loss / (num_batches * S)
    return total


def test_dropping_zero_advantages_is_train_sd3s_mean_over_the_kept_samples(setup):
    cfg, adapter, rollout = setup
    # step 1 (batches 0, 1 = samples 0-3) keeps 2 samples, step 2 (samples 4-7) keeps 4
    advantages = torch.tensor([0.0, 0.0, 0.9, -0.9, 1.2, -1.2, 0.4, -0.4])
    params = adapter.trainable_parameters()
    recorder = GradientRecorder(params)
    stats = flow_grpo_update(adapter, rollout, advantages, recorder, cfg, WORLD)
    assert stats.log_prob_mean_abs_diff == 0.0  # whole batches replay: still exact
    adapter.transformer.train()
    for step, (kept, num_batches) in enumerate([([2, 3], 2), ([4, 5, 6, 7], 2)]):
        loss = _upstream_step_loss(adapter, rollout, cfg, kept, advantages.tolist(), num_batches)
        expected = torch.autograd.grad(loss, params, allow_unused=True)
        for got, want in zip(recorder.grads[step], expected):
            want = torch.zeros_like(got) if want is None else want
            torch.testing.assert_close(got.double(), want.double(), rtol=2e-4, atol=1e-9)
    adapter.transformer.eval()
    # the zero-advantage samples' KL gradient is gone: the default keeps them in the first step's mean
    keep_all = GradientRecorder(params)
    cfg.train.drop_zero_advantage = False
    try:
        flow_grpo_update(adapter, rollout, advantages, keep_all, cfg, WORLD)
    finally:
        cfg.train.drop_zero_advantage = True
    difference = sum((a - b).norm() for a, b in zip(keep_all.grads[0], recorder.grads[0]))
    assert difference > 1e-3 * sum(a.norm() for a in recorder.grads[0])


def test_shuffled_batches_are_a_seeded_permutation_that_still_replays_exactly(setup):
    cfg, adapter, rollout = setup
    batches = rollout.batches()
    orders = {tuple(b.start for b in training_order(batches, cfg.run.seed, step, 0)) for step in range(8)}
    assert len(orders) > 1 and all(sorted(o) == [b.start for b in batches] for o in orders)
    assert training_order(batches, 7, 3, 0) == training_order(batches, 7, 3, 0)  # resumes draw the same order
    cfg.train.shuffle_batches = True
    try:
        stats = flow_grpo_update(adapter, rollout, torch.tensor([0.5, -0.5] * 4), GradientRecorder(
            adapter.trainable_parameters()), cfg, WORLD, rollout_step=3)
    finally:
        cfg.train.shuffle_batches = False
    assert stats.log_prob_mean_abs_diff == 0.0


def _upstream_ema(policy_after_step, batches_per_step, initial, interval, decay_cap=0.9):
    """train_sd3.py's loop: after every training batch, EMAModuleWrapper.step(params, global_step), global_step being
    the optimizer steps done; the weights change only at optimizer steps. float64."""
    ema, params, global_step = initial.clone(), initial.clone(), 0
    emas_after_step = []
    for k, after in enumerate(policy_after_step):
        for b in range(batches_per_step):
            if b == batches_per_step - 1:  # this batch completes the optimizer step
                params, global_step = after.clone(), global_step + 1
            if (global_step + 1) % interval == 0:
                decay = min((1 + global_step) / (10 + global_step), decay_cap)
                ema += (1 - decay) * (params - ema)
        emas_after_step.append(ema.clone())
    # the last step's repeats fall on the next rollout's first batches (same weights): apply them for the comparison
    return emas_after_step


@pytest.mark.parametrize("interval, repeats", [(1, 1), (8, 2), (4, 3)])
def test_ema_schedule_is_flow_grpos(monkeypatch, interval, repeats):
    """20 rollouts of 2 optimizer steps; the update is replaced by one that moves the policy to prescribed values."""
    cfg = types.SimpleNamespace(train=types.SimpleNamespace(ema=True, ema_cap=0.9, ema_update_interval=interval,
                                                            ema_repeats=repeats, num_optimizer_steps=2))
    weight = torch.nn.Parameter(torch.zeros(5, dtype=torch.float64))
    module = torch.nn.Module()
    module.weight = weight
    adapter = types.SimpleNamespace(transformer=module, trainable_parameters=lambda: [weight])
    algo = FlowGRPO(cfg, adapter)
    gen = torch.Generator().manual_seed(0)
    targets = [torch.randn(5, generator=gen, dtype=torch.float64) for _ in range(40)]
    emas = []

    def fake_update(adapter, rollout, advantages, optimizer, cfg, world, progress=None, after_step=None,
                    rollout_step=0, policy_loss=None):
        for opt_step in range(2):
            with torch.no_grad():
                weight.copy_(targets[2 * rollout_step + opt_step])
            after_step(opt_step)
            emas.append(algo.ema.states["ema"][0].clone())
        return types.SimpleNamespace(ema_decay=None)

    monkeypatch.setattr(flow_grpo_module, "flow_grpo_update", fake_update)
    for step in range(20):
        algo.update(adapter, None, None, None, WORLD, step)
    expected = _upstream_ema(targets, repeats, torch.zeros(5, dtype=torch.float64), interval)
    # after every even k (a rollout's end) the two agree exactly; in between, the repeats that flow_grpo applies on
    # the next step's first batches are already applied here (same weights, same decay)
    for k in range(1, 40, 2):
        torch.testing.assert_close(emas[k], expected[k], rtol=0, atol=1e-12)


@pytest.mark.parametrize("override, message", [
    ("train.ema_update_interval=0", "train.ema_update_interval must be an int >= 1"),
    ("train.ema_repeats=-1", "train.ema_repeats must be an int >= 1"),
])
def test_bad_ema_schedule_is_refused(tiny_checkpoint, tmp_path, override, message):
    from imagerl.validation import validate

    with pytest.raises(ValueError, match=message):
        validate(tiny_config(tiny_checkpoint, tmp_path, override))


@pytest.mark.parametrize("key", ["drop_zero_advantage", "shuffle_batches", "ema"])
def test_flow_grpo_order_options_are_refused_for_diffusion_nft(tiny_checkpoint, tmp_path, key):
    from imagerl.validation import validate

    with pytest.raises(ValueError, match=f"train.{key} is Flow-GRPO's"):
        validate(tiny_config(tiny_checkpoint, tmp_path, "train.algorithm=diffusion_nft", f"train.{key}=true"))
