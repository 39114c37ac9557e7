"""Up-front validation of a Config and the batch arithmetic of a rollout (BatchPlan): every setting that can
be checked before a model loads, with an error that says how to fix it."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from imagerl.components import check_adamw
from imagerl.config import MAX_LORA_RANK, Config, training_batch_size
from imagerl.distributed.parallel import validate_parallel
from imagerl.run.lock import validate_output_dir

LATENT_PIXELS = 16  # sample.height/width step: VAE factor 8 x patch size 2 (QwenImageAdapter.latent_grid)
FLOAT32_MAX = 3.4028234663852886e38  # settings become float32 scalars in tensor ops: a larger one is an error there


@dataclass(frozen=True)
class BatchPlan:
    """Derived sizes per rollout. Samples are group-major: prompt g's K samples are consecutive."""

    samples_per_rollout: int  # P x K over all ranks
    prompts_per_rank: int  # P / W complete groups per rank
    samples_per_rank: int  # P x K / W
    batches_per_rank: int  # training batches: samples_per_rank / training_batch_size
    batches_per_optimizer_step: int  # batches_per_rank / num_optimizer_steps
    samples_per_optimizer_step: int  # over all ranks


def validate(cfg: Config, world_size: int = 1) -> BatchPlan:
    """Check every setting that can be checked before loading a model; ValueError says how to fix it."""
    s, t = cfg.sample, cfg.train
    positive = {
        "sample.height": s.height, "sample.width": s.width, "sample.num_steps": s.num_steps,
        "sample.prompts_per_rollout": s.prompts_per_rollout, "sample.group_size": s.group_size,
        "sample.batch_size": s.batch_size, "train.num_rollouts": t.num_rollouts,
        "train.num_optimizer_steps": t.num_optimizer_steps, "model.lora_rank": cfg.model.lora_rank,
        "sample.max_sequence_length": s.max_sequence_length, "run.checkpoint_every": cfg.run.checkpoint_every,
        "model.checkpoint_every": cfg.model.checkpoint_every,
    }
    for key, value in positive.items():
        if value < 1:
            raise ValueError(f"{key} must be >= 1, got {value}")
    from imagerl.data.mixture import check_mixture

    check_mixture(cfg)  # data.mixture; reward.weights becomes the union of its sets' rewards
    if not cfg.model.prompt_cache_gib > 0 or cfg.model.prompt_cache_size < 1:
        raise ValueError(f"model.prompt_cache_gib must be > 0 and model.prompt_cache_size >= 1 (the cache must hold a "
                         f"rollout's prompts), got {cfg.model.prompt_cache_gib} and {cfg.model.prompt_cache_size}")
    if cfg.model.checkpoint_blocks < 0:
        raise ValueError(f"model.checkpoint_blocks must be >= 0 (0: every block checkpoint_every selects), got "
                         f"{cfg.model.checkpoint_blocks}")
    if not 1 <= world_size:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if s.group_size == 1:  # an advantage is a reward minus its group's mean: a group of one is always 0
        raise ValueError("sample.group_size=1: every advantage would be 0 (a sample is compared with the other samples "
                         "of its prompt), so nothing would be learned; use sample.group_size >= 2 (the quickstart "
                         "uses 8)")
    for key, value in {"sample.height": s.height, "sample.width": s.width}.items():
        if value % LATENT_PIXELS:  # qwen_image21 needs multiples of 32: its adapter checks when the model loads
            raise ValueError(f"{key} must be a positive multiple of {LATENT_PIXELS} (the VAE's factor 8 x the "
                             f"transformer's patch size 2, qwen_image latent_grid), got {value}")
    if cfg.model.lora_rank > MAX_LORA_RANK:
        raise ValueError(f"model.lora_rank must be at most {MAX_LORA_RANK} (above every family's hidden size, so "
                         f"nothing but memory), got {cfg.model.lora_rank}; the recipes use 8 to 64")
    if cfg.model.lora_alpha <= 0:
        raise ValueError(f"model.lora_alpha must be > 0 (the LoRA scale is lora_alpha / lora_rank), got "
                         f"{cfg.model.lora_alpha}")
    samples = s.prompts_per_rollout * s.group_size
    if s.prompts_per_rollout % world_size == 0 and s.batch_size > samples // world_size:
        # sample.batch_size is a per-rank ceiling: a recipe's one-forward-per-rollout batch (quickstart: 128) runs
        # unchanged on more ranks (the rank's samples in one forward; the same images, keyed noise)
        s.batch_size = samples // world_size
        if t.batch_size > s.batch_size:
            t.batch_size = 0
    if t.batch_size < 0 or (t.batch_size and s.batch_size % t.batch_size):
        raise ValueError(f"train.batch_size={t.batch_size} must divide sample.batch_size={s.batch_size} (the rollout's "
                         "SDE-window steps run in training-sized sub-batches), or be 0 for sample.batch_size")
    if s.decode_batch_size < 0:
        raise ValueError(f"sample.decode_batch_size must be >= 0 (images per VAE decode; 0: train.batch_size), got "
                         f"{s.decode_batch_size}")
    if cfg.model.text_length_multiple < 0:
        raise ValueError(f"model.text_length_multiple must be >= 0 (0: automatic), got {cfg.model.text_length_multiple}")
    if cfg.model.vae_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"model.vae_dtype must be 'float32' or 'bfloat16', got {cfg.model.vae_dtype!r}")
    from imagerl.algorithms.registry import algorithm_class

    algorithm_class(t.algorithm).check_config(cfg)  # unknown names: a ValueError listing the registered ones
    for key, value in {"train.lr": t.lr, "train.clip_range": t.clip_range, "train.beta": t.beta,
                       "train.weight_decay": t.weight_decay, "train.max_grad_norm": t.max_grad_norm,
                       "train.adv_clip_max": t.adv_clip_max, "sample.noise_level": s.noise_level,
                       "sample.guidance_scale": 0.0 if s.guidance_scale is None else s.guidance_scale,
                       "train.adam_eps": t.adam_eps}.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{key} must be a finite number >= 0, got {value}")
        if value > FLOAT32_MAX:
            raise ValueError(f"{key} must be at most 3.4e38 (float32's largest: tensor code takes it as a float32), "
                             f"got {value}")
    check_adamw(t.lr, t.weight_decay, "train.")
    for key, value in {"train.adam_beta1": t.adam_beta1, "train.adam_beta2": t.adam_beta2}.items():
        if not 0 <= value < 1:
            raise ValueError(f"{key} must be in [0, 1) (an Adam moment decay), got {value}")
    if cfg.eval.suites:
        from imagerl.evaluation.suites.run import check_suite_names

        check_suite_names(cfg.eval.suites, cfg.reward)
        if cfg.eval.interval <= 0 and not cfg.eval.before_training:
            raise ValueError("eval.suites run at evaluations: set eval.interval (and data.test_prompts) or "
                             "eval.before_training=true")
    if cfg.run.keep_best:
        if not cfg.run.keep_best.startswith("eval/"):
            raise ValueError(f"run.keep_best={cfg.run.keep_best!r} must be a held-out metric (eval/...), e.g. "
                             "eval/reward/raw_mean")
        if cfg.eval.interval <= 0:
            raise ValueError("run.keep_best needs evaluations: set eval.interval (and data.test_prompts or eval.suites)")
        if cfg.run.keep_best_mode not in ("max", "min"):
            raise ValueError(f"run.keep_best_mode must be 'max' or 'min', got {cfg.run.keep_best_mode!r}")
    if t.advantage not in ("sum", "per_reward"):
        raise ValueError(f"train.advantage must be 'sum' or 'per_reward', got {t.advantage!r}")
    if cfg.model.lora_init not in ("gaussian", "default"):
        raise ValueError(f"model.lora_init must be 'gaussian' or 'default', got {cfg.model.lora_init!r}")
    if not cfg.reward.weights:
        raise ValueError("reward.weights is empty: name at least one reward, e.g. reward.weights={jpeg_compressibility: 1.0}")
    for name, weight in cfg.reward.weights.items():
        if not math.isfinite(weight):  # negative weights are legitimate (a penalty)
            raise ValueError(f"reward.weights.{name} must be a finite number, got {weight}")
    if cfg.reward.on_error not in ("error", "skip"):
        raise ValueError(f"reward.on_error must be 'error' or 'skip', got {cfg.reward.on_error!r}")
    if cfg.reward.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"reward.dtype must be float32 or bfloat16, got {cfg.reward.dtype!r}")
    if cfg.reward.batch_size < 1:
        raise ValueError(f"reward.batch_size must be >= 1, got {cfg.reward.batch_size}")
    e = cfg.eval
    if e.interval < 0 or e.num_steps < 1 or e.batch_size < 1 or e.max_prompts < 0:
        raise ValueError("eval.interval and eval.max_prompts must be >= 0, eval.num_steps and eval.batch_size >= 1")
    held_out = cfg.data.test_prompts or any(m.test_prompts for m in cfg.data.mixture)
    if (e.interval or e.before_training) and not held_out and not e.suites:
        raise ValueError("evaluation is on (eval.interval / eval.before_training) but data.test_prompts is empty; "
                         "give a prompt file or data.test_prompts=split (with data.mixture: a set's test_prompts), "
                         "or an evaluation suite (eval.suites)")
    if not 0 < cfg.data.test_fraction < 1:
        raise ValueError(f"data.test_fraction must be in (0, 1), got {cfg.data.test_fraction}")
    if cfg.data.test_samples_per_prompt < 1:
        raise ValueError(f"data.test_samples_per_prompt must be >= 1 (images per held-out prompt), got "
                         f"{cfg.data.test_samples_per_prompt}")
    if cfg.model.dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"model.dtype must be auto, float32 or bfloat16, got {cfg.model.dtype!r}")
    validate_output_dir(cfg)

    if validate_parallel(cfg, world_size) == "fsdp" and s.merge_lora:
        # a one-GPU speed setting of the bundled recipes: under FSDP the weights are sharded, so the rollout runs
        # unmerged (the same function) and the recipe still runs unchanged
        warnings.warn("sample.merge_lora has no effect under FSDP (sharded weights): the rollout runs the unmerged "
                      "LoRA (sample.off_window_fp8 with it); parallel.strategy=replicate keeps it", stacklevel=2)
        s.merge_lora = False
        s.off_window_fp8 = False
    if s.off_window_fp8 and not s.merge_lora:
        raise ValueError("sample.off_window_fp8=true runs the merged weights in FP8: it needs sample.merge_lora=true "
                         "(set both, or drop sample.off_window_fp8)")

    samples = s.prompts_per_rollout * s.group_size
    if s.prompts_per_rollout % world_size:
        raise ValueError(
            f"sample.prompts_per_rollout={s.prompts_per_rollout} must be divisible by the {world_size} ranks so that "
            f"each rank holds complete groups of sample.group_size={s.group_size}"
        )
    per_rank = samples // world_size
    if per_rank % s.batch_size:
        raise ValueError(
            f"each rank generates prompts_per_rollout/ranks x group_size = {s.prompts_per_rollout // world_size} x "
            f"{s.group_size} = {per_rank} samples, not a multiple of sample.batch_size={s.batch_size}"
        )
    micro = training_batch_size(cfg)
    batches = per_rank // micro
    if batches % t.num_optimizer_steps:
        raise ValueError(
            f"{batches} training batches per rank (of {micro} samples) cannot be split evenly into "
            f"train.num_optimizer_steps={t.num_optimizer_steps}; change one of sample.prompts_per_rollout, "
            "sample.group_size, sample.batch_size / train.batch_size, train.num_optimizer_steps"
        )
    return BatchPlan(samples, s.prompts_per_rollout // world_size, per_rank, batches,
                     batches // t.num_optimizer_steps, samples // t.num_optimizer_steps)
