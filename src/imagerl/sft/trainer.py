"""`imagerl sft`: flow-matching supervised fine-tuning on image-caption pairs (a warm start before RL).

One optimizer step on a batch of B examples (x0: the image's packed VAE latents, encode_images, cached once):
    sigma ~ logit-normal(mean, std) (SD3 / diffusers' compute_density_for_timestep_sampling) or uniform(0, 1)
    eps ~ N(0, I);  x_t = (1 - sigma) x0 + sigma eps;  target v = eps - x0
    loss = mean((velocity(x_t, 1000 sigma, caption, guidance 1) - v)^2)       (plain MSE, no weighting)
AdamW on float32 master weights: the LoRA (lora_rank > 0) or the whole transformer (lora_rank = 0; float32,
bf16 autocast when dtype is bfloat16). Batch order, sigmas, noise and caption dropout derive from
(seed, step), so `--resume` continues a run bit for bit on CPU. Checkpoints: checkpoint.py.
`export_model` writes a standalone diffusers checkpoint (LoRA merged) for `--model` / from_pretrained.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
import time
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from imagerl.run.checkpoint import (check_checkpoint, check_lora_dir, load_checkpoint, load_full_checkpoint,
                                   merged_lora_transformer, resolve_resume, save_checkpoint, save_full_checkpoint,
                                   save_model_dir)
from imagerl.run.load_checks import check_weights_dir
from imagerl.components import NAMED_MODELS, check_adamw, resolve_dtype, resolve_model_path
from imagerl.distributed.parallel import World, resolve_device
from imagerl.distributed.rng import make_generator
from imagerl.families.model_defaults import ModelDefaults, model_defaults
from imagerl.config import MAX_LORA_RANK
from imagerl.run.checkpoint import recover_interrupted
from imagerl.run.lock import CHECKPOINT_NAME
from imagerl.run.lock import check_run_files, hold_run_dir
from imagerl.sft.data import batch_indices, load_examples, load_image


@dataclass
class SFTConfig:
    model: str = "tiny"  # diffusers-format checkpoint directory, or quickstart / tiny / tiny21
    family: str = "auto"
    device: str = "auto"
    dtype: str = "auto"  # forward dtype: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16
    data: str = ""  # JSONL ({"image": relative path, "prompt"/"caption": text} per line) or image folder + .txt
    height: int = 0  # images are resized to cover height x width and center-cropped; 0: the model's
    width: int = 0  # imagerl_defaults.json size (the quickstart model: 64), else 512
    lora_rank: int = 64  # 0: full fine-tuning of the transformer
    lora_alpha: int = 128
    lora_target_modules: list[str] = field(default_factory=list)  # empty: the family's default
    lr: float = 1e-4
    lr_warmup_steps: int = 0  # linear warm-up, then constant
    weight_decay: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    batch_size: int = 4
    num_steps: int = 1000
    max_grad_norm: float = 1.0  # 0: no clipping (the norm is still logged)
    seed: int = 42
    sigma_sampling: str = "logit_normal"  # or "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    caption_dropout: float = 0.0  # probability of training on null_caption instead (keeps CFG's uncond branch)
    null_caption: str = " "  # the pipelines' default negative prompt
    max_sequence_length: int = 512
    prompt_cache_size: int = 4096  # caption embeddings kept (LRU); each unique caption is encoded once while cached
    gradient_checkpointing: bool = True
    output_dir: str = "runs/sft"
    checkpoint_every: int = 500  # the last step is always saved
    keep_checkpoints: int = 2
    log_every: int = 10
    tensorboard: bool = True
    validation_prompts: list[str] = field(default_factory=list)  # sample grids in <output_dir>/images
    validation_every: int = 0  # 0: before and after training only
    validation_steps: int = 0  # ODE steps; 0: the model's imagerl_defaults.json num_steps, else the family's
    validation_guidance: typing.Optional[float] = None  # None: the model's imagerl_defaults.json, else the family's


def load_sft_config(overrides: list[str] = (), base: dict | None = None) -> SFTConfig:
    """SFTConfig from a saved dict (or the defaults) and `key=value` overrides (values parsed as YAML, with the
    alias-bomb and nesting guard of every imagerl config: config.safe_load_yaml)."""
    from imagerl.config import safe_load_yaml

    cfg = SFTConfig()
    hints = typing.get_type_hints(SFTConfig)
    items = list((base or {}).items())
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item[:60]!r} must look like key=value (e.g. lr=1e-5)")
        try:
            items.append((key.strip(), safe_load_yaml(raw, f"override {item[:60]!r}") if raw.strip() else raw))
        except yaml.YAMLError as e:
            raise ValueError(f"override {item!r}: cannot parse value: {e}") from e
    for key, value in items:
        if key not in hints:
            raise ValueError(f"unknown sft setting {key!r}; valid: {', '.join(hints)}")
        setattr(cfg, key, _coerce(key, value, hints[key]))
    return cfg


def read_saved_sft_config(path: Path) -> dict:
    """A run's sft_config.yaml (the settings `--resume` starts from), read as every imagerl config is."""
    from imagerl.config import safe_load_yaml

    try:
        saved = safe_load_yaml(path.read_text(), str(path))
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not valid YAML ({e}); fix it or resume with every setting given") from e
    if not isinstance(saved, dict):
        raise ValueError(f"{path} must be a mapping of sft settings (key: value per line); fix it or remove it")
    return saved


def _coerce(key: str, value, hint):
    if hint is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)  # YAML reads 1e-4 (no dot) as a string
        except ValueError:
            pass
    if typing.get_origin(hint) is list and isinstance(value, (list, tuple)):
        return [_coerce(key, v, str) for v in value]
    if typing.get_origin(hint) is typing.Union:  # Optional[float]
        return None if value is None else _coerce(key, value, float)
    if hint in (int, float, str, bool) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    from imagerl.config import _short

    raise ValueError(f"{key}: expected {getattr(hint, '__name__', hint)}, got {_short(value)}")


def validate_sft(cfg: SFTConfig) -> None:
    for key in ("batch_size", "num_steps", "checkpoint_every", "log_every", "max_sequence_length", "prompt_cache_size"):
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(cfg, key)}")
    for key in ("height", "width", "lora_rank", "lora_alpha", "lr_warmup_steps", "validation_every", "validation_steps",
                "keep_checkpoints"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key} must be >= 0, got {getattr(cfg, key)}")
    if cfg.lora_rank > MAX_LORA_RANK:
        raise ValueError(f"lora_rank must be at most {MAX_LORA_RANK} (above every family's hidden size), got "
                         f"{cfg.lora_rank}; 0 trains the whole transformer")
    for key in ("lr", "weight_decay", "max_grad_norm", "adam_eps", "logit_std"):
        if not math.isfinite(getattr(cfg, key)) or not 0 <= getattr(cfg, key) <= 3.4e38:  # float32 scalars
            raise ValueError(f"{key} must be a finite number >= 0, got {getattr(cfg, key)}")
    check_adamw(cfg.lr, cfg.weight_decay)
    if cfg.sigma_sampling not in ("logit_normal", "uniform"):
        raise ValueError(f"sigma_sampling must be logit_normal or uniform, got {cfg.sigma_sampling!r}")
    if not 0 <= cfg.caption_dropout < 1:
        raise ValueError(f"caption_dropout must be in [0, 1), got {cfg.caption_dropout}")
    if cfg.dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"dtype must be auto, float32 or bfloat16, got {cfg.dtype!r}")


def with_model_defaults(cfg: SFTConfig, defaults: ModelDefaults) -> SFTConfig:
    """Settings left unset (height/width 0, validation_steps 0, validation_guidance None) from the model's
    imagerl_defaults.json; height/width else 512. Validation steps/guidance left unset use the family's."""
    return dataclasses.replace(
        cfg, height=cfg.height or defaults.height or 512, width=cfg.width or defaults.width or 512,
        validation_steps=cfg.validation_steps or defaults.num_steps or 0,
        validation_guidance=defaults.guidance_scale if cfg.validation_guidance is None else cfg.validation_guidance)


def load_sft_adapter(cfg: SFTConfig, device: torch.device):
    """The family adapter with trainable float32 parameters: a fresh LoRA, or (lora_rank 0) the transformer."""
    from imagerl.families.registry import family_class

    path = resolve_model_path(cfg.model)
    family = family_class(path, cfg.family)
    adapter = family.from_pretrained(path, device, resolve_dtype(cfg.dtype, device), cfg.prompt_cache_size)
    if cfg.lora_rank:
        torch.manual_seed(cfg.seed)  # the LoRA init is the only draw from the global RNG
        adapter.add_lora(cfg.lora_rank, cfg.lora_alpha, "gaussian", cfg.lora_target_modules or None)
    else:
        transformer = adapter.transformer.float()
        if adapter.dtype != torch.float32:  # the checkpoint's own weights, not a bf16 round trip
            saved = type(transformer).from_pretrained(path, subfolder="transformer", torch_dtype=torch.float32)
            transformer.load_state_dict(saved.state_dict())
            del saved
        transformer.requires_grad_(True)
    if cfg.gradient_checkpointing:
        adapter.transformer.enable_gradient_checkpointing()
    adapter.transformer.eval()  # no dropout in these models; eval keeps the forward deterministic
    return adapter, path


@torch.no_grad()
def encode_dataset(adapter, examples, cfg: SFTConfig, progress=None) -> torch.Tensor:
    """x0 of every example, (E, N, C) float32 on the CPU, encoded once (VAE batches of batch_size)."""
    out = []
    for i in range(0, len(examples), cfg.batch_size):
        images = torch.stack([load_image(e.image, cfg.height, cfg.width) for e in examples[i : i + cfg.batch_size]])
        out.append(adapter.encode_images(images).cpu())
        if progress is not None:
            progress.update(len(images))
    return torch.cat(out)


@dataclass
class StepDraw:
    """The random choices of one optimizer step, all from (seed, step)."""

    indices: list[int]
    sigmas_B: torch.Tensor  # float32, CPU
    noise_BNC: torch.Tensor  # float32, on the adapter's device
    dropped_B: torch.Tensor  # bool: caption replaced by null_caption


def draw_step(cfg: SFTConfig, step: int, num_examples: int, adapter) -> StepDraw:
    b = cfg.batch_size
    indices = batch_indices(cfg.seed, step, b, num_examples)
    normal_or_uniform = make_generator(cfg.seed, "sft/sigma", step)
    if cfg.sigma_sampling == "logit_normal":
        sigmas = torch.sigmoid(torch.randn(b, generator=normal_or_uniform) * cfg.logit_std + cfg.logit_mean)
    else:
        sigmas = torch.rand(b, generator=normal_or_uniform)
    noise = adapter.initial_noise([make_generator(cfg.seed, "sft/noise", step, j) for j in range(b)], cfg.height, cfg.width)
    dropped = torch.rand(b, generator=make_generator(cfg.seed, "sft/dropout", step)) < cfg.caption_dropout
    return StepDraw(indices, sigmas, noise, dropped)


def flow_matching_loss(adapter, x0_BNC, noise_BNC, sigmas_B, cond, height: int, width: int) -> torch.Tensor:
    """mean((v_theta(x_t, sigma) - (eps - x0))^2) with x_t = (1 - sigma) x0 + sigma eps."""
    s = sigmas_B.to(x0_BNC.device, torch.float32).view(-1, 1, 1)
    x_t = (1 - s) * x0_BNC + s * noise_BNC
    pred = adapter.velocity(x_t, s.flatten() * 1000, cond, height, width)
    return torch.nn.functional.mse_loss(pred, noise_BNC - x0_BNC)


@dataclass
class SFTRun:
    run_dir: Path
    adapter: object
    checkpoint: Path


def sft(cfg: SFTConfig, resume: str | None = None) -> SFTRun:
    """Train for cfg.num_steps optimizer steps (continuing a checkpoint with `resume`)."""
    validate_sft(cfg)
    examples = load_examples(cfg.data)  # data errors before any model loads
    cfg = dataclasses.replace(cfg, data=str(Path(cfg.data).expanduser().resolve()), model=cfg.model if cfg.model
                              in NAMED_MODELS else str(Path(cfg.model).expanduser().resolve()))  # cwd-proof
    cfg = with_model_defaults(cfg, model_defaults(resolve_model_path(cfg.model)))
    run_dir = Path(cfg.output_dir)
    check_run_files(run_dir)  # a symbolic link among the run's files: refused before anything is written
    if not resume and any(CHECKPOINT_NAME.fullmatch(p.name) for p in (run_dir / "checkpoints").glob("step_*")):
        # before the lock, as every refusal: a refused run leaves the directory as it was
        raise ValueError(f"{run_dir} already holds checkpoints: continue with `imagerl sft --output-dir "
                         f"{shlex.quote(str(run_dir.absolute()))} --resume latest` or pick another --output-dir")
    with hold_run_dir(run_dir, World(0, 1, torch.device("cpu"))):  # one writer, as imagerl train (run_lock.py)
        return _sft(cfg, examples, run_dir, resume)


def _sft(cfg: SFTConfig, examples, run_dir: Path, resume: str | None) -> SFTRun:
    from imagerl.run.metrics import MetricsLogger, memory_metrics, progress_bar

    if resume:
        recover_interrupted(run_dir)  # the lock is held: finish a checkpoint swap a kill interrupted
    resume_from = resolve_resume(resume, run_dir) if resume else None
    if resume_from is not None:
        check_checkpoint(resume_from)  # its files, before the model loads
    device = resolve_device(cfg.device)
    adapter, base = load_sft_adapter(cfg, device)
    adapter.latent_grid(cfg.height, cfg.width)  # the size suits the family
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "sft_config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False))
    params = adapter.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                                  weight_decay=cfg.weight_decay)
    start = 0
    if resume_from is not None:
        if cfg.lora_rank and not (resume_from / "lora").is_dir():
            raise ValueError(f"{resume_from} is a full fine-tuning checkpoint; resume with lora_rank=0")
        full = not cfg.lora_rank
        start = (load_full_checkpoint(resume_from, adapter.transformer, optimizer) if full
                 else load_checkpoint(resume_from, adapter, optimizer))
    with progress_bar(len(examples), "encode images", True, unit="img", leave=False) as pb:
        latents = encode_dataset(adapter, examples, cfg, pb)
    logger = MetricsLogger(run_dir, True, cfg.tensorboard)
    logger.truncate_after(start)
    if start == 0 and cfg.validation_prompts:
        logger.log(0, validate_samples(adapter, cfg, run_dir, 0), echo=lambda s: None)
    bar = progress_bar(cfg.num_steps, "sft", True, unit="step")
    bar.update(start)
    window: dict[str, list[float]] = {"loss": [], "grad_norm": [], "time": []}
    checkpoint = resume_from
    for step in range(start, cfg.num_steps):
        tic = time.perf_counter()
        lr = cfg.lr * min(1.0, (step + 1) / cfg.lr_warmup_steps) if cfg.lr_warmup_steps else cfg.lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        draw = draw_step(cfg, step, len(examples), adapter)
        captions = [cfg.null_caption if d else examples[i].caption for i, d in zip(draw.indices, draw.dropped_B.tolist())]
        cond = adapter.conditioning(adapter.encode_prompts(captions, cfg.max_sequence_length), None, 1.0)
        x0 = latents[draw.indices].to(adapter.device)
        with torch.enable_grad():  # also when the caller is under no_grad
            loss = flow_matching_loss(adapter, x0, draw.noise_BNC, draw.sigmas_B, cond, cfg.height, cfg.width)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        clip = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        optimizer.step()
        done = step + 1
        window["loss"].append(loss.item())
        window["grad_norm"].append(grad_norm.item())
        window["time"].append(time.perf_counter() - tic)
        bar.set_postfix(loss=f"{window['loss'][-1]:.4g}")
        bar.update(1)
        metrics = {}
        if done % cfg.log_every == 0 or done == cfg.num_steps:
            seconds = sum(window["time"]) / len(window["time"])
            metrics = {"sft/loss": _mean(window["loss"]), "sft/grad_norm": _mean(window["grad_norm"]), "sft/lr": lr,
                       "sft/epoch": done * cfg.batch_size / len(examples), "time/step_s": seconds,
                       "perf/images_per_s": cfg.batch_size / seconds, **memory_metrics(device)}
            window = {k: [] for k in window}
        if cfg.validation_prompts and ((cfg.validation_every and done % cfg.validation_every == 0) or done == cfg.num_steps):
            metrics.update(validate_samples(adapter, cfg, run_dir, done))
        if metrics:
            logger.log(done, metrics, echo=lambda s: None)
        if done % cfg.checkpoint_every == 0 or done == cfg.num_steps:
            config = dataclasses.asdict(cfg)
            checkpoint = (save_checkpoint(run_dir, done, adapter, optimizer, config, cfg.keep_checkpoints) if cfg.lora_rank
                          else save_full_checkpoint(run_dir, done, adapter.transformer, base, optimizer, config,
                                                    cfg.keep_checkpoints))
    bar.close()
    logger.close()
    return SFTRun(run_dir, adapter, checkpoint)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@torch.no_grad()
def validate_samples(adapter, cfg: SFTConfig, run_dir: Path, step: int) -> dict[str, float]:
    """ODE samples of the validation prompts (image i from the noise of (seed, i)) -> images/validation_<step>.png;
    the number under each tile is the training step."""
    from imagerl.run.metrics import save_image_grid
    from imagerl.rollout import ode_sample

    tic = time.perf_counter()
    prompts, h, w = cfg.validation_prompts, cfg.height, cfg.width
    guidance = adapter.default_guidance_scale if cfg.validation_guidance is None else cfg.validation_guidance
    noise = torch.cat([adapter.initial_noise([make_generator(cfg.seed, "sft/validation", i)], h, w)
                       for i in range(len(prompts))])
    latents = ode_sample(adapter, prompts, num_steps=cfg.validation_steps or adapter.default_num_steps,
                         guidance_scale=guidance, height=h, width=w, initial_noise_BNC=noise,
                         negative_prompt=cfg.null_caption, max_sequence_length=cfg.max_sequence_length)
    images = adapter.decode(latents, h, w).cpu()
    save_image_grid(images, torch.full((len(prompts),), float(step)), run_dir / "images" / f"validation_{step:06d}.png",
                    captions=prompts)
    return {"time/validation_s": time.perf_counter() - tic}


def export_model(run_dir: str | Path, out_dir: str | Path, dtype: str = "auto", link: bool = False) -> Path:
    """A standalone diffusers-format checkpoint at out_dir from a run's latest checkpoint (or a checkpoint dir):
    the base components (copied; symlinked with `link`) and the fine-tuned transformer (LoRA merged), saved in
    `dtype` ("auto": the dtype of the base checkpoint's transformer weights). Loads with `--model out_dir`
    and with the family's diffusers pipeline's from_pretrained."""
    import shutil

    try:
        path = resolve_resume(str(run_dir), Path(run_dir))
    except ValueError:
        raise ValueError(f"export: {run_dir} is neither an sft run directory nor a checkpoint") from None
    config = check_checkpoint(path).get("config", {})  # checksums and format, as a resume checks them
    if not isinstance(config.get("model"), str):
        raise ValueError(f"{path / 'state.json'}: its config names no base model ('model'): not an sft checkpoint")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"export target {out} exists and is not empty")
    hint = "export an earlier checkpoint (imagerl sft --export <run>/checkpoints/step_N OUT_DIR)"
    if (path / "model").is_dir():  # full fine-tuning: the checkpoint is already a complete model
        import diffusers

        source = path / "model"
        check_weights_dir(source / "transformer", hint)  # finite floats: no NaN model leaves as a standalone one
        index = json.loads((source / "model_index.json").read_text())
        transformer = getattr(diffusers, index["transformer"][1]).from_pretrained(
            source, subfolder="transformer", torch_dtype=torch.float32)
    else:
        source = resolve_model_path(config["model"])
        transformer = merged_lora_transformer(source, check_lora_dir(path / "lora"))
    base_weights = resolve_model_path(config["model"]) / "transformer"
    target = _weights_dtype(base_weights) if dtype == "auto" else resolve_dtype(dtype, torch.device("cpu"))
    torch.nn.Module.to(transformer, target)  # (ModelMixin.to warns about _keep_in_fp32_modules; these have none)
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    save_model_dir(source, transformer, tmp, link=link)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    return out


def _weights_dtype(folder: Path) -> torch.dtype:
    """The dtype of the first tensor in a safetensors weights folder (float32 if there is none)."""
    from safetensors import safe_open

    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                return names.get(f.get_slice(key).get_dtype(), torch.float32)
    return torch.float32
