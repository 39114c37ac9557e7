"""A plain Flow-GRPO loop for Qwen-Image 2.1 on diffusers' QwenImage21Pipeline + peft: the 2.1 baseline of the
throughput benchmark. Like perf/baseline.py (Qwen-Image 1.0) it shares no code with imagerl's own
rollout/sampling/algorithms/families; it reuses baseline.py's flow_grpo SDE step and its iteration/remove code.

Batch geometry as miles-diffusion's 1-GPU Qwen-Image 2.1 recipe: one prompt x group 16, rollout batch 8, training
micro-batch 4 samples x 1 SDE step, 2 optimizer steps per iteration, SDE steps {3, 4} of 10, noise level 1.2,
no CFG (2.1 is CFG-distilled; the pipeline's true_cfg_scale defaults to 1), LoRA r64/a128 gaussian on the 2.1
targets, fp32 LoRA params, AdamW lr 1e-4, clip range 1e-4, gradient checkpointing.

Numerics are QwenImage21Pipeline.__call__'s (diffusers 0.42.1, pipelines/qwenimage21/pipeline_qwenimage21.py):
  text      pipe.encode_prompt([prompt], num_images_per_prompt=n): raw chat-template string, the text encoder's
            last decoder layer BEFORE its final norm, system turn dropped; its mask is None when nothing is padded.
  schedule  sigmas = model_index's sample_sigmas, else linspace(1, 1/N, N); mu = calculate_shift(T) with T the
            target token count (H/16 * W/16: the 16x VAE's latents, unpatched); retrieve_timesteps(sigmas, mu)
            (the scheduler's exponential time shift and shift_terminal stretch); sigmas end with the terminal 0.
  latents   pipe.prepare_latents: (n, 1, C, H/16, W/16) noise in the text dtype, flattened to (n, T, C).
  model     transformer(latents, timestep=t.expand(n) / 1000, text, img_shapes=[[(1, H/16, W/16)]],
            img_mask = encode_prompt's image_pad_mask + T/4 ones (one slot per 2x2 target tokens), attention_kwargs
            {}) -> output[:, -T:] (the joint sequence holds the text positions too).
  decode    unpack, x * latents_std + latents_mean (1.0 divides by 1/std), VAE decode, frame 0,
            image_processor.postprocess(output_type="pt") = (x / 2 + 0.5).clamp(0, 1): RGBA (the 2.1 VAE has 4
            output channels). The reward gets RGB composited over white, rgb * a + 1 - a (imagerl's 2.1 convention;
            the pipeline composites RGBA condition images over white the same way for its vision encoder).
Departures, both for an exact replay (with frozen weights the first optimizer step's ratio is exactly 1):
  * no prefix KV cache. The pipeline's default use_kv_cache=True reuses the text keys/values after the first
    step; its own docstring says cached and full forwards round differently in reduced precision, and a Flow-GRPO
    replay recomputes full forwards, so the rollout runs full forwards too (= pipe(use_kv_cache=False)).
  * contiguous latents. _pack_latents returns a transposed view, which the pipeline keeps through its steps; the
    same values contiguous give other GEMM rounding (~1e-6 in the fp32 images of the CPU test) but the layout the
    stacked trajectory has in the replay (tests/test_baseline21.py).
The rollout (8) and the replay (4) run different batch sizes: bit-exact on the CPU tests; a GPU GEMM that picks
its kernel by batch size could make the first step's log-prob difference non-zero (the bench row reports it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift, retrieve_timesteps

from imagerl.perf.baseline import FlowGRPOBaseline, sde_step_with_logprob

# miles-diffusion's Qwen-Image 2.1 LoRA targets: the single-stream block's attention and SwiGLU projections
QWEN_IMAGE21_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "img_mlp.proj", "img_mlp.out", "img_mlp.gate_layer")


@dataclass
class BaselineSettings21:
    height: int = 512
    width: int = 512
    num_steps: int = 10
    noise_level: float = 1.2
    sde_steps: tuple[int, ...] = (3, 4)  # denoising-step indices that are SDE (trained) steps; the rest ODE
    group_size: int = 16
    batch_size: int = 8  # rollout (sampling) batch, samples; rewards are scored per sampling batch
    train_batch_size: int = 4  # training micro-batch: samples x 1 SDE step per forward
    num_optimizer_steps: int = 2
    lr: float = 1e-4
    clip_range: float = 1e-4
    max_grad_norm: float = 1.0
    lora_rank: int = 64
    lora_alpha: int = 128
    gradient_checkpointing: bool = True


class FlowGRPOBaseline21:
    def __init__(self, pipe, reward_fn, settings: BaselineSettings21, device, adapter_name="baseline"):
        self.pipe, self.reward_fn, self.s, self.device = pipe, reward_fn, settings, torch.device(device)
        self.transformer, self.adapter_name = pipe.transformer, adapter_name
        self.dtype = self.transformer.dtype
        assert settings.group_size % settings.num_optimizer_steps == 0, "group_size must split into optimizer steps"
        # QwenImage21Pipeline.__call__ floors H, W to multiples of 2 x vae_scale_factor (32) with a warning
        multiple = 2 * pipe.vae_scale_factor
        assert settings.height % multiple == 0 and settings.width % multiple == 0, f"H, W: multiples of {multiple}"
        # latent grid: vae_scale_factor is hard-coded 16 and 2.1 consumes latents unpatched, one token per 16x16 px
        self.grid = (settings.height // pipe.vae_scale_factor, settings.width // pipe.vae_scale_factor)
        self.tokens = self.grid[0] * self.grid[1]
        self._add_trainable_lora(QWEN_IMAGE21_LORA_TARGETS)

    # the same timing, reward (per sampling batch), advantage (population std + 1e-4, clamp 5) and clean-up code as
    # the 1.0 baseline: iteration() calls this class's rollout() and _train(); remove() deletes the LoRA
    _add_trainable_lora = FlowGRPOBaseline._add_trainable_lora
    iteration = FlowGRPOBaseline.iteration
    remove = FlowGRPOBaseline.remove
    _train = FlowGRPOBaseline._train

    def _timesteps(self):
        """Exactly QwenImage21Pipeline.__call__'s schedule; returns (timesteps, fp32 sigmas incl. the final 0)."""
        sched, n = self.pipe.scheduler, self.s.num_steps
        sigmas = self.pipe.config.sample_sigmas  # the checkpoint's fixed grid (model_index.json), if any
        if sigmas is None:
            sigmas = np.linspace(1.0, 1 / n, n)
        elif len(sigmas) != n:
            raise ValueError(f"the pipeline's sample_sigmas has {len(sigmas)} steps, the settings ask for {n}")
        # mu from latents.shape[1]: the target token count H/16 * W/16 (1024 at 512 px, as Qwen-Image 1.0's count)
        mu = calculate_shift(self.tokens, sched.config.get("base_image_seq_len", 256),
                             sched.config.get("max_image_seq_len", 4096), sched.config.get("base_shift", 0.5),
                             sched.config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(sched, n, self.device, sigmas=sigmas, mu=mu)
        return timesteps, sched.sigmas.to(self.device, torch.float32)

    def _encode(self, prompt: str, n: int):
        """The pipeline's encode_prompt, once per sampling batch, repeated to its n rows. One iteration is one prompt
        x group, so every row shares the prompt and nothing is padded (mask None). That matters in 2.1: a padded
        text token still advances the RoPE frame position of the image block after it (QwenImage21Rope.forward), so a
        right-padded prompt would predict differently from the same prompt alone; mixed prompts would need
        per-length sub-batches. Returns (embeds (n, L, D), img_mask (1, L + T/4))."""
        embeds, mask, image_pad_mask = self.pipe.encode_prompt(prompt=[prompt], device=self.device,
                                                               num_images_per_prompt=n)
        assert mask is None, "one prompt per batch: nothing is padded"
        # __call__'s append_target_slots: one image slot per 2x2 target latent tokens; the transformer reads row 0
        img_mask = torch.cat([image_pad_mask, image_pad_mask.new_ones(image_pad_mask.shape[0], self.tokens // 4)], 1)
        return embeds, img_mask

    def _velocity(self, latents, t, embeds, img_mask):
        """The transformer call as QwenImage21Pipeline.__call__ makes it (true_cfg_scale 1: the cond rows only)."""
        n = latents.shape[0]
        pred = self.transformer(
            hidden_states=latents.to(self.dtype), timestep=t.expand(n).to(self.dtype) / 1000,
            # the text in the transformer's dtype: a no-op where the pipeline runs (text encoder and transformer
            # share a dtype), needed for the bf16 transformer beside an fp32 text encoder of the CPU tests
            encoder_hidden_states=embeds.to(self.dtype), encoder_hidden_states_mask=None,
            img_shapes=[[(1, *self.grid)]] * n, img_mask=img_mask, attention_kwargs={}, return_dict=False)[0]
        return pred[:, -self.tokens:]  # the target image's tokens: the joint sequence starts with the text

    def _decode(self, latents):
        """QwenImage21Pipeline's output path (the VAE in its dtype: fp32 in the benchmark): RGBA in [0, 1]."""
        pipe, vae = self.pipe, self.pipe.vae
        z = pipe._unpack_latents(latents, self.s.height, self.s.width, pipe.vae_scale_factor).to(vae.dtype)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        std = torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        image = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="pt").float()

    @staticmethod
    def composite_over_white(rgba):
        """RGB for the reward: the RGBA output composited over white (rgb * a + 1 - a); RGB passes through."""
        if rgba.shape[1] != 4:
            return rgba
        alpha = rgba[:, 3:]
        return rgba[:, :3] * alpha + (1 - alpha)

    @torch.no_grad()
    def rollout(self, prompt: str, generator: torch.Generator) -> dict:
        """Sample group_size images in batches of batch_size (flow_grpo pipeline_with_logprob on the 2.1 pipeline).
        images: RGB composited over white (what the reward sees); rgba: the pipeline's output_type="pt" images."""
        s, pipe = self.s, self.pipe
        timesteps, sigmas = self._timesteps()
        embeds, rgba, before, after, log_probs, img_mask = [], [], [], [], [], None
        for start in range(0, s.group_size, s.batch_size):
            n = min(s.batch_size, s.group_size - start)
            text, img_mask = self._encode(prompt, n)
            latents, _ = pipe.prepare_latents(None, n, self.transformer.config.in_channels, s.height, s.width,
                                              text.dtype, self.device, generator)
            # fp32 latents between steps, as flow_grpo. _pack_latents returns a transposed view (T, C strides 1, T);
            # contiguous, as the stacked trajectory the training replays, so that the log-prob's mean reduces in the
            # same order in both (else the first optimizer step's ratio is off by float rounding)
            latents = latents.float().contiguous()
            traj = ([], [], [])
            for i, t in enumerate(timesteps):
                velocity = self._velocity(latents, t, text, img_mask)
                if i in s.sde_steps:
                    prev, log_prob = sde_step_with_logprob(sigmas, i, velocity, latents, s.noise_level,
                                                           generator=generator)
                    for store, x in zip(traj, (latents, prev, log_prob)):
                        store.append(x)
                else:  # ODE (Euler) step, as FlowMatchEulerDiscreteScheduler.step (fp32 sample + dt * v)
                    prev = latents + (sigmas[i + 1] - sigmas[i]) * velocity.float()
                latents = prev
            embeds.append(text)
            rgba.append(self._decode(latents))
            for store, x in zip((before, after, log_probs), traj):
                store.append(torch.stack(x, dim=1) if x else None)  # (n, num_sde_steps, ...)
        cat = lambda xs: None if xs[0] is None else torch.cat(xs)  # noqa: E731
        rgba = torch.cat(rgba)
        return {"images": self.composite_over_white(rgba), "rgba": rgba, "text": (torch.cat(embeds), img_mask),
                "latents": cat(before), "next_latents": cat(after), "log_probs": cat(log_probs),
                "timesteps": timesteps, "sigmas": sigmas}

    def _replay_velocity(self, traj, sl: slice, j: int, i: int):
        """The velocity of rows `sl` at their j-th SDE step (denoising step i), with grad, for the replay (the
        training loop is baseline.py's: micro-batches of train_batch_size, clipped PPO loss per SDE step)."""
        embeds, img_mask = traj["text"]
        return self._velocity(traj["latents"][sl, j], traj["timesteps"][i], embeds[sl], img_mask)
