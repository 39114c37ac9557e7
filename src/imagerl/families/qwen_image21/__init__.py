"""Qwen-Image 2.1: single-stream block-causal DiT, Qwen3-VL text encoder, 64-channel RGBA VAE (16x), no CFG.

Everything here mirrors diffusers 0.42.1 `QwenImage21Pipeline` text-to-image
(pipelines/qwenimage/, its transformer and VAE in models/):
  prompts   the raw template string (system turn + user turn + "<|im_start|>assistant\\n"), the text encoder's
            last decoder layer output BEFORE its final RMSNorm, the system turn's tokens dropped (their count
            from the chat template, as the pipeline computes `_drop_idx`), valid tokens only. No
            max_sequence_length and no truncation (the pipeline has none).
  latents   (B, 1, C, H/16, W/16) noise packed by a plain flatten -> (B, T, C), T = H/16 * W/16; the pipeline
            floors H and W to multiples of 32, so we require them.
  model     transformer(latents, timestep = t / 1000, text, img_mask = [0] * L + [1] * T/4 slots) -> [:, -T:].
  CFG       plain u + s (c - u) (no norm rescale) when s > 1; 2.1 is meant to be sampled at s = 1.
  decode    x * std + mean, VAE decode (float32), frame 0, (x / 2 + 0.5).clamp(0, 1) -> RGBA; rewards get RGB
            composited over white (rgb * a + 1 - a), the convention the pipeline uses for RGBA condition images.
Departures, for numerics:
  * Text rows are never padded into one batch. In 2.1 a padded text token still advances the RoPE frame
    position of the target image block (§2.5/§2.6), so a right-padded prompt gives a different prediction
    from the same prompt alone. velocity() therefore runs the rows (cond and uncond alike) grouped by text
    length as unpadded sub-batches and scatters the results back: a batch of mixed-length prompts equals
    per-prompt runs, and every single-prompt call equals the pipeline (tests/test_qwen_image21_adapter.py).
  * Prompts are encoded one per text-encoder call: in a left-padded batch a short prompt's absolute positions
    shift, which changes its embedding by float rounding, so batch-mates (or what the prompt cache already
    holds) would change a prompt's embedding. One per call equals `pipe.encode_prompt([prompt])` bit for bit.
  * Only the tokenizer of the processor/ folder is loaded: the text-to-image processor call is the
    tokenizer call (its extra mm_token_type_ids are all zero and change nothing without images), and
    transformers cannot build a Qwen3VLProcessor without torchvision (its video processor needs it).
  * With kv_cache=True (rollouts only) the text prefix keys/values of each sub-batch are computed on the
    first velocity call ("extract") and reused by later calls ("cached"); training always runs full forwards.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from imagerl.families.base import (FamilyAdapter, PromptCache, check_components, group_rows_by_length,
                                   load_transformer_and_vae, loading, plain_cfg, read_model_index)
from imagerl.families.registry import register_family

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
PROMPT_TEMPLATE = (
    f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n{{}}<|im_end|>\n<|im_start|>assistant\n"
)
VAE_SCALE_FACTOR = 16  # hard-coded in QwenImage21Pipeline: one latent token per 16x16 pixels

COMPONENTS = {
    "transformer": "QwenImage21Transformer2DModel",
    "vae": "AutoencoderKLQwenImage21",
    "scheduler": "FlowMatchEulerDiscreteScheduler",
    "text_encoder": "Qwen3VLForConditionalGeneration",
    "processor": "Qwen3VLProcessor",
}


@dataclass
class Conditioning21:
    """Text rows (the B cond rows, then the B uncond rows when `cfg`) grouped by text length.

    rows_G[g]: indices of group g's rows in that cond+uncond order; embeds_G[g]: their (n_g, L_g, D) embeddings;
    inverse: puts the concatenated group outputs back in row order; caches_G: one QwenImage21KVCache per
    group when the prefix KV cache is on (filled by the first velocity call), else None.
    """

    rows_G: list[torch.Tensor]
    embeds_G: list[torch.Tensor]
    inverse: torch.Tensor
    guidance_scale: float
    cfg: bool
    num_images: int
    caches_G: list | None = None
    cache_filled: bool = False


def system_turn_tokens(tokenizer, chat_template: str | None) -> int:
    """Tokens of the system turn, as QwenImage21Pipeline computes `_drop_idx` (via the chat template)."""
    if not chat_template:
        raise ValueError("the Qwen-Image 2.1 processor has no chat template (needed to find the system-turn length)")
    message = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
    text = tokenizer.apply_chat_template(message, chat_template=chat_template, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False).input_ids)


def rebuild_rope_tables(transformer, device: torch.device) -> None:
    """Build QwenImage21Rope's complex tables on the compute device with the module's own construction
    (diffusers builds them on the CPU in __init__ and moves them on first use; see qwen_image.py). They are
    a plain list, which .to() does not move. QwenImage21Rope keeps no shape cache to clear."""
    rope = transformer.pos_embed
    with torch.device(device):
        rope.freqs = type(rope)(theta=rope.theta, axes_dim=list(rope.axes_dim)).freqs


@register_family
class QwenImage21Family(FamilyAdapter):
    name = "qwen_image21"
    name_patterns = ("qwen-image-2.1", "qwen_image_2.1", "qwen-image2.1", "qwen_image21", "qwen-image-21",
                     "qwen_image_21", "qwenimage21", "qwenimage-2.1")
    pipeline_class_name = "QwenImage21Pipeline"
    tiny_name, tiny_cache_name = "tiny21", "tiny-qwen-image21-v1"

    @classmethod
    def load_pipeline(cls, path, **components):
        """QwenImage21Pipeline with its processor built by load_processor21: transformers cannot load a
        Qwen3VLProcessor without torchvision, which neither imagerl nor the pipeline's text path needs."""
        from pathlib import Path

        from imagerl.families.qwen_image21.tiny import load_processor21

        components.setdefault("processor", load_processor21(Path(path) / "processor"))
        return super().load_pipeline(path, **components)

    @classmethod
    def build_tiny_checkpoint(cls, directory, seed: int = 0):
        from imagerl.families.qwen_image21.tiny import make_tiny_qwen_image21  # imports this module: lazily

        return make_tiny_qwen_image21(directory, seed=seed)
    default_guidance_scale = 1.0  # the pipeline's default: 2.1 is sampled without guidance
    default_num_steps = 40  # QwenImage21Pipeline's num_inference_steps default
    supports_kv_cache = True
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj", "img_mlp.out", "img_mlp.gate_layer")
    token_linears = lora_target_modules  # all of them (the blocks have no per-block modulation Linear)

    def __init__(self, transformer, vae, text_encoder, processor, scheduler_config: dict, device: torch.device,
                 dtype: torch.dtype, prompt_cache_size: int = 4096, raw_sigmas: list[float] | None = None):
        """From loaded components (see from_pretrained); moves them to `device`, frozen. `processor` is a
        Qwen3VLProcessor or its tokenizer (with the processor's chat template)."""
        self.device, self.dtype = torch.device(device), dtype
        self.scheduler_config = dict(scheduler_config)
        self.raw_sigmas = list(raw_sigmas) if raw_sigmas is not None else None
        self.transformer = transformer.to(self.device).requires_grad_(False)
        rebuild_rope_tables(self.transformer, self.device)
        self.vae = vae.to(self.device).eval().requires_grad_(False)
        self.text_encoder = text_encoder.to(self.device).eval().requires_grad_(False) if text_encoder is not None else None
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.drop_tokens = system_turn_tokens(self.tokenizer, getattr(processor, "chat_template", None))
        self.latent_channels = self.transformer.config.in_channels  # == vae z_dim (64; tiny: 8)
        self.prompt_cache = PromptCache(prompt_cache_size)

    def prepare_compile(self) -> None:
        """Compiled blocks get the RoPE as real pairs: no complex operators in the Inductor graph (rope_pairs.py),
        and attention without the cuDNN backend, whose compiled backward faults on the GPU (attention_backends.py)."""
        from imagerl.families.layers.attention_backends import exclude_cudnn_attention
        from imagerl.families.layers.rope_pairs import use_real_rope_pairs

        use_real_rope_pairs(self.transformer)
        exclude_cudnn_attention(self.transformer_blocks())

    @classmethod
    def from_pretrained(cls, path: str | Path, device: torch.device, dtype: torch.dtype, prompt_cache_size: int = 4096):
        """Load a local diffusers-format Qwen-Image 2.1 directory (transformer/text encoder in `dtype`, VAE fp32)."""
        from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        path = Path(path)
        index = read_model_index(path)
        check_components(path, index, COMPONENTS)
        scheduler_config, transformer, vae = load_transformer_and_vae(path, QwenImage21Transformer2DModel, AutoencoderKLQwenImage21, dtype)
        with loading(path, "text_encoder"):
            text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(path, subfolder="text_encoder", dtype=dtype)
        with loading(path, "processor"):
            tokenizer = AutoTokenizer.from_pretrained(path / "processor")
            # the processor's chat template (what the pipeline renders), in either saved layout
            jinja, legacy = path / "processor" / "chat_template.jinja", path / "processor" / "chat_template.json"
            if jinja.is_file():
                tokenizer.chat_template = jinja.read_text()
            elif legacy.is_file():
                tokenizer.chat_template = json.loads(legacy.read_text())["chat_template"]
        return cls(transformer, vae, text_encoder, tokenizer, scheduler_config, device, dtype, prompt_cache_size,
                   raw_sigmas=index.get("sample_sigmas"))

    # --- geometry ------------------------------------------------------------------------------

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """Latent (h, w) = (H/16, W/16); the pipeline floors H, W to multiples of 32, so we require them."""
        f = VAE_SCALE_FACTOR * 2
        if height % f or width % f:
            raise ValueError(f"sample.height/width must be multiples of {f} for {self.name}, got {height}x{width}")
        return height // VAE_SCALE_FACTOR, width // VAE_SCALE_FACTOR

    def image_seq_len(self, height: int, width: int) -> int:
        h, w = self.latent_grid(height, width)
        return h * w

    def initial_noise(self, generators: list[torch.Generator], height: int, width: int) -> torch.Tensor:
        """Packed float32 noise (B, T, C), one generator per image; the pipeline's (1, 1, C, h, w) draw, flattened."""
        h, w = self.latent_grid(height, width)
        c = self.latent_channels
        noise = [torch.randn((1, 1, c, h, w), generator=g, dtype=torch.float32) for g in generators]
        return torch.cat(noise).view(len(generators), c, h * w).transpose(1, 2).contiguous().to(self.device)

    # --- text -----------------------------------------------------------------------------------

    @torch.no_grad()
    def _encode_uncached(self, prompts: list[str]) -> list[torch.Tensor]:
        out = []
        language_model = getattr(self.text_encoder.model, "language_model", self.text_encoder.model)
        for prompt in prompts:  # one per call: see the module docstring
            tokens = self.tokenizer([PROMPT_TEMPLATE.format(prompt or " ")], padding=True, padding_side="left",
                                    return_tensors="pt").to(self.device)
            # 2.1 was trained on the last decoder layer's output before the final RMSNorm. transformers 5.x
            # ties hidden_states[-1] to the normalised last_hidden_state, so, like the pipeline, a forward hook
            # returning the norm's input disables the norm for this call. The inner Qwen3VLModel gives the
            # pipeline's hidden states without the lm_head's vocabulary logits.
            handle = language_model.norm.register_forward_hook(lambda module, args, output: args[0])
            try:
                hidden = self.text_encoder.model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask,
                                                 output_hidden_states=True).hidden_states[-1]
            finally:
                handle.remove()
            out.append(hidden[0][tokens.attention_mask[0].bool()][self.drop_tokens:].to(self.dtype))
        return out

    def encode_prompts(self, prompts: list[str], max_sequence_length: int | None = None) -> list[torch.Tensor]:
        """One (L_i, D) embedding per prompt (valid tokens only), each unique prompt encoded once.
        max_sequence_length is accepted for the common interface and ignored: the 2.1 pipeline never truncates."""
        return self.prompt_cache.get_many(prompts, self.encode_missing)

    def conditioning(self, cond: list[torch.Tensor], uncond: list[torch.Tensor] | None, guidance_scale: float,
                     kv_cache: bool = False) -> Conditioning21:
        """Group the rows (cond, then uncond when CFG is on) by text length into unpadded sub-batches."""
        cfg = guidance_scale > 1 and uncond is not None
        rows_G, embeds_G, inverse = group_rows_by_length(list(cond) + (list(uncond) if cfg else []), self.device)
        caches = None
        if kv_cache:
            from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

            if not self.transformer.config.causal_condition:
                raise ValueError("sample.kv_cache needs a transformer with causal_condition=True")
            caches = [QwenImage21KVCache(len(self.transformer.transformer_blocks)) for _ in rows_G]
        return Conditioning21(rows_G, embeds_G, inverse, float(guidance_scale), cfg, len(cond), caches)

    # --- the model ------------------------------------------------------------------------------

    def velocity(self, latents_BTC: torch.Tensor, timesteps_B: torch.Tensor, cond: Conditioning21,
                 height: int, width: int) -> torch.Tensor:
        """Guided velocity (float32, B x T x C) at scheduler timesteps t (the model gets t / 1000)."""
        h, w = self.latent_grid(height, width)
        n_tokens = h * w
        reps = 2 if cond.cfg else 1
        x = latents_BTC.repeat(reps, 1, 1) if reps > 1 else latents_BTC
        t = timesteps_B.to(self.device, torch.float32).repeat(reps) / 1000
        mode = None if cond.caches_G is None else ("cached" if cond.cache_filled else "extract")
        preds = []
        with self.autocast():
            for g, (rows, emb) in enumerate(zip(cond.rows_G, cond.embeds_G)):
                n, length = emb.shape[:2]
                img_mask = torch.cat([torch.zeros(n, length, dtype=torch.bool, device=self.device),
                                      torch.ones(n, n_tokens // 4, dtype=torch.bool, device=self.device)], dim=1)
                out = self.transformer(
                    hidden_states=x[rows], timestep=t[rows], encoder_hidden_states=emb, img_shapes=[[(1, h, w)]] * n,
                    img_mask=img_mask, kv_cache=cond.caches_G[g] if mode else None, kv_cache_mode=mode,
                    return_dict=False,
                )[0]
                preds.append(out[:, -n_tokens:].float())
        if mode == "extract":
            cond.cache_filled = True
        pred = torch.cat(preds)[cond.inverse]
        if not cond.cfg:
            return pred
        return plain_cfg(pred, cond.guidance_scale)

    @torch.no_grad()
    def encode_images(self, images_B3HW: torch.Tensor) -> torch.Tensor:
        """Packed float32 latents (B, T, C) of images in [0, 1] (H, W multiples of 32): the inverse of decode.

        RGB gets an opaque alpha channel (the pipeline converts condition images to RGBA; a 4-channel RGBA batch
        is used as is); VAE encode in float32 of 2x - 1 as a one-frame video; the posterior's mean
        (`latent_dist.mode()`, the pipeline's `_encode_vae_image` with sample_mode="argmax"), normalised
        (z - latents_mean) / latents_std, flattened as QwenImage21Pipeline._pack_latents."""
        height, width = images_B3HW.shape[-2:]
        h, w = self.latent_grid(height, width)
        x = images_B3HW.to(self.device, self.vae.dtype)
        if x.shape[1] == 3:
            x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        z = self.vae.encode((x * 2 - 1).unsqueeze(2)).latent_dist.mode()
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        z = (z - mean) / std
        return z.reshape(z.shape[0], cfg.z_dim, h * w).transpose(1, 2).float().contiguous()

    @torch.no_grad()
    def decode_rgba(self, latents_BTC: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The pipeline's images (B, 4, H, W) float32 RGBA in [0, 1]."""
        h, w = self.latent_grid(height, width)
        b, _, c = latents_BTC.shape
        z = latents_BTC.transpose(1, 2).reshape(b, c, 1, h, w).to(self.vae.dtype)
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        std = torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1).to(z.device, z.dtype)
        image = self.vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return (image / 2 + 0.5).clamp(0, 1).float()

    @torch.no_grad()
    def decode(self, latents_BTC: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Images (B, 3, H, W) float32 in [0, 1]: the RGBA output composited over white."""
        rgba = self.decode_rgba(latents_BTC, height, width)
        alpha = rgba[:, 3:]
        return rgba[:, :3] * alpha + (1 - alpha)
