"""Stable Diffusion 3 / 3.5: MMDiT, CLIP-L + CLIP-G + T5-XXL text encoders with a pooled projection, 16-channel
VAE, plain CFG.

Mirrors diffusers 0.42.1 `StableDiffusion3Pipeline` (pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py):
  prompts   each CLIP: tokens padded to 77, hidden_states[-2] (clip_skip None) and the projected pooled output;
            the two CLIP sequences concatenated on features, zero-padded to T5's width, then the T5 sequence
            (padded to max_sequence_length, default 256) appended: L = 77 + max_sequence_length rows. pooled =
            cat(pooled_L, pooled_G). Here one tensor per prompt: the L rows, then one row holding pooled (zero-padded
            to the width), so the prompt cache, offload and batching keep one tensor per prompt.
  latents   (B, 16, H/8, W/8) noise; kept here as (B, H/8 * W/8, 16) (channels last), which the SDE and its
            log-prob (means over all latent values) treat alike.
  timestep  the transformer receives the scheduler timestep (0..1000) as is.
  CFG       v = u + s (c - u), uncond and cond in one batch (diffusers: [uncond, cond]; here [cond, uncond]);
            the gradient flows through both rows, as flow_grpo's train_sd3.py trains it since a482878
            (2025-08-19, "fix cfg gradient detach"; 2d76907 had detached u for five weeks).
  decode    x / scaling_factor + shift_factor, VAE decode (float32), (x / 2 + 0.5).clamp(0, 1).
"""

from __future__ import annotations

from pathlib import Path

import torch

from imagerl.families.base import Conditioning, FamilyAdapter, check_components, load_text_encoders, \
    load_transformer_and_vae, plain_cfg, read_model_index
from imagerl.families.registry import register_family

COMPONENTS = {
    "transformer": "SD3Transformer2DModel", "vae": "AutoencoderKL", "scheduler": "FlowMatchEulerDiscreteScheduler",
    "text_encoder": "CLIPTextModelWithProjection", "text_encoder_2": "CLIPTextModelWithProjection",
    "text_encoder_3": "T5EncoderModel",
}
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 256  # the pipeline's max_sequence_length default


@register_family
class SD3Family(FamilyAdapter):
    name = "sd3"
    name_patterns = ("stable-diffusion-3", "sd3", "sd-3")
    pipeline_class_name = "StableDiffusion3Pipeline"
    # flow_grpo's SD3 LoRA targets (scripts/train_sd3.py: the attention projections of both streams)
    lora_target_modules = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k",
                           "attn.to_out.0", "attn.to_q", "attn.to_v")
    # and SD3.5's second image attention (dual_attention_layers: attn2) and both streams' MLPs; norm1(_context).linear
    # take one row per sample
    token_linears = lora_target_modules + ("attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj",
                                           "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2")
    default_guidance_scale = 4.5  # flow_grpo config/base.py sample.guidance_scale (its SD3.5 runs)
    default_num_steps = 28  # StableDiffusion3Pipeline's num_inference_steps default
    default_resolution = 1024  # stable-diffusion-3.5-medium: transformer sample_size 128 x VAE factor 8
    tiny_name, tiny_cache_name = "tiny_sd3", "tiny-sd3-v2"

    @classmethod
    def build_tiny_checkpoint(cls, directory, seed: int = 0):
        from imagerl.families.sd3.tiny import build

        return build(directory, seed=seed)

    def __init__(self, transformer, vae, text_encoders, tokenizers, scheduler_config: dict, device, dtype,
                 prompt_cache_size: int = 4096):
        self._hold_modules(transformer, vae, text_encoders, tokenizers, scheduler_config, device, dtype,
                           prompt_cache_size)
        self.latent_channels = self.transformer.config.in_channels

    @classmethod
    def from_pretrained(cls, path, device, dtype, prompt_cache_size: int = 4096):
        from diffusers import AutoencoderKL, SD3Transformer2DModel
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        path = Path(path)
        check_components(path, read_model_index(path), COMPONENTS)
        scheduler_config, transformer, vae = load_transformer_and_vae(path, SD3Transformer2DModel, AutoencoderKL, dtype)
        encoders, tokenizers = load_text_encoders(path, (
            ("text_encoder", "tokenizer", CLIPTextModelWithProjection, AutoTokenizer),
            ("text_encoder_2", "tokenizer_2", CLIPTextModelWithProjection, AutoTokenizer),
            ("text_encoder_3", "tokenizer_3", T5EncoderModel, AutoTokenizer)), dtype)
        return cls(transformer, vae, encoders, tokenizers, scheduler_config, device, dtype, prompt_cache_size)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """num_steps + 1 float32 sigmas as StableDiffusion3Pipeline gets them: set_timesteps(num_steps) without
        explicit sigmas, i.e. linspace(1, sigma_min) in timestep space with the static shift (3.0 for SD3.5),
        computed by diffusers' own scheduler (Qwen-Image passes linspace(1, 1/N) instead)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler.sigmas.to(torch.float32).to(self.device)

    # --- geometry ------------------------------------------------------------------------------

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        f = self.vae_scale_factor * self.transformer.config.patch_size
        if height % f or width % f:
            raise ValueError(f"sample.height/width must be multiples of {f} for {self.name}, got {height}x{width}")
        # the learned position table covers pos_embed_max_size patches a side (SD3.5: 384 x 16 px = 6144 px); past it
        # diffusers' PatchEmbed raises "Height (N) cannot be greater than pos_embed_max_size"
        limit = getattr(self.transformer.config, "pos_embed_max_size", None)
        if limit and max(height, width) > limit * f:
            raise ValueError(f"{height}x{width} px is larger than this checkpoint's position table allows: at most "
                             f"{limit * f} px a side (pos_embed_max_size {limit} patches x {f} px); pass a smaller "
                             f"size (imagerl sample/eval: --height {min(height, limit * f)} --width "
                             f"{min(width, limit * f)}; a run: sample.height, sample.width)")
        return height // self.vae_scale_factor, width // self.vae_scale_factor

    def image_seq_len(self, height: int, width: int) -> int:
        h, w = self.latent_grid(height, width)
        p = self.transformer.config.patch_size
        return (h // p) * (w // p)

    def initial_noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        h, w = self.latent_grid(height, width)
        noise = torch.cat([torch.randn((1, self.latent_channels, h, w), generator=g, dtype=torch.float32)
                           for g in generators])
        return noise.flatten(2).transpose(1, 2).to(self.device)  # (B, h*w, C)

    def _to_4d(self, x_BNC: torch.Tensor, h: int, w: int) -> torch.Tensor:
        return x_BNC.transpose(1, 2).reshape(x_BNC.shape[0], self.latent_channels, h, w)

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, negative_prompt: str) -> dict:
        return {"guidance_scale": guidance_scale, "negative_prompt": negative_prompt}

    def to_pipeline_latents(self, latents_BNC, height: int, width: int):
        return self._to_4d(latents_BNC, *self.latent_grid(height, width))

    def from_pipeline_latents(self, latents, height: int, width: int):
        return latents.flatten(2).transpose(1, 2)

    # --- text ----------------------------------------------------------------------------------

    def _encode_uncached(self, prompts: list[str], max_sequence_length: int = T5_MAX_LENGTH) -> list[torch.Tensor]:
        clip_rows, pooled = [], []
        for tokenizer, encoder in zip(self.tokenizers[:2], self.text_encoder[:2]):
            ids = tokenizer(prompts, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True,
                            return_tensors="pt").input_ids.to(self.device)
            out = encoder(ids, output_hidden_states=True)
            clip_rows.append(out.hidden_states[-2])
            pooled.append(out[0])
        clip = torch.cat(clip_rows, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, self.text_width - clip.shape[-1]))
        ids = self.tokenizers[2](prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                                 add_special_tokens=True, return_tensors="pt").input_ids.to(self.device)
        t5 = self.text_encoder[2](ids)[0]
        pooled_row = torch.nn.functional.pad(torch.cat(pooled, dim=-1), (0, self.text_width - sum(p.shape[-1] for p in pooled)))
        rows = torch.cat([clip.to(t5.dtype), t5, pooled_row[:, None].to(t5.dtype)], dim=1)
        return [r.to(self.dtype) for r in rows]

    def encode_prompts(self, prompts: list[str], max_sequence_length: int = T5_MAX_LENGTH) -> list[torch.Tensor]:
        """One (77 + T5 length + 1, D) tensor per prompt: the sequence rows, then the pooled row (module docstring)."""
        return self.encode_padded(prompts, min(max_sequence_length, T5_MAX_LENGTH))

    def text_encoder_module(self) -> torch.nn.Module:
        """T5 (T5-XXL: 4.76 B of SD3.5's 5.6 B text-encoder parameters), what parallel.text_encoder shards under
        FSDP; the two CLIPs stay whole on every rank (fully_shard refuses the ModuleList holding all three)."""
        return self.text_encoder[2]

    def text_encoder_layers(self) -> list[torch.nn.Module]:
        """T5's blocks, the units it is sharded by (T5EncoderModel keeps them in `encoder.block`)."""
        return list(self.text_encoder[2].encoder.block)

    def text_token_count(self, embeds_LD: torch.Tensor) -> int:
        return embeds_LD.shape[0] - 1  # the last row holds the pooled projection

    def conditioning(self, cond, uncond, guidance_scale: float, kv_cache: bool = False) -> Conditioning:
        assert not kv_cache, "sd3 has no prefix KV cache"
        cfg = guidance_scale > 1 and uncond is not None
        rows = torch.stack(list(cond) + (list(uncond) if cfg else [])).to(self.device)
        return Conditioning(rows, None, float(guidance_scale), cfg)

    # --- the model -----------------------------------------------------------------------------

    def velocity(self, latents_BNC, timesteps_B, cond: Conditioning, height: int, width: int) -> torch.Tensor:
        h, w = self.latent_grid(height, width)
        reps = 2 if cond.cfg else 1
        x = self._to_4d(latents_BNC, h, w)
        x = x.repeat(reps, 1, 1, 1) if reps > 1 else x
        t = timesteps_B.to(self.device, torch.float32).repeat(reps)
        seq, pooled = cond.embeds_BLD[:, :-1], cond.embeds_BLD[:, -1, : self.transformer.config.pooled_projection_dim]
        with self.autocast():
            pred = self.transformer(hidden_states=x.to(self.dtype), timestep=t, encoder_hidden_states=seq,
                                    pooled_projections=pooled, return_dict=False)[0].float()
        pred = pred.flatten(2).transpose(1, 2)
        if not cond.cfg:
            return pred
        # both rows carry the gradient, s d(c) + (1 - s) d(u): flow_grpo scripts/train_sd3.py compute_log_prob at
        # 9745241 (the uncond detach of 2d76907 was removed by a482878, "fix cfg gradient detach")
        return plain_cfg(pred, cond.guidance_scale)

    @torch.no_grad()
    def encode_images(self, images_B3HW: torch.Tensor) -> torch.Tensor:
        height, width = images_B3HW.shape[-2:]
        self.latent_grid(height, width)
        z = self.vae.encode(images_B3HW.to(self.device, self.vae.dtype) * 2 - 1).latent_dist.mode()
        z = (z - self.vae.config.shift_factor) * self.vae.config.scaling_factor
        return z.float().flatten(2).transpose(1, 2)

    @torch.no_grad()
    def decode(self, latents_BNC: torch.Tensor, height: int, width: int) -> torch.Tensor:
        h, w = self.latent_grid(height, width)
        z = self._to_4d(latents_BNC, h, w).to(self.vae.dtype)
        z = z / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(z, return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1).float()
