"""FLUX.1 (dev / schnell): MMDiT with double- and single-stream blocks, CLIP-L (pooled) + T5-XXL text encoders,
16-channel VAE with a shift, guidance distillation instead of CFG.

Mirrors diffusers 0.42.1 `FluxPipeline` (pipelines/flux/pipeline_flux.py) and `FluxTransformer2DModel`
(models/transformers/transformer_flux.py):
  prompts   CLIP: tokens padded to tokenizer.model_max_length (77), the pooled output (`pooler_output`) ->
            `pooled_projections`; T5: tokens padded to max_sequence_length (512, at most 512), the last hidden
            state -> `encoder_hidden_states`, every padded row kept (no mask). Here one tensor per prompt: the T5
            rows, then one row holding the pooled vector (zero-padded to the T5 width), as the sd3 family does.
  latents   (B, 16, H/8, W/8) noise packed into 2x2 patches (FluxPipeline._pack_latents) -> (B, H/16 * W/16, 64);
            txt_ids zeros (L, 3), img_ids (FluxPipeline._prepare_latent_image_ids) rows (0, y, x).
  sigmas    linspace(1, 1/N, N) through the checkpoint's own FlowMatchEulerDiscreteScheduler with
            mu = calculate_shift(image tokens, base/max_image_seq_len, base/max_shift) (dynamic shifting).
  timestep  the transformer receives scheduler_timestep / 1000 (it multiplies by 1000 again).
  guidance  FLUX.1-dev is guidance-distilled (transformer config guidance_embeds=True): `guidance` is an input,
            guidance_scale for every row (pipeline default 3.5); no negative prompt, no uncond rows, no true CFG
            (`true_cfg = False`: guidance_scale > 1 never doubles the rows). FLUX.1-schnell (guidance_embeds=False)
            gets guidance=None. The pipeline's optional true CFG (true_cfg_scale > 1 with a negative prompt) is
            not used (default true_cfg_scale 1.0).
  decode    unpack, x / scaling_factor + shift_factor, VAE decode (float32), (x / 2 + 0.5).clamp(0, 1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from imagerl.families.base import (
    Conditioning,
    PackedLatentFamily,
    check_components,
    load_text_encoders,
    loading,
    read_json,
    read_model_index,
)
from imagerl.families.registry import register_family

COMPONENTS = {
    "transformer": "FluxTransformer2DModel", "vae": "AutoencoderKL", "scheduler": "FlowMatchEulerDiscreteScheduler",
    "text_encoder": "CLIPTextModel", "text_encoder_2": "T5EncoderModel",
}
T5_MAX_LENGTH = 512  # FluxPipeline's max_sequence_length default, and the most its check_inputs allows


@register_family
class FluxFamily(PackedLatentFamily):
    name = "flux"
    name_patterns = ("flux.1", "flux1", "flux")
    pipeline_class_name = "FluxPipeline"
    true_cfg = False  # guidance-distilled: guidance_scale is the transformer's `guidance` input (module docstring)
    # flow_grpo's FLUX LoRA targets (github.com/yifan123/flow_grpo scripts/train_flux.py): the attention projections
    # of both streams and the double blocks' MLPs. PEFT matches by suffix, so "attn.to_q/to_k/to_v" also adapt the
    # single-stream blocks' attention (diffusers' FluxSingleTransformerBlock: attn.to_q/to_k/to_v, no to_out);
    # their proj_mlp / proj_out stay frozen, as in flow_grpo (DanceGRPO's train_grpo_flux_lora.py adapts
    # to_q/to_k/to_v/to_out.0 only).
    lora_target_modules = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                           "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                           "ff_context.net.0.proj", "ff_context.net.2")
    # and the single-stream blocks' MLP-in and fused output projections (3072 -> 12288, 15360 -> 3072): 9 of their
    # 12 x 3072^2 linear FLOPs per token beside q/k/v's 3; norm(1(_context)).linear take one row per sample
    token_linears = lora_target_modules + ("proj_mlp", "proj_out")
    default_guidance_scale = 3.5  # FluxPipeline.__call__ guidance_scale default (FLUX.1-dev's distilled guidance)
    default_num_steps = 28  # FluxPipeline.__call__ num_inference_steps default
    default_resolution = 1024  # FluxPipeline default_sample_size 128 x VAE factor 8
    tiny_name, tiny_cache_name = "tiny_flux", "tiny-flux-v1"

    @classmethod
    def build_tiny_checkpoint(cls, directory, seed: int = 0):
        from imagerl.families.flux.tiny import build

        return build(directory, seed=seed)

    @classmethod
    def pipeline_call_kwargs(cls, guidance_scale: float, negative_prompt: str) -> dict:
        return {"guidance_scale": guidance_scale}  # no negative prompt: FluxPipeline's true CFG stays off

    def __init__(self, transformer, vae, text_encoders, tokenizers, scheduler_config: dict, device, dtype,
                 prompt_cache_size: int = 4096):
        self._hold_modules(transformer, vae, text_encoders, tokenizers, scheduler_config, device, dtype,
                           prompt_cache_size)
        self.latent_channels = self.transformer.config.in_channels // 4  # 16
        self.pooled_width = self.transformer.config.pooled_projection_dim
        if self.pooled_width > self.text_width:
            raise ValueError(f"transformer pooled_projection_dim {self.pooled_width} exceeds joint_attention_dim "
                             f"{self.text_width}: the pooled row cannot ride with the T5 rows")
        self.guidance_embeds = bool(self.transformer.config.guidance_embeds)
        if self.device.type == "cuda":
            # cuDNN attention's backward at FLUX.1-dev's shapes (24 heads x 128, 1024 image + 512 text tokens) gave
            # NaN LoRA gradients, then an illegal memory access, on an H100 with torch 2.11, eager and compiled alike
            # (benchmarks/LOG.md runs AS-AU); every block attends with the other SDPA kernels, except in the
            # rollout's merged off-window steps, which nothing replays (cuDNN's forward: 1.9x flash's rate, run AY)
            from imagerl.families.layers.attention_backends import exclude_cudnn_attention

            exclude_cudnn_attention(self.transformer_blocks(), except_unreplayed=True)

    @classmethod
    def from_pretrained(cls, path, device, dtype, prompt_cache_size: int = 4096):
        from diffusers import AutoencoderKL, FluxTransformer2DModel
        from transformers import (
            CLIPTextModel,
            CLIPTokenizer,
            T5EncoderModel,
            T5TokenizerFast,
        )

        path = Path(path)
        check_components(path, read_model_index(path), COMPONENTS)
        for sub in ("tokenizer", "tokenizer_2"):
            if not (path / sub).is_dir():
                raise ValueError(f"{path} lacks the {sub}/ folder of a FLUX.1 checkpoint")
        scheduler_config = read_json(path / "scheduler" / "scheduler_config.json")
        with loading(path, "transformer"):
            transformer = FluxTransformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=dtype)
        with loading(path, "vae"):
            vae = AutoencoderKL.from_pretrained(path, subfolder="vae", torch_dtype=torch.float32)
        encoders, tokenizers = load_text_encoders(path, (  # the classes FLUX.1's model_index.json names
            ("text_encoder", "tokenizer", CLIPTextModel, CLIPTokenizer),
            ("text_encoder_2", "tokenizer_2", T5EncoderModel, T5TokenizerFast)), dtype)
        return cls(transformer, vae, encoders, tokenizers, scheduler_config, device, dtype, prompt_cache_size)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """num_steps + 1 float32 sigmas as FluxPipeline gets them: set_timesteps(sigmas=linspace(1, 1/N, N), mu)
        on diffusers' own scheduler, mu from the packed image token count (calculate_shift with the scheduler
        config's base/max sequence lengths and shifts; FLUX.1-dev at 1024 px: 4096 tokens, mu 1.15)."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler_config)
        grid = None if scheduler.config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        c = scheduler.config
        mu = calculate_shift(self.image_seq_len(height, width), c.get("base_image_seq_len", 256),
                             c.get("max_image_seq_len", 4096), c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        scheduler.set_timesteps(num_steps if grid is None else None, device="cpu", sigmas=grid, mu=mu)
        return scheduler.sigmas.to(torch.float32).to(self.device)

    def prepare_compile(self) -> None:
        """Inductor's coalescing analysis off (process-wide): on the GPU, torch 2.11's Triton scheduler asserted in
        it (tiling_utils.get_pw_red_splits, pytorch/pytorch#197077) on FLUX.1's compiled blocks and no block
        compiled; with it off every phase compiled and ran (benchmarks/LOG.md runs AZ, BA). The analysis only
        chooses how kernels tile their loops, not what they compute."""
        import torch._inductor.config as inductor_config

        inductor_config.triton.coalesce_tiling_analysis = False

    def transformer_blocks(self) -> list[torch.nn.Module]:
        """The 19 double-stream then the 38 single-stream blocks (FLUX.1): both run through diffusers' gradient
        checkpointing branch, and each is a unit of compile and sharding."""
        return list(self.transformer.transformer_blocks) + list(self.transformer.single_transformer_blocks)

    def text_encoder_module(self) -> torch.nn.Module:
        """T5 (T5-XXL: 4.7 B of the 4.9 B text-encoder parameters), what parallel.text_encoder shards under FSDP;
        CLIP-L (123 M) stays whole on every rank. (fully_shard refuses the ModuleList holding both: no forward.)"""
        return self.text_encoder[1]

    def text_encoder_layers(self) -> list[torch.nn.Module]:
        """T5's blocks, the units it is sharded by (T5EncoderModel keeps them in `encoder.block`, not `layers`)."""
        return list(self.text_encoder[1].encoder.block)

    # --- geometry ------------------------------------------------------------------------------

    def initial_noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """Packed float32 noise (B, N, 64), one generator per image, drawn as FluxPipeline.prepare_latents."""
        from diffusers import FluxPipeline

        h, w = self.latent_grid(height, width)
        noise = torch.cat([torch.randn((1, self.latent_channels, h, w), generator=g, dtype=torch.float32)
                           for g in generators])
        return FluxPipeline._pack_latents(noise, len(generators), self.latent_channels, h, w).to(self.device)

    # --- text ----------------------------------------------------------------------------------

    @torch.no_grad()
    def _encode_uncached(self, prompts: list[str], max_sequence_length: int = T5_MAX_LENGTH) -> list[torch.Tensor]:
        """FluxPipeline.encode_prompt: CLIP's pooled output and T5's padded sequence; one (L + 1, D) per prompt."""
        (clip_tokenizer, t5_tokenizer), (clip, t5) = self.tokenizers, self.text_encoder
        ids = clip_tokenizer(prompts, padding="max_length", max_length=clip_tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids.to(self.device)
        pooled = clip(ids, output_hidden_states=False).pooler_output.to(clip.dtype)
        ids = t5_tokenizer(prompts, padding="max_length", max_length=max_sequence_length, truncation=True,
                           return_tensors="pt").input_ids.to(self.device)
        seq = t5(ids, output_hidden_states=False)[0].to(t5.dtype)
        pooled_row = torch.nn.functional.pad(pooled, (0, self.text_width - pooled.shape[-1]))
        rows = torch.cat([seq, pooled_row[:, None].to(seq.dtype)], dim=1)
        return [r.to(self.dtype) for r in rows]

    def encode_prompts(self, prompts: list[str], max_sequence_length: int = T5_MAX_LENGTH) -> list[torch.Tensor]:
        """One (max_sequence_length + 1, D) tensor per prompt: the T5 rows, then the pooled row (module docstring)."""
        if not 1 <= max_sequence_length <= T5_MAX_LENGTH:  # FluxPipeline.check_inputs refuses more than 512
            raise ValueError(f"sample.max_sequence_length must be in [1, {T5_MAX_LENGTH}] for {self.name} "
                             f"(FluxPipeline's limit), got {max_sequence_length}")
        return self.encode_padded(prompts, max_sequence_length)

    def text_token_count(self, embeds_LD: torch.Tensor) -> int:
        return embeds_LD.shape[0] - 1  # the last row holds the pooled vector (pooled_projections, not a token)

    def conditioning(self, cond, uncond, guidance_scale: float, kv_cache: bool = False) -> Conditioning:
        """The cond rows only: FLUX's guidance is the `guidance` input, never negative rows (`uncond` ignored)."""
        assert not kv_cache, "flux has no prefix KV cache"
        rows = torch.stack(list(cond)).to(self.device)
        return Conditioning(rows, None, float(guidance_scale), False)

    # --- the model -----------------------------------------------------------------------------

    def velocity(self, latents_BNC, timesteps_B, cond: Conditioning, height: int, width: int) -> torch.Tensor:
        """The velocity (float32, B x N x 64) at scheduler timesteps t, as FluxPipeline's denoising loop calls the
        transformer: timestep t / 1000, guidance = guidance_scale per row (guidance_embeds) or None."""
        assert not cond.cfg, "flux conditioning has no uncond rows"
        h, w = self.latent_grid(height, width)
        b = latents_BNC.shape[0]
        t = timesteps_B.to(self.device, torch.float32) / 1000
        guidance = (torch.full((b,), cond.guidance_scale, dtype=torch.float32, device=self.device)
                    if self.guidance_embeds else None)
        seq, pooled = cond.embeds_BLD[:, :-1], cond.embeds_BLD[:, -1, : self.pooled_width]
        # the pipeline's ids: txt zeros in the text encoder's dtype, img rows in the prompt embeddings' dtype
        txt_ids = torch.zeros(seq.shape[1], 3, device=self.device, dtype=self.dtype)
        img_ids = self._image_ids(h // 2, w // 2)
        with self.autocast():
            pred = self.transformer(hidden_states=latents_BNC.to(self.dtype), timestep=t, guidance=guidance,
                                    pooled_projections=pooled, encoder_hidden_states=seq, txt_ids=txt_ids,
                                    img_ids=img_ids, return_dict=False)[0]
        return pred.float()

    def _image_ids(self, h: int, w: int) -> torch.Tensor:
        """FluxPipeline._prepare_latent_image_ids of an h x w packed grid, built once per grid: the pipeline builds
        them on the CPU and copies them in, a blocking copy (a host sync) in every forward."""
        from diffusers import FluxPipeline

        cache = self.__dict__.setdefault("_image_ids_cache", {})
        if (h, w) not in cache:
            cache[h, w] = FluxPipeline._prepare_latent_image_ids(1, h, w, self.device, self.dtype)
        return cache[h, w]

    @torch.no_grad()
    def encode_images(self, images_B3HW: torch.Tensor) -> torch.Tensor:
        """Packed float32 latents of images in [0, 1]: the posterior's mode, (z - shift_factor) * scaling_factor
        (diffusers' train_dreambooth_lora_flux.py), packed 2x2: the inverse of decode."""
        from diffusers import FluxPipeline

        height, width = images_B3HW.shape[-2:]
        h, w = self.latent_grid(height, width)
        z = self.vae.encode(images_B3HW.to(self.device, self.vae.dtype) * 2 - 1).latent_dist.mode()
        z = (z - self.vae.config.shift_factor) * self.vae.config.scaling_factor
        return FluxPipeline._pack_latents(z.float(), z.shape[0], self.latent_channels, h, w)

    @torch.no_grad()
    def decode(self, latents_BNC: torch.Tensor, height: int, width: int) -> torch.Tensor:
        from diffusers import FluxPipeline

        self.latent_grid(height, width)
        z = FluxPipeline._unpack_latents(latents_BNC, height, width, self.vae_scale_factor).to(self.vae.dtype)
        z = z / self.vae.config.scaling_factor + self.vae.config.shift_factor
        image = self.vae.decode(z, return_dict=False)[0]
        return (image / 2 + 0.5).clamp(0, 1).float()
