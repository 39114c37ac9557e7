"""A plain flow_grpo-style Flow-GRPO loop for Qwen-Image on diffusers + peft: the baseline of the throughput
benchmark. It deliberately shares no code with imagerl's own rollout/sampling/algorithms/families.

It follows github.com/yifan123/flow_grpo (scripts/train_qwenimage.py, its diffusers_patch pipeline_with_logprob and
sd3_sde_with_logprob.py): eager PyTorch, prompt encoding per sampling batch, true CFG with the cond
and uncond rows in one batched forward, SDE steps with log-probs, fp32 VAE decode, per-prompt GRPO advantages,
clipped PPO loss replayed per SDE step with gradient checkpointing, a peft LoRA trained by AdamW.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

# flow_grpo train_qwenimage.py target_modules
QWEN_IMAGE_LORA_TARGETS = (
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
)


@dataclass
class BaselineSettings:
    height: int = 512
    width: int = 512
    num_steps: int = 10
    guidance_scale: float = 4.0
    noise_level: float = 1.2
    sde_steps: tuple[int, ...] = (3, 4)  # denoising-step indices that are SDE (trained) steps; the rest ODE
    group_size: int = 16
    batch_size: int = 4  # sampling and training micro-batch (samples; CFG doubles rows)
    num_optimizer_steps: int = 2
    lr: float = 3e-4
    clip_range: float = 1e-4
    max_grad_norm: float = 1.0
    lora_rank: int = 64
    lora_alpha: int = 128
    max_sequence_length: int = 512
    negative_prompt: str = " "
    gradient_checkpointing: bool = True

    @classmethod
    def from_config(cls, cfg, batch_size: int, gradient_checkpointing: bool) -> "BaselineSettings":
        """The settings of an imagerl config's geometry (perf/bench_sd3.py, bench_flux.py): its SDE window's steps (a
        fixed start; "random" counts from 0), sampling at min(batch_size, sample.batch_size)."""
        s, t = cfg.sample, cfg.train
        start = s.sde_window_start if isinstance(s.sde_window_start, int) else 0
        return cls(height=s.height, width=s.width, num_steps=s.num_steps, guidance_scale=s.guidance_scale,
                   noise_level=s.noise_level, sde_steps=tuple(range(start, start + s.num_sde_steps)),
                   group_size=s.group_size, batch_size=min(batch_size, s.batch_size),
                   num_optimizer_steps=t.num_optimizer_steps, lr=t.lr, clip_range=t.clip_range,
                   lora_rank=cfg.model.lora_rank, lora_alpha=cfg.model.lora_alpha,
                   max_sequence_length=s.max_sequence_length, negative_prompt=s.negative_prompt,
                   gradient_checkpointing=gradient_checkpointing)


def sde_step_with_logprob(sigmas, i, velocity, sample, noise_level, prev_sample=None, generator=None):
    """flow_grpo sde_step_with_logprob (fp32): one step sigmas[i] -> sigmas[i+1] of the SDE whose marginals match
    the flow ODE; returns (prev_sample, log_prob averaged over all but the batch dim)."""
    velocity, sample = velocity.float(), sample.float()
    sigma, sigma_prev, sigma_max = sigmas[i], sigmas[i + 1], sigmas[1].item()
    dt = sigma_prev - sigma  # negative
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    prev_mean = (sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                 + velocity * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
    std = std_dev_t * torch.sqrt(-dt)
    if prev_sample is None:
        noise = torch.randn(velocity.shape, generator=generator, dtype=torch.float32).to(velocity.device)
        prev_sample = prev_mean + std * noise
    prev_sample = prev_sample.float()
    log_prob = (-((prev_sample.detach() - prev_mean) ** 2) / (2 * std**2) - torch.log(std)
                - math.log(math.sqrt(2 * math.pi)))
    return prev_sample, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def _pad_text(embeds, mask, length):
    """Right-pad prompt embeddings with zeros and their mask with 0 to `length` tokens."""
    if mask is None:
        mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
    pad = length - embeds.shape[1]
    return F.pad(embeds, (0, 0, 0, pad)), F.pad(mask, (0, pad))


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class FlowGRPOBaseline:
    lora_targets = QWEN_IMAGE_LORA_TARGETS

    def __init__(self, pipe, reward_fn, settings: BaselineSettings, device, adapter_name="baseline"):
        self.pipe, self.reward_fn, self.s, self.device = pipe, reward_fn, settings, torch.device(device)
        self.transformer, self.adapter_name = pipe.transformer, adapter_name
        self.dtype = self.transformer.dtype
        assert settings.group_size % settings.num_optimizer_steps == 0, "group_size must split into optimizer steps"
        self._add_trainable_lora(self.lora_targets)

    def _add_trainable_lora(self, targets) -> None:
        """flow_grpo: freeze the base model, add a gaussian-init LoRA, keep the trainable LoRA params in fp32,
        AdamW (lr from the settings, betas 0.9/0.999, eps 1e-8, weight decay 1e-4), gradient checkpointing."""
        from peft import LoraConfig

        settings, adapter_name = self.s, self.adapter_name
        self.transformer.requires_grad_(False)
        config = LoraConfig(r=settings.lora_rank, lora_alpha=settings.lora_alpha, init_lora_weights="gaussian",
                            target_modules=list(targets))
        self.transformer.add_adapter(config, adapter_name=adapter_name)
        self.lora_params = [p for n, p in self.transformer.named_parameters() if f".{adapter_name}." in n]
        for p in self.lora_params:
            p.data = p.data.float()
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.lora_params, lr=settings.lr, betas=(0.9, 0.999), eps=1e-8,
                                           weight_decay=1e-4)
        self._had_checkpointing = self.transformer.is_gradient_checkpointing
        if settings.gradient_checkpointing:
            self.transformer.enable_gradient_checkpointing()

    @property
    def cfg(self) -> bool:
        return self.s.guidance_scale > 1

    def _timesteps(self, image_seq_len):
        """Exactly QwenImagePipeline.__call__'s schedule; returns (timesteps, fp32 sigmas incl. the final 0)."""
        sched = self.pipe.scheduler
        sigmas = np.linspace(1.0, 1 / self.s.num_steps, self.s.num_steps)
        mu = calculate_shift(image_seq_len, sched.config.get("base_image_seq_len", 256),
                             sched.config.get("max_image_seq_len", 4096), sched.config.get("base_shift", 0.5),
                             sched.config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(sched, self.s.num_steps, self.device, sigmas=sigmas, mu=mu)
        return timesteps, sched.sigmas.to(self.device, torch.float32)

    def _encode(self, prompt, n):
        """flow_grpo: encode per sampling batch; cond and negative padded to one length for the batched forward."""
        kw = dict(device=self.device, num_images_per_prompt=1, max_sequence_length=self.s.max_sequence_length)
        cond, cond_mask = self.pipe.encode_prompt(prompt=[prompt] * n, **kw)
        if not self.cfg:
            return cond, cond_mask, None, None
        neg, neg_mask = self.pipe.encode_prompt(prompt=[self.s.negative_prompt] * n, **kw)
        if cond.shape[1] == neg.shape[1] and cond_mask is None and neg_mask is None:
            return cond, None, neg, None
        length = max(cond.shape[1], neg.shape[1])
        return (*_pad_text(cond, cond_mask, length), *_pad_text(neg, neg_mask, length))

    def _velocity(self, latents, t, text):
        """Transformer call as QwenImagePipeline makes it; true CFG with norm rescale, cond+uncond in one forward."""
        cond, cond_mask, neg, neg_mask = text
        rows = latents.shape[0] * (2 if self.cfg else 1)
        hidden = latents.to(self.dtype)
        if self.cfg:
            hidden = torch.cat([hidden, hidden])
            cond = torch.cat([cond, neg])
            cond_mask = None if cond_mask is None else torch.cat([cond_mask, neg_mask])
        h, w = self.s.height // self.pipe.vae_scale_factor // 2, self.s.width // self.pipe.vae_scale_factor // 2
        pred = self.transformer(
            hidden_states=hidden, timestep=t.expand(rows).to(self.dtype) / 1000, guidance=None,
            encoder_hidden_states_mask=cond_mask, encoder_hidden_states=cond, img_shapes=[[(1, h, w)]] * rows,
            attention_kwargs={}, return_dict=False)[0]
        if not self.cfg:
            return pred
        pred, neg_pred = pred.chunk(2)
        comb = neg_pred + self.s.guidance_scale * (pred - neg_pred)
        return comb * (torch.norm(pred, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))

    def _decode(self, latents):
        """QwenImagePipeline's output path in fp32: unpack, de-normalise, VAE decode, to [0, 1]."""
        pipe, vae = self.pipe, self.pipe.vae
        latents = pipe._unpack_latents(latents, self.s.height, self.s.width, pipe.vae_scale_factor).to(vae.dtype)
        latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype)
        latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype)
        latents = latents / latents_std + latents_mean
        image = vae.decode(latents, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    @torch.no_grad()
    def rollout(self, prompt: str, generator: torch.Generator) -> dict:
        """Sample group_size images in batches of batch_size (flow_grpo pipeline_with_logprob)."""
        s, pipe = self.s, self.pipe
        image_seq_len = (s.height // pipe.vae_scale_factor // 2) * (s.width // pipe.vae_scale_factor // 2)
        timesteps, sigmas = self._timesteps(image_seq_len)
        texts, images, before, after, log_probs = [], [], [], [], []
        for start in range(0, s.group_size, s.batch_size):
            n = min(s.batch_size, s.group_size - start)
            text = self._encode(prompt, n)
            latents = self._initial_latents(n, text[0].dtype, generator)
            traj = ([], [], [])
            for i, t in enumerate(timesteps):
                velocity = self._velocity(latents, t, text)
                if i in s.sde_steps:
                    prev, log_prob = sde_step_with_logprob(sigmas, i, velocity, latents, s.noise_level,
                                                           generator=generator)
                    for store, x in zip(traj, (latents, prev, log_prob)):
                        store.append(x)
                else:  # ODE (Euler) step, as FlowMatchEulerDiscreteScheduler.step
                    prev = latents + (sigmas[i + 1] - sigmas[i]) * velocity.float()
                latents = prev
            texts.append(text)
            images.append(self._decode(latents))
            for store, x in zip((before, after, log_probs), traj):
                store.append(torch.stack(x, dim=1) if x else None)  # (n, num_sde_steps, ...)
        cat = lambda xs: None if xs[0] is None else torch.cat(xs)  # noqa: E731
        return {"images": torch.cat(images), "text": tuple(cat([t[k] for t in texts]) for k in range(4)),
                "latents": cat(before), "next_latents": cat(after), "log_probs": cat(log_probs),
                "timesteps": timesteps, "sigmas": sigmas}

    def _initial_latents(self, n: int, dtype, generator):
        """QwenImagePipeline.prepare_latents: packed 2x2 noise (its in_channels count the packed channels)."""
        return self.pipe.prepare_latents(n, self.transformer.config.in_channels // 4, self.s.height, self.s.width,
                                         dtype, self.device, generator).float()

    def _replay_velocity(self, traj, sl: slice, j: int, i: int):
        """The velocity of rows `sl` at their j-th SDE step (denoising step i), with grad, for the replay."""
        text = tuple(None if x is None else x[sl] for x in traj["text"])
        return self._velocity(traj["latents"][sl, j], traj["timesteps"][i], text)

    def _train(self, traj, advantages):
        """flow_grpo train loop: per optimizer step (contiguous chunk), per micro-batch, per SDE step: clipped
        PPO loss on the recomputed log-prob, gradients accumulated over the chunk."""
        s = self.s
        chunk = s.group_size // s.num_optimizer_steps
        batch = getattr(s, "train_batch_size", s.batch_size)  # flow_grpo: the sampling batch; miles 2.1: its own
        first_diffs, ratio_dev = [], torch.zeros((), device=self.device)
        for k in range(s.num_optimizer_steps):
            starts = range(k * chunk, (k + 1) * chunk, batch)
            for start in starts:
                sl = slice(start, min(start + batch, (k + 1) * chunk))
                adv = advantages[sl]
                for j, i in enumerate(s.sde_steps):
                    velocity = self._replay_velocity(traj, sl, j, i)
                    _, log_prob = sde_step_with_logprob(traj["sigmas"], i, velocity, traj["latents"][sl, j],
                                                        s.noise_level, prev_sample=traj["next_latents"][sl, j])
                    old = traj["log_probs"][sl, j]
                    ratio = torch.exp(log_prob - old)
                    unclipped = -adv * ratio
                    clipped = -adv * torch.clamp(ratio, 1.0 - s.clip_range, 1.0 + s.clip_range)
                    loss = torch.mean(torch.maximum(unclipped, clipped))
                    (loss / (len(starts) * len(s.sde_steps))).backward()
                    if k == 0:
                        first_diffs.append((log_prob.detach() - old).abs())
                    ratio_dev = torch.maximum(ratio_dev, (ratio.detach() - 1).abs().max())
            torch.nn.utils.clip_grad_norm_(self.lora_params, s.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad()
        diff = torch.cat(first_diffs).mean().item() if first_diffs else 0.0
        return diff, ratio_dev.item()

    def iteration(self, prompt: str, generator_seed: int) -> dict:
        """One Flow-GRPO iteration on one prompt: rollout of group_size samples, rewards, advantages, training.
        text_tokens is the text length of each transformer row (cond and negative padded to one length)."""
        s, dev = self.s, self.device
        generator = torch.Generator("cpu").manual_seed(generator_seed)
        _sync(dev)
        t0 = time.perf_counter()
        traj = self.rollout(prompt, generator)
        _sync(dev)
        t1 = time.perf_counter()
        with torch.no_grad():  # flow_grpo scores each sampling batch
            batches = traj["images"].split(s.batch_size)
            rewards = torch.cat([torch.as_tensor(self.reward_fn(x, [prompt] * len(x)), dtype=torch.float32,
                                                 device=dev).reshape(-1) for x in batches])
        # flow_grpo PerPromptStatTracker: (r - mean) / (np.std + 1e-4), np.std is the population std
        advantages = ((rewards - rewards.mean()) / (rewards.std(correction=0) + 1e-4)).clamp(-5, 5)
        _sync(dev)
        t2 = time.perf_counter()
        diff, ratio_dev = self._train(traj, advantages) if s.sde_steps else (0.0, 0.0)
        _sync(dev)
        t3 = time.perf_counter()
        return {"rollout_s": t1 - t0, "reward_s": t2 - t1, "train_s": t3 - t2, "total_s": t3 - t0,
                "images": s.group_size, "reward_mean": rewards.mean().item(), "log_prob_mean_abs_diff": diff,
                "ratio_abs_minus_1_max": ratio_dev, "text_tokens": int(traj["text"][0].shape[1])}

    def remove(self):
        """Delete the LoRA (and unwrap the emptied peft layers if no other adapter is left), drop the optimizer."""
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer, self.lora_params = None, []
        self.transformer.delete_adapters(self.adapter_name)
        if not getattr(self.transformer, "peft_config", None):
            self.transformer.unload_lora()
        if self.s.gradient_checkpointing and not self._had_checkpointing:
            self.transformer.disable_gradient_checkpointing()
