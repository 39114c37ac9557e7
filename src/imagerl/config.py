"""Typed configuration: dataclasses, YAML recipes, dotted CLI overrides, up-front validation.

A recipe is a YAML file with the sections below (any key left out keeps its default). Overrides on
the command line use dotted keys: `imagerl train --recipe quickstart train.lr=1e-4 sample.group_size=8`.
Values are parsed as YAML scalars/lists (`sample.sde_window_range=[0,5]`). Unknown keys and wrong
types are errors that name the key and suggest the closest valid one.
"""

from __future__ import annotations

import dataclasses
import math
import difflib
import re
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from imagerl.sampling.window import validate_window


@dataclass
class ModelConfig:
    path: str = "tiny"
    """Local diffusers-format checkpoint directory; "quickstart" for the small pretrained shapes-world
    Qwen-Image shipped with imagerl; or "tiny" / "tiny21" for a tiny random Qwen-Image / Qwen-Image 2.1
    built on first use (in $IMAGERL_CACHE or ~/.cache/imagerl)."""
    family: str = "auto"
    """Family adapter name ("qwen_image"), or "auto" to resolve from the checkpoint."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1", ..."""
    dtype: str = "auto"
    """Forward dtype of the transformer and text encoder: "auto" (bfloat16 on GPU, float32 on CPU), "float32", "bfloat16"."""
    lora_rank: int = 64
    lora_alpha: int = 128
    lora_init: str = "gaussian"
    """PEFT init_lora_weights: "gaussian" (flow_grpo) or "default"; both start with B = 0 (no effect at step 0)."""
    lora_target_modules: list[str] = field(default_factory=list)
    """Empty: the family's default (the 12 modules of the flow_grpo/miles Qwen-Image recipes)."""
    gradient_checkpointing: bool = True
    checkpoint_every: int = 1
    """With gradient_checkpointing: checkpoint every k-th transformer block (1: all, flow_grpo; 2: every other
    block keeps its activations, half the recompute for more memory)."""
    prompt_cache_size: int = 4096
    """Prompt embeddings kept (LRU) across rollouts; one text-encoder pass per unique prompt."""
    vae_dtype: str = "float32"
    """VAE decode (and encode) dtype: "float32" (flow_grpo, the pipeline's output path) or "bfloat16" (faster;
    the images, and so the rewards, differ slightly: benchmarks/RESULTS.md measures by how much)."""
    group_text_lengths: bool = False
    text_length_multiple: int = 0
    """qwen_image: pad each forward's text to a multiple of this many tokens (masked keys, the same values).
    0: 8 with parallel.compile, else 1. Inductor specialises a block's graph on whether the joint sequence
    (4096 image + L text tokens at 1024 px, 1024 + L at 512 px) is a multiple of 8 (alignment guard
    `(N + L) % 8`), so unpadded prompt lengths cost a second compiled graph; padded, one graph serves all."""
    """qwen_image: run the rows of a batch with different text lengths (cond vs uncond with CFG, prompts of
    different lengths) as separate unmasked forwards instead of one forward padded to the longest row with a
    key mask (flow_grpo, the pipeline): no padded tokens and attention without a mask; the same math. qwen_image21
    always groups by length."""


@dataclass
class DataConfig:
    train_prompts: str = "bundled"
    """.txt (one prompt per line) or .jsonl ("prompt" field), or a set shipped with imagerl: "bundled" (128 OCR
    prompts), "shapes-train" / "shapes-test" (the shapes world's training captions / held-out captions)."""
    test_prompts: str = ""
    """Held-out prompts for evaluation: a file or shipped set (as train_prompts), "split" (hold out
    test_fraction of train_prompts, deterministically), or "" (no evaluation)."""
    test_samples_per_prompt: int = 1
    """Images per held-out prompt, each from its own noise (GenEval samples 4): a less noisy evaluation."""
    test_fraction: float = 0.1
    split_seed: int = 0


@dataclass
class SampleConfig:
    height: int = 512
    width: int = 512
    num_steps: int = 10
    guidance_scale: typing.Optional[float] = None
    """CFG scale, the same in rollout and training; <= 1 disables CFG. None: the family's default
    (qwen_image 4.0, true CFG with norm rescale; qwen_image21 1.0, no CFG: plain CFG when > 1)."""
    negative_prompt: str = " "
    max_sequence_length: int = 512
    noise_level: float = 1.2
    sde_type: str = "sde"
    num_sde_steps: int = 2
    """SDE (= trained) steps per trajectory; flow_grpo Qwen-Image: 2."""
    sde_window_range: list[int] = field(default_factory=lambda: [0, 5])
    sde_window_start: typing.Union[int, str] = 3
    """Int (fixed) or "random". 3 reproduces flow_grpo's effective Qwen-Image window {3, 4} (see sampling/window.py)."""
    prompts_per_rollout: int = 32
    """Unique prompts per rollout, over all ranks (flow_grpo: 32)."""
    group_size: int = 16
    """Samples per prompt K (flow_grpo: 16)."""
    batch_size: int = 4
    """Samples per rollout forward per rank (CFG doubles the rows). The SDE-window steps run in sub-batches of
    train.batch_size, the batches the training forwards replay."""
    same_initial_noise: bool = False
    """All K samples of a group start from the same initial noise (flow_grpo's `sample.same_latent`): the
    group's rewards then differ only through the SDE window's noise, the part the update credits."""
    merge_lora: bool = False
    """The steps outside the SDE window (ODE steps, never replayed) run without gradients on a copy of the
    weights with the LoRA merged in: no LoRA matmuls there. The window steps and training keep the unmerged
    weights, so the replay stays exact. Costs the merged copies during the rollout (qwen_image r64, 12 targets:
    27 GB in bf16). Not under FSDP (sharded weights)."""
    kv_cache: bool = False
    """qwen_image21 only: reuse the text prefix's keys/values across rollout steps (faster rollout). Training
    always runs the full forward: the replay is exact on CPU fp32, but not guaranteed on GPU (an H200 run
    showed train/log_prob_mean_abs_diff up to 1.5e-8 in fp32; benchmarks/RESULTS.md)."""


@dataclass
class TrainConfig:
    num_rollouts: int = 100
    lr: float = 3e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    clip_range: float = 1e-4
    adv_clip_max: float = 5.0
    beta: float = 0.0
    """KL weight against the LoRA-disabled reference policy (0: no reference forward)."""
    num_optimizer_steps: int = 2
    """Optimizer steps per rollout; the rollout's samples are split evenly (flow_grpo: 2)."""
    batch_size: int = 0
    """Samples per training forward per rank (CFG doubles the rows); 0: sample.batch_size. It must divide
    sample.batch_size: the rollout runs its SDE-window steps in sub-batches of this size, so that the training
    forwards replay them exactly, and its other steps at sample.batch_size (a larger rollout batch than
    training memory allows)."""
    timestep_staging: bool = False
    """Keep the rollout's trajectory (window latents, old log-probs) on the CPU and copy each micro-batch's step
    inputs to the GPU just before their forward (verl-omni's enable_timestep_staging): device memory for
    host-to-device copies. Exact either way (fp32 copies)."""
    global_std: bool = True
    """Advantage std over the whole rollout (True, flow_grpo Qwen-Image) or per group."""


@dataclass
class RewardConfig:
    weights: dict[str, float] = field(default_factory=lambda: {"jpeg_compressibility": 1.0})
    """Reward name -> weight; the training reward is the weighted sum."""
    on_error: str = "error"
    """A reward that raises or returns NaN/inf: "error" stops the run (state saved, resumable); "skip" drops
    those samples from the update (advantage 0) and counts them in rollout/reward/failed_count."""
    device: str = "auto"
    """Where reward models run: "auto" (the policy's device), "cpu", "cuda:1", ..."""
    dtype: str = "float32"
    """Reward-model dtype: "float32" (flow_grpo) or "bfloat16"."""
    batch_size: int = 32
    """Images per reward-model forward."""
    async_scoring: bool = True
    """Score each rollout batch in a background thread while the next batch is generated."""
    pickscore_model: str = ""
    """Local copy of yuvalkirstain/PickScore_v1 (CLIPModel)."""
    pickscore_processor: str = ""
    """Local copy of laion/CLIP-ViT-H-14-laion2B-s32B-b79K (its CLIPProcessor); empty: pickscore_model."""
    clip_model: str = ""
    """Local CLIP ViT-L/14 (openai/clip-vit-large-patch14) for aesthetic and clipscore."""
    aesthetic_head: str = ""
    """LAION improved-aesthetic MLP weights (sac+logos+ava1-l14-linearMSE.pth or .safetensors)."""


@dataclass
class EvalConfig:
    interval: int = 0
    """Rollouts between held-out evaluations (0: never); also after the last rollout. Needs data.test_prompts."""
    before_training: bool = False
    num_steps: int = 50
    """ODE steps (flow_grpo evaluates Qwen-Image with 50)."""
    guidance_scale: typing.Optional[float] = None
    """None: sample.guidance_scale (flow_grpo evaluates with the training CFG, 4)."""
    seed: int = 0
    """Image i of the test set always starts from the noise of (seed, i)."""
    batch_size: int = 4
    max_prompts: int = 0
    """Evaluate only the first N test prompts (0: all)."""


@dataclass
class RunConfig:
    output_dir: str = "runs/{recipe}"
    seed: int = 42
    checkpoint_every: int = 10
    """Rollouts between checkpoints (the last rollout is always saved)."""
    keep_checkpoints: int = 3
    image_grid_every: int = 10
    """Rollouts between sample-image grids written to <output_dir>/images (0: never)."""
    tensorboard: bool = True
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str = "imagerl"


@dataclass
class ParallelConfig:
    """Several processes (torchrun); see docs/design.md "Many GPUs". Single process: only `compile` and
    `deterministic` apply."""

    strategy: str = "auto"
    """"auto" (fsdp when world size > 1), "fsdp" (FSDP2 fully_shard per transformer block, then the root) or
    "replicate" (every rank holds the whole model; LoRA gradients are all-reduced)."""
    reduce_dtype: str = "float32"
    """FSDP gradient reduce-scatter dtype: "float32" or "bfloat16"."""
    reshard_after_forward: bool = True
    """FSDP: free each block's gathered weights after its forward (less memory, one more all-gather in backward)."""
    text_encoder: str = "auto"
    """"auto" (shard when it has more than text_encoder_shard_min_params parameters), "shard" (fully_shard its
    decoder layers, gathered once per encode call) or "replicate"."""
    text_encoder_shard_min_params: int = 1_000_000_000
    compile: bool = False
    """Regional torch.compile of each transformer block (after activation checkpointing, before sharding)."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8, cudnn deterministic, math SDPA."""


@dataclass
class Config:
    recipe: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def output_dir(self) -> Path:
        return Path(self.run.output_dir.format(recipe=self.recipe))


# ---------------------------------------------------------------- loading and overrides


def _check_type(key: str, value, hint):
    """Coerce/verify one value against a dataclass field type; ValueError names the key."""
    origin = typing.get_origin(hint)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads "1e-4" (no dot) as a string, in recipe files and overrides alike
    if hint is type(None):
        if value is None:
            return None
        raise ValueError(f"{key}: expected null, got {value!r}")
    if hint in (int, float, str, bool):
        if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
            return value
        raise ValueError(f"{key}: expected {hint.__name__}, got {value!r}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a mapping, got {value!r}")
        _, val_t = typing.get_args(hint)
        return {str(k): _check_type(f"{key}.{k}", v, val_t) for k, v in value.items()}
    if origin is typing.Union:
        for option in typing.get_args(hint):
            try:
                return _check_type(key, value, option)
            except ValueError:
                pass
        raise ValueError(f"{key}: {value!r} is none of {[getattr(a, '__name__', a) for a in typing.get_args(hint)]}")
    raise TypeError(f"unsupported config type {hint} for {key}")


def _set(cfg: Config, dotted: str, value) -> None:
    parts = dotted.split(".")
    obj = cfg
    for depth, name in enumerate(parts):
        hints = typing.get_type_hints(type(obj))
        if name not in hints:
            prefix = ".".join(parts[:depth])
            close = difflib.get_close_matches(name, list(hints), n=1)
            hint = f"; did you mean {'.'.join([*parts[:depth], close[0]]) if prefix else close[0]}?" if close else ""
            raise ValueError(f"unknown config key {dotted!r}{hint} (valid here: {', '.join(hints)})")
        if dataclasses.is_dataclass(hints[name]):
            if depth == len(parts) - 1:
                if not isinstance(value, dict):
                    raise ValueError(f"{dotted}: expected a section (mapping), got {value!r}")
                for k, v in value.items():
                    _set(cfg, f"{dotted}.{k}", v)
                return
            obj = getattr(obj, name)
            continue
        if depth != len(parts) - 1:
            raise ValueError(f"config key {dotted!r}: {'.'.join(parts[:depth + 1])} is not a section")
        setattr(obj, name, _check_type(dotted, value, hints[name]))
        return


def recipe_dir() -> Path:
    return Path(str(resources.files("imagerl") / "recipes"))


def available_recipes() -> list[str]:
    return sorted(p.stem for p in recipe_dir().glob("*.yaml"))


def load_config(recipe: str = "quickstart", overrides: list[str] = ()) -> Config:
    """Recipe name (bundled) or path to a YAML file, then `key=value` overrides in order."""
    path = Path(recipe)
    if not path.suffix:
        path = recipe_dir() / f"{recipe}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown recipe {recipe!r}; bundled recipes: {', '.join(available_recipes())}")
    elif not path.is_file():
        raise ValueError(f"recipe file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    cfg = Config(recipe=path.stem)
    for key, value in data.items():
        _set(cfg, key, value)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. train.lr=1e-4)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw  # "sample.negative_prompt= " keeps the space
        except yaml.YAMLError as e:
            raise ValueError(f"override {item!r}: cannot parse value: {e}") from e
        _set(cfg, key.strip(), value)
    return cfg


_DECIMAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ---------------------------------------------------------------- validation and batch arithmetic


@dataclass(frozen=True)
class BatchPlan:
    """Derived sizes per rollout. Samples are group-major: prompt g's K samples are consecutive."""

    samples_per_rollout: int  # P x K over all ranks
    prompts_per_rank: int  # P / W complete groups per rank
    samples_per_rank: int  # P x K / W
    batches_per_rank: int  # training batches: samples_per_rank / training_batch_size
    batches_per_optimizer_step: int  # batches_per_rank / num_optimizer_steps
    samples_per_optimizer_step: int  # over all ranks


def training_batch_size(cfg: Config) -> int:
    """Samples per training forward (train.batch_size, 0 meaning sample.batch_size)."""
    return cfg.train.batch_size or cfg.sample.batch_size


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
    if not 1 <= world_size:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if t.batch_size < 0 or (t.batch_size and s.batch_size % t.batch_size):
        raise ValueError(f"train.batch_size={t.batch_size} must divide sample.batch_size={s.batch_size} (the rollout's "
                         "SDE-window steps run in training-sized sub-batches), or be 0 for sample.batch_size")
    if cfg.model.text_length_multiple < 0:
        raise ValueError(f"model.text_length_multiple must be >= 0 (0: automatic), got {cfg.model.text_length_multiple}")
    if cfg.model.vae_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"model.vae_dtype must be 'float32' or 'bfloat16', got {cfg.model.vae_dtype!r}")
    if s.sde_type not in ("sde", "cps"):
        raise ValueError(f"sample.sde_type must be 'sde' or 'cps', got {s.sde_type!r}")
    if s.noise_level <= 0:
        raise ValueError(f"sample.noise_level must be > 0 for training (got {s.noise_level}); 0 is the ODE")
    if len(s.sde_window_range) != 2:
        raise ValueError(f"sample.sde_window_range must be [lo, hi], got {s.sde_window_range}")
    validate_window(s.num_steps, s.num_sde_steps, tuple(s.sde_window_range), s.sde_window_start)
    for key, value in {"train.lr": t.lr, "train.clip_range": t.clip_range, "train.beta": t.beta,
                       "train.weight_decay": t.weight_decay, "train.max_grad_norm": t.max_grad_norm,
                       "train.adv_clip_max": t.adv_clip_max, "sample.noise_level": s.noise_level,
                       "sample.guidance_scale": 0.0 if s.guidance_scale is None else s.guidance_scale,
                       "train.adam_eps": t.adam_eps}.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{key} must be a finite number >= 0, got {value}")
    if cfg.model.lora_init not in ("gaussian", "default"):
        raise ValueError(f"model.lora_init must be 'gaussian' or 'default', got {cfg.model.lora_init!r}")
    if not cfg.reward.weights:
        raise ValueError("reward.weights is empty: name at least one reward, e.g. reward.weights={jpeg_compressibility: 1.0}")
    if cfg.reward.on_error not in ("error", "skip"):
        raise ValueError(f"reward.on_error must be 'error' or 'skip', got {cfg.reward.on_error!r}")
    if cfg.reward.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"reward.dtype must be float32 or bfloat16, got {cfg.reward.dtype!r}")
    if cfg.reward.batch_size < 1:
        raise ValueError(f"reward.batch_size must be >= 1, got {cfg.reward.batch_size}")
    e = cfg.eval
    if e.interval < 0 or e.num_steps < 1 or e.batch_size < 1 or e.max_prompts < 0:
        raise ValueError("eval.interval and eval.max_prompts must be >= 0, eval.num_steps and eval.batch_size >= 1")
    if (e.interval or e.before_training) and not cfg.data.test_prompts:
        raise ValueError("evaluation is on (eval.interval / eval.before_training) but data.test_prompts is empty; "
                         "give a prompt file or data.test_prompts=split")
    if not 0 < cfg.data.test_fraction < 1:
        raise ValueError(f"data.test_fraction must be in (0, 1), got {cfg.data.test_fraction}")
    if cfg.data.test_samples_per_prompt < 1:
        raise ValueError(f"data.test_samples_per_prompt must be >= 1 (images per held-out prompt), got "
                         f"{cfg.data.test_samples_per_prompt}")
    if cfg.model.dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"model.dtype must be auto, float32 or bfloat16, got {cfg.model.dtype!r}")

    if validate_parallel(cfg, world_size) == "fsdp" and s.merge_lora:
        raise ValueError("sample.merge_lora needs unsharded weights: set sample.merge_lora=false under FSDP, or "
                         "parallel.strategy=replicate")

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


def validate_parallel(cfg: Config, world_size: int) -> str:
    """Check the parallel.* section; return the effective strategy: "fsdp", "replicate" or "none" (one process)."""
    p = cfg.parallel
    choices = {"parallel.strategy": (p.strategy, ("auto", "fsdp", "replicate")),
               "parallel.reduce_dtype": (p.reduce_dtype, ("float32", "bfloat16")),
               "parallel.text_encoder": (p.text_encoder, ("auto", "shard", "replicate"))}
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
    if p.text_encoder_shard_min_params < 0:
        raise ValueError(f"parallel.text_encoder_shard_min_params must be >= 0, got {p.text_encoder_shard_min_params}")
    if world_size == 1:
        return "none"
    strategy = "fsdp" if p.strategy == "auto" else p.strategy
    if p.text_encoder == "shard" and strategy != "fsdp":
        raise ValueError("parallel.text_encoder=shard needs parallel.strategy=fsdp (or auto with several ranks)")
    return strategy
