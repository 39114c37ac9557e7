"""Flow-GRPO policy update (github.com/yifan123/flow_grpo, scripts/train_qwenimage.py).

Per rollout the rank's batches are split into `num_optimizer_steps` equal, consecutive chunks (by default in
rollout order with zero-advantage samples trained too, as flow_grpo's Qwen trainer; train.shuffle_batches and
train.drop_zero_advantage as its train_sd3.py, below). For each batch and each window step j, one forward with
grad replays the rollout's batch (same CFG), then

  ratio   = exp(log_prob - old_log_prob)
  A       = clip(advantage, -adv_clip_max, adv_clip_max)
  policy  = mean_batch max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps))
  kl      = mean_batch mean_elements (mean - mean_ref)^2 / (2 std_dev_t^2)   (beta > 0; reference = LoRA off)
  loss    = (policy + beta kl) / (batches_per_step x S)        -> the gradient of the mean over (sample, step)

train.drop_zero_advantage (flow_grpo scripts/train_sd3.py lines 799-819 at 9745241): samples with advantage exactly 0
leave the loss, which becomes sum over the step's kept (sample, step) pairs / (kept samples of the step x S), the
mean over what flow_grpo keeps (its per-process mean; flow_grpo re-admits a few zero-advantage samples at random to
make the count divisible by its batch count, which the mean does not need). The forwards still run whole batches, so
the replay stays exact and every rank runs the same forwards (FSDP's collectives need that).
train.shuffle_batches (lines 829-838 there): the batches are trained in a permutation seeded by (run.seed, rollout,
rank). flow_grpo permutes samples before batching; imagerl moves whole batches, which keeps each batch's forward
bit for bit the rollout's (a forward's rounding depends on its rows).

Gradients are averaged over ranks (all-reduce, or FSDP's reduce-scatter), clipped to max_grad_norm by
the global norm over all shards (flow_grpo clipped the local shard's norm), then AdamW steps.
Metric `log_prob_mean_abs_diff` is measured on the first optimizer step only, where the policy is
still the rollout policy, so it must be exactly 0 for an exact replay.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from imagerl.algorithms.base import Algorithm, NonFiniteError, OptimizerClock, ema_decay, run_optimizer_steps, \
    stats_as_metrics
from imagerl.algorithms.registry import register_algorithm
from imagerl.config import Config
from imagerl.distributed.parallel import World
from imagerl.rollout import Rollout
from imagerl.sampling import flow_sde_step

__all__ = ["FlowGRPO", "NonFiniteError", "flow_grpo_update", "grpo_guard_loss", "kl_to_reference", "ppo_clip_loss"]


def ppo_clip_loss(log_prob_B, old_log_prob_B, advantages_B, clip_range: float, adv_clip_max: float):
    """Per-sample clipped surrogate (to minimise) and the ratio."""
    adv = advantages_B.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob_B - old_log_prob_B)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped), ratio


def grpo_guard_loss(log_prob_B, old_log_prob_B, mean_BNC, old_mean_BNC, std_dev_t, sqrt_neg_dt, advantages_B,
                    clip_range: float, adv_clip_max: float):
    """GRPO-Guard (arXiv 2510.22319, as verl-omni's compute_diffusion_loss_grpo_guard): per-sample clipped surrogate
    (to minimise) and the ratio. With scale = sqrt(-dt) sigma_t, the transition's std,
      b     = mean (mu - mu_old)^2 / (2 scale^2)               (the ratio-mean bias)
      ratio = exp((log p - log p_old + b) scale)                = exp(mean((mu - mu_old) eps)) for sde log-probs
      loss  = max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)) / (-dt)
    so the ratio is centred whatever the step's noise, and every step's gradient has the same scale."""
    adv = advantages_B.clamp(-adv_clip_max, adv_clip_max)
    scale = sqrt_neg_dt * std_dev_t
    dims = tuple(range(1, mean_BNC.ndim))
    bias = ((mean_BNC - old_mean_BNC) ** 2).mean(dim=dims) / (2 * scale**2)
    ratio = torch.exp((log_prob_B - old_log_prob_B + bias) * scale)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range))
    return surrogate / sqrt_neg_dt**2, ratio


def kl_to_reference(mean_BNC, mean_ref_BNC, std_dev_t) -> torch.Tensor:
    """flow_grpo's KL estimate per sample: element-mean squared mean difference / (2 std_dev_t^2)."""
    sq = ((mean_BNC - mean_ref_BNC) ** 2).mean(dim=tuple(range(1, mean_BNC.ndim)))
    return sq / (2 * std_dev_t.reshape(-1) ** 2)


@dataclass
class TrainStats:
    loss: float
    policy_loss: float
    kl_loss: float
    clipfrac: float
    approx_kl: float
    ratio_abs_minus_1: float
    log_prob_mean_abs_diff: float
    grad_norm: float
    num_optimizer_steps: int
    ema_decay: float = math.nan  # train.ema: the EMA's last decay

    as_metrics = stats_as_metrics


def _step_log_prob(adapter, rollout: Rollout, batch: slice, j: int, cond, cfg: Config):
    s = cfg.sample
    # .to(): a no-op unless train.timestep_staging left the trajectory on the CPU (then this step's inputs are
    # copied now, just before their forward; fp32 both ways, so the replay stays exact)
    x = rollout.latents_BSNC[batch, j].to(adapter.device)
    v = adapter.velocity(x, rollout.timesteps_S[j].expand(x.shape[0]), cond, s.height, s.width)
    return flow_sde_step(x, v, rollout.sigmas_S[j], rollout.sigmas_next_S[j], noise_level=s.noise_level,
                         sigma_max=rollout.sigma_max, sde_type=s.sde_type, cps_log_prob=s.cps_log_prob,
                         prev_sample=rollout.next_latents_BSNC[batch, j].to(adapter.device))


def training_order(batches: list[slice], seed: int, rollout_step: int, rank: int) -> list[slice]:
    """train.shuffle_batches: the rollout's batches in a permutation seeded by (seed, rollout, rank)."""
    from imagerl.distributed.rng import make_generator

    perm = torch.randperm(len(batches), generator=make_generator(seed, "train_batch_order", rollout_step, rank))
    return [batches[i] for i in perm.tolist()]


def kept_per_step(advantages_B: torch.Tensor, batches: list[slice], num_optimizer_steps: int) -> list[int]:
    """train.drop_zero_advantage: the samples with a nonzero advantage in each optimizer step's batches."""
    per_step = len(batches) // num_optimizer_steps
    nonzero = (advantages_B != 0).cpu()
    return [sum(int(nonzero[b].sum()) for b in batches[k * per_step: (k + 1) * per_step])
            for k in range(num_optimizer_steps)]


def flow_grpo_update(adapter, rollout: Rollout, advantages_B: torch.Tensor, optimizer: torch.optim.Optimizer,
                     cfg: Config, world: World, progress=None, after_step=None, rollout_step: int = 0,
                     policy_loss=None) -> TrainStats:
    """policy_loss(out, old_log_prob_B, old_mean_BNC, sqrt_neg_dt, advantages_B) -> (per-sample loss, ratio, clipped:
    the samples the clipfrac counts); default: train.ratio's (the PPO clip or GRPO-Guard). Flow-DPPO (dppo.py) gives
    its own."""
    t = cfg.train
    if policy_loss is None:
        def policy_loss(out, old, old_mean, sqrt_neg_dt, adv):
            if t.ratio == "grpo_guard":
                loss_B, ratio = grpo_guard_loss(out.log_prob, old, out.mean, old_mean, out.std_dev_t, sqrt_neg_dt, adv,
                                                t.clip_range, t.adv_clip_max)
            else:
                loss_B, ratio = ppo_clip_loss(out.log_prob, old, adv, t.clip_range, t.adv_clip_max)
            return loss_B, ratio, (ratio - 1).abs() > t.clip_range
    params = adapter.trainable_parameters()
    batches = rollout.batches()
    if t.shuffle_batches:
        batches = training_order(batches, cfg.run.seed, rollout_step, world.rank)
    per_step = len(batches) // t.num_optimizer_steps
    num_steps_window = rollout.latents_BSNC.shape[1]
    micro = per_step * num_steps_window
    advantages_B = advantages_B.to(adapter.device, torch.float32)
    kept = kept_per_step(advantages_B, batches, t.num_optimizer_steps) if t.drop_zero_advantage else None
    # loss, policy, kl, clipfrac, approx_kl, |ratio-1|, count, on-policy |diff|, on-policy count: summed on the
    # device, read once after the loop (no host sync per micro-step)
    sums = torch.zeros(9, dtype=torch.float64, device=adapter.device)

    def train_batch(opt_step: int, batch: slice) -> None:
        nonlocal sums
        cond = rollout.conditioning(adapter, batch, cfg.sample.guidance_scale)
        for j in range(num_steps_window):
            out = _step_log_prob(adapter, rollout, batch, j, cond, cfg)
            old = rollout.log_probs_BS[batch, j].to(adapter.device)
            sqrt_neg_dt = (rollout.sigmas_S[j] - rollout.sigmas_next_S[j]).sqrt()
            old_mean = rollout.means_BSNC[batch, j].to(adapter.device) if rollout.means_BSNC is not None else None
            policy_B, ratio, clipped_B = policy_loss(out, old, old_mean, sqrt_neg_dt, advantages_B[batch])
            kl_B = torch.zeros_like(policy_B)
            if t.beta > 0:
                with torch.no_grad(), adapter.lora_disabled():
                    ref = _step_log_prob(adapter, rollout, batch, j, cond, cfg)
                kl_B = kl_to_reference(out.mean, ref.mean, out.std_dev_t)
            loss = policy_B.mean() + t.beta * kl_B.mean()
            if kept is None:
                (loss / micro).backward()
            else:  # the mean over the step's kept samples and the S window steps (module docstring)
                keep_B = advantages_B[batch] != 0
                (torch.where(keep_B, policy_B + t.beta * kl_B, 0.0).sum()
                 / (max(kept[opt_step], 1) * num_steps_window)).backward()
            with torch.no_grad():
                diff = (out.log_prob - old).double()
                n = diff.numel()
                on = float(opt_step == 0)
                sums += torch.stack([loss.detach().double() * n, policy_B.sum().double(), kl_B.sum().double(),
                                     clipped_B.double().sum(), (0.5 * diff**2).sum(),
                                     (ratio - 1).abs().double().sum(), diff.new_tensor(n),
                                     on * diff.abs().sum(), diff.new_tensor(on * n)])
            if progress is not None:
                progress.update(1)

    grad_norms = run_optimizer_steps(adapter, optimizer, world, params, batches, t.num_optimizer_steps,
                                     t.max_grad_norm, train_batch, after_step)

    totals = world.all_reduce_mean_(sums.to(world.device)).cpu()  # equal counts per rank: mean of sums is fine
    count = totals[6].item()
    return TrainStats(
        loss=totals[0].item() / count, policy_loss=totals[1].item() / count, kl_loss=totals[2].item() / count,
        clipfrac=totals[3].item() / count, approx_kl=totals[4].item() / count,
        ratio_abs_minus_1=totals[5].item() / count, log_prob_mean_abs_diff=totals[7].item() / max(totals[8].item(), 1),
        grad_norm=sum(grad_norms) / len(grad_norms), num_optimizer_steps=t.num_optimizer_steps,
    )


@register_algorithm
class FlowGRPO(Algorithm):
    """train.algorithm=flow_grpo for the loop (train.py): SDE-window rollouts with old log-probs, then the update."""

    name = "flow_grpo"
    rollout = "sde"

    def __init__(self, cfg: Config, adapter):
        super().__init__(cfg, adapter)
        self.ema = None
        if cfg.train.ema:  # flow_grpo's train.ema (EMAModuleWrapper): evaluation and exports use an EMA of the policy
            from imagerl.algorithms.lora_states import LoraStates

            self.param_names = [name for name, p in adapter.transformer.named_parameters() if p.requires_grad]
            self.ema = LoraStates(adapter.trainable_parameters(), ("ema",))
        self.clock = OptimizerClock()  # the EMA's clock, saved with it

    @classmethod
    def console_metrics(cls, cfg: Config) -> tuple[str, ...]:
        # One optimizer step per rollout is on-policy (ratio exactly 1): clipfrac and approx_kl are 0. The loss is
        # then minus the mean (clipped) advantage, often 0 up to rounding, but it moves with the KL term and with
        # train.adv_clip_max clipping, so it stays; grad_norm shows the update, the replay's |log-prob diff| that
        # the ratio is 1.
        off_policy = cfg.train.num_optimizer_steps > 1
        return ("train/loss", *(("train/clipfrac", "train/approx_kl") if off_policy else ()),
                "train/grad_norm", "train/log_prob_mean_abs_diff")

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        from imagerl.sampling.window import OFF_WINDOW_SOLVERS, validate_window

        s, t = cfg.sample, cfg.train
        if s.sde_type not in ("sde", "cps"):
            raise ValueError(f"sample.sde_type must be 'sde' or 'cps', got {s.sde_type!r}")
        if s.cps_log_prob not in ("flow_grpo", "gaussian"):
            raise ValueError(f"sample.cps_log_prob must be 'flow_grpo' or 'gaussian', got {s.cps_log_prob!r}")
        if t.ema and not 0 <= t.ema_cap < 1:
            raise ValueError(f"train.ema_cap must be in [0, 1) (a decay of 1 never moves), got {t.ema_cap}")
        for key in ("ema_update_interval", "ema_repeats"):
            value = getattr(t, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"train.{key} must be an int >= 1 (1: every optimizer step, once), got {value!r}")
        if t.ratio not in ("standard", "grpo_guard"):
            raise ValueError(f"train.ratio must be 'standard' or 'grpo_guard', got {t.ratio!r}")
        if t.ratio == "grpo_guard" and s.sde_type != "sde":
            raise ValueError("train.ratio=grpo_guard scales the ratio by the sde step's sqrt(-dt) sigma_t: it needs "
                             f"sample.sde_type=sde (got {s.sde_type})")
        if s.noise_level <= 0:
            raise ValueError(f"sample.noise_level must be > 0 for training (got {s.noise_level}); 0 is the ODE")
        if len(s.sde_window_range) != 2:
            raise ValueError(f"sample.sde_window_range must be [lo, hi], got {s.sde_window_range}")
        validate_window(s.num_steps, s.num_sde_steps, tuple(s.sde_window_range), s.sde_window_start)
        if s.sde_window_schedule not in ("fixed", "sliding"):
            raise ValueError(f"sample.sde_window_schedule must be 'fixed' or 'sliding', got {s.sde_window_schedule!r}")
        if s.off_window_solver not in OFF_WINDOW_SOLVERS:
            raise ValueError(f"sample.off_window_solver must be one of {', '.join(OFF_WINDOW_SOLVERS)}, got "
                             f"{s.off_window_solver!r}")
        if s.post_window_ratio is not None:
            if isinstance(s.post_window_ratio, bool) or not 0 < s.post_window_ratio <= 1:
                raise ValueError(f"sample.post_window_ratio must be null or in (0, 1] (MixGRPO-Flash: 0.4), got "
                                 f"{s.post_window_ratio!r}")
            if s.post_window_steps is not None:
                raise ValueError("sample.post_window_steps and sample.post_window_ratio both set: keep one (a fixed "
                                 "count, or MixGRPO's compress ratio)")
        if s.post_window_steps is not None and (isinstance(s.post_window_steps, bool) or s.post_window_steps < 1):
            raise ValueError(f"sample.post_window_steps must be null (the schedule's steps) or an int >= 1, got "
                             f"{s.post_window_steps!r}")
        if s.sde_window_schedule == "sliding":
            if s.sde_window_stride < 1 or s.sde_window_period < 1:
                raise ValueError(f"sample.sde_window_stride ({s.sde_window_stride}) and sample.sde_window_period "
                                 f"({s.sde_window_period}) must be >= 1 with sample.sde_window_schedule=sliding")
            if s.sde_window_direction not in ("forward", "backward"):
                raise ValueError("sample.sde_window_direction must be 'forward' or 'backward', got "
                                 f"{s.sde_window_direction!r}")

    def generate(self, adapter, groups, step: int, progress=None, on_batch=None) -> Rollout:
        from imagerl.rollout import generate
        from imagerl.sampling import sde_window
        from imagerl.sampling.window import Sliding

        s = self.cfg.sample
        sliding = Sliding(s.sde_window_stride, s.sde_window_period, 1 if s.sde_window_direction == "forward" else -1) \
            if s.sde_window_schedule == "sliding" else None
        window = sde_window(s.num_sde_steps, tuple(s.sde_window_range), s.sde_window_start, seed=self.cfg.run.seed,
                            rollout_step=step, sliding=sliding)
        return generate(adapter, groups, self.cfg, step, window, progress=progress, on_batch=on_batch)

    def update(self, adapter, rollout: Rollout, advantages_B, optimizer, world: World, step: int,
               progress=None) -> TrainStats:
        return self._update(adapter, rollout, advantages_B, optimizer, world, step, progress)

    def _update(self, adapter, rollout: Rollout, advantages_B, optimizer, world: World, step: int, progress=None,
                policy_loss=None) -> TrainStats:
        """The update with this policy objective (flow_grpo_update's policy_loss; None: train.ratio's)."""
        after_step, decays, t = None, [], self.cfg.train
        if self.ema is not None:
            done = int(self.clock)

            def after_step(opt_step: int) -> None:
                # flow_grpo's EMAModuleWrapper.step(parameters, k) with k the optimizer steps done: an update when
                # (k + 1) % update_step_interval == 0, decay min((1 + k) / (10 + k), cap); train_sd3.py calls it after
                # every training batch, so each update lands once per batch of the optimizer step (ema_repeats).
                # Its repeats after the first fall on the next step's batches, before that step's optimizer step, where
                # the weights are the same: applying them here is the same arithmetic, and no evaluation comes between
                # unless a rollout ends on such a k (never with flow_grpo's 2 steps per rollout: k is then even)
                k = done + opt_step + 1
                if (k + 1) % t.ema_update_interval == 0:
                    decays.append(ema_decay(k, t.ema_cap))
                    for _ in range(t.ema_repeats):
                        self.ema.blend_toward_policy("ema", decays[-1])

        stats = flow_grpo_update(adapter, rollout, advantages_B, optimizer, self.cfg, world, progress=progress,
                                 after_step=after_step, rollout_step=step, policy_loss=policy_loss)
        self.clock.advance(self.cfg.train.num_optimizer_steps)
        if decays:
            stats.ema_decay = decays[-1]
        return stats

    def forwards_per_update(self, batches_per_rank: int) -> int:
        return batches_per_rank * self.cfg.sample.num_sde_steps

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        return {"rollout/sde_window_start": rollout.window.start}

    def evaluation_weights(self):
        """The weights evaluation and exports use: the EMA (train.ema), else the policy's."""
        return self.ema.swapped_in("ema") if self.ema is not None else contextlib.nullcontext()

    def checkpoint_state(self) -> dict:
        """Tensors beside the LoRA and optimizer in a checkpoint: the EMA and its clock (train.ema), else none."""
        if self.ema is None:
            return {}
        return {"flow_grpo": {**self.ema.state_dict(self.param_names), "optimizer_steps": self.clock.optimizer_steps}}
