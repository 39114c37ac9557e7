"""Rewards: one file per reward, a registry, and the weighted scorer that checks every value."""

from imagerl.rewards.registry import REWARDS, RewardError, Scorer, register_reward

__all__ = ["REWARDS", "RewardError", "Scorer", "register_reward"]
