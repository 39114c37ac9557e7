"""The algorithm contract: what the training loop (train.py) and the benchmark need from an RL algorithm, and the
update skeleton every algorithm shares.

An algorithm is a class registered by name (`@register_algorithm`, algorithms/registry.py) and chosen with
`train.algorithm=<name>`. The loop sees it through these members, and nothing else:

  name                    the train.algorithm value
  rollout                 what it needs from sampling: "sde" (an SDE window with the old log-probs of its steps,
                          rollout.Rollout) or "clean" (the final samples only, rollout.CleanRollout)
  check_config(cfg)       (classmethod) its settings checks, run by validation.validate before any model loads;
                          ValueError with what to change
  __init__(cfg, adapter)  after the LoRA is added and sharded; allocates its states (old policy, EMA)
  generate(adapter, groups, step, progress, on_batch) -> the rollout it trains on (on_batch: scoring overlap)
  update(adapter, rollout, advantages_B, optimizer, world, step, progress) -> stats with .as_metrics()
                          ({"train/<field>": value}; docs/metrics.md documents every key); NonFiniteError before an
                          optimizer step whose loss or gradient is not finite (the weights stay the last good ones)
  forwards_per_update(batches_per_rank) -> int   training forwards of one update (the progress bar's total)
  trained_steps(cfg) -> int                      (classmethod) timesteps trained per image (the CPU time estimate)
  rollout_metrics(rollout) -> dict               extra rollout/* metrics (default none)
  evaluation_weights()    context manager: the weights evaluation and lora/ exports use (an EMA), else the policy
  checkpoint_state()      {section: {name: tensor}} kept beside the LoRA and optimizer in checkpoints and loaded into
                          in place on resume (its states and its optimizer-step clock); {} when it has none

What every algorithm must guarantee, checked for each registered one by tests/test_algorithm_contract.py: lr 0
moves nothing; a resume mid-run continues bit for bit; 1 and 2 gloo processes agree (LoRA within 1e-6 after two
rollouts at lr 1e-4); a non-finite loss stops the run with the last checkpoint intact; every logged metric is
documented. docs/adding_an_algorithm.md walks through adding one.
"""

from __future__ import annotations

import abc
import contextlib
import math
from typing import ClassVar

import torch

from imagerl.distributed.parallel import World


class NonFiniteError(ValueError):
    """A NaN/inf loss or gradient: the update stops before the optimizer step, the weights stay the last good ones."""


def stats_as_metrics(stats) -> dict[str, float]:
    """{"train/<field>": value} of a stats dataclass."""
    return {f"train/{k}": v for k, v in stats.__dict__.items()}


def ema_decay(k: int, cap: float) -> float:
    """An evaluation EMA's decay at optimizer step k >= 1: min((1 + k) / (10 + k), cap) (flow_grpo's and NVlabs'
    EMAModuleWrapper.get_current_decay)."""
    return min((1 + k) / (10 + k), cap)


def evaluation_ema_step(states, enabled: bool, cap: float, steps_before: int, decays: list):
    """An after_step for run_optimizer_steps: the evaluation EMA (LoRA state "ema") <- e EMA + (1 - e) theta with
    e = ema_decay(k, cap), k the optimizer steps so far; each e is appended to `decays`. A no-op when not enabled."""
    def after_step(opt_step: int) -> None:
        if enabled:
            decays.append(ema_decay(steps_before + opt_step + 1, cap))
            states.blend_toward_policy("ema", decays[-1])

    return after_step


class OptimizerClock:
    """Optimizer steps taken so far: the clock of the EMA and old-policy decays. Counted, not derived from the
    rollout index (a resume may change train.num_optimizer_steps), and saved in checkpoints as the 0-d int64 tensor
    `optimizer_steps` of the algorithm's section (loaded into in place)."""

    def __init__(self):
        self.optimizer_steps = torch.zeros((), dtype=torch.int64)

    def __int__(self) -> int:
        return int(self.optimizer_steps)

    def advance(self, steps: int) -> None:
        self.optimizer_steps += steps


def global_clip_grad_norm_(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """clip_grad_norm_ over all ranks' shards: with FSDP2 the grads are DTensors and the returned total norm
    is a DTensor whose full_tensor() reduces the shards' partial norms (the same number on every rank). A
    non-finite norm (the same on every rank) raises NonFiniteError: call this before optimizer.step()."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not math.isfinite(value):
        raise NonFiniteError(f"the loss or its gradient is not finite (gradient norm {value}); the optimizer step "
                             "was not taken, the weights are unchanged")
    return value


def run_optimizer_steps(adapter, optimizer, world: World, params, batches: list, num_optimizer_steps: int,
                        max_grad_norm: float, train_batch, after_step=None) -> list[float]:
    """The update's skeleton, shared by the algorithms: train mode; per optimizer step zero the grads,
    train_batch(opt_step, batch) (its backward calls) over that step's equal share of `batches`, all-reduce,
    clip (NonFiniteError before a non-finite step), step, after_step(opt_step); then eval mode, grads freed.
    Returns the gradient norms before clipping."""
    per_step = len(batches) // num_optimizer_steps
    grad_norms = []
    adapter.transformer.train()
    for opt_step in range(num_optimizer_steps):
        optimizer.zero_grad(set_to_none=True)
        for batch in batches[opt_step * per_step: (opt_step + 1) * per_step]:
            train_batch(opt_step, batch)
        world.all_reduce_grads(params)  # a no-op under FSDP: backward already reduce-scattered the grads
        grad_norms.append(global_clip_grad_norm_(params, max_grad_norm))
        optimizer.step()
        if after_step is not None:
            after_step(opt_step)
    adapter.transformer.eval()
    optimizer.zero_grad(set_to_none=True)
    return grad_norms


class Algorithm(abc.ABC):
    """The contract (module docstring). Subclass it, set `name` and `rollout`, implement the abstract methods and
    register the class with @register_algorithm."""

    name: ClassVar[str]
    rollout: ClassVar[str]  # "sde" or "clean"

    def __init__(self, cfg, adapter):
        self.cfg = cfg

    @classmethod
    def check_config(cls, cfg) -> None:
        """Settings checks of this algorithm (validation.validate calls it); ValueError with what to change."""

    @abc.abstractmethod
    def generate(self, adapter, groups, step: int, progress=None, on_batch=None):
        """The rollout this algorithm trains on."""

    @abc.abstractmethod
    def update(self, adapter, rollout, advantages_B: torch.Tensor, optimizer, world: World, step: int,
               progress=None):
        """One update over the rollout; returns stats with .as_metrics()."""

    @abc.abstractmethod
    def forwards_per_update(self, batches_per_rank: int) -> int:
        """Training forwards of one update (the progress bar's total)."""

    @classmethod
    def trained_steps(cls, cfg) -> int:
        """Timesteps trained per image (the CPU time estimate): the SDE window's by default."""
        return cfg.sample.num_sde_steps

    def rollout_metrics(self, rollout) -> dict[str, float]:
        return {}

    @classmethod
    def console_metrics(cls, cfg) -> tuple[str, ...]:
        """The training metrics the console line shows after the rewards (metrics.jsonl has them all): ones that
        move, so that a line reads as training."""
        return ("train/loss", "train/grad_norm")

    def evaluation_weights(self):
        """The weights evaluation and exports use; the policy's by default."""
        return contextlib.nullcontext()

    def checkpoint_state(self) -> dict:
        """Tensors kept beside the LoRA and optimizer in checkpoints; none by default."""
        return {}
