"""RL algorithms behind one contract (base.py), registered by name (registry.py): Flow-GRPO (flow_grpo.py) and
DiffusionNFT (diffusion_nft.py); group advantages (advantages.py); the LoRA states they keep beside the policy
(lora_states.py)."""

from __future__ import annotations

from imagerl.algorithms.registry import algorithm_class, algorithm_names, make_algorithm, register_algorithm

__all__ = ["algorithm_class", "algorithm_names", "make_algorithm", "register_algorithm"]
