"""DiffusionNFT (negative-aware fine-tuning on the forward process; github.com/NVlabs/DiffusionNFT,
scripts/train_nft_sd3.py).

The `old` policy samples each rollout by a deterministic ODE (rollout.generate_clean); only the clean latents
x0 are kept. Rewards become optimality probabilities

  r = clamp(clip(A, -c, c) / c / 2 + 1/2, 0, 1)          c = train.adv_clip_max (5): r = A/10 + 1/2

and the policy is trained with the flow-matching loss on the forward process: for each sample, a permutation
of the sampler's timestep grid, the first floor(T x nft.timestep_fraction) of it, fresh noise eps per step,

  x_t = (1 - t) x0 + t eps,       v_old (old policy), v_theta (with grad), v_ref (adapters off; no grad)
  v+  = beta v_theta + (1 - beta) v_old           (implicit positive policy)
  v-  = (1 + beta) v_old - beta v_theta           (implicit negative: the reflection of v+ about v_old)
  x0+- = x_t - t v+-,   w+- = stopgrad mean|x0+- - x0| (float64, floored at nft.adaptive_weight_min)
  loss = c / beta [ r mean (x0+ - x0)^2 / w+  +  (1 - r) mean (x0- - x0)^2 / w- ]  +  ref_weight mean (v_theta - v_ref)^2

averaged over the batch; each (batch, step) backward is divided by batches_per_step x trained steps (the
gradient of the mean), gradients reduced over ranks, clipped, AdamW. After the rollout's optimizer steps,
old <- d old + (1 - d) theta with d = old_policy_decay(k) (k = optimizer steps so far); every optimizer step
the evaluation EMA <- e EMA + (1 - e) theta with e = min((1 + k) / (10 + k), nft.ema_cap).

Training forwards are conditional only (no CFG), as NVlabs' and verl-omni's: the rollout's guidance scale, when
a user sets one, shapes only the samples.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from imagerl.algorithms.base import (Algorithm, OptimizerClock, ema_decay, evaluation_ema_step, run_optimizer_steps,
                                     stats_as_metrics)
from imagerl.algorithms.registry import register_algorithm
from imagerl.config import Config
from imagerl.distributed.parallel import World
from imagerl.distributed.rng import make_generator
from imagerl.rollout import CleanRollout, batch_conditioning


def reward_probability(advantages_B: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clamp(clip(A, -c, c) / c / 2 + 1/2, 0, 1) (NVlabs: normalized_advantages_clip)."""
    a = advantages_B.clamp(-adv_clip_max, adv_clip_max)
    return ((a / adv_clip_max) / 2.0 + 0.5).clamp(0, 1)


def old_policy_decay(k: int, flat: int, rate: float, cap: float) -> float:
    """The old policy's decay after k optimizer steps (NVlabs return_decay): 0 before `flat`, then linear, capped."""
    return 0.0 if k < flat else min((k - flat) * rate, cap)


@dataclass
class NFTLossTerms:
    """Per-sample (B,) float64 terms: loss = policy + ref_weight * ref; w_pos / w_neg the adaptive weights."""

    loss: torch.Tensor
    policy: torch.Tensor
    ref: torch.Tensor
    w_pos: torch.Tensor
    w_neg: torch.Tensor


def nft_loss(v_theta: torch.Tensor, v_old: torch.Tensor, v_ref: torch.Tensor | None, x_t: torch.Tensor,
             x0: torch.Tensor, t_B: torch.Tensor, r_B: torch.Tensor, beta: float, ref_weight: float,
             adv_clip_max: float, weight_min: float) -> NFTLossTerms:
    """The DiffusionNFT loss per sample (module docstring); v_old and v_ref carry no gradient."""
    dims = tuple(range(1, x0.ndim))
    t = t_B.reshape(-1, *([1] * (x0.ndim - 1)))
    v_old = v_old.detach()
    positive = beta * v_theta + (1 - beta) * v_old
    negative = (1.0 + beta) * v_old - beta * v_theta

    def weighted_sq_error(v):
        x0_hat = x_t - t * v
        with torch.no_grad():
            w = (x0_hat.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=weight_min)
        return ((x0_hat - x0) ** 2 / w).mean(dim=dims), w.reshape(-1)

    pos, w_pos = weighted_sq_error(positive)
    neg, w_neg = weighted_sq_error(negative)
    r = r_B.double()
    policy = (r * pos / beta + (1.0 - r) * neg / beta) * adv_clip_max
    ref = ((v_theta - v_ref.detach()) ** 2).mean(dim=dims).double() if v_ref is not None else torch.zeros_like(policy)
    return NFTLossTerms(policy + ref_weight * ref, policy, ref, w_pos, w_neg)


@dataclass
class NFTStats:
    loss: float
    policy_loss: float
    ref_loss: float
    reward_prob_mean: float
    old_deviation: float  # mean |v_theta - v_old|: 0 while the policy is the sampling policy
    adaptive_weight_pos: float
    adaptive_weight_neg: float
    grad_norm: float
    num_optimizer_steps: int
    trained_timesteps: int
    old_decay: float
    ema_decay: float

    as_metrics = stats_as_metrics  # {"train/<field>": value}


def trained_timesteps(num_steps: int, fraction: float) -> int:
    """floor(T x fraction), at least 1 (NVlabs: int(10 x 0.99) = 9)."""
    return max(1, int(num_steps * fraction))


def timestep_order(seed: int, rollout_step: int, sample_ids: list[int], num_steps: int) -> torch.Tensor:
    """(B, T) long: each sample's permutation of the grid, keyed by its global index (rank- and batch-independent)."""
    return torch.stack([torch.randperm(num_steps, generator=make_generator(seed, "nft_timesteps", rollout_step, sid))
                        for sid in sample_ids])


def forward_noise(seed: int, rollout_step: int, sample_ids: list[int], j: int, like: torch.Tensor,
                  tag: str = "nft_noise") -> torch.Tensor:
    """Fresh noise for trained step j of each sample, keyed by (seed, tag, rollout step, global sample index, j)."""
    return torch.cat([torch.randn((1, *like.shape[1:]), generator=make_generator(seed, tag, rollout_step, sid, j))
                      for sid in sample_ids]).to(like.device)


def shuffled_batches(seed: int, rollout_step: int, sample_ids: list[int], group_size: int,
                     batch_size: int) -> list[list[int]]:
    """This rank's samples (local indices) in a seeded order, cut into training batches: NVlabs' train_nft_sd3.py
    shuffles a rollout's samples before splitting them over the optimizer steps. Here each group's K samples get a
    permutation keyed by (seed, rollout, group), and the samples are ordered by (position in their group's
    permutation, group), so every optimizer step trains the same share of every group, and (K divisible by
    train.num_optimizer_steps) the same samples on any number of ranks. Sample ids are g K + j (rollout.py)."""
    position = {}
    keys = []
    for row, sid in enumerate(sample_ids):
        group, j = divmod(sid, group_size)
        if group not in position:
            perm = torch.randperm(group_size, generator=make_generator(seed, "nft_order", rollout_step, group))
            position[group] = torch.argsort(perm).tolist()  # where each of the group's samples landed
        keys.append((position[group][j], group, row))
    order = [row for *_, row in sorted(keys)]
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def diffusion_nft_update(adapter, rollout: CleanRollout, advantages_B: torch.Tensor, optimizer, cfg: Config,
                         world: World, states, rollout_step: int, progress=None,
                         steps_before: int | None = None) -> NFTStats:
    """One rollout's optimizer steps, then the old-policy refresh. `states` (LoraStates) holds "old" and, with
    nft.ema, "ema"; steps_before: optimizer steps of the earlier rollouts (the clock of both decays; default
    rollout_step x train.num_optimizer_steps, right while that setting never changed). Returns the averaged
    statistics (all ranks)."""
    t, n, s = cfg.train, cfg.nft, cfg.sample
    params = adapter.trainable_parameters()
    if n.shuffle and t.num_optimizer_steps > 1:  # with one step every sample is in it: nothing to shuffle
        batches = shuffled_batches(cfg.run.seed, rollout_step, rollout.sample_ids_B, s.group_size, rollout.batch_size)
    else:
        batches = [list(range(b.start, b.stop)) for b in rollout.batches()]
    per_step = len(batches) // t.num_optimizer_steps
    steps_T = len(rollout.timesteps_T)
    num_trained = trained_timesteps(steps_T, n.timestep_fraction)
    micro = per_step * num_trained
    r_B = reward_probability(advantages_B.to(adapter.device, torch.float32), t.adv_clip_max)
    order_BT = timestep_order(cfg.run.seed, rollout_step, rollout.sample_ids_B, steps_T)
    done_before = rollout_step * t.num_optimizer_steps if steps_before is None else steps_before
    # the old policy is an exact copy of the policy until this update's first optimizer step when the last refresh
    # copied (decay 0) or there was none; derived from the schedule, so the same on every rank and after a resume
    def old_decay_at(k: int) -> float:
        return old_policy_decay(k, n.old_decay_flat, n.old_decay_rate, n.old_decay_cap)

    old_is_policy = done_before == 0 or old_decay_at(done_before) == 0.0
    # loss, policy, ref, r, |v - v_old|, w+, w-, count: summed on the device, read once after the loop
    sums = torch.zeros(8, dtype=torch.float64, device=adapter.device)
    ema_decays = []

    def train_batch(opt_step: int, rows: list[int]) -> None:
        nonlocal sums
        batch = torch.tensor(rows)
        cond = batch_conditioning(adapter, [rollout.text_B[i] for i in rows], None, 1.0)
        x0 = rollout.x0_BNC[batch].to(adapter.device)  # a copy from the CPU with train.timestep_staging
        ids = [rollout.sample_ids_B[i] for i in rows]
        r_batch = r_B[batch.to(r_B.device)]
        for j in range(num_trained):
            idx = order_BT[batch, j].to(rollout.sigmas_T.device)
            sigma_B, timestep_B = rollout.sigmas_T[idx], rollout.timesteps_T[idx]
            sig = sigma_B.to(adapter.device).reshape(-1, *([1] * (x0.ndim - 1)))
            x_t = (1 - sig) * x0 + sig * forward_noise(cfg.run.seed, rollout_step, ids, j, x0)
            reuse = old_is_policy and opt_step == 0  # the same weights bit for bit: the same velocity
            if not reuse:  # before the policy's forward: the swap writes the parameters its backward saves
                with torch.no_grad(), states.swapped_in("old"):
                    v_old = adapter.velocity(x_t, timestep_B, cond, s.height, s.width)
            v_ref = None
            if n.ref_weight > 0:
                with torch.no_grad(), adapter.lora_disabled():
                    v_ref = adapter.velocity(x_t, timestep_B, cond, s.height, s.width)
            v = adapter.velocity(x_t, timestep_B, cond, s.height, s.width)
            if reuse:
                v_old = v.detach()
            terms = nft_loss(v, v_old, v_ref, x_t, x0, sigma_B.to(adapter.device), r_batch, n.beta,
                             n.ref_weight, t.adv_clip_max, n.adaptive_weight_min)
            (terms.loss.mean() / micro).backward()
            with torch.no_grad():
                k = terms.loss.numel()
                dev = (v - v_old).abs().mean(dim=tuple(range(1, v.ndim))).double()
                sums += torch.stack([terms.loss.detach().sum(), terms.policy.detach().sum(), terms.ref.sum(),
                                     r_batch.double().sum(), dev.sum(), terms.w_pos.sum(), terms.w_neg.sum(),
                                     sums.new_tensor(k)])
            if progress is not None:
                progress.update(1)

    grad_norms = run_optimizer_steps(adapter, optimizer, world, params, batches, t.num_optimizer_steps,
                                     t.max_grad_norm, train_batch,
                                     evaluation_ema_step(states, n.ema, n.ema_cap, done_before, ema_decays))
    decay = old_decay_at(done_before + t.num_optimizer_steps)
    states.blend_toward_policy("old", decay)

    totals = world.all_reduce_mean_(sums.to(world.device)).cpu()  # equal counts per rank: mean of sums is fine
    count = totals[7].item()
    mean = [totals[i].item() / count for i in range(7)]
    return NFTStats(loss=mean[0], policy_loss=mean[1], ref_loss=mean[2], reward_prob_mean=mean[3],
                    old_deviation=mean[4], adaptive_weight_pos=mean[5], adaptive_weight_neg=mean[6],
                    grad_norm=sum(grad_norms) / len(grad_norms), num_optimizer_steps=t.num_optimizer_steps,
                    trained_timesteps=num_trained, old_decay=decay,
                    ema_decay=ema_decays[-1] if ema_decays else math.nan)


@register_algorithm
class DiffusionNFT(Algorithm):
    """train.algorithm=diffusion_nft for the loop (train.py): the old policy's ODE rollouts, the NFT update, the old
    policy and EMA states (saved in checkpoints; the EMA is what evaluation and lora/ exports use)."""

    name = "diffusion_nft"
    rollout = "clean"

    def __init__(self, cfg: Config, adapter):
        from imagerl.algorithms.lora_states import LoraStates

        super().__init__(cfg, adapter)
        self.param_names = [name for name, p in adapter.transformer.named_parameters() if p.requires_grad]
        self.states = LoraStates(adapter.trainable_parameters(), ("old", "ema") if cfg.nft.ema else ("old",))
        self.clock = OptimizerClock()  # the clock of the old-policy and EMA decays

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        """The nft section, and sampling settings that cannot work with deterministic ODE rollouts."""
        from imagerl.sampling.ode import ODE_SOLVERS

        n = cfg.nft
        if n.solver not in ODE_SOLVERS:
            raise ValueError(f"nft.solver must be one of {', '.join(ODE_SOLVERS)}, got {n.solver!r}")
        if not (math.isfinite(n.beta) and n.beta > 0):
            raise ValueError(f"nft.beta must be > 0 (the loss is scaled by 1/beta), got {n.beta}")
        if not 0 < n.timestep_fraction <= 1:
            raise ValueError(f"nft.timestep_fraction must be in (0, 1], got {n.timestep_fraction}")
        for key, value in {"nft.ref_weight": n.ref_weight, "nft.adaptive_weight_min": n.adaptive_weight_min,
                           "nft.old_decay_rate": n.old_decay_rate, "nft.old_decay_flat": n.old_decay_flat}.items():
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{key} must be a finite number >= 0, got {value}")
        for key, value in {"nft.old_decay_cap": n.old_decay_cap, "nft.ema_cap": n.ema_cap}.items():
            if not 0 <= value < 1:
                raise ValueError(f"{key} must be in [0, 1) (a decay of 1 never moves), got {value}")
        if n.adaptive_weight_min == 0:
            raise ValueError("nft.adaptive_weight_min must be > 0: it keeps the loss normaliser from dividing by zero")
        for key in ("drop_zero_advantage", "shuffle_batches", "ema"):
            if getattr(cfg.train, key):
                raise ValueError(f"train.{key} is Flow-GRPO's (flow_grpo's train_sd3.py); DiffusionNFT keeps every "
                                 "sample in rollout order and has its own EMA (nft.ema_cap): remove it or set it false")
        if cfg.sample.same_initial_noise:
            raise ValueError("sample.same_initial_noise=true with train.algorithm=diffusion_nft: deterministic ODE "
                             "rollouts from one noise give a group of identical images (zero advantages); set it false")

    def generate(self, adapter, groups, step: int, progress=None, on_batch=None) -> CleanRollout:
        from imagerl.rollout import generate_clean

        with self.states.swapped_in("old"):
            return generate_clean(adapter, groups, self.cfg, step, self.cfg.nft.solver, progress=progress,
                                  on_batch=on_batch)

    def update(self, adapter, rollout: CleanRollout, advantages_B, optimizer, world: World, step: int,
               progress=None) -> NFTStats:
        stats = diffusion_nft_update(adapter, rollout, advantages_B, optimizer, self.cfg, world, self.states, step,
                                     progress=progress, steps_before=int(self.clock))
        self.clock.advance(self.cfg.train.num_optimizer_steps)
        return stats

    @classmethod
    def trained_steps(cls, cfg: Config) -> int:
        return trained_timesteps(cfg.sample.num_steps, cfg.nft.timestep_fraction)

    def forwards_per_update(self, batches_per_rank: int) -> int:
        return batches_per_rank * self.trained_steps(self.cfg)

    def rollout_metrics(self, rollout: CleanRollout) -> dict[str, float]:
        return {}

    def evaluation_weights(self):
        """The EMA swapped in (nft.ema), else the policy."""
        return self.states.swapped_in("ema") if self.cfg.nft.ema else contextlib.nullcontext()

    def checkpoint_state(self) -> dict:
        """The old and EMA states by parameter name and the optimizer-step count; loaded into in place."""
        return {"nft": {**self.states.state_dict(self.param_names), "optimizer_steps": self.clock.optimizer_steps}}
