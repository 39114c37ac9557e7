"""Typed configuration: dataclasses, YAML recipes, dotted CLI overrides (validation.py checks a Config up front).

A recipe is a YAML file with the sections below (any key left out keeps its default). Overrides on
the command line use dotted keys: `imagerl train --recipe quickstart train.lr=1e-4 sample.group_size=8`.
Values are parsed as YAML scalars/lists (`sample.sde_window_range=[0,5]`). Unknown keys and wrong
types are errors that name the key and suggest the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml


MAX_LORA_RANK = 4096  # above every family's hidden size (3072 at most): a larger rank adds nothing but memory


@dataclass
class ModelConfig:
    path: str = "tiny"
    """Local diffusers-format checkpoint directory; "quickstart" for the small pretrained shapes-world
    Qwen-Image shipped with imagerl; or "tiny" / "tiny21" / "tiny_sd3" / "tiny_flux" for a tiny random
    Qwen-Image / Qwen-Image 2.1 / SD3 / FLUX.1 built on first use (in $IMAGERL_CACHE or ~/.cache/imagerl)."""
    family: str = "auto"
    """Family adapter name (qwen_image, qwen_image21, sd3, flux), or "auto" to resolve from the checkpoint."""
    device: str = "auto"
    """"auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1", ..."""
    dtype: str = "auto"
    """Forward dtype of the transformer and text encoder: "auto" (bfloat16 on GPU, float32 on CPU), "float32", "bfloat16"."""
    lora_rank: int = 64
    """1 to MAX_LORA_RANK (4096)."""
    lora_alpha: int = 128
    lora_init: str = "gaussian"
    """PEFT init_lora_weights: "gaussian" (flow_grpo) or "default"; both start with B = 0 (no effect at step 0)."""
    lora_target_modules: list[str] = field(default_factory=list)
    """Empty: the family's default (the 12 modules of the flow_grpo/miles Qwen-Image recipes)."""
    gradient_checkpointing: bool = True
    checkpoint_every: int = 1
    """With gradient_checkpointing: checkpoint every k-th transformer block (1: all, flow_grpo; 2: every other
    block keeps its activations, half the recompute for more memory)."""
    checkpoint_blocks: int = 0
    """With gradient_checkpointing: checkpoint only the first n of the blocks checkpoint_every selects; the blocks
    after them keep their activations (less recompute, about 0.9 GiB per block and training batch of 4 at 512 px
    for qwen_image with CFG). 0: all of them."""
    prompt_cache_size: int = 4096
    """Prompt embeddings kept (LRU) across rollouts; one text-encoder pass per unique prompt."""
    prompt_cache_gib: float = 2.0
    """Device memory the cached prompt embeddings may hold (GiB; LRU beyond it). FLUX.1 keeps 4 MiB per prompt (T5
    padded to 512 tokens): 512 prompts in 2 GiB; Qwen-Image about 0.2 MiB."""
    text_encoder_offload: bool = False
    """Keep the text encoder's weights in (pinned) CPU memory and copy them to the device only while prompts the
    cache lacks are encoded (families/base.py offload_text_encoder): the same embeddings bit for bit, and its device
    memory (qwen_image: 14 GiB) free for the rest of the run, for one copy per rollout with new prompts (~0.6 s)."""
    vae_dtype: str = "float32"
    """VAE decode (and encode) dtype: "float32" (flow_grpo, the pipeline's output path) or "bfloat16" (faster;
    the images, and so the rewards, differ slightly: benchmarks/LOG.md measures by how much)."""
    group_text_lengths: bool = False
    """qwen_image: run the rows of a batch with different text lengths (cond vs uncond with CFG, prompts of
    different lengths) as separate unmasked forwards instead of one forward padded to the longest row with a
    key mask (flow_grpo, the pipeline): no padded tokens and attention without a mask; the same math. qwen_image21
    always groups by length."""
    text_length_multiple: int = 0
    """qwen_image: pad each forward's text to a multiple of this many tokens (masked keys, the same values).
    0: 8 with parallel.compile, else 1. Inductor specialises a block's graph on whether the joint sequence
    (4096 image + L text tokens at 1024 px, 1024 + L at 512 px) is a multiple of 8 (alignment guard
    `(N + L) % 8`), so unpadded prompt lengths cost a second compiled graph; padded, one graph serves all."""


@dataclass
class MixtureSet:
    """One prompt set of data.mixture."""

    name: str = ""
    """Its name in the metrics (rollout/set/<name>/...): letters, digits, "_" and "-"."""
    prompts: str = ""
    """A .txt / .jsonl file or a shipped set, as data.train_prompts."""
    share: float = 1.0
    """Its share of each rollout's prompts (the shares are normalised; each set gets at least one prompt)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """The rewards that score its images and their weights, as reward.weights."""
    test_prompts: str = ""
    """Held-out prompts scored by these rewards (a file or shipped set; "" none): eval/set/<name>/... ."""


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
    mixture: list[MixtureSet] = field(default_factory=list)
    """Several prompt sets instead of train_prompts, each with its rewards and its share of every rollout
    (imagerl.data.mixture): a group never mixes sets, each image is scored by its own set's rewards, and each set gets
    rollout/set/<name>/* metrics. reward.weights becomes the union of the sets' rewards (what is loaded; the
    held-out evaluation of data.test_prompts scores with it); the sets' test_prompts replace data.test_prompts."""


@dataclass
class SampleConfig:
    height: int = 512
    width: int = 512
    num_steps: int = 10
    guidance_scale: typing.Optional[float] = None
    """CFG scale, the same in rollout and training; <= 1 disables CFG. None: the family's default
    (qwen_image 4.0, true CFG with norm rescale; qwen_image21 1.0, no CFG: plain CFG when > 1; sd3 4.5, plain CFG;
    flux 3.5, FLUX.1-dev's distilled guidance: an input of the transformer, never a negative-prompt row)."""
    negative_prompt: str = " "
    max_sequence_length: int = 512
    noise_level: float = 1.2
    sde_type: str = "sde"
    """"sde" (Flow-GRPO's marginal-preserving SDE) or "cps" (coefficients-preserving sampling, arXiv 2509.05952;
    flow_grpo sde_type="cps"): sampling/sde.py."""
    cps_log_prob: str = "flow_grpo"
    """sde_type=cps only: "flow_grpo", its log-prob -(x_next - mean)^2 (the scale flow_grpo's cps clip ranges are
    set for), or "gaussian", the full Gaussian log-density (a true density ratio; late steps weigh far more)."""
    num_sde_steps: int = 2
    """SDE (= trained) steps per trajectory; flow_grpo Qwen-Image: 2."""
    sde_window_range: list[int] = field(default_factory=lambda: [0, 5])
    sde_window_start: typing.Union[int, str] = 3
    """Int (fixed) or "random". 3 reproduces flow_grpo's effective Qwen-Image window {3, 4} (see sampling/window.py)."""
    sde_window_schedule: str = "fixed"
    """"fixed": every rollout's window starts at sde_window_start (an int, or "random": drawn per rollout); "sliding"
    (MixGRPO, arXiv 2507.21802): the start moves by sde_window_stride steps every sde_window_period rollouts in
    sde_window_direction, wrapping around inside sde_window_range (sampling/window.py)."""
    sde_window_stride: int = 1
    sde_window_period: int = 1
    sde_window_direction: str = "forward"
    """"forward": toward the clean end of sampling (MixGRPO's order), "backward": toward the noisy end."""
    off_window_solver: str = "euler"
    """The ODE steps outside the SDE window: "euler" (flow_grpo's, the family pipeline's), "dpm2", DPM-Solver++(2M) on
    both sides (sampling/ode.py), or "dpm2_post", Euler before the window and DPM-Solver++(2M) after it (MixGRPO-Flash,
    arXiv 2507.21802: its scripts' --dpm_apply_strategy post). DPM-Solver restarts at first order after the window.
    These steps are never replayed, so the replay stays exact either way."""
    post_window_steps: typing.Optional[int] = None
    """Steps after the SDE window: null keeps the schedule's; n compresses them to n steps over a subset of the
    schedule's own sigmas, evenly spaced by index, ending at 0. Fewer forwards per rollout; pair it with a DPM-Solver
    off_window_solver, which loses less per step."""
    post_window_ratio: typing.Optional[float] = None
    """MixGRPO-Flash's --dpm_post_compress_ratio (0.4 in its Flash script): the steps after the window as MixGRPO
    counts them, int(max((num_steps - last window step) x ratio, 1)) - 1, at least 1 (10 steps, window {3, 4}: 1
    step). Instead of post_window_steps; sampling/window.py."""
    prompts_per_rollout: int = 32
    """Unique prompts per rollout, over all ranks (flow_grpo: 32)."""
    group_size: int = 16
    """Samples per prompt K (flow_grpo: 16)."""
    batch_size: int = 4
    """Samples per rollout forward per rank (CFG doubles the rows), at most: above a rank's samples per rollout it
    is lowered to them (and train.batch_size, if larger, to it). The SDE-window steps run in sub-batches of
    train.batch_size, the batches the training forwards replay."""
    decode_batch_size: int = 0
    """Images per VAE decode (0: train.batch_size). The float32 VAE decoder keeps about 6.5 kB of activations per
    pixel (1.6 GiB per 512 x 512 image, perf/memory_estimate.py), so decoding a training batch of 8 takes 13 GiB at
    the rollout's peak; decoding 2 at a time frees 10 of them for a few percent of the decode's speed. Each chunk
    is scored as soon as it is decoded. Decoding is never replayed: the log-probs do not depend on it."""
    same_initial_noise: bool = False
    """All K samples of a group start from the same initial noise (flow_grpo's `sample.same_latent`): the
    group's rewards then differ only through the SDE window's noise, the part the update credits."""
    merge_lora: bool = False
    """The steps outside the SDE window (ODE steps, never replayed) run without gradients on a copy of the
    weights with the LoRA merged in: no LoRA matmuls there. The window steps and training keep the unmerged
    weights, so the replay stays exact. Costs the merged copies during the rollout (qwen_image r64, 12 targets:
    27 GB in bf16). Not under FSDP (sharded weights)."""
    off_window_fp8: bool = False
    """With sample.merge_lora: the merged weights are quantized to FP8 (e4m3, a scale per output channel; the
    activations scaled per token at each call) and the steps outside the SDE window run FP8 GEMMs (CUDA compute
    capability 8.9+). Faster and half the merged copies' memory, but not the bf16 function: each layer's
    output moves by about 3.6 % rms of its size (families/layers/fp8_linear.py). The window steps and training keep bf16,
    so the replay stays exact. benchmarks/LOG.md has its speed and its effect on images and rewards."""
    kv_cache: bool = False
    """qwen_image21 only: the rollout's steps outside the SDE window reuse the text prefix's keys/values (the
    first of them computes them): only the image rows pass the blocks there (2.1 at 512 px: 5-8 % fewer FLOPs per
    cached step). The SDE-window steps and training run full forwards, so the replay stays exact. (The cached
    velocity equals the full forward on CPU fp32 but not on the GPU: an H200 run whose window steps were cached
    showed train/log_prob_mean_abs_diff up to 1.5e-8 in fp32, benchmarks/LOG.md.) DiffusionNFT's ODE
    rollouts (never replayed) use it at every step."""


@dataclass
class TrainConfig:
    algorithm: str = "flow_grpo"
    """"flow_grpo" (SDE rollouts, PPO-clipped likelihood ratios), "diffusion_nft" (ODE rollouts by the old policy, the
    flow-matching loss on their clean samples; its settings: the nft section), "awm" (ODE rollouts by the policy,
    the advantage-weighted flow-matching loss; the awm section) or "dppo" (Flow-GRPO's rollouts, its ratio clip
    replaced by a trust-region mask on the transitions' KL; the dppo section)."""
    num_rollouts: int = 100
    lr: float = 3e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 1e-4
    max_grad_norm: float = 1.0
    clip_range: float = 1e-4
    ratio: str = "standard"
    """Flow-GRPO's importance ratio: "standard" exp(log p - log p_old), or "grpo_guard" (GRPO-Guard, arXiv
    2510.22319: the ratio-mean bias and per-step rescaling, algorithms/flow_grpo.py; its clip_range is about 2e-6,
    verl-omni docs/algo/grpo_guard.md). Needs sample.sde_type=sde."""
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
    ema: bool = False
    """Flow-GRPO: evaluate and export (checkpoints' lora/) an EMA of the policy, updated every optimizer step with
    decay min((1 + k) / (10 + k), train.ema_cap) (flow_grpo's train.ema, EMAModuleWrapper; DiffusionNFT has its own:
    nft.ema). Training and rollouts use the policy."""
    ema_cap: float = 0.9
    ema_update_interval: int = 1
    """train.ema: update the EMA only after optimizer steps k with (k + 1) a multiple of this (flow_grpo's
    EMAModuleWrapper update_step_interval; its train_sd3.py uses 8). 1: after every optimizer step."""
    ema_repeats: int = 1
    """train.ema: apply each EMA update this many times. flow_grpo's train_sd3.py steps its EMA after every training
    batch on the optimizer-step counter, so each update lands once per batch of an optimizer step (2 in
    general_ocr_sd3); with ema_update_interval 8 it then averages over about 42 optimizer steps instead of 10."""
    drop_zero_advantage: bool = False
    """Flow-GRPO: leave samples whose advantage is exactly 0 out of the loss (flow_grpo's train_sd3.py; its Qwen-Image
    trainer keeps them). The loss is then the mean over the kept samples of each optimizer step, so a zero-advantage
    group adds no KL-only gradient. The replay still runs whole batches, so the on-policy ratio stays exactly 1."""
    shuffle_batches: bool = False
    """Flow-GRPO: train the rollout's batches in a seeded random order, (run.seed, rollout) (flow_grpo's train_sd3.py
    shuffles its samples before batching). Whole batches move, so each replays its rollout forward bit for bit."""
    global_std: bool = True
    """Advantage std over the whole rollout (True, flow_grpo Qwen-Image) or per group."""
    advantage: str = "sum"
    """"sum": the group advantage of the weighted sum of the rewards (flow_grpo); "per_reward" (GDPO): each reward's
    group advantage normalised on its own (global_std as set), weighted, summed and normalised over the batch, so
    that a reward with a large spread cannot drown the others (algorithms/advantages.py). Both algorithms. Under
    data.mixture either is computed set by set."""


@dataclass
class NFTConfig:
    """DiffusionNFT (train.algorithm=diffusion_nft; github.com/NVlabs/DiffusionNFT). Defaults:
    NVlabs' config/base.py + nft.py (decay_type 1)."""

    beta: float = 1.0
    """Mixing strength: v+ = beta v_theta + (1 - beta) v_old, v- = (1 + beta) v_old - beta v_theta (NVlabs 1.0;
    0.1 for OCR and multi-reward: faster reward rise, less stable)."""
    ref_weight: float = 1e-4
    """Weight of the velocity MSE to the reference model (adapters off); 0: no reference forward."""
    timestep_fraction: float = 0.99
    """Fraction of the sampler's timestep grid trained per sample (floor, at least 1): 0.99 of 10 -> 9."""
    adaptive_weight_min: float = 1e-5
    """Floor of the per-sample x0-space loss normaliser mean|x0_hat - x0|."""
    solver: str = "dpm2"
    """Rollout ODE sampler: "dpm2" (DPM-Solver++(2M), NVlabs) or "euler" (the family pipeline's, verl-omni)."""
    old_decay_flat: int = 0
    old_decay_rate: float = 0.001
    old_decay_cap: float = 0.5
    """Old (sampling) policy after each rollout: old <- d old + (1 - d) theta with d = 0 for k < flat, else
    min((k - flat) rate, cap), k = optimizer steps so far. 0/0.001/0.5 (NVlabs default); 75/0.0075/0.999 (OCR);
    rate 0: a copy (on-policy)."""
    ema: bool = True
    """Evaluate and export (checkpoints' lora/) an EMA of the policy, decay min((1 + k) / (10 + k), ema_cap),
    updated every optimizer step; false: the policy itself."""
    ema_cap: float = 0.9
    shuffle: bool = True
    """With train.num_optimizer_steps > 1: shuffle the rollout's samples (seeded, stratified by group) before they
    are split over the optimizer steps, as NVlabs' train_nft_sd3.py does; false: the first groups go to step 1."""


@dataclass
class AWMConfig:
    """AWM, Advantage Weighted Matching (train.algorithm=awm; arXiv 2509.25050). Defaults: the official OCR config,
    github.com/scxue/advantage_weighted_matching at be51372, config/dgx_awm.py ocr_sd3_no_cfg_1node (lines 176-228)
    and config/base_awm.py; learning rate 3e-4 and LoRA 32/64 there are train.lr / model.lora_rank."""

    solver: str = "euler"
    """Rollout ODE sampler: "euler" (Flow-Factory's AWM port) or "dpm2"; the official SA-Solver is not in imagerl."""
    num_timesteps: int = 6
    """Grid indices trained per sample, one per stratum (train_timesteps 6)."""
    timestep_fraction: float = 0.9
    """Indices drawn from [s, floor(T x fraction)): 0.9 of 14 -> up to index 11 (timestep_fraction 0.9)."""
    skip_first: bool = True
    """s = 1: never the first, noisiest index (time_type discrete_wo_init: GenEval, OCR); false: s = 0 (discrete,
    PickScore)."""
    weighting: str = "ghuber"
    """"ghuber": -((mse + 1e-10)^p - 1e-10^p) t / p (every official config); "uniform": -mse."""
    ghuber_power: float = 0.25
    kl_weight: float = 0.003
    """beta of the velocity MSE to the reference model (adapters off): 0.003 OCR, 0.001 GenEval, 0.0001 PickScore;
    0 turns off both KL terms (as the official code nests the EMA term under it)."""
    ema_kl_weight: float = 1.0
    """ema_beta of the velocity MSE to the KL anchor, an EMA of the policy refreshed after each rollout."""
    ema_kl_decay_rate: float = 0.001
    ema_kl_decay_cap: float = 0.3
    """The anchor's decay after k optimizer steps: min(rate k, cap) (kl_ema_decay 0.3, type linear)."""
    ema: bool = True
    """Evaluate and export an EMA of the policy, decay min((1 + k) / (10 + k), ema_cap) (train.ema, decay 0.99)."""
    ema_cap: float = 0.99


@dataclass
class DPPOConfig:
    """Flow-DPPO (train.algorithm=dppo; Flow-GRPO's rollouts and settings otherwise). Defaults: verl-omni at a1139ba,
    examples/flowdppo_trainer/qwen_image/run_qwen_image_ocr_lora.sh and UniRL's examples/diffusion/sd3_flowdppo.yaml."""

    kl_threshold: float = 1e-5
    """delta: an update whose per-step Gaussian KL to the rollout's transition (mean over latent elements) reaches it
    is dropped where it moves further the way the advantage pushes (kl_mask_threshold 1e-5 in both)."""


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
    plugins: list[str] = field(default_factory=list)
    """Modules that register rewards, imported before the reward names are checked: an importable module
    (my_pkg.rewards) or a .py file (./my_rewards.py, made absolute when the config is read). Installed packages can
    also register through the entry-point group imagerl.rewards."""
    options: dict[str, dict[str, typing.Any]] = field(default_factory=dict)
    """Reward name -> that reward's own settings ({threshold: 0.5}), read as cfg.options[name] and checked by the
    reward's check_config."""
    remote: dict[str, str] = field(default_factory=dict)
    """Reward name -> URL of an `imagerl reward-server` that serves it (http://127.0.0.1:8765)."""
    remote_encoding: str = "auto"
    """How images travel to a reward server: "auto" (what the server advises for the reward: float32 for one that
    reads float pixels, as shapes and clipscore do, else uint8), "uint8" (round(x * 255), what the PickScore,
    aesthetic, OCR and JPEG rewards compute from anyway), "png" (the same pixels, compressed) or "float32" (exact)."""
    remote_timeout_s: float = 300.0
    """Seconds to wait for one answer of a reward server."""
    remote_retries: int = 3
    """Tries after the first when a reward server is unreachable or busy (HTTP 502/503/504), waiting 1, 2, 4, ... s
    (capped at 30 s) between them; a request that timed out is not sent again."""
    remote_max_in_flight: int = 2
    """Requests of reward.batch_size images one process keeps open at once, per reward server."""
    remote_token_file: str = ""
    """A file holding the token the reward server was started with (--token-file); made absolute when the config is
    read."""


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
    """Evaluate only the first N test prompts (0: all); under data.mixture the sets' held-out prompts alternate, so
    the first N hold every set's first prompts."""
    suites: list[str] = field(default_factory=list)
    """Evaluation suites run at each evaluation beside the held-out reward, on the weights evaluation uses:
    shapes, ocr, geneval (images only, under <run>/suites/geneval/step_N/), reward:NAME (on data.test_prompts);
    metrics eval/suite/<suite>/<measure> (imagerl.evaluation.suites; `imagerl eval --suite` compares finished runs)."""
    suite_max_prompts: int = 0
    """Only the first N prompts of each suite (0: all of them)."""


@dataclass
class MonitorConfig:
    """Drift monitors of each rollout's images (imagerl.run.monitors: saturation, contrast, edge density, colour entropy,
    dark / bright fractions, JPEG size), logged as monitor/<name> and monitor/<name>_drift."""

    enabled: bool = True
    max_drift: float = 3.0
    """Warn when a monitor's rollout mean moves more than this many of the first rollout's spreads (per-image std)
    from the first rollout's mean; 0: never warn."""
    warn_every: int = 20
    """While a monitor stays past max_drift, repeat its warning every this many rollouts."""
    stop_on_drift: bool = False
    """Stop (after saving the state) when a monitor passes max_drift."""


@dataclass
class RunConfig:
    output_dir: str = "runs/{recipe}"
    seed: int = 42
    checkpoint_every: int = 10
    """Rollouts between checkpoints (the last rollout is always saved)."""
    keep_checkpoints: int = 3
    keep_best: str = ""
    """A held-out metric (e.g. eval/reward/raw_mean, eval/suite/shapes/overall): the checkpoint of its best value is
    kept beside the latest keep_checkpoints (a checkpoint is written at each new best; checkpoints/best.json names
    it, and imagerl report shows it). Empty: off."""
    keep_best_mode: str = "max"
    """"max" (rewards) or "min"."""
    image_grid_every: int = 10
    """Rollouts between sample-image grids written to <output_dir>/images (0: never)."""
    tensorboard: bool = True
    wandb: bool = False
    """Also log to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str = "imagerl"
    gc_freeze: bool = True
    """After the first rollout, one garbage collection, then gc.freeze(): later full collections skip the models'
    and compiled code's objects (~1 s pauses that idle the GPU otherwise; gc_freeze.py)."""


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
    nft: NFTConfig = field(default_factory=NFTConfig)
    awm: AWMConfig = field(default_factory=AWMConfig)
    dppo: DPPOConfig = field(default_factory=DPPOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    run: RunConfig = field(default_factory=RunConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def output_dir(self) -> Path:
        try:
            return Path(self.run.output_dir.format(recipe=self.recipe))
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as e:  # '{nope}', '{0}', '{', ...
            raise ValueError(f"run.output_dir={self.run.output_dir!r} is not a valid template ({type(e).__name__}: "
                             f"{e}); the only placeholder available is {{recipe}} (write a literal brace as {{{{ "
                             "or }})") from e


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
        raise ValueError(f"{key}: expected null, got {_short(value)}")
    if hint is typing.Any:  # free-form settings (reward.options): what JSON holds, as checkpoints record the config
        return _json_value(key, value)
    if hint in (int, float, str, bool):
        if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
            return value
        empty = (f" (to clear it, give it nothing: {key}= on the command line, '' in YAML)"
                 if hint is str and value is None else "")
        raise ValueError(f"{key}: expected {hint.__name__}, got {_short(value)}{empty}")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a mapping, got {_short(value)}")
        obj, hints = hint(), typing.get_type_hints(hint)
        for k, v in value.items():
            if k not in hints:
                raise ValueError(f"{key}: unknown key {k!r} (valid: {', '.join(hints)})")
            setattr(obj, k, _check_type(f"{key}.{k}", v, hints[k]))
        return obj
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key}: expected a list, got {_short(value)}")
        (item,) = typing.get_args(hint)
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{key}: expected a mapping, got {_short(value)}")
        _, val_t = typing.get_args(hint)
        return {str(k): _check_type(f"{key}.{k}", v, val_t) for k, v in value.items()}
    if origin is typing.Union:
        for option in typing.get_args(hint):
            try:
                return _check_type(key, value, option)
            except ValueError:
                pass
        options = [getattr(a, "__name__", a) for a in typing.get_args(hint)]
        raise ValueError(f"{key}: {_short(value)} is none of {options}")
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
                    raise ValueError(f"{dotted}: expected a section (mapping), got {_short(value)}")
                for k, v in value.items():
                    _set(cfg, f"{dotted}.{k}", v)
                return
            obj = getattr(obj, name)
            continue
        if depth != len(parts) - 1 and typing.get_origin(hints[name]) is dict:  # reward.options.NAME.KEY=...
            _set_in_mapping(getattr(obj, name), parts[depth + 1:], value, hints[name], dotted)
            return
        if depth != len(parts) - 1:
            raise ValueError(f"config key {dotted!r}: {'.'.join(parts[:depth + 1])} is not a section")
        setattr(obj, name, _check_type(dotted, value, hints[name]))
        return


def _set_in_mapping(mapping: dict, keys: list[str], value, hint, dotted: str) -> None:
    """One entry of a mapping setting, e.g. reward.weights.shapes=2 or reward.options.redness.scale=2: the other
    entries stay; the value is checked against the mapping's value type."""
    _, value_type = typing.get_args(hint)
    if len(keys) == 1 and value in ("", None):  # `reward.remote.shapes=` removes that entry
        mapping.pop(keys[0], None)
        return
    if len(keys) == 1:
        mapping[keys[0]] = _check_type(dotted, value, value_type)
        return
    inner = mapping.setdefault(keys[0], {})
    if not isinstance(inner, dict) or (value_type is not typing.Any and typing.get_origin(value_type) is not dict):
        raise ValueError(f"config key {dotted!r}: {dotted.rsplit('.', len(keys) - 1)[0]} is not a mapping")
    if value_type is typing.Any:  # free-form settings (reward.options.NAME): nested plain mappings
        for key in keys[1:-1]:
            inner = inner.setdefault(key, {})
            if not isinstance(inner, dict):
                raise ValueError(f"config key {dotted!r}: {key} is not a mapping")
        inner[keys[-1]] = _json_value(dotted, value)
        return
    _set_in_mapping(inner, keys[1:], value, value_type, dotted)


def _json_value(key: str, value):
    """value if JSON can hold it (str, int, float, bool, null, lists, mappings with text keys), else ValueError."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(f"{key}[{i}]", v) for i, v in enumerate(value)]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _json_value(f"{key}.{k}", v) for k, v in value.items()}
    raise ValueError(f"{key}: {_short(value)} is a {type(value).__name__}; settings hold text, numbers, true/false, "
                     "lists and mappings with text keys (quote a date or a time: '2024-01-01')")


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
        data = safe_load_yaml(path.read_text(), f"recipe {path}") or {}
    except yaml.YAMLError as e:
        raise ValueError(f"recipe {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"recipe {path} must be a mapping of sections, got {type(data).__name__}")
    return config_from_dict(dict(data, recipe=data.get("recipe", path.stem)), overrides)


def config_from_dict(data: dict, overrides: list[str] = ()) -> Config:
    """A Config from a recipe's mapping (or a saved run's config, `recipe` included), then `key=value` overrides."""
    cfg = Config()
    for key, value in data.items():
        _set(cfg, key, value)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. train.lr=1e-4)")
        try:
            value = safe_load_yaml(raw, f"override {item[:60]!r}") if raw.strip() else raw  # "x= " keeps the space
        except yaml.YAMLError as e:
            raise ValueError(f"override {item!r}: cannot parse value: {e}") from e
        _set(cfg, key.strip(), value)
    cfg.reward.plugins = [absolute_plugin_path(p) for p in cfg.reward.plugins]
    if cfg.reward.remote_token_file:
        cfg.reward.remote_token_file = str(Path(cfg.reward.remote_token_file).expanduser().resolve())
    return cfg


def absolute_plugin_path(plugin: str) -> str:
    """A reward.plugins entry that names a file (ends in .py or holds a path separator), made absolute against the
    current folder, so that a resume or an evaluation from another folder imports the same file; a module name as
    given."""
    if plugin.endswith(".py") or "/" in plugin or os.sep in plugin:
        return str(Path(plugin).expanduser().resolve())  # resolved: ./a.py and sub/../a.py are one plugin
    return plugin


# A config is a few hundred values; YAML aliases (&a / *a) can make a few hundred bytes stand for billions (each
# alias of a list of aliases multiplies), which safe_load shares but any message or copy would expand
MAX_EXPANDED_VALUES = 100_000


def safe_load_yaml(text: str, what: str):
    """yaml.safe_load, refusing a document whose aliases expand past MAX_EXPANDED_VALUES values or that nests past
    Python's recursion limit (PyYAML composes and builds nodes recursively). Every YAML imagerl reads as settings
    goes through this: recipes, overrides, sft settings and a run's saved sft_config.yaml. `what` names the file or
    the setting in the message."""
    try:
        data = yaml.safe_load(text)
        size = _expanded_size(data, {})
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply to be a config") from None
    if size > MAX_EXPANDED_VALUES:
        raise ValueError(f"{what} expands to more than {MAX_EXPANDED_VALUES} values through YAML aliases (&name / "
                         "*name): an alias bomb, or far more than any config; write the values out")
    return data


def _expanded_size(value, memo: dict) -> int:
    """Values in `value` with every shared (aliased) object counted each time it occurs: O(distinct objects)."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, dict):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        size = 1 + sum(_expanded_size(v, memo) for v in value)
    else:
        size = 1
    memo[id(value)] = size = min(size, MAX_EXPANDED_VALUES + 1)  # past the limit the count stops mattering
    return size


def _short(value, limit: int = 120) -> str:
    """repr(value) for a message, at most `limit` characters (reprlib: nested containers cut, not expanded)."""
    import reprlib

    cut = reprlib.Repr()  # attributes, not keywords: Python 3.10 and 3.11 take none
    cut.maxlevel, cut.maxlist, cut.maxtuple, cut.maxdict, cut.maxstring, cut.maxother = 3, 6, 6, 6, 80, 80
    short = cut.repr(value)
    return short if len(short) <= limit else short[:limit - 3] + "..."


_DECIMAL = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def save_config(cfg: Config, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def planned_rollouts(run_dir: Path) -> tuple[int, Path] | None:
    """train.num_rollouts of the config the run was last started with, and that file: the newest of run_dir's
    config.yaml and config.resumed_*.yaml (train writes one at every start). None if there is none readable."""
    files = [p for p in [Path(run_dir) / "config.yaml", *Path(run_dir).glob("config.resumed_*.yaml")] if p.is_file()]
    for path in sorted(files, key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True):
        try:
            value = ((safe_load_yaml(path.read_text(), str(path)) or {}).get("train") or {}).get("num_rollouts")
        except (ValueError, yaml.YAMLError, AttributeError, OSError):
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            return value, path
    return None


def training_batch_size(cfg: "Config") -> int:
    """Samples per training forward (train.batch_size, 0 meaning sample.batch_size)."""
    return cfg.train.batch_size or cfg.sample.batch_size
