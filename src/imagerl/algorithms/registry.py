"""Algorithm registry: train.algorithm name -> class (the contract: algorithms/base.py).

The bundled algorithms register when their module is imported; `_import_builtin` imports them on first use, so
that a name lookup never depends on what happened to be imported before. A plugin registers its own class with
@register_algorithm before the config is checked.
"""

from __future__ import annotations

ALGORITHMS: dict[str, type] = {}
BUILTIN = ("flow_grpo", "diffusion_nft", "awm", "dppo")  # listed first, in this order, whatever was imported first


def register_algorithm(cls):
    """Class decorator: make `cls` available as train.algorithm=cls.name."""
    if cls.rollout not in ("sde", "clean"):
        raise ValueError(f"algorithm {cls.name!r}: rollout must be 'sde' or 'clean', got {cls.rollout!r}")
    ALGORITHMS[cls.name] = cls
    return cls


def _import_builtin() -> None:
    from imagerl.algorithms import awm, diffusion_nft, dppo, flow_grpo  # noqa: F401  (registration on import)


def algorithm_names() -> list[str]:
    _import_builtin()
    return [*BUILTIN, *(name for name in ALGORITHMS if name not in BUILTIN)]


def algorithm_class(name: str) -> type:
    """The class registered as `name`; ValueError listing the registered names otherwise."""
    _import_builtin()
    if name not in ALGORITHMS:
        raise ValueError(f"train.algorithm must be one of {', '.join(algorithm_names())}, got {name!r}")
    return ALGORITHMS[name]


def make_algorithm(cfg, adapter):
    """The train.algorithm object for this adapter (after its LoRA is added and sharded)."""
    return algorithm_class(cfg.train.algorithm)(cfg, adapter)
