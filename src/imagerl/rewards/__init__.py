"""Rewards: one file per reward, a registry, and the weighted scorer that checks every value."""

from imagerl.rewards.ocr import ocr_reward
from imagerl.rewards.registry import REWARDS, RewardBatch, RewardError, Scorer, register_reward

__all__ = ["REWARDS", "RewardBatch", "RewardError", "Scorer", "ocr_reward", "register_reward"]
