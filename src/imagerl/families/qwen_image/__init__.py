"""Qwen-Image (1.0): dual-stream MMDiT, Qwen2.5-VL text encoder, 16-channel VAE, true CFG with norm rescale.

Everything here mirrors diffusers 0.42.1 `QwenImagePipeline` (pipelines/qwenimage/pipeline_qwenimage.py):
  prompts   template + "<|im_start|>assistant\\n", tokenized with max_length 1024 + 34, hidden_states[-1]
            of the text encoder, the first 34 tokens (system turn + "<|im_start|>user\\n") dropped,
            right-padded; truncated to max_sequence_length.
  latents   (B, 1, 16, H/8, W/8) noise packed into 2x2 patches -> (B, H/16 * W/16, 64), channel c*4+dy*2+dx.
  timestep  the transformer receives scheduler_timestep / 1000 (= sigma, up to float32 rounding).
  CFG       v = u + s (c - u), rescaled per token to ||c|| (norm over the 64 packed channels), when s > 1.
            Departure: cond and uncond run as one batched forward (diffusers runs two); the batch is
            padded to the longer text with a key mask, which matches unpadded within float rounding.
  decode    unpack, x / (1 / std) + mean, VAE decode (float32), frame 0, (x / 2 + 0.5).clamp(0, 1).
            Departure: the VAE's causal 3D convolutions of the one frame run as the 2D convolutions they
            amount to (vae_single_frame.py: a third of the multiply-adds; the same sums up to their order).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from imagerl.families.base import (Conditioning, PackedLatentFamily, PromptCache, check_components,
                                   group_rows_by_length, load_transformer_and_vae, loading, read_model_index)
from imagerl.families.registry import register_family
from imagerl.families.layers.vae_single_frame import single_frame_convs

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
TEMPLATE_DROP_TOKENS = 34  # diffusers' prompt_template_encode_start_idx
TOKENIZER_MAX_LENGTH = 1024

COMPONENTS = {
    "transformer": "QwenImageTransformer2DModel",
    "vae": "AutoencoderKLQwenImage",
    "scheduler": "FlowMatchEulerDiscreteScheduler",
    "text_encoder": "Qwen2_5_VLForConditionalGeneration",
}


def pack_latents(latents_BC1HW: torch.Tensor) -> torch.Tensor:
    """(B, C, 1, h, w) -> (B, h/2 * w/2, 4C) with channel index c*4 + dy*2 + dx."""
    b, c, _, h, w = latents_BC1HW.shape
    x = latents_BC1HW.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(latents_BNC: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of pack_latents; h, w are the VAE latent height/width (pixels / 8)."""
    b, _, c4 = latents_BNC.shape
    x = latents_BNC.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, 1, h, w)


def cfg_combine(cond_BNC: torch.Tensor, uncond_BNC: torch.Tensor, scale: float) -> torch.Tensor:
    """True CFG with per-token norm rescale to the conditional prediction (diffusers QwenImagePipeline)."""
    comb = uncond_BNC + scale * (cond_BNC - uncond_BNC)
    cond_norm = torch.norm(cond_BNC, dim=-1, keepdim=True)
    comb_norm = torch.norm(comb, dim=-1, keepdim=True)
    return comb * (cond_norm / comb_norm)


@register_family
class QwenImageFamily(PackedLatentFamily):
    name = "qwen_image"
    name_patterns = ("qwen-image", "qwen_image", "qwenimage")
    pipeline_class_name = "QwenImagePipeline"
    tiny_name, tiny_cache_name = "tiny", "tiny-qwen-image-v1"

    @classmethod
    def build_tiny_checkpoint(cls, directory, seed: int = 0):
        from imagerl.families.qwen_image.tiny import make_tiny_qwen_image  # imports this module: lazily

        return make_tiny_qwen_image(directory, seed=seed)
    default_guidance_scale = 4.0  # flow_grpo's Qwen-Image recipe (rollout, training and eval)
    # The 12 block Linears of the flow_grpo / miles Qwen-Image recipes (all but img_mod/txt_mod).
    lora_target_modules = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
        "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
    )
    token_linears = lora_target_modules  # all of them (img_mod / txt_mod take one row per sample)

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler_config: dict, device: torch.device,
                 dtype: torch.dtype, prompt_cache_size: int = 4096):
        """From loaded components (see from_pretrained); moves them to `device`, frozen."""
        self.device, self.dtype = torch.device(device), dtype
        self.scheduler_config = dict(scheduler_config)
        self.transformer = transformer.to(self.device).requires_grad_(False)
        rebuild_rope_tables(self.transformer, self.device)
        self.vae = vae.to(self.device).eval().requires_grad_(False)
        self.text_encoder = text_encoder.to(self.device).eval().requires_grad_(False) if text_encoder is not None else None
        self.tokenizer = tokenizer
        self.vae_scale_factor = 2 ** len(self.vae.temperal_downsample)  # 8
        self.latent_channels = self.transformer.config.in_channels // 4  # 16 (tiny: 4)
        self.prompt_cache = PromptCache(prompt_cache_size)
        self.truncation_warned: set[str] = set()  # prompts already warned about (once each)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device, dtype: torch.dtype, prompt_cache_size: int = 4096):
        """Load a local diffusers-format Qwen-Image directory (transformer/text encoder in `dtype`, VAE in fp32)."""
        from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        path = Path(path)
        check_components(path, read_model_index(path), COMPONENTS)
        if not (path / "tokenizer").is_dir():
            raise ValueError(f"{path} lacks the tokenizer/ folder of a Qwen-Image checkpoint")
        scheduler_config, transformer, vae = load_transformer_and_vae(path, QwenImageTransformer2DModel, AutoencoderKLQwenImage, dtype)
        with loading(path, "text_encoder"):
            text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(path, subfolder="text_encoder", dtype=dtype)
        with loading(path, "tokenizer"):
            tokenizer = AutoTokenizer.from_pretrained(path / "tokenizer")
        return cls(transformer, vae, text_encoder, tokenizer, scheduler_config, device, dtype, prompt_cache_size)

    # --- geometry ------------------------------------------------------------------------------

    def initial_noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """Packed float32 noise (B, N, C), one generator per image (independent of batching)."""
        h, w = self.latent_grid(height, width)
        noise = [torch.randn((1, self.latent_channels, 1, h, w), generator=g, dtype=torch.float32) for g in generators]
        return pack_latents(torch.cat(noise)).to(self.device)

    # --- text -----------------------------------------------------------------------------------

    @torch.no_grad()
    def _encode_uncached(self, prompts: list[str], chunk: int = 16) -> list[torch.Tensor]:
        out = []
        for i in range(0, len(prompts), chunk):
            texts = [PROMPT_TEMPLATE.format(p) for p in prompts[i : i + chunk]]
            tokens = self.tokenizer(
                texts, max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_DROP_TOKENS, padding=True, truncation=True,
                return_tensors="pt",
            ).to(self.device)
            # The inner Qwen2_5_VLModel: same hidden states as the pipeline's ForConditionalGeneration call,
            # without the lm_head's (L x 152k) vocabulary logits. hidden_states[-1] is what the pipeline
            # uses: with transformers 5.x it is the output after the final RMSNorm (== last_hidden_state);
            # tests/test_qwen_image_adapter.py checks equality with QwenImagePipeline.encode_prompt.
            hidden = self.text_encoder.model(
                input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, output_hidden_states=True
            ).hidden_states[-1]
            for row, mask in zip(hidden, tokens.attention_mask.bool()):
                out.append(row[mask][TEMPLATE_DROP_TOKENS:].to(self.dtype))
        return out

    def encode_prompts(self, prompts: list[str], max_sequence_length: int = 512) -> list[torch.Tensor]:
        """One (L_i, D) embedding per prompt (valid tokens only), each unique prompt encoded once."""
        embeds = self.prompt_cache.get_many(prompts, self.encode_missing)
        for prompt, e in zip(prompts, embeds):
            if e.shape[0] > max_sequence_length and prompt not in self.truncation_warned:
                self.truncation_warned.add(prompt)
                warnings.warn(f"prompt of {e.shape[0]} text tokens truncated to sample.max_sequence_length="
                              f"{max_sequence_length} (as the pipeline does): {prompt[:80]!r}. Raise "
                              "sample.max_sequence_length to keep it whole (where a recipe caps it to bound the "
                              "training's activation memory, also set model.gradient_checkpointing=true)",
                              stacklevel=2)
        return [e[:max_sequence_length] for e in embeds]

    def conditioning(self, cond: list[torch.Tensor], uncond: list[torch.Tensor] | None, guidance_scale: float,
                     kv_cache: bool = False) -> Conditioning:
        """Right-pad the rows (cond, then uncond when CFG is on) to one (B', L, D) batch with a key mask.
        Padding is exact here: the mask removes padded keys and text RoPE positions do not depend on it."""
        assert not kv_cache, "qwen_image has no prefix KV cache (train() rejects sample.kv_cache for it)"
        cfg = guidance_scale > 1 and uncond is not None
        rows = list(cond) + (list(uncond) if cfg else [])
        if self.group_text_lengths:
            rows_G, embeds_G, inverse = group_rows_by_length(rows, self.device)
            return Conditioning(None, None, float(guidance_scale), cfg, rows_G, embeds_G, inverse)
        m = self.text_length_multiple  # padded keys are masked, so rounding the length up changes no value
        length = -(-max(r.shape[0] for r in rows) // m) * m
        embeds = torch.zeros(len(rows), length, rows[0].shape[1], dtype=rows[0].dtype, device=self.device)
        mask = torch.zeros(len(rows), length, dtype=torch.bool, device=self.device)
        for i, r in enumerate(rows):
            embeds[i, : r.shape[0]] = r
            mask[i, : r.shape[0]] = True
        return Conditioning(embeds, None if bool(mask.all()) else mask, float(guidance_scale), cfg)

    # --- the model ------------------------------------------------------------------------------

    def velocity(self, latents_BNC: torch.Tensor, timesteps_B: torch.Tensor, cond: Conditioning,
                 height: int, width: int) -> torch.Tensor:
        """Guided velocity (float32, B x N x C) at scheduler timesteps t (the model gets t / 1000)."""
        h, w = self.latent_grid(height, width)
        reps = 2 if cond.cfg else 1
        hidden = latents_BNC.repeat(reps, 1, 1) if reps > 1 else latents_BNC
        t = timesteps_B.to(self.device, torch.float32).repeat(reps) / 1000
        with self.autocast():
            if cond.rows_G is None:
                pred = self._forward(hidden, t, cond.embeds_BLD, cond.mask_BL, h, w)
            else:  # one unmasked forward per text length
                pred = torch.cat([self._forward(hidden[rows], t[rows], embeds, None, h, w)
                                  for rows, embeds in zip(cond.rows_G, cond.embeds_G)])[cond.inverse]
        if not cond.cfg:
            return pred
        c, u = pred.chunk(2)
        return cfg_combine(c, u, cond.guidance_scale)

    def _forward(self, hidden_BNC, t_B, embeds_BLD, mask_BL, h: int, w: int) -> torch.Tensor:
        return self.transformer(
            hidden_states=hidden_BNC, timestep=t_B, encoder_hidden_states=embeds_BLD, encoder_hidden_states_mask=mask_BL,
            img_shapes=[[(1, h // 2, w // 2)]] * hidden_BNC.shape[0], return_dict=False,
        )[0].float()

    @torch.no_grad()
    def encode_images(self, images_B3HW: torch.Tensor) -> torch.Tensor:
        """Packed float32 latents (B, N, C) of images in [0, 1] (H, W multiples of 16): the inverse of decode.

        VAE encode in float32 of 2x - 1 as a one-frame video; the posterior's mean (`latent_dist.mode()`, what
        the edit pipelines' `_encode_vae_image` take; no sampling), normalised (z - latents_mean) / latents_std as
        QwenImageImg2ImgPipeline and diffusers' train_dreambooth_lora_qwen_image.py do, then packed into 2x2
        patches (QwenImagePipeline._pack_latents)."""
        height, width = images_B3HW.shape[-2:]
        self.latent_grid(height, width)  # checks the size
        x = (images_B3HW.to(self.device, self.vae.dtype) * 2 - 1).unsqueeze(2)
        with single_frame_convs(self.vae):  # one frame: the causal 3D convolutions as 2D ones (same math)
            z = self.vae.encode(x).latent_dist.mode()
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        return pack_latents((z - mean) / std).float()

    @torch.no_grad()
    def decode(self, latents_BNC: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Images (B, 3, H, W) float32 in [0, 1]."""
        h, w = self.latent_grid(height, width)
        z = unpack_latents(latents_BNC, h, w).to(self.vae.dtype)
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        with single_frame_convs(self.vae):  # one frame: the causal 3D convolutions as 2D ones (same math)
            image = self.vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]
        return (image / 2 + 0.5).clamp(0, 1).float()


def rebuild_rope_tables(transformer, device: torch.device) -> None:
    """Build QwenEmbedRope's complex tables on the compute device (diffusers builds them on the CPU in
    __init__ and copies them; a CUDA build differs by float32 ULPs, which miles measured drifting the
    frozen-weight prediction by ~2e-2). Uses diffusers' own rope_params under the device context."""
    rope = transformer.pos_embed
    with torch.device(device):
        pos = torch.arange(4096)
        neg = torch.arange(4096).flip(0) * -1 - 1
        rope.pos_freqs = torch.cat([rope.rope_params(pos, d, rope.theta) for d in rope.axes_dim], dim=1)
        rope.neg_freqs = torch.cat([rope.rope_params(neg, d, rope.theta) for d in rope.axes_dim], dim=1)
    for cached in ("_get_device_freqs", "_compute_video_freqs"):
        clear = getattr(getattr(rope, cached, None), "cache_clear", None)
        if clear is not None:
            clear()
