"""Peak memory of a training run, estimated from the config and the model's dimensions before anything compiles.

`check_memory(cfg, adapter, world)` raises ValueError when the estimate exceeds the device (CUDA: the memory
this process can still get, torch.cuda.mem_get_info plus what it already holds; CPU: MemAvailable of
/proc/meminfo plus the weights already loaded), naming the estimated peak and settings that fit.
`estimate_memory(cfg, dims, world_size)` is the pure arithmetic (no device, no model), so it is tested on a CPU
against the peaks measured on H100 and H200 cards (benchmarks/LOG.md; tests/test_memory_estimate.py).

The model, per rank (bytes):
  static    = transformer weights + text encoder + VAE + reward models + LoRA (fp32 params and AdamW's two
              moments; the gradients, fp32, only in training) [+ DiffusionNFT: old-policy, EMA and backup copies
              of the LoRA, fp32 (algorithms/lora_states.py)]
  samples   = what the rollout keeps for every sample of this rank until the update (rollout.py): the initial
              noise (float32 latents), Flow-GRPO's window latents in and out per SDE step (float32) and log-probs,
              DiffusionNFT's clean latents; the prompts' embeddings. On the device unless train.timestep_staging.
              The decoded images (float32, 3 x H x W) wait on the CPU.
  rollout   = static + samples + merged LoRA copies (sample.merge_lora: bf16, or e4m3 with off_window_fp8) +
              the inference activations of one block (rows x tokens x hidden x INFERENCE_BYTES) + the VAE
              decode of one training batch (pixels x DECODE_BYTES_PER_PIXEL, halved for a bf16 VAE)
  training  = static + gradients + samples + activations kept for the backward, rows x tokens x hidden x
              (TRAIN_BLOCK_BYTES per block that keeps its activations + CHECKPOINT_BYTES per checkpointed
              block, whose input alone is kept, + TRAIN_BLOCK_BYTES for the block being recomputed)
  encode    = (model.text_encoder_offload) static + the text encoder, copied in for the prompts the cache lacks
              before the rollout's samples and merged copies exist; the encoder is then out of `static` and waits
              in host memory (pinned)
  peak      = max(rollout, training[, encode])
rows: samples per forward, doubled under CFG (the negative prompt's rows); tokens: image tokens + the text cap
(sample.max_sequence_length, the worst case). Not counted: the prompt cache's embeddings of earlier rollouts,
which grow over a run up to model.prompt_cache_gib (2 GiB by default; FLUX.1 and SD3 reach it, Qwen-Image stays
under 1 GiB at 4096 prompts) and ride in the headroom check_memory leaves (USABLE_FRACTION).

The four coefficients were fitted to nine measured peaks of the released-size qwen_image (LOG.md runs I, P,
S, AE, AH, AI: rollout batch 8-16, training batch 4-8, merged or not, checkpointing every block, every other
block or none, Flow-GRPO and DiffusionNFT); those and the four of runs AK and AL (the text encoder off the GPU,
merged copies in FP8, the first 40 or 45 blocks checkpointed) are reproduced within 4 %:
  TRAIN_BLOCK_BYTES 37: a Qwen-Image dual-stream block keeps, per token and hidden unit, its norms, q/k/v, the
      attention output, the 4x MLP's input and GELU output (16 bytes in bf16 alone) and the fp32 LoRA inputs.
  CHECKPOINT_BYTES 2: a checkpointed block keeps its bf16 input.
  INFERENCE_BYTES 4: a no-grad forward frees each block's activations before the next.
  DECODE_BYTES_PER_PIXEL 6500: the float32 VAE decoder's full-resolution feature maps of one image.
Fitted on Qwen-Image alone, they put SD3.5-Medium's and FLUX.1-dev's measured peaks (runs AR, AX) 4-7 % high.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

GIB = 2**30
TRAIN_BLOCK_BYTES = 37.0
CHECKPOINT_BYTES = 2.0
INFERENCE_BYTES = 4.0
DECODE_BYTES_PER_PIXEL = 6500.0
LORA_STATE_BYTES = 4 * 3  # fp32 parameter, AdamW exp_avg and exp_avg_sq
NFT_LORA_COPIES = 3  # LoraStates: the old policy's and the EMA's LoRA, and the backup of the policy's
# parameters of the reward models that run on the GPU (the checkpoints the reward modules load by default):
# PickScore_v1 is a CLIP ViT-H/14 (986 M), CLIP score and the LAION aesthetic predictor a CLIP ViT-L/14 (428 M);
# the JPEG, OCR (onnxruntime on the CPU) and shapes rewards hold no GPU weights
REWARD_PARAMS = {"pickscore": 986_000_000, "clipscore": 428_000_000, "aesthetic": 428_000_000}
# the device's memory the estimate may use: the rest is the CUDA context, cuBLAS workspaces and the caching
# allocator's fragmentation (LOG.md run AK, H100: a configuration estimated at 73.9 GiB ran out of memory with
# 74.5 GiB allocated and 3.6 GiB reserved but unallocated; 0.93 of the H100's 79.2 GiB is 73.6)
USABLE_FRACTION = 0.93


@dataclass(frozen=True)
class ModelDims:
    """What the estimate needs of a loaded model (ModelDims.of(adapter)) or of a released one (the tests)."""

    transformer_bytes: int  # base weights and buffers, LoRA excluded
    text_encoder_bytes: int
    vae_bytes: int  # at model.vae_dtype
    lora_params: int
    merge_target_params: int  # the LoRA targets' base weights: what sample.merge_lora copies
    blocks: int
    hidden: int  # the transformer's inner dim
    image_tokens: int  # at the config's height and width
    latent_values: int  # one sample's packed latent (image_tokens x channels)
    text_hidden: int  # the prompt embeddings' width
    text_bytes_per_value: int = 2
    true_cfg: bool = True  # the family's true_cfg: guidance_scale > 1 doubles the rows (False: FLUX.1's guidance input)
    # the family's token_linears that are not LoRA targets: sample.off_window_fp8 copies them in e4m3 too
    frozen_token_params: int = 0

    @classmethod
    def of(cls, adapter, height: int, width: int) -> "ModelDims":
        """A loaded family adapter with its LoRA (components.load_adapter): the LoRA as added."""
        rank = next((getattr(m, "r", {}).get("default") for m in adapter.transformer.modules()
                     if isinstance(getattr(m, "r", None), dict)), 0) or 0
        return cls.from_modules(adapter.transformer, adapter.text_encoder, adapter.vae, rank,
                                adapter.lora_target_modules, adapter.image_seq_len(height, width),
                                true_cfg=adapter.true_cfg, token_linears=adapter.token_linears)

    @classmethod
    def from_modules(cls, transformer, text_encoder, vae, lora_rank: int, lora_targets, image_tokens: int,
                     true_cfg: bool = True, token_linears=()) -> "ModelDims":
        """From the modules (any device, meta too): a transformer with a PEFT LoRA counts the LoRA it has, one
        without counts rank x (in + out) for each nn.Linear named by lora_targets (PEFT's suffix match)."""
        import torch

        def size(module, skip=lambda name: False) -> int:
            if module is None:
                return 0
            return sum(t.numel() * t.element_size() for name, t in [*module.named_parameters(), *module.named_buffers()]
                       if not skip(name))

        wrapped = [m.base_layer for m in transformer.modules() if hasattr(m, "base_layer")]
        if wrapped:
            targets = wrapped
            lora = sum(p.numel() for n, p in transformer.named_parameters() if "lora_" in n)
        else:
            targets = [m for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)
                       and any(n == t or n.endswith("." + t) for t in lora_targets)]
            lora = sum(lora_rank * (m.in_features + m.out_features) for m in targets)
        from imagerl.families.layers.merged_lora import frozen_token_linears

        target_ids = {id(m) for m in targets}
        frozen_token = [m for _, m in frozen_token_linears(transformer, token_linears) if id(m) not in target_ids]
        config = transformer.config
        hidden = getattr(transformer, "inner_dim", None) or config.num_attention_heads * config.attention_head_dim
        text_config = getattr(text_encoder, "config", None)
        text_config = getattr(text_config, "text_config", None) or text_config
        return cls(transformer_bytes=size(transformer, lambda n: "lora_" in n), text_encoder_bytes=size(text_encoder),
                   vae_bytes=size(vae), lora_params=lora, merge_target_params=sum(m.weight.numel() for m in targets),
                   # flux: its 38 single-stream blocks beside the 19 double-stream ones
                   blocks=len(transformer.transformer_blocks) + len(getattr(transformer, "single_transformer_blocks", ())),
                   hidden=hidden, image_tokens=image_tokens,
                   latent_values=image_tokens * config.in_channels,
                   # sd3 / flux hold several encoders (no config): their embeddings are the transformer's width
                   text_hidden=getattr(text_config, "hidden_size", 0) or getattr(config, "joint_attention_dim", 0) or 0,
                   true_cfg=true_cfg, frozen_token_params=sum(m.weight.numel() for m in frozen_token))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank: the device's peak and its parts, and what waits in host memory (the images)."""

    static: int
    samples: int
    rollout: int
    training: int
    host: int  # the decoded images and (train.timestep_staging) the trajectories, in CPU memory
    device_is_host: bool  # model.device=cpu: the device's peak and the host's memory are one pool

    @property
    def peak(self) -> int:
        return max(self.rollout, self.training) + (self.host if self.device_is_host else 0)

    def gib(self, value: int | None = None) -> float:
        return (self.peak if value is None else value) / GIB


def _reward_bytes(cfg) -> int:
    if cfg.reward.device == "cpu":
        return 0
    per = 2 if cfg.reward.dtype == "bfloat16" else 4
    return sum(REWARD_PARAMS.get(name, 0) * per for name, weight in cfg.reward.weights.items() if weight)


def estimate_memory(cfg, dims: ModelDims, world_size: int = 1, fsdp: bool = False,
                    device_type: str = "cuda", text_tokens: int | None = None) -> MemoryEstimate:
    """The peak memory per rank of cfg's run on a model of these dims (module docstring); no device needed.
    text_tokens: the text length per row (default the cap, sample.max_sequence_length)."""
    s, t = cfg.sample, cfg.train
    from imagerl.algorithms.registry import algorithm_class

    nft = algorithm_class(t.algorithm).rollout == "clean"  # clean rollouts: x0 kept, two LoRA copies (NFT, AWM)
    shard = world_size if fsdp else 1
    from imagerl.families.base import cfg_rows as rows_per_sample

    cfg_rows = rows_per_sample(dims.true_cfg, s.guidance_scale)
    tokens = dims.image_tokens + (text_tokens if text_tokens is not None else s.max_sequence_length)
    samples_per_rank = -(-s.prompts_per_rollout * s.group_size // world_size)
    prompts_per_rank = -(-s.prompts_per_rollout // world_size)
    micro = t.batch_size or s.batch_size

    lora = dims.lora_params // shard
    offload = cfg.model.text_encoder_offload
    text_encoder = 0 if offload else dims.text_encoder_bytes // shard
    static = (dims.transformer_bytes // shard + text_encoder + dims.vae_bytes + _reward_bytes(cfg)
              + lora * LORA_STATE_BYTES + (lora * 4 * NFT_LORA_COPIES if nft else 0))
    gradients = lora * 4

    latent = dims.latent_values * 4  # float32
    # per SDE step: the latent in and out (+ the step's mean for train.ratio=grpo_guard and Flow-DPPO) and a log-prob
    from imagerl.rollout import keeps_step_means

    kept = latent * (1 if nft else (3 if keeps_step_means(cfg) else 2) * s.num_sde_steps) + \
        (0 if nft else 4 * s.num_sde_steps)
    # the prompts' embeddings (and the negative prompt's), shared by their samples
    text = (prompts_per_rank + 1) * (tokens - dims.image_tokens) * dims.text_hidden * dims.text_bytes_per_value
    on_device = samples_per_rank * (latent + (0 if t.timestep_staging else kept)) + text
    images = samples_per_rank * 3 * s.height * s.width * 4
    host = images + (samples_per_rank * kept if t.timestep_staging else 0) + (dims.text_encoder_bytes if offload else 0)

    merged = 0
    if s.merge_lora:
        # bf16 merged copies, or e4m3 ones of the targets and the frozen token linears (merged_lora.py)
        merged = (dims.merge_target_params + dims.frozen_token_params if s.off_window_fp8
                  else 2 * dims.merge_target_params)
    decode_per_pixel = DECODE_BYTES_PER_PIXEL / (2 if cfg.model.vae_dtype == "bfloat16" else 1)
    rollout = (static + on_device + merged + s.batch_size * cfg_rows * tokens * dims.hidden * INFERENCE_BYTES
               + min(s.decode_batch_size or micro, s.batch_size) * s.height * s.width * decode_per_pixel)

    checkpointed = checkpointed_blocks(cfg.model, dims.blocks)
    per_token = checkpointed * CHECKPOINT_BYTES + (dims.blocks - checkpointed + (1 if checkpointed else 0)) * TRAIN_BLOCK_BYTES
    training = static + gradients + on_device + micro * cfg_rows * tokens * dims.hidden * per_token
    encode = static + dims.text_encoder_bytes if offload else 0
    return MemoryEstimate(static=int(static), samples=int(on_device), rollout=int(max(rollout, encode)),
                          training=int(training), host=int(host), device_is_host=device_type == "cpu")


def checkpointed_blocks(model, blocks: int) -> int:
    """How many of `blocks` transformer blocks recompute their activations in the backward under cfg.model
    (gradient_checkpointing, checkpoint_every, checkpoint_blocks; families/base.py enable_activation_checkpointing)."""
    if not model.gradient_checkpointing:
        return 0
    selected = -(-blocks // model.checkpoint_every)
    return min(selected, model.checkpoint_blocks) if model.checkpoint_blocks > 0 else selected


# one change at a time, then pairs, in this order: the first that fit are suggested
def _levers(cfg) -> list[tuple[str, ...]]:
    s, t, m = cfg.sample, cfg.train, cfg.model
    micro = t.batch_size or s.batch_size
    single = [] if m.text_encoder_offload else ["model.text_encoder_offload=true"]  # the same run, ~0.6 s a rollout
    if not m.gradient_checkpointing:
        single.append("model.gradient_checkpointing=true")
    elif m.checkpoint_every > 1:
        single.append("model.checkpoint_every=1")
    elif m.checkpoint_blocks > 0:
        single.append("model.checkpoint_blocks=0")
    decode = min(s.decode_batch_size or micro, s.batch_size)
    if decode > 2:  # the rollout's VAE activations (1.6 GiB per 512 px image in float32), a few % of decode speed
        single.append("sample.decode_batch_size=2")
    if s.merge_lora and not s.off_window_fp8:
        single.append("sample.off_window_fp8=true")
    if s.merge_lora:
        single.append("sample.merge_lora=false")
    if micro > 1 and micro % 2 == 0:
        single.append(f"train.batch_size={micro // 2}")
    if s.batch_size > micro and s.batch_size % 2 == 0:
        single.append(f"sample.batch_size={s.batch_size // 2}")
    if m.vae_dtype != "bfloat16":
        single.append("model.vae_dtype=bfloat16")
    if not t.timestep_staging:
        single.append("train.timestep_staging=true")
    if s.group_size > 2:
        single.append(f"sample.group_size={max(2, s.group_size // 2)}")
    if s.prompts_per_rollout > 1:
        single.append(f"sample.prompts_per_rollout={max(1, s.prompts_per_rollout // 2)}")
    return [(o,) for o in single] + [(a, b) for i, a in enumerate(single) for b in single[i + 1:]]


def _apply(cfg, overrides: tuple[str, ...]):
    out = copy.deepcopy(cfg)
    for item in overrides:
        key, _, value = item.partition("=")
        section, name = key.split(".")
        current = getattr(getattr(out, section), name)
        parsed = value == "true" if isinstance(current, bool) else type(current)(value) if current is not None else value
        setattr(getattr(out, section), name, parsed)
    if out.train.batch_size and out.sample.batch_size % out.train.batch_size:
        out.sample.batch_size = out.train.batch_size
    return out


def settings_that_fit(cfg, dims: ModelDims, available: int, world_size: int = 1, fsdp: bool = False,
                      device_type: str = "cuda", limit: int = 3) -> list[tuple[tuple[str, ...], MemoryEstimate]]:
    """Up to `limit` of the _levers (one change, then two) whose estimate fits `available` bytes."""
    fits = []
    for overrides in _levers(cfg):
        estimate = estimate_memory(_apply(cfg, overrides), dims, world_size, fsdp, device_type)
        if estimate.peak <= available and (device_type == "cpu" or estimate.host <= _host_available()):
            fits.append((overrides, estimate))
        if len(fits) == limit:
            break
    if not fits:  # fewer samples: the largest group (halving) that fits, e.g. when the kept samples dominate
        group = cfg.sample.group_size
        while not fits and group > 2:
            group = max(2, group // 2)
            overrides = (f"sample.group_size={group}",)
            estimate = estimate_memory(_apply(cfg, overrides), dims, world_size, fsdp, device_type)
            if estimate.peak <= available and (device_type == "cpu" or estimate.host <= _host_available()):
                fits.append((overrides, estimate))
    return fits


def _host_available() -> int:
    """MemAvailable of /proc/meminfo (Linux), else free pages x page size."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _loaded_bytes(adapter) -> int:
    modules = [adapter.transformer, adapter.text_encoder, adapter.vae]
    return sum(t.numel() * t.element_size() for m in modules if m is not None for t in [*m.parameters(), *m.buffers()])


def check_memory(cfg, adapter, world) -> None:
    """Refuse a run whose estimated peak exceeds the device, before it compiles or samples: ValueError with the
    estimate, the device's memory and settings that fit. Call it once the adapter (with its LoRA) is loaded."""
    import torch

    device = world.device
    dims = ModelDims.of(adapter, cfg.sample.height, cfg.sample.width)
    estimate = estimate_memory(cfg, dims, world.size, world.fsdp, device.type)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # what this process already holds is part of the estimate (the weights): count it as available
        available = int((free + torch.cuda.memory_reserved(device)) * USABLE_FRACTION)
        where = f"{torch.cuda.get_device_name(device)}, {total / GIB:.1f} GiB in all"
    else:
        available = int((_host_available() + _loaded_bytes(adapter)) * USABLE_FRACTION)
        where = "CPU memory available"
    host_available = _host_available()
    if estimate.peak <= available and (device.type == "cpu" or estimate.host <= host_available):
        return
    fits = settings_that_fit(cfg, dims, available, world.size, world.fsdp, device.type)
    suggestion = "; ".join(f"{' '.join(o)} ({e.gib():.1f} GiB)" for o, e in fits) or \
        "none of the memory settings alone or in pairs; fewer samples per rollout (sample.prompts_per_rollout, " \
        "sample.group_size) or more ranks"
    if estimate.peak > available:
        raise ValueError(f"{cfg.recipe}: the run does not fit: estimated peak {estimate.gib():.1f} GiB per rank "
                         f"(rollout {estimate.gib(estimate.rollout):.1f}, training {estimate.gib(estimate.training):.1f}"
                         + (f", + {estimate.gib(estimate.host):.1f} of decoded images" if estimate.device_is_host else "")
                         + f"; the samples kept {estimate.gib(estimate.samples):.1f}), device has {available / GIB:.1f} GiB "
                         f"({where}); settings that fit: {suggestion}")
    raise ValueError(f"{cfg.recipe}: the rollout's images do not fit in CPU memory: estimated "
                     f"{estimate.gib(estimate.host):.1f} GiB, {host_available / GIB:.1f} GiB available; settings that "
                     f"fit: {suggestion}")
