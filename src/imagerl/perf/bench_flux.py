"""`imagerl bench --family flux`: FLUX.1-dev at its released size with random weights (no download), and the
baseline: a DanceGRPO-style Flow-GRPO loop (github.com/XueZeyue/DanceGRPO, fastvideo/train_grpo_flux.py) on
diffusers' FluxPipeline + peft.

Released sizes (black-forest-labs/FLUX.1-dev's config.json files): the transformer (19 double-stream and 38
single-stream blocks of 24 heads x 128, guidance embedding; 11.9 B parameters), CLIP-L/14's text tower (123 M, its
pooled output) and T5-XXL's encoder (4.76 B), the 16-channel VAE with FLUX's scaling and shift. The tokenizers are
trained on the benchmark prompts (families/sd3/tiny.py); CLIP pads to 77 tokens and T5 to FluxPipeline's 512, so the
sequence lengths are the real ones. `layers` (dry run on a CPU) shrinks the transformer to that many 2-head blocks
of each kind and the text towers to that many narrow layers.

Geometry: the shared bench's (one prompt x 16 images at 512 px, 10 steps, SDE window {3, 4} at a fixed start, LoRA
r64/a128) with FLUX.1-dev's distilled guidance 3.5 as an input (one row per sample, no negative prompt), T5 at 512
tokens, noise level 0.7 (MixGRPO's eta), the LoRA on the flux_ocr recipe's targets (DanceGRPO's). Both sides
recompute every block in the backward (DanceGRPO trains FLUX with --gradient_checkpointing). The baseline samples
and trains one image per forward as DanceGRPO does (train_grpo_flux_lora.py: sample_reference_model's batch_size = 1,
grpo_one_step on one sample and one timestep per backward); `--baseline-batch-size 4` adds the stronger, batched
comparison. Every block attends without cuDNN attention on both sides (its backward faulted at these shapes;
benchmarks/LOG.md runs AS-AU).
"""

from __future__ import annotations

import math

import torch

from imagerl.perf.baseline import BaselineSettings, FlowGRPOBaseline
from imagerl.perf.bench_sd3 import CLIP_L, CLIP_VOCAB, SD3_VAE, T5_XXL

GEOMETRY = ["sample.guidance_scale=3.5", "sample.max_sequence_length=512", "sample.batch_size=4", "train.batch_size=4",
            "model.gradient_checkpointing=true", "model.checkpoint_every=1", "sample.sde_window_range=[0, 5]",
            "sample.sde_window_schedule=fixed", "sample.same_initial_noise=false", "sample.noise_level=0.7"]
DRY_GEOMETRY = ["sample.batch_size=2", "train.batch_size=0", "model.lora_rank=4", "model.lora_alpha=8",
                "sample.max_sequence_length=64"]
BASELINE_BATCH_SIZE = 1  # DanceGRPO train_grpo_flux_lora.py: one image per sampling and per training forward
BASELINE_CHECKPOINTING = True  # DanceGRPO's finetune_flux_grpo.sh: --gradient_checkpointing
# the flux_ocr recipe sets no parallel.compile, so its blocks run eager (every FLUX.1 row before run AY was eager,
# benchmarks/LOG.md); the compiled rows name it
DEFAULT_VARIANTS = {"imagerl (flux_ocr: eager, batch 4, checkpointing)": [],
                    "imagerl, regional compile": ["parallel.compile=true"],
                    "imagerl, compile, rollout 16 merged in FP8, training without checkpointing": [
                        "parallel.compile=true", "sample.batch_size=16", "sample.merge_lora=true",
                        "sample.off_window_fp8=true", "model.gradient_checkpointing=false",
                        "model.text_encoder_offload=true"]}

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
# the text towers are SD3.5's CLIP-L and T5-XXL (perf/bench_sd3.py); the VAE is SD3's architecture with FLUX.1-dev's
# factors (vae/config.json)
FLUX_VAE = SD3_VAE | {"scaling_factor": 0.3611, "shift_factor": 0.1159}


def build(device, prompts: list[str], layers: int | None = None, blocks: int | None = None):
    """(transformer bf16, vae fp32, [CLIP-L, T5] bf16, their tokenizers) at the released sizes."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from imagerl.families.sd3.tiny import _corpus, build_clip_tokenizer, build_t5_tokenizer
    from imagerl.perf.real_size import _default_dtype

    corpus = _corpus() + list(prompts)
    clip_tokenizer, t5_tokenizer = build_clip_tokenizer(corpus, 4096), build_t5_tokenizer(corpus, 2000)
    t5_tokenizer.model_max_length = 512
    spec = dict(FLUX_DEV)
    if layers is not None:  # dry run: 2 heads of 128 (the RoPE axes sum to the head dim)
        spec.update(num_layers=layers, num_single_layers=layers, num_attention_heads=2)
    elif blocks is not None:
        spec.update(num_layers=blocks, num_single_layers=2 * blocks)
    clip_small = dict(num_hidden_layers=layers, intermediate_size=256, vocab_size=len(clip_tokenizer)) if layers else {}
    t5_small = dict(num_layers=layers, d_ff=256, vocab_size=len(t5_tokenizer)) if layers else {}
    with torch.device(device), _default_dtype(torch.bfloat16):
        transformer = FluxTransformer2DModel(**spec)
        clip_spec = dict(CLIP_L, vocab_size=CLIP_VOCAB) | clip_small
        clip = CLIPTextModel(CLIPTextConfig(**clip_spec, max_position_embeddings=77,
                                            bos_token_id=clip_tokenizer.bos_token_id,
                                            eos_token_id=clip_tokenizer.eos_token_id,
                                            pad_token_id=clip_tokenizer.pad_token_id))
        t5 = T5EncoderModel(T5Config(**(T5_XXL | t5_small)))
    with torch.device(device):
        vae = AutoencoderKL(**(dict(FLUX_VAE, block_out_channels=[32] * 4, layers_per_block=1) if layers else FLUX_VAE))
    return transformer, vae, [clip, t5], [clip_tokenizer, t5_tokenizer]


def new_adapter(modules, device):
    from imagerl.families.flux import FluxFamily
    from imagerl.families.flux.tiny import FLUX_DEV_SCHEDULER_CONFIG

    transformer, vae, encoders, tokenizers = modules
    return FluxFamily(transformer, vae, encoders, tokenizers, FLUX_DEV_SCHEDULER_CONFIG, device, torch.bfloat16)


def _meta_inputs(config, image_tokens: int, text_tokens: int) -> dict:
    """One sample's forward arguments on the meta device (packed latents, RoPE ids, the distilled guidance)."""
    side = math.isqrt(image_tokens)
    with torch.device("meta"):
        return dict(hidden_states=torch.empty(1, image_tokens, config.in_channels, dtype=torch.bfloat16),
                    encoder_hidden_states=torch.empty(1, text_tokens, config.joint_attention_dim, dtype=torch.bfloat16),
                    pooled_projections=torch.empty(1, config.pooled_projection_dim, dtype=torch.bfloat16),
                    timestep=torch.empty(1), guidance=torch.empty(1) if config.guidance_embeds else None,
                    txt_ids=torch.zeros(text_tokens, 3), img_ids=torch.zeros(side * side, 3), return_dict=False)


def forward_flops(transformer, image_tokens: int, text_tokens: list[int], lora_rank: int, targets,
                  cached: bool = False) -> int:
    """FLOPs of one velocity of one sample (one row: no true CFG), counted (perf/counted_flops.py)."""
    from diffusers import FluxTransformer2DModel

    from imagerl.perf.counted_flops import counted_forward_flops

    return sum(counted_forward_flops(FluxTransformer2DModel, transformer.config, _meta_inputs, (image_tokens, length),
                                     lora_rank, tuple(targets)) for length in text_tokens)


class FlowGRPOBaselineFlux(FlowGRPOBaseline):
    """A DanceGRPO-style loop on FluxPipeline: prompts encoded per sampling batch (pipeline.encode_prompt: CLIP's
    pooled output and T5 at 512 tokens), one row per sample with the distilled guidance as an input, the pipeline's
    dynamically shifted schedule, packed latents with their RoPE ids, fp32 VAE decode; eager, every block
    recomputed in the backward."""

    def __init__(self, pipe, reward_fn, settings: BaselineSettings, device, targets, adapter_name="baseline"):
        self.lora_targets = tuple(targets)
        self._ids = None
        super().__init__(pipe, reward_fn, settings, device, adapter_name)

    @property
    def cfg(self) -> bool:
        return False  # guidance-distilled: guidance_scale is the guidance embedding's input

    def iteration(self, prompt: str, generator_seed: int) -> dict:
        """Without cuDNN attention, as the flux family: its backward at these shapes gave NaN gradients and an
        illegal memory access on an H100 (benchmarks/LOG.md runs AS-AU); a diffusers user meets the same."""
        from torch.nn.attention import sdpa_kernel

        from imagerl.families.layers.attention_backends import backends_without_cudnn

        with sdpa_kernel(backends_without_cudnn()):
            return super().iteration(prompt, generator_seed)

    def _encode(self, prompt, n):
        embeds, pooled, text_ids = self.pipe.encode_prompt(prompt=[prompt] * n, prompt_2=None, device=self.device,
                                                           num_images_per_prompt=1,
                                                           max_sequence_length=self.s.max_sequence_length)
        self._text_ids = text_ids
        return embeds, pooled, None, None

    def _velocity(self, latents, t, text):
        embeds, pooled, _, _ = text
        n = latents.shape[0]
        guidance = (torch.full((n,), self.s.guidance_scale, device=self.device, dtype=torch.float32)
                    if self.transformer.config.guidance_embeds else None)
        return self.transformer(hidden_states=latents.to(self.dtype), timestep=t.expand(n).to(self.dtype) / 1000,
                                guidance=guidance, pooled_projections=pooled, encoder_hidden_states=embeds,
                                txt_ids=self._text_ids, img_ids=self._ids, return_dict=False)[0]

    def _initial_latents(self, n: int, dtype, generator):
        latents, self._ids = self.pipe.prepare_latents(n, self.transformer.config.in_channels // 4, self.s.height,
                                                       self.s.width, dtype, self.device, generator)
        return latents.float()

    def _decode(self, latents):
        pipe, vae = self.pipe, self.pipe.vae
        z = pipe._unpack_latents(latents, self.s.height, self.s.width, pipe.vae_scale_factor).to(vae.dtype)
        z = z / vae.config.scaling_factor + vae.config.shift_factor
        return (vae.decode(z, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)


def new_baseline(modules, reward_fn, cfg, device, gradient_checkpointing: bool,
                 batch_size: int = BASELINE_BATCH_SIZE):
    """The baseline on the shared modules at cfg's geometry; (baseline, the config overrides that count its FLOPs)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from imagerl.families.flux import FluxFamily
    from imagerl.families.flux.tiny import FLUX_DEV_SCHEDULER_CONFIG

    transformer, vae, encoders, tokenizers = modules
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(**FLUX_DEV_SCHEDULER_CONFIG), vae=vae,
                        text_encoder=encoders[0], tokenizer=tokenizers[0], text_encoder_2=encoders[1],
                        tokenizer_2=tokenizers[1], transformer=transformer)
    settings = BaselineSettings.from_config(cfg, batch_size, gradient_checkpointing)
    flops_overrides = [f"model.gradient_checkpointing={gradient_checkpointing}", "model.checkpoint_every=1",
                       "model.checkpoint_blocks=0", "sample.merge_lora=false"]
    targets = cfg.model.lora_target_modules or FluxFamily.lora_target_modules
    return FlowGRPOBaselineFlux(pipe, reward_fn, settings, device, targets), flops_overrides
