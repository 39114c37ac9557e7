"""`imagerl bench`: whole Flow-GRPO iterations on released-size random-weight models, imagerl's loop and a plain
diffusers + peft loop side by side in one process (qwen_image: flow_grpo's, perf/baseline.py, batch 4; qwen_image21:
miles-diffusion's 1-GPU loop on QwenImage21Pipeline, perf/baseline21.py, rollout batch 8, training micro-batch 4,
no prefix KV cache), with MFU over the bf16 matmul ceiling measured in the same run.

Geometry (flow_grpo's Qwen-Image recipe, per GPU): one prompt x group 16 per iteration, 512 px, 10 steps,
SDE window {3, 4}, 2 optimizer steps per iteration, LoRA r64/a128 on the family's targets (12 / 7), the real
`pickscore` reward on a random CLIP ViT-H/14, the text encoder at its released size; qwen_image with true CFG 4,
qwen_image21 without CFG. Each variant runs `warmup` iterations, then `iterations` measured ones.

Counting (perf/flops.py, from diffusers' transformer_qwenimage.py): rollout FLOPs = samples x steps x
(cond forward at the prompt's length + uncond forward at the negative prompt's length); training FLOPs =
samples x SDE steps x (forward + activation-gradient backward [+ recompute with gradient checkpointing]),
i.e. recompute is counted as work done (hardware FLOPs). Text encoder, VAE and reward are not counted
(they are in the end-to-end time). Padding of cond/uncond rows to one length is not counted as work.
qwen_image21: no uncond row, block-causal attention, KV-cached rollout steps counted as such (sample.kv_cache).
"""

from __future__ import annotations

import gc
import json
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch._dynamo.exc

from imagerl.perf.bench_rows import Row, format_table, iteration_record, make_row
from imagerl.perf.family_parts import MODULE_FAMILIES, _forward_flops, family_module

FAMILIES = ("qwen_image", "qwen_image21", "sd3", "flux")
RECIPES = {"qwen_image": "qwen_image_jpeg", "qwen_image21": "qwen_image21_jpeg", "sd3": "sd3_5_ocr", "flux": "flux_ocr"}
NFT_RECIPES = {"qwen_image": "qwen_image_nft_ocr", "qwen_image21": "qwen_image21_nft_ocr", "sd3": "sd3_5_nft_ocr",
               "flux": "flux_ocr"}
ALGORITHMS = ("flow_grpo", "diffusion_nft")
GEOMETRY = ["sample.prompts_per_rollout=1", "sample.group_size=16", "sample.height=512", "sample.width=512",
            "sample.num_steps=10", "sample.num_sde_steps=2", "sample.sde_window_start=3", "train.num_optimizer_steps=2",
            "model.lora_rank=64", "model.lora_alpha=128", "model.lora_init=gaussian", "reward.weights={pickscore: 1.0}"]
DRY_GEOMETRY = ["sample.group_size=4", "sample.height=64", "sample.width=64", "sample.num_steps=6",
                "sample.batch_size=2", "train.batch_size=0", "model.lora_rank=4", "model.lora_alpha=8", "parallel.compile=false"]
# the qwen_image recipe: regional compile, rollout batch 16 merged off the window, training batch 4 without
# checkpointing, text capped at 128 tokens (what won on the H200, benchmarks/LOG.md runs J-K); the eager row
# is run E's (it alone takes ~100 s of a 10-minute run). The memory row pads every forward's text to the cap (a
# long negative prompt), the recipe's worst case.
TEXT_CAP_NEGATIVE_PROMPT = " ".join(["word"] * 140)  # 140 tokens, truncated to the recipe's 128
DEFAULT_VARIANTS = {
    "qwen_image": {"imagerl (recipe: compile, rollout 16 merged, train 4, no checkpointing)": [],
                   "imagerl, train 8 with checkpointing (any text length)": [
                       "train.batch_size=8", "model.gradient_checkpointing=true", "sample.max_sequence_length=512"],
                   "imagerl (recipe), off-window steps in FP8": ["sample.off_window_fp8=true"],
                   "imagerl (recipe), every row at the 128-token text cap": [
                       f"sample.negative_prompt={TEXT_CAP_NEGATIVE_PROMPT}"]},
    # the qwen_image21 recipe: regional compile, rollout and training batch 8, merged and KV-cached off the window,
    # no checkpointing (LOG.md runs AB, AD); training batch 4 is the 80 GB card's setting
    "qwen_image21": {"imagerl (recipe: compile, batch 8 merged and KV-cached, no checkpointing)": [],
                     "imagerl (recipe), train 4 (80 GB cards)": ["train.batch_size=4"],
                     "imagerl (recipe), off-window steps not KV-cached": ["sample.kv_cache=false"],
                     "imagerl (recipe), off-window steps in FP8": ["sample.off_window_fp8=true"]},
}


# torch._dynamo.exc.TorchDynamoException: Dynamo's and Inductor's errors (InductorError subclasses it), e.g. torch
# 2.11's tiling assertion on FLUX.1's compiled blocks (benchmarks/LOG.md run AZ)
CompileFailure = torch._dynamo.exc.TorchDynamoException


def compile_failure_note(error: BaseException) -> str:
    """One line: the compiler's exception class and the last line of its message that says something."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not line.startswith("Set TORCH")]
    return f"compile failed: {type(error).__name__}" + (f": {lines[-1][:160]}" if lines else "")


def geometry(family: str, dry: bool) -> list[str]:
    """The bench geometry's overrides for the family (its module's settings after the shared ones)."""
    module = family_module(family)
    own = module.GEOMETRY + (module.DRY_GEOMETRY if dry else []) if module else []
    return GEOMETRY + (DRY_GEOMETRY if dry else []) + own


for _family in MODULE_FAMILIES:
    DEFAULT_VARIANTS[_family] = family_module(_family).DEFAULT_VARIANTS
# `--algorithm diffusion_nft`: the NFT recipe with and without timestep staging beside the family's Flow-GRPO recipe
# (a variant's `recipe=NAME` picks its recipe; the bench geometry and reward apply to all)
NFT_VARIANTS = {family: {"flow_grpo recipe": [f"recipe={RECIPES[family]}"],
                         "diffusion_nft recipe": [f"recipe={NFT_RECIPES[family]}"],
                         "diffusion_nft recipe, timestep staging": [f"recipe={NFT_RECIPES[family]}",
                                                                    "train.timestep_staging=true"]}
                for family in FAMILIES}
BASELINE_BATCH_SIZE = 4  # flow_grpo's Qwen-Image sample / train batch per GPU
BASELINE21_BATCH_SIZE, BASELINE21_TRAIN_BATCH_SIZE = 8, 4  # miles-diffusion's 1-GPU Qwen-Image 2.1 rollout / train


def _prompts() -> list[str]:
    from imagerl.data.prompts import bundled_prompt_file, load_prompts

    shared = Path(__file__).resolve().parents[3] / ".." / "shared" / "datasets" / "ocr" / "prompts.txt"
    return load_prompts(shared if shared.is_file() else bundled_prompt_file())[:64]


def _peak_gib(device: torch.device) -> float:
    """Peak GPU memory since the last call (metrics.memory_metrics reads and resets it); nan on a CPU."""
    from imagerl.run.metrics import memory_metrics

    return memory_metrics(device).get("memory/peak_allocated_gib", float("nan"))


def _alloc_retries(device: torch.device) -> int:
    """The caching allocator's cudaMalloc retries so far (each one a cache flush and a stall); 0 on a CPU."""
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0) if device.type == "cuda" else 0


def variant_config(family: str, base_overrides: list[str], overrides: list[str]):
    """The family's recipe (or the variant's `recipe=NAME`) in the bench geometry with the variant's overrides,
    validated."""
    from imagerl.config import load_config
    from imagerl.validation import validate

    recipes = [o.partition("=")[2] for o in overrides if o.startswith("recipe=")]
    overrides = [o for o in overrides if not o.startswith("recipe=")]
    cfg = load_config(recipes[-1] if recipes else RECIPES[family], base_overrides + overrides)
    validate(cfg)
    return cfg


def parse_variants(specs: list[str]) -> dict[str, list[str]]:
    """`--variant` values, 'name:section.key=value,section.key=value', as name -> overrides."""
    variants = {}
    for spec in specs:
        name, _, overrides = spec.partition(":")
        name, items = name.strip(), [o.strip() for o in overrides.split(",") if o.strip()]
        if not name:
            raise ValueError(f"--variant {spec!r} must look like 'name:section.key=value,section.key=value'")
        if any("=" not in o for o in items):
            raise ValueError(f"--variant {spec!r}: the name ends at the first ':', so {name!r} is the name "
                             f"and {overrides!r} the overrides (section.key=value, comma-separated); a name cannot "
                             f"contain ':'")
        variants[name] = items
    return variants


def check_variants(family: str, dry: bool, variants: dict[str, list[str]], profiles) -> None:
    """Every variant and profile validated before the models are built (minutes on the GPU): a bad one is a
    ValueError naming it, not a crash after the rows before it."""
    if family not in FAMILIES:
        raise ValueError(f"imagerl bench: unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    base = geometry(family, dry)
    for name, overrides in [*variants.items(), *((f"--profile {','.join(p)}", p) for p in profiles)]:
        try:
            variant_config(family, base, overrides)
        except ValueError as error:
            raise ValueError(f"variant {name!r}: {error}") from error


class Bench:
    def __init__(self, family: str, device: torch.device, dry: bool, workdir: Path, warmup: int, iterations: int,
                 blocks: int | None = None):
        """blocks: that many transformer blocks at the released dims instead of the released model (real_size)."""
        from imagerl.config import load_config
        from imagerl.perf.real_size import build_qwen_image, build_qwen_image21, save_pickscore_size_clip
        from imagerl.rewards import Scorer

        if family not in FAMILIES:
            raise ValueError(f"imagerl bench: unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
        self.family, self.device, self.dry = family, device, dry
        self.warmup, self.iterations = warmup, iterations
        self.prompts = _prompts()
        save_pickscore_size_clip(workdir / "pickscore", device, dry=dry)
        module = family_module(family)
        build = module.build if module else build_qwen_image if family == "qwen_image" else build_qwen_image21
        t0 = time.perf_counter()
        self.transformer, self.vae, self.text_encoder, self.tokenizer = build(
            device, self.prompts, 1 if dry else None, blocks=None if dry else blocks)
        self.build_s = time.perf_counter() - t0
        self.base_overrides = geometry(family, dry) + [f"reward.pickscore_model={workdir / 'pickscore'}"]
        if device.type != "cuda":
            self.base_overrides.append("model.device=cpu")
        self.scorer = Scorer(load_config(RECIPES[family], self.base_overrides).reward, device)

    def config(self, overrides: list[str]):
        return variant_config(self.family, self.base_overrides, overrides)

    def new_adapter(self):
        """A family adapter around the shared modules (no LoRA yet)."""
        from imagerl.families.qwen_image.tiny import QWEN_IMAGE_SCHEDULER_CONFIG

        module = family_module(self.family)
        if module:
            return module.new_adapter((self.transformer, self.vae, self.text_encoder, self.tokenizer), self.device)
        if self.family == "qwen_image":
            from imagerl.families.qwen_image import QwenImageFamily as Family
        else:
            from imagerl.families.qwen_image21 import QwenImage21Family as Family
        return Family(self.transformer, self.vae, self.text_encoder, self.tokenizer, QWEN_IMAGE_SCHEDULER_CONFIG,
                      self.device, torch.bfloat16)

    def _iteration_flops(self, cfg, adapter, text_tokens: list[int]) -> tuple[int, int]:
        from imagerl.perf.flops import training_flops

        s = cfg.sample
        args = (self.family, self.transformer, adapter.image_seq_len(s.height, s.width), text_tokens,
                cfg.model.lora_rank, adapter.lora_target_modules)
        forward = _forward_flops(*args)
        # kv_cache (qwen_image21): the first rollout step fills the text prefix's cache, later steps reuse it
        rollout_per_sample = forward + (s.num_steps - 1) * (_forward_flops(*args, cached=True) if s.kv_cache else forward)
        if s.merge_lora:  # the off-window steps run no LoRA matmuls: count what ran (kv_cache: as cached steps)
            no_lora = args[:4] + (0,) + args[5:]
            off = _forward_flops(*no_lora, cached=s.kv_cache) - _forward_flops(*args, cached=s.kv_cache)
            rollout_per_sample += (s.num_steps - s.num_sde_steps) * off
        samples = s.prompts_per_rollout * s.group_size
        from imagerl.perf.memory_estimate import checkpointed_blocks

        blocks = len(adapter.transformer_blocks())  # flux: the double- and single-stream blocks
        recomputed = checkpointed_blocks(cfg.model, blocks) / blocks
        train = training_flops(forward, full_fine_tune=False, recompute=recomputed)
        if cfg.train.algorithm != "diffusion_nft":
            return samples * rollout_per_sample, samples * s.num_sde_steps * train
        # DiffusionNFT: every rollout step an ODE step (merged: no LoRA matmuls); per trained timestep the
        # policy's forward + backward, the old policy's forward and (ref_weight > 0) the reference's, without LoRA
        from imagerl.algorithms.diffusion_nft import trained_timesteps

        no_lora = _forward_flops(*args[:4], 0, *args[5:])
        rollout_per_sample = s.num_steps * (no_lora if s.merge_lora else forward)
        per_timestep = train + forward + (no_lora if cfg.nft.ref_weight > 0 else 0)
        return samples * rollout_per_sample, samples * trained_timesteps(s.num_steps, cfg.nft.timestep_fraction) * per_timestep

    def _mean_flops(self, cfg, adapter, text_tokens: list[list[int]]) -> tuple[int, int]:
        """Rollout and training FLOPs per iteration, averaged over the measured iterations' text lengths."""
        flops = [self._iteration_flops(cfg, adapter, lengths) for lengths in text_tokens]
        return sum(f[0] for f in flops) // len(flops), sum(f[1] for f in flops) // len(flops)

    def run_imagerl(self, name: str, overrides: list[str], ceiling: float) -> Row:
        """imagerl's own loop body (train.py): generate (scored as it goes) -> advantages -> the algorithm's update."""
        from imagerl.algorithms import make_algorithm
        from imagerl.algorithms.advantages import rollout_advantages
        from imagerl.algorithms.diffusion_nft import trained_timesteps
        from imagerl.components import make_optimizer, prepare_adapter, resolve_family_defaults
        from imagerl.data.prompts import PromptGroups
        from imagerl.distributed.fsdp import apply_parallelism
        from imagerl.distributed.parallel import World
        from imagerl.run.gc_freeze import GCFreeze
        from imagerl.run.metrics import PhaseTimer
        from imagerl.rewards.scoring import AsyncScorer

        cfg = self.config(overrides)
        adapter = prepare_adapter(self.new_adapter(), cfg)  # as components.load_adapter, on the shared modules
        try:
            resolve_family_defaults(cfg, adapter)
            world = World(0, 1, self.device)
            apply_parallelism(adapter, cfg, world)
            optimizer = make_optimizer(adapter.trainable_parameters(), cfg)
            algo = make_algorithm(cfg, adapter)
            scoring = AsyncScorer(self.scorer, enabled=cfg.reward.async_scoring)
            timer, times, text_tokens = PhaseTimer(self.device), [], []
            _peak_gib(self.device)  # resets the peak
            gc_freeze = GCFreeze(cfg.run.gc_freeze)
            try:
                for it in range(self.warmup + self.iterations):
                    retries = _alloc_retries(self.device)
                    groups = PromptGroups([self.prompts[it % len(self.prompts)]], [{}], [0])
                    with timer("rollout"):
                        rollout = algo.generate(adapter, groups, it, on_batch=scoring.submit)
                    with timer("reward"):
                        scored = scoring.collect()
                        advantages, _ = rollout_advantages(scored.rewards.total_B, scored.rewards.valid_B,
                                                           rollout.group_ids_B, world, cfg.train.global_std)
                    with timer("train"):
                        stats = algo.update(adapter, rollout, advantages, optimizer, world, it)
                    gc_freeze.after_iteration(timer)  # as train.py: after the first iteration (a warm-up one if any)
                    phases, peak = timer.pop_metrics(), _peak_gib(self.device)
                    if it >= self.warmup:
                        negative = getattr(rollout, "negative", None)
                        lengths = [adapter.text_token_count(rollout.text_B[0])] + (
                            [adapter.text_token_count(negative)] if negative is not None else [])
                        text_tokens.append(lengths)
                        # (DiffusionNFT replays nothing: no log-prob difference)
                        lp_diff = getattr(stats, "log_prob_mean_abs_diff", float("nan"))
                        times.append(iteration_record(phases, peak, lp_diff, lengths[0],
                                                      _alloc_retries(self.device) - retries))
            finally:
                scoring.close()
                gc_freeze.close()
            samples = cfg.sample.prompts_per_rollout * cfg.sample.group_size
            nft = cfg.train.algorithm == "diffusion_nft"
            steps = trained_timesteps(cfg.sample.num_steps, cfg.nft.timestep_fraction) if nft else cfg.sample.num_sde_steps
            return make_row(name, overrides, times, *self._mean_flops(cfg, adapter, text_tokens), ceiling, samples,
                            samples * steps, text_tokens[0][0])
        finally:
            self.restore(adapter)

    def run_baseline(self, ceiling: float, gradient_checkpointing: bool | None = None,
                     batch_size: int | None = None) -> Row:
        """The family's plain Flow-GRPO loop on diffusers + peft (qwen_image: perf/baseline.py, true CFG 4;
        qwen_image21: perf/baseline21.py, no CFG), same geometry and reward; batch_size (samples per forward,
        sampling and training) instead of the upstream trainer's."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        from imagerl.families.qwen_image.tiny import QWEN_IMAGE_SCHEDULER_CONFIG
        from imagerl.run.metrics import gc_pauses

        def reward_fn(images, prompts):
            return self.scorer.score(images, prompts, [{}] * len(prompts)).total_B.float()

        cfg = self.config([])
        s = cfg.sample
        module = family_module(self.family)
        if gradient_checkpointing is None:  # flow_grpo checkpoints Qwen-Image's blocks, not SD3's (train_sd3.py)
            gradient_checkpointing = module.BASELINE_CHECKPOINTING if module else True
        torch.manual_seed(cfg.run.seed)  # the LoRA's gaussian init
        modules = dict(scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG), vae=self.vae,
                       text_encoder=self.text_encoder, transformer=self.transformer)
        common = dict(height=s.height, width=s.width, num_steps=s.num_steps, noise_level=s.noise_level,
                      sde_steps=(3, 4), group_size=s.group_size, num_optimizer_steps=cfg.train.num_optimizer_steps,
                      lr=cfg.train.lr, clip_range=cfg.train.clip_range, lora_rank=cfg.model.lora_rank,
                      lora_alpha=cfg.model.lora_alpha, gradient_checkpointing=gradient_checkpointing)
        # the FLOPs of what it runs: every block checkpointed (diffusers), full forwards (no KV cache), the LoRA
        # unmerged on every step (the qwen_image recipe merges it off the window: not the baseline)
        flops_overrides = [f"model.gradient_checkpointing={gradient_checkpointing}", "model.checkpoint_every=1",
                           "sample.kv_cache=false", "sample.merge_lora=false"]
        if module:
            baseline, flops_overrides = module.new_baseline(
                (self.transformer, self.vae, self.text_encoder, self.tokenizer), reward_fn, cfg, self.device,
                gradient_checkpointing, batch_size or module.BASELINE_BATCH_SIZE)
        elif self.family == "qwen_image":
            from diffusers import QwenImagePipeline

            from imagerl.perf.baseline import BaselineSettings, FlowGRPOBaseline

            pipe = QwenImagePipeline(tokenizer=self.tokenizer, **modules)
            settings = BaselineSettings(guidance_scale=4.0, batch_size=batch_size or BASELINE_BATCH_SIZE, **common)
            baseline = FlowGRPOBaseline(pipe, reward_fn, settings, self.device)
        else:
            from diffusers import QwenImage21Pipeline

            from imagerl.perf.baseline21 import BaselineSettings21, FlowGRPOBaseline21

            # the bench's "tokenizer" for 2.1 is a Qwen3VLProcessor (qwen_image21/tiny.py, build_tiny_processor), what
            # QwenImage21Pipeline takes as `processor`; sample_sigmas None: the linspace grid, as the imagerl rows
            pipe = QwenImage21Pipeline(processor=self.tokenizer, **modules)
            settings = BaselineSettings21(batch_size=batch_size or BASELINE21_BATCH_SIZE,
                                          train_batch_size=batch_size or BASELINE21_TRAIN_BATCH_SIZE, **common)
            baseline = FlowGRPOBaseline21(pipe, reward_fn, settings, self.device)

        times, text_tokens = [], []
        _peak_gib(self.device)  # resets the peak
        for it in range(self.warmup + self.iterations):
            retries, (gc_s, gc_full) = _alloc_retries(self.device), gc_pauses()
            r = baseline.iteration(self.prompts[it % len(self.prompts)], generator_seed=it)  # times synchronised
            peak, (gc_s_end, gc_full_end) = _peak_gib(self.device), gc_pauses()
            if it >= self.warmup:
                text_tokens.append(r["text_tokens"])  # 1.0: the padded row length, the prompt's (longer than " ")
                phases = {f"time/{k}": r[k] for k in ("rollout_s", "reward_s", "train_s", "total_s")}
                phases.update({"perf/gc_pause_s": gc_s_end - gc_s, "perf/gc_full_collections": gc_full_end - gc_full})
                times.append(iteration_record(phases, peak, r["log_prob_mean_abs_diff"], r["text_tokens"],
                                              _alloc_retries(self.device) - retries))
        baseline.remove()
        if self.transformer.is_gradient_checkpointing:
            self.transformer.disable_gradient_checkpointing()
        adapter = self.new_adapter()
        if module and adapter.cfg_rows(s.guidance_scale) == 2:  # the negative prompt padded as the prompt (sd3)
            rows = [[length, length] for length in text_tokens]
        elif self.family == "qwen_image":  # a cond and a negative-prompt row per sample (true CFG)
            negative = adapter.encode_prompts([s.negative_prompt])[0].shape[0]
            rows = [[length, negative] for length in text_tokens]
        else:  # no CFG: the cond row only
            rows = [[length] for length in text_tokens]
        flops = self._mean_flops(self.config(flops_overrides), adapter, rows)
        name = "baseline (diffusers+peft)" + (f", batch {batch_size}" if batch_size else "")
        return make_row(name, [], times, *flops, ceiling, s.group_size,
                        s.group_size * s.num_sde_steps, text_tokens[0])

    def vae_bf16_effect(self, num_images: int = 16) -> dict:
        """Decode the same latents (N(0, 1), seeded) with the VAE in fp32 and in bf16 and score both images with
        the reward: what model.vae_dtype=bfloat16 changes (random weights: images and rewards are arbitrary,
        the differences are the decode precision's)."""
        cfg = self.config([])
        adapter = self.new_adapter()
        s = cfg.sample
        latents = adapter.initial_noise([torch.Generator().manual_seed(i) for i in range(num_images)], s.height, s.width)
        images = {}
        # in rollout-sized chunks: 16 images at once in fp32 took more than the 78 GiB an H100 had left with the
        # 2.1 VAE (run Z); the decode is per image, so chunking changes no pixel
        chunks = latents.split(s.batch_size)
        for dtype in (torch.float32, torch.bfloat16):
            self.vae.to(dtype)
            images[dtype] = torch.cat([adapter.decode(chunk, s.height, s.width).cpu() for chunk in chunks])
        self.vae.to(torch.float32)
        prompts = [self.prompts[0]] * num_images
        rewards = {d: self.scorer.score(x, prompts, [{}] * num_images).total_B for d, x in images.items()}
        pixel = (images[torch.bfloat16] - images[torch.float32]).abs()
        delta = (rewards[torch.bfloat16] - rewards[torch.float32]).abs()
        return {"pixel_abs_diff_max": pixel.max().item(), "pixel_abs_diff_mean": pixel.mean().item(),
                "reward_abs_diff_max": delta.max().item(), "reward_abs_diff_mean": delta.mean().item(),
                "reward_std_fp32": rewards[torch.float32].std().item()}

    def restore(self, adapter) -> None:
        """Return the shared transformer (and text encoder) to its plain state for the next variant."""
        adapter.reload_text_encoder()  # model.text_encoder_offload moved the shared encoder's weights to the CPU
        for block in adapter.transformer_blocks():
            block._compiled_call_impl = None  # nn.Module.compile's wrapper
        if self.transformer.is_gradient_checkpointing:
            self.transformer.disable_gradient_checkpointing()
        self.transformer.delete_adapters("default")
        self.transformer.eval()  # a variant stopped mid-update (out of memory) leaves it in train mode
        self.vae.to(torch.float32)
        self.free_memory()

    def free_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def run_bench(family: str = "qwen_image", variants: dict[str, list[str]] | None = None, *, baseline: bool = True,
              warmup: int = 2, iterations: int = 2, dry: bool = False, out: Path | None = None,
              profiles: list[list[str]] = (), echo=print, algorithm: str = "flow_grpo",
              blocks: int | None = None, baseline_batch_sizes: list[int] = ()) -> list[Row]:
    """Profile one step of each config in `profiles` (lists of overrides), then run the family's baseline and each
    variant (name -> overrides); print and return the rows. blocks: a model of that many released-size blocks.
    baseline_batch_sizes: a baseline row per batch size instead of the upstream trainer's (the first is the one
    the ratios divide by)."""
    from imagerl.perf.flops import measure_matmul_flops_per_s
    from imagerl.perf.profile import profile_step

    device = torch.device("cuda" if torch.cuda.is_available() and not dry else "cpu")
    if device.type != "cuda" and not dry:
        raise RuntimeError("imagerl bench needs a CUDA GPU (released-size models); --dry-run checks the code path on CPU")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"imagerl bench: unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if variants is None and algorithm == "diffusion_nft":
        variants = NFT_VARIANTS[family]
    elif variants is None:
        variants = {"imagerl": [], "imagerl grouped": ["model.group_text_lengths=true"]} if dry else DEFAULT_VARIANTS[family]
    check_variants(family, dry, variants, profiles)
    ceiling = measure_matmul_flops_per_s(device, torch.bfloat16, size=512 if dry else 8192, iterations=3 if dry else 20)
    echo(f"bf16 matmul ceiling: {ceiling / 1e12:.1f} TFLOP/s")
    rows, base, vae, profile_text = [], None, None, []
    info = {"family": family, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (dry run)",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "matmul_ceiling_flops": ceiling,
            "warmup": warmup, "iterations": iterations}

    def save():  # after every row, so a run cut short keeps what it measured
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            record = dict(info, build_s=bench.build_s, vae_bf16=vae, rows=[asdict(r) for r in rows])
            (out / f"bench_{family}.json").write_text(json.dumps(record, indent=1))
            (out / f"bench_{family}.md").write_text(format_table(rows, base) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(family, device, dry, Path(tmp), warmup, iterations, blocks=blocks)
        echo(f"built {family} (random weights) in {bench.build_s:.1f} s")
        for overrides in profiles:
            try:
                text = profile_step(bench, overrides, ceiling=None if dry else ceiling)
            except CompileFailure as error:  # a result (the compiler's, not ours): the bench goes on
                text = f"profile {' '.join(overrides)}: {compile_failure_note(error)}"
            echo(text)
            profile_text.append(text)
            if out is not None:
                out.mkdir(parents=True, exist_ok=True)
                (out / f"profile_{family}.txt").write_text("\n\n".join(profile_text) + "\n")
        for batch_size in (list(baseline_batch_sizes) or [None]) if baseline else []:
            rows.append(bench.run_baseline(ceiling, batch_size=batch_size))
            base = base or rows[-1]
            echo(format_table(rows[-1:], base))
            save()
            bench.free_memory()
        for name, overrides in variants.items():
            try:
                rows.append(bench.run_imagerl(name, overrides, ceiling))
            except torch.OutOfMemoryError as error:  # a variant too big for the device: say so, go on with the rest
                echo(f"{name}: out of memory ({str(error).splitlines()[0]})")
                rows.append(Row.out_of_memory(name, overrides))
            except CompileFailure as error:  # Dynamo / Inductor refused the variant's graphs: a row that says so
                echo(f"{name}: {compile_failure_note(error)}")
                rows.append(Row.failed(name, overrides, compile_failure_note(error)))
                torch._dynamo.reset()  # the next variant compiles afresh
            bench.free_memory()  # what the failed variant's frames held, now that the exception is gone
            echo(format_table(rows[-1:], base))
            save()
        try:
            vae = bench.vae_bf16_effect()
        except torch.OutOfMemoryError as error:  # a side measurement: the rows above stay measured and printed
            echo(f"bf16 VAE decode vs fp32: out of memory ({str(error).splitlines()[0]})")
        save()
    if vae is not None:
        echo(f"bf16 VAE decode vs fp32 (same latents): |pixel diff| max {vae['pixel_abs_diff_max']:.3g} mean "
             f"{vae['pixel_abs_diff_mean']:.3g}; |reward diff| max {vae['reward_abs_diff_max']:.3g} mean "
             f"{vae['reward_abs_diff_mean']:.3g} (reward std over the images {vae['reward_std_fp32']:.3g})")
    echo(format_table(rows, base))
    return rows
