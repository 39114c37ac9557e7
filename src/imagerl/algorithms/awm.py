"""AWM, Advantage Weighted Matching (Xue et al., arXiv 2509.25050; the official code github.com/scxue/
advantage_weighted_matching at be51372, advantage_weighted_matching/scripts/train_sd3_awm.py, "train" below; its
configs config/dgx_awm.py and config/base_awm.py).

The pretraining flow-matching loss on the policy's own samples, weighted by the group advantage. The current policy
samples each rollout by a deterministic ODE (awm.solver); only the clean latents x0 are kept (train:1209). For each
sample, awm.num_timesteps indices of the sampler's grid, one per stratum of [s, floor(T x awm.timestep_fraction)),
s = 1 when awm.skip_first (time_type discrete_wo_init, the GenEval and OCR configs; 0: discrete, PickScore;
train:1172-1205), and fresh noise eps per (sample, index):

  x_t = (1 - t) x0 + t eps,    u = eps - x0,    mse = mean (v_theta(x_t, t) - u)^2          (float64, train:236-238)
  lp  = -((mse + 1e-10)^p - (1e-10)^p) t / p                  awm.weighting=ghuber, p = awm.ghuber_power (train:248)
        -mse                                                  awm.weighting=uniform
  A'  = clamp(A, -c, c) / c                                   c = train.adv_clip_max (5; advantage_max 1, train:1293)
  ratio = exp(lp - stopgrad lp) = 1                           on-policy: the old log-prob is this forward's (train:1282)
  policy = max(-A' ratio, -A' clamp(ratio, 0, 2))             clip_range 1 never acts: the value is -A', the gradient
                                                              -A' d lp, an advantage-weighted flow-matching gradient
  kl     = mean (v_theta - v_ref)^2                           v_ref: adapters off (train:1272-1275, 1330-1338)
  ema_kl = mean (v_theta - v_ema)^2                           v_ema: the "kl_ema" LoRA state (train:1276-1280)
  loss   = policy + awm.kl_weight kl + awm.ema_kl_weight ema_kl

averaged over the batch and the trained indices (train:1305-1354: the mean over a micro-batch's T x B rows, then
gradient accumulation over the micro-batches), gradients reduced over ranks, clipped, AdamW. As in the code, the KL
terms (both) are computed only when awm.kl_weight > 0 (train:1330 nests the EMA term under `beta > 0`). After the
rollout's optimizer steps the KL anchor moves: kl_ema <- d kl_ema + (1 - d) theta, d = min(rate k, cap), k =
optimizer steps so far (kl_ema_decay_type linear, train:1409-1419); every optimizer step the evaluation EMA <- e EMA +
(1 - e) theta, e = min((1 + k) / (10 + k), awm.ema_cap) (train:1391, one step per epoch there).

Where imagerl differs, and why: the official rollout is SA-Solver (14 steps, noise 0.4 for t in [0.3, 0.9] on GenEval
and OCR), which imagerl does not have; the ODE solvers here (Euler, as Flow-Factory's port src/flow_factory/
trainers/awm.py samples, or DPM-Solver++(2M)) keep AWM's point, a loss independent of the sampler. Each sample draws
its own stratified indices, keyed by its global index (the code draws one set per micro-batch): the same
distribution, and the same numbers on any number of ranks. The official loop skips training in its first two epochs
(a workaround, train:879-881); imagerl trains from the first rollout.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from imagerl.algorithms.base import (Algorithm, OptimizerClock, evaluation_ema_step, run_optimizer_steps,
                                     stats_as_metrics)
from imagerl.algorithms.diffusion_nft import forward_noise, old_policy_decay
from imagerl.algorithms.registry import register_algorithm
from imagerl.config import Config
from imagerl.distributed.parallel import World
from imagerl.distributed.rng import make_generator
from imagerl.rollout import CleanRollout, batch_conditioning

GHUBER_EPS = 1e-10  # train:248, inside the power and subtracted as (1e-10)^p so that mse 0 gives lp 0
CLIP_RANGE = 1.0  # dgx_awm.py clip_range for every task: ratio in [0, 2], which an on-policy ratio of 1 never leaves


def awm_timestep_indices(seed: int, rollout_step: int, sample_ids: list[int], num_steps: int, count: int,
                         fraction: float, skip_first: bool) -> torch.Tensor:
    """(B, count) long grid indices: stratum k of linspace(s, int(num_steps x fraction), count + 1) (cast to long) gives
    lower_k + floor(u (upper_k - lower_k)), u ~ U[0, 1) per sample (train:1197-1205)."""
    bounds = torch.linspace(1 if skip_first else 0, int(num_steps * fraction), count + 1).long()
    lower, upper = bounds[:-1], bounds[1:]
    rows = []
    for sid in sample_ids:
        u = torch.rand(count, generator=make_generator(seed, "awm_timesteps", rollout_step, sid))
        rows.append(lower + (u * (upper - lower)).long())
    return torch.stack(rows)


def scaled_advantages(advantages_B: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """A' = clamp(A, -c, c) / c (train:1293-1299, advantage_max 1)."""
    return advantages_B.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max


@dataclass
class AWMLossTerms:
    """Per-sample (B,) float64 terms of one trained index: loss = policy + kl_weight kl + ema_kl_weight ema_kl."""

    loss: torch.Tensor
    policy: torch.Tensor
    mse: torch.Tensor
    kl: torch.Tensor
    ema_kl: torch.Tensor


def awm_loss(v_theta: torch.Tensor, eps: torch.Tensor, x0: torch.Tensor, v_ref: torch.Tensor | None,
             v_ema: torch.Tensor | None, t_B: torch.Tensor, a_B: torch.Tensor, weighting: str, power: float,
             kl_weight: float, ema_kl_weight: float) -> AWMLossTerms:
    """The AWM loss per sample (module docstring); a_B the scaled advantages A'. The target eps - x0 is formed in
    float64, as the official code does (train:237)."""
    dims = tuple(range(1, v_theta.ndim))
    v = v_theta.double()
    mse = ((v - (eps.double() - x0.double())) ** 2).mean(dim=dims)
    if weighting == "ghuber":
        floor = torch.tensor(GHUBER_EPS, dtype=torch.float64, device=mse.device) ** power
        lp = -((mse + GHUBER_EPS) ** power - floor) * t_B.double() / power
    else:
        lp = -mse
    ratio = torch.exp(lp - lp.detach())
    a = a_B.double()
    policy = torch.maximum(-a * ratio, -a * ratio.clamp(1.0 - CLIP_RANGE, 1.0 + CLIP_RANGE))
    zero = torch.zeros_like(policy)
    kl = ((v - v_ref.detach().double()) ** 2).mean(dim=dims) if v_ref is not None else zero
    ema_kl = ((v - v_ema.detach().double()) ** 2).mean(dim=dims) if v_ema is not None else zero
    return AWMLossTerms(policy + kl_weight * kl + ema_kl_weight * ema_kl, policy, mse.detach(), kl, ema_kl)


@dataclass
class AWMStats:
    loss: float
    policy_loss: float
    flow_mse: float  # the unweighted flow-matching error mean (v_theta - (eps - x0))^2
    kl_loss: float
    ema_kl_loss: float
    advantage_abs_mean: float  # mean |A'| the loss weights by
    grad_norm: float
    num_optimizer_steps: int
    trained_timesteps: int
    kl_ema_decay: float
    ema_decay: float

    as_metrics = stats_as_metrics  # {"train/<field>": value}


def awm_update(adapter, rollout: CleanRollout, advantages_B: torch.Tensor, optimizer, cfg: Config, world: World,
               states, rollout_step: int, steps_before: int, progress=None) -> AWMStats:
    """One rollout's optimizer steps, then the KL anchor's refresh. `states` (LoraStates) holds "kl_ema" and, with
    awm.ema, "ema"; steps_before: optimizer steps of the earlier rollouts (the clock of both decays)."""
    t, a, s = cfg.train, cfg.awm, cfg.sample
    params = adapter.trainable_parameters()
    batches = [list(range(b.start, b.stop)) for b in rollout.batches()]
    per_step = len(batches) // t.num_optimizer_steps
    micro = per_step * a.num_timesteps
    adv_B = scaled_advantages(advantages_B.to(adapter.device, torch.float64), t.adv_clip_max)
    index_BK = awm_timestep_indices(cfg.run.seed, rollout_step, rollout.sample_ids_B, len(rollout.timesteps_T),
                                    a.num_timesteps, a.timestep_fraction, a.skip_first)
    kl_on = a.kl_weight > 0
    ema_kl_on = kl_on and a.ema_kl_weight > 0
    # loss, policy, flow mse, kl, ema kl, |A'|, count: summed on the device, read once after the loop
    sums = torch.zeros(7, dtype=torch.float64, device=adapter.device)
    ema_decays = []

    def train_batch(opt_step: int, rows: list[int]) -> None:
        nonlocal sums
        batch = torch.tensor(rows)
        cond = batch_conditioning(adapter, [rollout.text_B[i] for i in rows], None, 1.0)  # conditional (train.cfg off)
        x0 = rollout.x0_BNC[batch].to(adapter.device)
        ids = [rollout.sample_ids_B[i] for i in rows]
        a_batch = adv_B[batch.to(adv_B.device)]
        for j in range(a.num_timesteps):
            idx = index_BK[batch, j].to(rollout.sigmas_T.device)
            sigma_B, timestep_B = rollout.sigmas_T[idx], rollout.timesteps_T[idx]
            sig = sigma_B.to(adapter.device).reshape(-1, *([1] * (x0.ndim - 1)))
            eps = forward_noise(cfg.run.seed, rollout_step, ids, j, x0, tag="awm_noise")
            x_t = (1 - sig) * x0 + sig * eps
            # the KL anchor is the policy itself, bit for bit, until the first refresh moves it
            reuse = steps_before == 0 and opt_step == 0
            v_ema = None
            if ema_kl_on and not reuse:  # before the policy's forward: the swap writes the parameters it saves
                with torch.no_grad(), states.swapped_in("kl_ema"):
                    v_ema = adapter.velocity(x_t, timestep_B, cond, s.height, s.width)
            v_ref = None
            if kl_on:
                with torch.no_grad(), adapter.lora_disabled():
                    v_ref = adapter.velocity(x_t, timestep_B, cond, s.height, s.width)
            v = adapter.velocity(x_t, timestep_B, cond, s.height, s.width)
            if ema_kl_on and reuse:
                v_ema = v.detach()
            terms = awm_loss(v, eps, x0, v_ref, v_ema, sigma_B.to(adapter.device), a_batch, a.weighting,
                             a.ghuber_power, a.kl_weight, a.ema_kl_weight)
            (terms.loss.mean() / micro).backward()
            with torch.no_grad():
                sums += torch.stack([terms.loss.detach().sum(), terms.policy.detach().sum(), terms.mse.sum(),
                                     terms.kl.sum(), terms.ema_kl.sum(), a_batch.abs().sum(),
                                     sums.new_tensor(terms.loss.numel())])
            if progress is not None:
                progress.update(1)

    grad_norms = run_optimizer_steps(adapter, optimizer, world, params, batches, t.num_optimizer_steps,
                                     t.max_grad_norm, train_batch,
                                     evaluation_ema_step(states, a.ema, a.ema_cap, steps_before, ema_decays))
    decay = old_policy_decay(steps_before + t.num_optimizer_steps, 0, a.ema_kl_decay_rate, a.ema_kl_decay_cap)
    states.blend_toward_policy("kl_ema", decay)

    totals = world.all_reduce_mean_(sums.to(world.device)).cpu()  # equal counts per rank: mean of sums is fine
    count = totals[6].item()
    mean = [totals[i].item() / count for i in range(6)]
    return AWMStats(loss=mean[0], policy_loss=mean[1], flow_mse=mean[2], kl_loss=mean[3], ema_kl_loss=mean[4],
                    advantage_abs_mean=mean[5], grad_norm=sum(grad_norms) / len(grad_norms),
                    num_optimizer_steps=t.num_optimizer_steps, trained_timesteps=a.num_timesteps, kl_ema_decay=decay,
                    ema_decay=ema_decays[-1] if ema_decays else math.nan)


@register_algorithm
class AWM(Algorithm):
    """train.algorithm=awm for the loop (train.py): the policy's ODE rollouts, the AWM update, the KL anchor and EMA
    states (saved in checkpoints; the EMA is what evaluation and lora/ exports use)."""

    name = "awm"
    rollout = "clean"

    def __init__(self, cfg: Config, adapter):
        from imagerl.algorithms.lora_states import LoraStates

        super().__init__(cfg, adapter)
        self.param_names = [name for name, p in adapter.transformer.named_parameters() if p.requires_grad]
        self.states = LoraStates(adapter.trainable_parameters(), ("kl_ema", "ema") if cfg.awm.ema else ("kl_ema",))
        self.clock = OptimizerClock()

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        from imagerl.sampling.ode import ODE_SOLVERS

        a = cfg.awm
        if a.solver not in ODE_SOLVERS:
            raise ValueError(f"awm.solver must be one of {', '.join(ODE_SOLVERS)}, got {a.solver!r}")
        if a.weighting not in ("ghuber", "uniform"):
            raise ValueError(f"awm.weighting must be 'ghuber' or 'uniform', got {a.weighting!r}")
        if not (math.isfinite(a.ghuber_power) and a.ghuber_power > 0):
            raise ValueError(f"awm.ghuber_power must be > 0 (the loss divides by it), got {a.ghuber_power}")
        if not 0 < a.timestep_fraction <= 1:
            raise ValueError(f"awm.timestep_fraction must be in (0, 1], got {a.timestep_fraction}")
        span = int(cfg.sample.num_steps * a.timestep_fraction) - (1 if a.skip_first else 0)
        if a.num_timesteps < 1 or span < 1:
            raise ValueError(f"awm.num_timesteps must be >= 1 and sample.num_steps x awm.timestep_fraction must leave "
                             f"at least one index{' after the first (awm.skip_first)' if a.skip_first else ''}; got "
                             f"{a.num_timesteps} of {cfg.sample.num_steps} x {a.timestep_fraction:g}")
        for key, value in {"awm.kl_weight": a.kl_weight, "awm.ema_kl_weight": a.ema_kl_weight,
                           "awm.ema_kl_decay_rate": a.ema_kl_decay_rate}.items():
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{key} must be a finite number >= 0, got {value}")
        for key, value in {"awm.ema_kl_decay_cap": a.ema_kl_decay_cap, "awm.ema_cap": a.ema_cap}.items():
            if not 0 <= value < 1:
                raise ValueError(f"{key} must be in [0, 1) (a decay of 1 never moves), got {value}")
        for key in ("drop_zero_advantage", "shuffle_batches", "ema"):
            if getattr(cfg.train, key):
                raise ValueError(f"train.{key} is Flow-GRPO's (flow_grpo's train_sd3.py); AWM keeps every sample in "
                                 "rollout order and has its own EMA (awm.ema_cap): remove it or set it false")
        if cfg.sample.same_initial_noise:
            raise ValueError("sample.same_initial_noise=true with train.algorithm=awm: deterministic ODE rollouts from "
                             "one noise give a group of identical images (zero advantages); set it false")

    @classmethod
    def trained_steps(cls, cfg: Config) -> int:
        return cfg.awm.num_timesteps

    def generate(self, adapter, groups, step: int, progress=None, on_batch=None) -> CleanRollout:
        from imagerl.rollout import generate_clean

        return generate_clean(adapter, groups, self.cfg, step, self.cfg.awm.solver, progress=progress,
                              on_batch=on_batch)

    def update(self, adapter, rollout: CleanRollout, advantages_B, optimizer, world: World, step: int,
               progress=None) -> AWMStats:
        stats = awm_update(adapter, rollout, advantages_B, optimizer, self.cfg, world, self.states, step,
                           int(self.clock), progress=progress)
        self.clock.advance(self.cfg.train.num_optimizer_steps)
        return stats

    def forwards_per_update(self, batches_per_rank: int) -> int:
        return batches_per_rank * self.cfg.awm.num_timesteps

    @classmethod
    def console_metrics(cls, cfg) -> tuple[str, ...]:
        return ("train/flow_mse", "train/grad_norm")

    def evaluation_weights(self):
        return self.states.swapped_in("ema") if self.cfg.awm.ema else contextlib.nullcontext()

    def checkpoint_state(self) -> dict:
        return {"awm": {**self.states.state_dict(self.param_names), "optimizer_steps": self.clock.optimizer_steps}}
