"""imagerl: online reinforcement learning (Flow-GRPO, DiffusionNFT) for flow-matching text-to-image models."""

from imagerl.algorithms.advantages import group_advantages
from imagerl.families.registry import resolve_family
from imagerl.rewards.ocr import ocr_reward
from imagerl.rewards.registry import register_reward
from imagerl.sampling import flow_sde_step, flow_sigmas

__version__ = "0.1.0"
__all__ = ["flow_sigmas", "flow_sde_step", "group_advantages", "ocr_reward", "register_reward", "resolve_family",
           "__version__"]
