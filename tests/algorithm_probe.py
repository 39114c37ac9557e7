"""One update of an algorithm on the tiny model at lr 0, recording the gradients its optimizer step saw: the probe of
the algorithms' whole-update tests (tests/test_diffusion_nft.py, test_awm.py, test_dppo.py)."""

from __future__ import annotations

import torch

from imagerl.algorithms.registry import algorithm_class
from imagerl.components import load_adapter, resolve_family_defaults
from imagerl.data.prompts import GroupSampler, bundled_prompt_file, load_prompt_set
from imagerl.distributed.parallel import World


class GradientRecorder(torch.optim.SGD):
    """SGD that keeps a copy of the gradients at each step (zeros for a parameter without one: the last block's
    text-stream LoRA feeds nothing)."""

    def __init__(self, params, lr: float = 0.0):
        super().__init__(params, lr=lr)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([torch.zeros_like(p) if p.grad is None else p.grad.clone()
                          for p in self.param_groups[0]["params"]])
        return super().step(closure)


def first_update(cfg, advantages_B: torch.Tensor, update=None):
    """(gradients of the first optimizer step, stats, rollout, algorithm, adapter) of one update of cfg's algorithm on
    rollout 0 of the bundled prompts at lr 0. update(adapter, algo, rollout, advantages, optimizer, world) -> stats
    runs it (default: algo.update)."""
    world = World(0, 1, torch.device("cpu"))
    adapter = load_adapter(cfg, world)
    resolve_family_defaults(cfg, adapter)
    algo = algorithm_class(cfg.train.algorithm)(cfg, adapter)
    groups = GroupSampler(load_prompt_set(bundled_prompt_file()), cfg.sample.prompts_per_rollout,
                          cfg.run.seed).groups_for(0)
    rollout = algo.generate(adapter, groups, 0)
    optimizer = GradientRecorder(adapter.trainable_parameters())
    if update is None:
        stats = algo.update(adapter, rollout, advantages_B, optimizer, world, 0)
    else:
        stats = update(adapter, algo, rollout, advantages_B, optimizer, world)
    return optimizer.seen[0], stats, rollout, algo, adapter
