"""imagerl: online reinforcement learning (Flow-GRPO, DiffusionNFT) for flow-matching text-to-image models."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"
# the public names and the modules that define them, imported on first use (PEP 562): `imagerl recipes` and
# `imagerl --help` then start without importing torch (seconds on a small CPU)
_PUBLIC = {
    "flow_sigmas": "imagerl.sampling",
    "flow_sde_step": "imagerl.sampling",
    "group_advantages": "imagerl.algorithms.advantages",
    "ocr_reward": "imagerl.rewards.ocr",
    "register_reward": "imagerl.rewards.registry",
    "resolve_family": "imagerl.families.registry",
}
__all__ = [*_PUBLIC, "__version__"]


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'imagerl' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})
