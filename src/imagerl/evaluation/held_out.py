"""Held-out evaluation: deterministic ODE samples of the test prompts, scored, gathered over ranks.

Image i of the test set (its global index) always starts from the noise of (eval.seed, "eval", i),
so an evaluation does not depend on the batch size, the number of ranks or the step it runs at:
the reward changes only when the weights change. Sampling is the Euler ODE (rollout.ode_sample,
noise level 0) with eval.num_steps steps and eval.guidance_scale (else sample.guidance_scale, else
the family's default) at sample.height x sample.width.

Ranks: rank r evaluates the contiguous block r of the test prompts split into world.size parts
(data.rank_block; the first N % W ranks take one more), so every prompt is evaluated exactly once.
Per-sample rewards are padded to the largest block, all-gathered and unpadded, so every rank returns
the same metrics.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from imagerl.data.prompts import PromptSet, rank_block
from imagerl.distributed.parallel import World
from imagerl.distributed.rng import make_generator
from imagerl.run.metrics import progress_bar, save_image_grid
from imagerl.rewards.registry import RewardError
from imagerl.rollout import ode_sample

GRID_IMAGES = 16


@dataclass
class EvalSettings:
    num_steps: int
    guidance_scale: float
    height: int
    width: int
    seed: int
    batch_size: int
    negative_prompt: str
    num_prompts: int
    max_sequence_length: int = 512
    decode_batch_size: int = 0  # images per VAE decode; 0: as many as make DECODE_PIXELS (512 px: 4, 1024 px: 1)


# pixels per VAE decode by default: the float32 decoder keeps ~6.5 kB per pixel (perf/memory_estimate.py), so 2^20
# pixels take ~6.4 GiB whatever the evaluation's batch
DECODE_PIXELS = 2**20


def decode_in_chunks(adapter, latents: torch.Tensor, settings: EvalSettings) -> torch.Tensor:
    """(B, 3, H, W) float32 on the CPU, decoded settings.decode_batch_size images at a time."""
    h, w = settings.height, settings.width
    chunk = settings.decode_batch_size or max(1, DECODE_PIXELS // (h * w))
    return torch.cat([adapter.decode(latents[a : a + chunk], h, w).float().cpu()
                      for a in range(0, latents.shape[0], chunk)])


@dataclass
class EvalResult:
    """Everything one evaluation produced, identical on every rank except `errors` and `grid_images_B3HW`.

    total_N / components (name -> (N,)) float64 and valid_N bool are per test prompt in test-set order
    (NaN where a reward failed); grid_images_B3HW: the first min(16, N) images (rank 0 only, else None);
    extra: name -> (N, width) float64, the tables of run_evaluation's extra_columns on the same images."""

    metrics: dict[str, float]
    settings: EvalSettings
    prompts: list[str]
    total_N: torch.Tensor
    components: dict[str, torch.Tensor]
    valid_N: torch.Tensor
    errors: list[str] = field(default_factory=list)
    grid_images_B3HW: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def eval_settings(cfg, adapter, test_set: PromptSet) -> EvalSettings:
    e, s = cfg.eval, cfg.sample
    guidance = e.guidance_scale if e.guidance_scale is not None else s.guidance_scale
    if guidance is None:
        guidance = adapter.default_guidance_scale
    n = len(test_set) if e.max_prompts <= 0 else min(e.max_prompts, len(test_set))
    return EvalSettings(e.num_steps, float(guidance), s.height, s.width, e.seed, e.batch_size, s.negative_prompt, n,
                        s.max_sequence_length, s.decode_batch_size)


def eval_noise(adapter, seed: int, indices, height: int, width: int) -> torch.Tensor:
    """Initial noise (B, N, C) of the test images with these global indices: image i from (seed, "eval", i)."""
    return torch.cat([adapter.initial_noise([make_generator(seed, "eval", i)], height, width) for i in indices])


@torch.no_grad()
def run_evaluation(adapter, scorer, test_set: PromptSet, cfg, world: World, progress: bool = True,
                   reward_names: list[str] | None = None, extra_columns: dict | None = None) -> EvalResult:
    """Sample and score this rank's block of the test prompts, gather the rewards of all ranks.

    reward_names: the components to report (default: the names in cfg.reward.weights, the rewards the
    scorer was built from). extra_columns: name -> (width, score(images_B3HW, prompts, metadata) -> (B, width)),
    more measures of the same images (an evaluation suite whose images these are), in EvalResult.extra. With reward.on_error=error a failed or non-finite reward raises RewardError
    on every rank (after the gather, so no rank is left waiting); with skip it is counted."""
    start_time = time.perf_counter()
    settings = eval_settings(cfg, adapter, test_set)
    n = settings.num_prompts
    if n == 0:
        raise ValueError("the held-out prompt set is empty")
    names = list(reward_names if reward_names is not None else cfg.reward.weights)
    errors: list[str] = []
    extra_columns = extra_columns or {}

    def score(images, prompts, metadata):
        rows = _score_rows(scorer, images, prompts, metadata, names, errors)
        return torch.cat([rows, *(fn(images, prompts, metadata) for _, fn in extra_columns.values())], dim=1)

    widths = [w for w, _ in extra_columns.values()]
    table, grid = generate_and_score(adapter, test_set.prompts[:n], test_set.metadata, settings, world, score,
                                     2 + len(names) + sum(widths), grid_count=min(GRID_IMAGES, n), progress=progress)
    total, valid = table[:, 0], table[:, 1] == 1
    components = {name: table[:, 2 + j] for j, name in enumerate(names)}
    bounds = np.cumsum([2 + len(names), *widths]).tolist()
    extra = {name: table[:, a:b] for name, a, b in zip(extra_columns, bounds, bounds[1:])}

    failed = int((~valid).sum())
    if failed and cfg.reward.on_error == "error":
        where = "; ".join(errors[:2]) or "on other ranks, or NaN/inf values"
        raise RewardError(f"evaluation: {failed} of {n} held-out samples have no finite reward ({where}); "
                          "reward.on_error=error (reward.on_error=skip counts them in eval/reward/failed_count)")
    ok = total[valid]
    metrics: dict[str, float] = {
        "eval/reward/raw_mean": ok.mean().item() if ok.numel() else float("nan"),
        "eval/reward/raw_std": ok.std(correction=0).item() if ok.numel() else float("nan"),
    }
    for name, values in components.items():
        finite = values[torch.isfinite(values)]
        metrics[f"eval/reward/{name}_mean"] = finite.mean().item() if finite.numel() else float("nan")
    metrics["eval/reward/failed_count"] = failed
    metrics["eval/num_prompts"] = n
    metrics["time/eval_s"] = time.perf_counter() - start_time
    return EvalResult(metrics, settings, list(test_set.prompts[:n]), total, components, valid, errors, grid, extra)


@torch.no_grad()
def generate_and_score(adapter, prompts: list[str], metadata: list[dict], settings: EvalSettings, world: World,
                       score_batch, width: int, grid_count: int = 0, progress: bool = True, desc: str = "eval",
                       overlap: bool | None = None):
    """ODE-sample prompt i from noise (settings.seed, "eval", i) on the rank that holds i (data.rank_block), score
    each batch with score_batch(images_B3HW, prompts, metadata) -> (B, width) float64, and gather every rank's
    rows. Returns (the (len(prompts), width) table in prompt order, the first grid_count images on rank 0).

    overlap (default: on a GPU): score in one background thread while the next batch samples (at most 2 batches
    wait; rows keep their order), so OCR or a reward model on the CPU costs no sampling time. On a CPU the two
    would share the same cores, so it is off there."""
    n, h, w = len(prompts), settings.height, settings.width
    if overlap is None:
        overlap = torch.device(adapter.device).type == "cuda"
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eval-score") if overlap else None
    pending: list[Future] = []
    adapter.transformer.eval()
    block = rank_block(n, world.rank, world.size)
    first_block = len(rank_block(n, 0, world.size))
    keep = max(0, min(block.stop, grid_count) - block.start)  # this rank's images among the first grid_count
    rows, kept_images = [], []
    bar = progress_bar(len(block), desc, progress and world.is_main, unit="img", leave=False)
    # every rank runs the same number of batches (FSDP gathers weights collectively in each forward): a rank
    # with a shorter block runs a discarded batch of prompt 0 instead
    for start in range(block.start, block.start + first_block, settings.batch_size):
        idx = range(start, min(start + settings.batch_size, block.stop))
        if not len(idx):
            if world.fsdp:
                ode_sample(adapter, prompts[:1], num_steps=settings.num_steps,
                           guidance_scale=settings.guidance_scale, height=h, width=w,
                           initial_noise_BNC=eval_noise(adapter, settings.seed, range(1), h, w),
                           negative_prompt=settings.negative_prompt, batch_size=1,
                           max_sequence_length=settings.max_sequence_length)
            continue
        batch_prompts = [prompts[i] for i in idx]
        batch_metadata = [metadata[i] if i < len(metadata) else {} for i in idx]
        latents = ode_sample(adapter, batch_prompts, num_steps=settings.num_steps,
                             guidance_scale=settings.guidance_scale, height=h, width=w,
                             initial_noise_BNC=eval_noise(adapter, settings.seed, idx, h, w),
                             negative_prompt=settings.negative_prompt, batch_size=len(idx),
                             max_sequence_length=settings.max_sequence_length)
        images = decode_in_chunks(adapter, latents, settings)
        if executor is None:
            rows.append(score_batch(images, batch_prompts, batch_metadata))
        else:
            if len(pending) >= 2:  # backpressure: images are not piled up faster than they are scored
                rows.append(pending.pop(0).result())
            pending.append(executor.submit(score_batch, images, batch_prompts, batch_metadata))
        if len(kept_images) < keep:
            kept_images.extend(images[: keep - len(kept_images)])
        bar.update(len(idx))
    if executor is not None:
        rows.extend(f.result() for f in pending)
        executor.shutdown()
    bar.close()
    local = torch.full((first_block, width), float("nan"), dtype=torch.float64)
    if rows:
        mine = torch.cat(rows)
        local[: mine.shape[0]] = mine
    table = unpad_gathered(world.all_gather(local.to(world.device)).cpu(), n, world.size)
    grid = _gather_grid(kept_images, n, grid_count, world, h, w) if grid_count else None
    return table, grid


def unpad_gathered(gathered: torch.Tensor, n: int, world_size: int) -> torch.Tensor:
    """Rows of the n items in global order from an all_gather of per-rank blocks (data.rank_block) each padded
    to rank 0's block length."""
    pad = len(rank_block(n, 0, world_size))
    if gathered.shape[0] != pad * world_size:
        raise ValueError(f"gathered {gathered.shape[0]} rows, expected {world_size} blocks of {pad}")
    return torch.cat([gathered[r * pad : r * pad + len(rank_block(n, r, world_size))] for r in range(world_size)])


def _score_rows(scorer, images, prompts, metadata, names, errors) -> torch.Tensor:
    """(B, 2 + len(names)) float64: total, valid (1/0), then each component (NaN when missing or failed)."""
    b = images.shape[0]
    out = torch.full((b, 2 + len(names)), float("nan"), dtype=torch.float64)
    out[:, 1] = 0
    try:
        rewards = scorer.score(images, prompts, metadata)
    except RewardError as e:
        errors.append(str(e))
        return out
    total = torch.as_tensor(rewards.total_B, dtype=torch.float64).reshape(-1).cpu()
    valid = torch.as_tensor(rewards.valid_B).reshape(-1).cpu().bool() & torch.isfinite(total)
    out[:, 0] = total
    out[:, 1] = valid.double()
    for j, name in enumerate(names):
        if name in rewards.components:
            out[:, 2 + j] = torch.as_tensor(rewards.components[name], dtype=torch.float64).reshape(-1).cpu()
    return out


def _gather_grid(kept: list[torch.Tensor], n: int, grid_count: int, world: World, h: int, w: int) -> torch.Tensor | None:
    """The first grid_count test images on rank 0 (None elsewhere). They are all on rank 0 unless its block
    is shorter; then the ranks holding some send them (uint8, padded to rank 0's count) in one all_gather.
    Every rank takes the same branch (it depends on n and the world size only)."""
    first_block = len(rank_block(n, 0, world.size))
    if first_block >= grid_count:
        return torch.stack(kept) if world.is_main and kept else None
    local = torch.zeros((first_block, 3, h, w), dtype=torch.uint8)
    if kept:
        local[: len(kept)] = (torch.stack(kept).clamp(0, 1) * 255).round().to(torch.uint8)
    gathered = world.all_gather(local.to(world.device)).cpu()
    if not world.is_main:
        return None
    blocks = [rank_block(n, r, world.size) for r in range(world.size)]
    counts = [max(0, min(block.stop, grid_count) - block.start) for block in blocks]
    return torch.cat([gathered[r * first_block : r * first_block + c] for r, c in enumerate(counts)]).float() / 255


def evaluate(adapter, scorer, test_set: PromptSet, cfg, world: World, step: int, run_dir: Path | None = None,
             progress: bool = True, suites=None) -> dict[str, float]:
    """Held-out metrics (eval/reward/raw_mean, raw_std, <name>_mean, failed_count, eval/num_prompts, time/eval_s),
    the same on every rank. On rank 0 with run_dir: a grid of the first 16 images with prompts and rewards
    at run_dir/images/eval_<step:06d>.png, and beside it eval_<step:06d>.json with every held-out prompt in full
    and its rewards. suites (suites.run.TrainingSuites): those whose images are the held-out ones are measured on
    them, their metrics added. Leaves the adapter in eval mode."""
    columns = suites.held_out_columns() if suites is not None else {}
    held_out_rewards = None
    if cfg.data.mixture:  # only the rewards of the sets that have held-out prompts score them
        held_out_rewards = list(dict.fromkeys(n for m in cfg.data.mixture if m.test_prompts for n in m.rewards))
    result = run_evaluation(adapter, scorer, test_set, cfg, world, progress=progress, extra_columns=columns,
                            reward_names=held_out_rewards)
    if columns:
        result.metrics.update(suites.held_out_metrics(result.extra))
    if cfg.data.mixture:  # each set's held-out prompts, scored by its rewards
        from imagerl.data.mixture import set_metrics

        result.metrics.update(set_metrics("eval", [m.name for m in cfg.data.mixture], test_set.metadata[:len(result.prompts)],
                                          result.total_N, result.valid_N, result.components, world))
    if world.is_main and run_dir is not None:
        grid = save_eval_grid(result, Path(run_dir) / "images" / f"eval_{step:06d}.png")
        if grid is not None:  # the full prompts (the grid cuts them at 3 lines) and every held-out reward
            import json

            record = {"step": step, "grid_tiles": result.grid_images_B3HW.shape[0], "samples": sample_records(result)}
            grid.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    return result.metrics


def sample_records(result: EvalResult) -> list[dict]:
    """Per held-out prompt, in test-set order: index, full prompt, total reward, valid, each component."""
    from imagerl.run.metrics import _clean

    return [{"index": i, "prompt": p, "reward": _clean(result.total_N[i].item()), "valid": bool(result.valid_N[i]),
             **{name: _clean(v[i].item()) for name, v in result.components.items()}}
            for i, p in enumerate(result.prompts)]


def save_eval_grid(result: EvalResult, path: Path) -> Path | None:
    if result.grid_images_B3HW is None:
        return None
    k = result.grid_images_B3HW.shape[0]
    save_image_grid(result.grid_images_B3HW, result.total_N[:k], path, columns=min(8, k), captions=result.prompts[:k])
    return path


def apply_reward_overrides(cfg, overrides: list[str]) -> None:
    """`reward.key=value` items (the only settings `imagerl eval` takes besides its flags) into cfg."""
    import yaml

    from imagerl.config import _set, safe_load_yaml

    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.startswith("reward."):
            raise ValueError(f"{item[:60]!r}: only reward settings can be given here, as reward.key=value "
                             "(e.g. reward.clip_model=/models/clip-vit-large-patch14)")
        try:
            _set(cfg, key.strip(), safe_load_yaml(raw, f"override {item[:60]!r}") if raw.strip() else raw)
        except yaml.YAMLError as e:
            raise ValueError(f"{item!r}: cannot parse value: {e}") from e


def check_eval_flags(args) -> None:
    """ValueError for a numeric flag of `imagerl eval` (with or without --suite) out of range, before anything loads."""
    for flag, value, low in (("--steps", args.steps, 1), ("--height", args.height, 1), ("--width", args.width, 1),
                             ("--batch-size", args.batch_size, 1), ("--max-prompts", args.max_prompts, 0),
                             ("--images-per-prompt", getattr(args, "images_per_prompt", None), 1)):
        if value is not None and value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")


def cli_evaluate(args) -> EvalResult:
    """`imagerl eval`: load the model (+ LoRA), evaluate a prompt file or shipped set (data.NAMED_PROMPT_SETS),
    write eval.json and eval_grid.png. Settings not given (size, steps, guidance, the reward) come from the
    model's imagerl_defaults.json, else the family's (jpeg_compressibility for the reward). Runs on one process
    or under torchrun (each rank evaluates its block; rank 0 writes)."""
    import dataclasses
    import json

    from imagerl.run.checkpoint import check_lora_dir, load_lora
    from imagerl.components import resolve_dtype, resolve_model_path
    from imagerl.config import Config
    from imagerl.data.prompts import load_prompt_set, resolve_prompt_file
    from imagerl.distributed.parallel import init_world
    from imagerl.families.registry import family_class
    from imagerl.run.metrics import _clean
    from imagerl.families.model_defaults import model_defaults
    from imagerl.rewards import Scorer
    from imagerl.rewards.registry import check_reward_config, check_reward_names, validate_prompts

    check_eval_flags(args)
    world = init_world(args.device)
    path = resolve_model_path(args.model, world)
    defaults = model_defaults(path)  # for the settings not given as flags (all None: the family's)
    cfg = Config(recipe="eval")
    apply_reward_overrides(cfg, args.overrides)
    check_reward_names({}, cfg.reward)  # imports reward.plugins and entry points: their failures named as such
    if args.reward is None and defaults.rewards:
        try:
            check_reward_names(dict.fromkeys(defaults.rewards, 1.0), cfg.reward)
        except ValueError as e:
            raise ValueError(f"{defaults.source}: 'rewards': {e}") from None
    cfg.reward.weights = {name: 1.0 for name in (args.reward or defaults.rewards or ["jpeg_compressibility"])}
    cfg.reward.on_error = args.on_error
    check_reward_config(cfg.reward)  # names and reward-model paths, before anything slow
    test_set = load_prompt_set(resolve_prompt_file(args.prompts), key="--prompts")
    validate_prompts(cfg.reward.weights, test_set.prompts, test_set.metadata, cfg.reward)

    lora = check_lora_dir(Path(args.lora)) if args.lora else None  # read and checked before the model loads
    family = family_class(path, args.family or "auto")
    cfg.sample.height, cfg.sample.width, cfg.eval.num_steps, cfg.eval.guidance_scale = defaults.sampling(
        family, height=args.height, width=args.width, num_steps=args.steps, guidance_scale=args.guidance)
    cfg.sample.negative_prompt = args.negative_prompt
    scorer = Scorer(cfg.reward, world.device)  # before the model: a served reward's server answers first
    if cfg.reward.remote:  # and checks the prompts
        scorer.validate_prompts(test_set.prompts, test_set.metadata)
    adapter = family.from_pretrained(path, world.device, resolve_dtype(args.dtype, world.device))
    if lora is not None:
        load_lora(adapter, lora)
    cfg.eval.seed, cfg.eval.batch_size, cfg.eval.max_prompts = args.seed, args.batch_size, args.max_prompts
    if world.is_main:
        s = eval_settings(cfg, adapter, test_set)
        print(f"eval: {s.num_prompts} prompts, {s.height}x{s.width} px, {s.num_steps} steps, guidance "
              f"{s.guidance_scale:g}, reward {' + '.join(cfg.reward.weights)}"
              + (f" (defaults: the model's {defaults.source.name})" if defaults.source else ""))

    result = run_evaluation(adapter, scorer, test_set, cfg, world)
    if world.is_main:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        samples = sample_records(result)
        record = {"model": str(args.model), "family": adapter.name, "lora": args.lora, "prompts": str(args.prompts),
                  "rewards": cfg.reward.weights, "settings": dataclasses.asdict(result.settings),
                  "model_defaults": str(defaults.source) if defaults.source else None,
                  "ranks": world.size, "metrics": {k: _clean(v) for k, v in result.metrics.items()}, "samples": samples}
        (out / "eval.json").write_text(json.dumps(record, indent=1) + "\n")
        grid = save_eval_grid(result, out / "eval_grid.png")
        width = max(len(k) for k in result.metrics)
        for key, value in result.metrics.items():
            print(f"{key:<{width}}  {value:.6g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
        print(f"wrote {out / 'eval.json'}" + (f" and {grid}" if grid else ""))
    world.barrier()
    return result
