"""`imagerl bench --family sd3`: Stable Diffusion 3.5 Medium at its released size with random weights (no download),
and the baseline: flow_grpo's scripts/train_sd3.py loop on diffusers' StableDiffusion3Pipeline + peft.

Released sizes (stabilityai/stable-diffusion-3.5-medium's config.json files): the MMDiT-X transformer (24 blocks of
24 heads x 64, dual attention in the first 13, RMS q/k norm; 2.47 B parameters), CLIP-L/14 and OpenCLIP bigG/14 text
towers with projections (123 M, 695 M), T5-XXL's encoder (4.76 B) and the 16-channel VAE. The tokenizers are trained
on the benchmark prompts (families/sd3/tiny.py); both CLIPs pad to 77 tokens and T5 to the recipe's 128, so the
sequence lengths are the real ones. `layers` (dry run on a CPU) shrinks the transformer to that many 2-head blocks
and the text towers to that many narrow layers at the tokenizers' vocabularies.

Geometry (flow_grpo's SD3.5 OCR recipe, config/grpo.py general_ocr_sd3, on one GPU): one prompt x 16 images per
iteration at 512 px, 10 steps, CFG 4.5 with the negative prompt "", SDE noise level 0.7 on the first 9 steps (the
trained ones: int(10 x timestep_fraction 0.99)), LoRA r32/a64 on the 8 attention projections, batch 8 (its 1-4 GPU
configs' per-GPU batch). The KL term (general_ocr_sd3's beta 0.04) is off on both sides: the baseline, like the
Qwen-Image one, is the clipped policy loss alone.
"""

from __future__ import annotations

import math

import torch

from imagerl.perf.baseline import BaselineSettings, FlowGRPOBaseline

GEOMETRY = ["sample.num_sde_steps=9", "sample.sde_window_range=[0, 9]", "sample.sde_window_start=0",
            "sample.noise_level=0.7", "sample.guidance_scale=4.5", "sample.negative_prompt=",
            "sample.max_sequence_length=128", "model.lora_rank=32", "model.lora_alpha=64", "train.beta=0.0",
            "sample.batch_size=8", "train.batch_size=8"]
DRY_GEOMETRY = ["sample.num_sde_steps=5", "sample.sde_window_range=[0, 5]", "sample.batch_size=2",
                "train.batch_size=0", "model.lora_rank=4", "model.lora_alpha=8"]
BASELINE_BATCH_SIZE = 8
BASELINE_CHECKPOINTING = False  # train_sd3.py enables no gradient checkpointing
DEFAULT_VARIANTS = {"imagerl (sd3_5_ocr: compile, batch 8)": [],
                    "imagerl, rollout 16, train 8": ["sample.batch_size=16"],
                    "imagerl, train 8 with checkpointing": ["model.gradient_checkpointing=true"]}

SD35_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64,
                   num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                   pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384,
                   dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              projection_dim=768, hidden_act="quick_gelu")
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              projection_dim=1280, hidden_act="gelu")
T5_XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, feed_forward_proj="gated-gelu",
              vocab_size=32128)
SD3_VAE = dict(in_channels=3, out_channels=3, down_block_types=["DownEncoderBlock2D"] * 4,
               up_block_types=["UpDecoderBlock2D"] * 4, block_out_channels=[128, 256, 512, 512], layers_per_block=2,
               latent_channels=16, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
               use_quant_conv=False, use_post_quant_conv=False)
CLIP_VOCAB = 49408


def build(device, prompts: list[str], layers: int | None = None, blocks: int | None = None):
    """(transformer bf16, vae fp32, [CLIP-L, CLIP-G, T5] bf16, their tokenizers) at the released sizes."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from imagerl.families.sd3.tiny import _corpus, build_clip_tokenizer, build_t5_tokenizer
    from imagerl.perf.real_size import _default_dtype

    corpus = _corpus() + list(prompts)
    tokenizers = [build_clip_tokenizer(corpus, 4096), build_clip_tokenizer(corpus, 4096),
                  build_t5_tokenizer(corpus, 2000)]
    transformer_spec = dict(SD35_MEDIUM)
    if layers is not None:  # dry run: 2 heads of 64, one dual-attention block
        transformer_spec.update(num_layers=layers, num_attention_heads=2, caption_projection_dim=128,
                                dual_attention_layers=(0,))
    elif blocks is not None:
        transformer_spec.update(num_layers=blocks, dual_attention_layers=tuple(range(min(13, blocks))))

    def clip(spec, tokenizer):
        small = dict(num_hidden_layers=layers, intermediate_size=256, vocab_size=len(tokenizer)) if layers else {}
        return CLIPTextModelWithProjection(CLIPTextConfig(**(dict(spec, vocab_size=CLIP_VOCAB) | small),
                                                          max_position_embeddings=77,
                                                          bos_token_id=tokenizer.bos_token_id,
                                                          eos_token_id=tokenizer.eos_token_id,
                                                          pad_token_id=tokenizer.pad_token_id))

    t5_small = dict(num_layers=layers, d_ff=256, vocab_size=len(tokenizers[2])) if layers else {}
    with torch.device(device), _default_dtype(torch.bfloat16):
        transformer = SD3Transformer2DModel(**transformer_spec)
        encoders = [clip(CLIP_L, tokenizers[0]), clip(CLIP_G, tokenizers[1]),
                    T5EncoderModel(T5Config(**(T5_XXL | t5_small)))]
    vae_spec = dict(SD3_VAE, block_out_channels=[32] * 4, layers_per_block=1) if layers else SD3_VAE
    with torch.device(device):
        vae = AutoencoderKL(**vae_spec)
    return transformer, vae, encoders, tokenizers


def new_adapter(modules, device):
    from imagerl.families.sd3 import SD3Family
    from imagerl.families.sd3.tiny import SD3_SCHEDULER_CONFIG

    transformer, vae, encoders, tokenizers = modules
    return SD3Family(transformer, vae, encoders, tokenizers, SD3_SCHEDULER_CONFIG, device, torch.bfloat16)


def _meta_inputs(config, side: int, text_tokens: int) -> dict:
    """One sample's forward arguments on the meta device: latents side x side, text_tokens rows."""
    with torch.device("meta"):
        return dict(hidden_states=torch.empty(1, config.in_channels, side, side, dtype=torch.bfloat16),
                    timestep=torch.empty(1),
                    encoder_hidden_states=torch.empty(1, text_tokens, config.joint_attention_dim, dtype=torch.bfloat16),
                    pooled_projections=torch.empty(1, config.pooled_projection_dim, dtype=torch.bfloat16),
                    return_dict=False)


def forward_flops(transformer, image_tokens: int, text_tokens: list[int], lora_rank: int, targets,
                  cached: bool = False) -> int:
    """FLOPs of one guided velocity of one sample: a forward per row (cond, and uncond under CFG), counted
    (perf/counted_flops.py). text_tokens: the rows' text lengths (77 CLIP + the T5 length)."""
    from diffusers import SD3Transformer2DModel

    from imagerl.perf.counted_flops import counted_forward_flops

    patches = math.isqrt(image_tokens)
    assert patches * patches == image_tokens, "the bench's images are square"
    side = patches * transformer.config.patch_size
    return sum(counted_forward_flops(SD3Transformer2DModel, transformer.config, _meta_inputs, (side, length),
                                     lora_rank, tuple(targets)) for length in text_tokens)


class FlowGRPOBaselineSD3(FlowGRPOBaseline):
    """flow_grpo's scripts/train_sd3.py on StableDiffusion3Pipeline: prompts encoded per sampling batch
    (pipeline.encode_prompt, CLIP-L + CLIP-G + T5 at max_sequence_length 128), [uncond, cond] rows in one forward,
    plain CFG with the gradient through both rows in training (compute_log_prob at 9745241), the pipeline's
    static-shift schedule, fp32 VAE decode; eager, no gradient checkpointing (train_sd3.py enables none)."""

    lora_targets = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                    "attn.to_out.0", "attn.to_q", "attn.to_v")

    def _timesteps(self, image_seq_len):
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import retrieve_timesteps

        timesteps, _ = retrieve_timesteps(self.pipe.scheduler, self.s.num_steps, self.device)
        return timesteps, self.pipe.scheduler.sigmas.to(self.device, torch.float32)

    def _encode(self, prompt, n):
        cond, neg, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=[prompt] * n, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=self.cfg, negative_prompt=[self.s.negative_prompt] * n,
            max_sequence_length=self.s.max_sequence_length)
        return cond, pooled, neg, neg_pooled

    def _velocity(self, latents, t, text):
        cond, pooled, neg, neg_pooled = text
        hidden = latents.to(self.dtype)
        if self.cfg:
            hidden, cond, pooled = torch.cat([hidden, hidden]), torch.cat([neg, cond]), torch.cat([neg_pooled, pooled])
        pred = self.transformer(hidden_states=hidden, timestep=t.expand(hidden.shape[0]), encoder_hidden_states=cond,
                                pooled_projections=pooled, return_dict=False)[0]
        if not self.cfg:
            return pred
        uncond, text_pred = pred.chunk(2)  # no detach: train_sd3.py compute_log_prob since a482878
        return uncond + self.s.guidance_scale * (text_pred - uncond)

    def _initial_latents(self, n: int, dtype, generator):
        return self.pipe.prepare_latents(n, self.transformer.config.in_channels, self.s.height, self.s.width, dtype,
                                         self.device, generator).float()

    def _decode(self, latents):
        vae = self.pipe.vae
        z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return (vae.decode(z, return_dict=False)[0].float() / 2 + 0.5).clamp(0, 1)


def new_baseline(modules, reward_fn, cfg, device, gradient_checkpointing: bool,
                 batch_size: int = BASELINE_BATCH_SIZE):
    """The baseline on the shared modules at cfg's geometry; (baseline, the config overrides that count its FLOPs)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from imagerl.families.sd3.tiny import SD3_SCHEDULER_CONFIG

    transformer, vae, encoders, tokenizers = modules
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(**SD3_SCHEDULER_CONFIG), vae=vae,
        text_encoder=encoders[0], tokenizer=tokenizers[0], text_encoder_2=encoders[1], tokenizer_2=tokenizers[1],
        text_encoder_3=encoders[2], tokenizer_3=tokenizers[2])
    settings = BaselineSettings.from_config(cfg, batch_size, gradient_checkpointing)
    flops_overrides = [f"model.gradient_checkpointing={gradient_checkpointing}", "model.checkpoint_every=1",
                       "sample.merge_lora=false"]
    return FlowGRPOBaselineSD3(pipe, reward_fn, settings, device), flops_overrides
