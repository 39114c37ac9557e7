"""Group advantages and the two policy updates. The loop (train.py) sees an algorithm through six methods:
generate (the rollout it needs), update, forwards_per_update (progress), rollout_metrics, evaluation_weights
(what eval and exports use) and checkpoint_state (tensors it keeps beside the LoRA)."""

from __future__ import annotations


def make_algorithm(cfg, adapter):
    """The train.algorithm object for this adapter (after its LoRA is added and sharded)."""
    if cfg.train.algorithm == "diffusion_nft":
        from imagerl.algorithms.diffusion_nft import DiffusionNFT

        return DiffusionNFT(cfg, adapter)
    from imagerl.algorithms.flow_grpo import FlowGRPO

    return FlowGRPO(cfg, adapter)
