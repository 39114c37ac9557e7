"""Build the run's components from a validated config: model path, family adapter with LoRA, optimizer."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from imagerl.config import Config
from imagerl.distributed.parallel import World

TINY_CHECKPOINTS = ("tiny", "tiny21", "tiny_sd3", "tiny_flux")  # the families' tiny_name (families/registry.tiny_families; a test checks)
BUNDLED_MODELS = {"quickstart": "quickstart-model"}  # in imagerl/assets; BUILD.json there says how it was made
NAMED_MODELS = {*TINY_CHECKPOINTS, *BUNDLED_MODELS}


def cache_dir() -> Path:
    return Path(os.environ.get("IMAGERL_CACHE", Path.home() / ".cache" / "imagerl"))


def resolve_model_path(spec: str, world: World | None = None) -> Path:
    """"tiny" / "tiny21" -> a tiny random Qwen-Image / Qwen-Image 2.1 checkpoint in the cache (built once,
    by rank 0); "quickstart" -> the pretrained model shipped in imagerl/assets; anything else is a
    checkpoint directory."""
    if spec in BUNDLED_MODELS or spec in TINY_CHECKPOINTS:
        _warn_if_shadowed(spec)
    if spec in BUNDLED_MODELS:
        from importlib import resources

        return Path(str(resources.files("imagerl") / "assets" / BUNDLED_MODELS[spec]))
    if spec not in TINY_CHECKPOINTS:
        return Path(spec).expanduser()
    from imagerl.families.registry import tiny_families

    family = tiny_families()[spec]
    path = cache_dir() / family.tiny_cache_name
    if world is None or world.is_main:
        from imagerl.families.model_defaults import DEFAULTS_FILE, TINY_DEFAULTS, write_model_defaults

        if not (path / "model_index.json").is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            family.build_tiny_checkpoint(path)
        if not (path / DEFAULTS_FILE).is_file():  # a size it can sample at (a cache built before: added now)
            write_model_defaults(path, **TINY_DEFAULTS)
    if world is not None:
        world.barrier()
    return path


_SHADOW_NOTED: set[str] = set()


def _warn_if_shadowed(name: str) -> None:
    """A shipped model name wins over a local directory of that name: say so (once a process) when one exists."""
    if name not in _SHADOW_NOTED and (Path(name) / "model_index.json").is_file():
        import sys

        _SHADOW_NOTED.add(name)
        print(f"imagerl: note: --model {name} is imagerl's built-in model {name}, not the checkpoint directory "
              f"./{name} here; to use the directory, pass ./{name}", file=sys.stderr)


def resolve_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec]


def load_adapter(cfg: Config, world: World):
    """The family adapter with a fresh LoRA (trainable params fp32) on world.device."""
    from imagerl.families.registry import family_class

    path = resolve_model_path(cfg.model.path, world)
    family = family_class(path, cfg.model.family)
    adapter = family.from_pretrained(path, world.device, resolve_dtype(cfg.model.dtype, world.device), cfg.model.prompt_cache_size)
    adapter.prompt_cache.max_bytes = int(cfg.model.prompt_cache_gib * 2**30)
    return prepare_adapter(adapter, cfg)


def prepare_adapter(adapter, cfg: Config):
    """Apply cfg.model's execution settings to a loaded adapter and add a fresh LoRA."""
    adapter.group_text_lengths = cfg.model.group_text_lengths
    adapter.text_length_multiple = cfg.model.text_length_multiple or (8 if cfg.parallel.compile else 1)
    vae_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.model.vae_dtype)
    if vae_dtype is None:
        raise ValueError(f"model.vae_dtype must be float32 or bfloat16, got {cfg.model.vae_dtype!r}")
    adapter.vae.to(vae_dtype)
    torch.manual_seed(cfg.run.seed)  # LoRA init (gaussian A) is the only draw from the global RNG
    adapter.add_lora(cfg.model.lora_rank, cfg.model.lora_alpha,
                     True if cfg.model.lora_init == "default" else cfg.model.lora_init,
                     cfg.model.lora_target_modules or None)
    # without checkpointing (0) the blocks are still called as the rollout calls them (enable_activation_checkpointing)
    adapter.enable_activation_checkpointing(cfg.model.checkpoint_every if cfg.model.gradient_checkpointing else 0,
                                            cfg.model.checkpoint_blocks)
    if cfg.model.text_encoder_offload:
        adapter.offload_text_encoder()
    adapter.transformer.eval()
    return adapter


def check_adamw(lr: float, weight_decay: float, prefix: str = "") -> None:
    """AdamW moves each weight by about lr per step, and decays it by the factor 1 - lr x weight_decay: lr above 1
    or a factor below 0 (which flips every weight's sign) is no learning rate."""
    if lr > 1:
        raise ValueError(f"{prefix}lr must be at most 1 (AdamW moves each weight by about lr per step; the recipes "
                         f"use 1e-4 to 1e-3), got {lr}")
    if lr * weight_decay > 1:
        raise ValueError(f"{prefix}weight_decay={weight_decay} with {prefix}lr={lr}: AdamW multiplies the weights by "
                         f"1 - lr x weight_decay = {1 - lr * weight_decay:.3g} each step; keep lr x weight_decay <= 1")


def make_optimizer(params: list[torch.nn.Parameter], cfg: Config) -> torch.optim.Optimizer:
    t = cfg.train
    return torch.optim.AdamW(params, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
                             weight_decay=t.weight_decay)


def resolve_family_defaults(cfg: Config, adapter) -> None:
    """Fill settings left to the family (guidance scale) and reject ones it cannot honour."""
    if cfg.sample.guidance_scale is None:  # DiffusionNFT samples CFG-free (NVlabs: guidance 1.0)
        from imagerl.algorithms.registry import algorithm_class

        nft = algorithm_class(cfg.train.algorithm).rollout == "clean"  # AWM's official configs sample CFG-free too
        # (a guidance-distilled family has no CFG to turn off: its guidance input keeps the family's default)
        cfg.sample.guidance_scale = 1.0 if nft and adapter.true_cfg else adapter.default_guidance_scale
    if cfg.sample.kv_cache and not adapter.supports_kv_cache:
        raise ValueError(f"sample.kv_cache=true: the {adapter.name} family has no text prefix KV cache; set it to false")
