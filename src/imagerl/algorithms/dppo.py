"""Flow-DPPO (divergence PPO for flow models): Flow-GRPO with its ratio clip replaced by a trust-region mask on the
exact KL between the old and new Gaussian SDE transitions. Transcribed from verl-omni (github.com/verl-project/
verl-omni at a1139ba, verl_omni/trainer/diffusion/diffusion_algos.py FlowDPPOLoss, lines 361-463; its Qwen-Image
example examples/flowdppo_trainer/qwen_image/run_qwen_image_ocr_lora.sh), which names Tencent-Hunyuan/UniRL's
unirl/algorithms/flowdppo.py as the reference implementation.

Rollouts and the replay are Flow-GRPO's (the SDE window, old log-probs, the same CFG); per sample i and window step k,
with mu the step's SDE mean at the current weights, mu_old the rollout's and sigma_t = std_dev_t sqrt(-dt) the
transition's std (both transitions share it):

  ratio = exp(log p - log p_old)
  D     = mean_elements (mu - mu_old)^2 / (2 sigma_t^2)          the Gaussian KL, mean- not sum-reduced (lines 402-411)
  drop  = D >= dppo.kl_threshold  and  (ratio > 1 and A > 0  or  ratio < 1 and A < 0)       (lines 413-418)
  loss  = mean where(drop, 0, -A ratio)                            no ratio clip, no advantage clamp (lines 399-423)

so an update is dropped only where it is far from the old policy and moving further the way the advantage pushes;
corrective and near updates keep the full gradient. In a rollout's first optimizer step the policy is the rollout's
(ratio 1, D 0): the mask acts from the second step on (both published recipes take 2 per rollout). mu_old is the
rollout's own step mean, which imagerl's exact replay makes the pre-update weights' (verl-omni recomputes it before
the update). train/clipfrac counts the dropped (sample, step) pairs. The KL formula assumes the Flow-SDE transition:
sample.sde_type must be sde, as verl-omni requires.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from imagerl.algorithms.flow_grpo import FlowGRPO
from imagerl.algorithms.registry import register_algorithm
from imagerl.config import Config


@dataclass
class DPPOTerms:
    loss: torch.Tensor  # (B,) per-sample loss (0 where dropped)
    ratio: torch.Tensor
    dropped: torch.Tensor  # (B,) bool
    divergence: torch.Tensor  # (B,) D


def dppo_loss(log_prob_B, old_log_prob_B, mean_BNC, old_mean_BNC, std_dev_t, sqrt_neg_dt, advantages_B,
              kl_threshold: float) -> DPPOTerms:
    """Flow-DPPO's masked objective per sample (module docstring)."""
    advantages = advantages_B.detach()
    ratio = torch.exp(log_prob_B - old_log_prob_B)
    unclipped = -advantages * ratio
    sigma_t = (std_dev_t * sqrt_neg_dt).reshape(-1, *([1] * (mean_BNC.ndim - 1)))
    divergence = ((mean_BNC - old_mean_BNC) ** 2 / (2 * sigma_t**2)).mean(dim=tuple(range(1, mean_BNC.ndim)))
    high = divergence >= kl_threshold
    dropped = (high & (ratio > 1.0) & (advantages > 0)) | (high & (ratio < 1.0) & (advantages < 0))
    loss = torch.where(~dropped.detach(), unclipped, torch.zeros((), dtype=unclipped.dtype, device=unclipped.device))
    return DPPOTerms(loss, ratio, dropped, divergence.detach())


@register_algorithm
class FlowDPPO(FlowGRPO):
    """train.algorithm=dppo: Flow-GRPO's rollouts and replay with Flow-DPPO's masked objective."""

    name = "dppo"
    rollout = "sde"
    keeps_step_means = True  # the rollout keeps each window step's mean: mu_old of the divergence

    @classmethod
    def check_config(cls, cfg: Config) -> None:
        super().check_config(cfg)
        if cfg.sample.sde_type != "sde":
            raise ValueError("train.algorithm=dppo: its divergence is the KL of the Flow-SDE's Gaussian transitions; "
                             f"set sample.sde_type=sde (got {cfg.sample.sde_type})")
        if cfg.train.ratio != "standard":
            raise ValueError(f"train.ratio={cfg.train.ratio} is Flow-GRPO's; Flow-DPPO has no ratio clip: remove it")
        if not (math.isfinite(cfg.dppo.kl_threshold) and cfg.dppo.kl_threshold > 0):
            raise ValueError(f"dppo.kl_threshold must be > 0, got {cfg.dppo.kl_threshold}")

    @classmethod
    def console_metrics(cls, cfg: Config) -> tuple[str, ...]:
        masked = cfg.train.num_optimizer_steps > 1
        return ("train/loss", *(("train/clipfrac",) if masked else ()), "train/grad_norm",
                "train/log_prob_mean_abs_diff")

    def update(self, adapter, rollout, advantages_B, optimizer, world, step: int, progress=None):
        threshold = self.cfg.dppo.kl_threshold

        def policy_loss(out, old, old_mean, sqrt_neg_dt, adv):
            terms = dppo_loss(out.log_prob, old, out.mean, old_mean, out.std_dev_t, sqrt_neg_dt, adv, threshold)
            return terms.loss, terms.ratio, terms.dropped

        return self._update(adapter, rollout, advantages_B, optimizer, world, step, progress, policy_loss)
