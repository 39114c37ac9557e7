"""The rollout engine: K samples per prompt, SDE inside the window, ODE elsewhere, trajectories recorded.

Shapes: B images (this rank), S SDE (= trained) steps, N latent tokens, C packed latent channels.

Reproducibility: image b's initial noise and SDE noise come from generators keyed by (seed, rollout
step, global sample index, denoise step), so they do not depend on the batch size or on the rank the
image lands on; the SDE window depends on (seed, rollout step) only.
On-policy exactness: the training forward replays the same batches (same composition, padding,
CFG batch and float32 latents), so with unchanged weights it reproduces `log_probs_BS` bit for bit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from imagerl.config import Config
from imagerl.data.prompts import PromptGroups
from imagerl.distributed.rng import make_generator
from imagerl.families.layers.merged_lora import MergedLora
from imagerl.sampling import SDEWindow, flow_sde_step, flow_timesteps
from imagerl.sampling.window import off_window_solver, step_grid
from imagerl.sampling.ode import ODESolverState, ode_step
from imagerl.config import training_batch_size


@dataclass
class Rollout:
    """One rank's trajectories of one rollout.

    prompts_B, metadata_B: per image; group_ids_B (B,) long: global prompt-group index.
    text_B: per-image prompt embedding (L_i, D) (shared with the prompt cache); negative: (L, D) or None.
    latents_BSNC: float32 latent entering each window step; next_latents_BSNC: the sampled next latent.
    log_probs_BS: float32 old log-probs; timesteps_S / sigmas_S / sigmas_next_S: float32 per window step.
    images_B3HW: float32 in [0, 1] on the CPU. batch_size: the training batch (train.batch_size), in which the
    window steps were sampled and are replayed.
    """

    prompts_B: list[str]
    metadata_B: list[dict]
    group_ids_B: torch.Tensor
    text_B: list[torch.Tensor]
    negative: torch.Tensor | None
    latents_BSNC: torch.Tensor
    next_latents_BSNC: torch.Tensor
    log_probs_BS: torch.Tensor
    timesteps_S: torch.Tensor
    sigmas_S: torch.Tensor
    sigmas_next_S: torch.Tensor
    sigma_max: torch.Tensor
    images_B3HW: torch.Tensor
    window: SDEWindow
    batch_size: int
    means_BSNC: torch.Tensor | None = None  # train.ratio=grpo_guard: the rollout policy's step means (float32)

    def __len__(self) -> int:
        return len(self.prompts_B)

    def batches(self) -> list[slice]:
        return [slice(i, min(i + self.batch_size, len(self))) for i in range(0, len(self), self.batch_size)]

    def conditioning(self, adapter, batch: slice, guidance_scale: float):
        """The adapter's conditioning object for one replayed batch (training: never the KV cache)."""
        return batch_conditioning(adapter, self.text_B[batch], self.negative, guidance_scale)


def batch_conditioning(adapter, text_rows: list[torch.Tensor], negative: torch.Tensor | None, guidance_scale: float,
                       kv_cache: bool = False):
    """The adapter's conditioning for these images' text rows, each paired with the negative prompt under CFG."""
    negatives = [negative] * len(text_rows) if negative is not None else None
    return adapter.conditioning(text_rows, negatives, guidance_scale, kv_cache=kv_cache)


@contextlib.contextmanager
def _training_graph(adapter, enabled: bool):
    """With parallel.compile the rollout's forwards run as training forwards (train mode, grad on, outputs
    detached by the caller): Inductor compiles an inference graph differently from a training graph's forward
    and their fused kernels round differently (H200, bf16: the training replay's log-probs were off by 1.2e-5,
    benchmarks/LOG.md); one graph keeps the replay exact. Each block's outputs are cut from the graph as
    they come (adapter.forward_only_blocks), so no activations are held and no checkpoint wrapper runs."""
    if not enabled:
        yield
        return
    adapter.transformer.train()
    try:
        with torch.enable_grad(), adapter.forward_only_blocks():
            yield
    finally:
        adapter.transformer.eval()


def _noise(seed: int, purpose: str, step: int, sample_ids: list[int], shape_fn, *keys: int) -> list[torch.Tensor]:
    return [shape_fn(make_generator(seed, purpose, step, sid, *keys)) for sid in sample_ids]


@dataclass
class _Plan:
    """What every rollout of a rank derives from its prompt groups before sampling (all per image)."""

    prompts_B: list[str]
    metadata_B: list[dict]
    sample_ids_B: list[int]
    group_ids_B: torch.Tensor
    text_B: list[torch.Tensor]
    negative: torch.Tensor | None
    sigmas: torch.Tensor
    timesteps: torch.Tensor
    initial_noise_BNC: torch.Tensor
    micro: int
    decode: int  # images per VAE decode (sample.decode_batch_size, else micro)


def _plan(adapter, groups: PromptGroups, cfg: Config, rollout_step: int, initial_noise_BNC) -> _Plan:
    s, seed, k = cfg.sample, cfg.run.seed, cfg.sample.group_size
    prompts_B = [p for p in groups.prompts_G for _ in range(k)]
    sample_ids_B = [g * k + j for g in groups.group_ids_G for j in range(k)]
    text_B = adapter.encode_prompts(prompts_B, s.max_sequence_length)
    negative = adapter.encode_negative(s.negative_prompt, s.guidance_scale, s.max_sequence_length)
    sigmas = adapter.sigmas(s.num_steps, s.height, s.width)
    if initial_noise_BNC is None:
        # same_initial_noise: key the noise by the group's first sample id, so every sample of a group shares it
        noise_ids = [sid - sid % k for sid in sample_ids_B] if s.same_initial_noise else sample_ids_B
        initial_noise_BNC = torch.cat(_noise(seed, "init_noise", rollout_step, noise_ids,
                                             lambda g: adapter.initial_noise([g], s.height, s.width)))
    if initial_noise_BNC.shape[0] != len(prompts_B):
        raise ValueError(f"initial noise has {initial_noise_BNC.shape[0]} rows for {len(prompts_B)} samples")
    return _Plan(prompts_B, [m for m in groups.metadata_G for _ in range(k)], sample_ids_B,
                 torch.tensor(groups.group_ids_G).repeat_interleave(k), text_B, negative, sigmas,
                 flow_timesteps(sigmas, adapter.scheduler_config), initial_noise_BNC, training_batch_size(cfg),
                 s.decode_batch_size or training_batch_size(cfg))


def keeps_step_means(cfg: Config) -> bool:
    """Whether the rollout keeps each window step's SDE mean (train.ratio=grpo_guard; an algorithm whose class sets
    keeps_step_means, Flow-DPPO)."""
    from imagerl.algorithms.registry import algorithm_class

    return cfg.train.ratio == "grpo_guard" or getattr(algorithm_class(cfg.train.algorithm), "keeps_step_means", False)


def _decode(adapter, plan: _Plan, batch: slice, x_BNC: torch.Tensor, cfg: Config, on_batch) -> torch.Tensor:
    """Images of one rollout batch, decoded sample.decode_batch_size at a time (default the training batch): the
    VAE's full-resolution activations of a large rollout batch set the peak; each chunk is scored (on_batch) as soon
    as it is decoded, so only the last one's scoring is left after the rollout."""
    n, decoded = x_BNC.shape[0], []
    for a in range(0, n, plan.decode):
        sub = slice(a, min(a + plan.decode, n))
        decoded.append(adapter.decode(x_BNC[sub], cfg.sample.height, cfg.sample.width).cpu())
        if on_batch is not None:
            on_batch(decoded[-1], plan.prompts_B[batch][sub], plan.metadata_B[batch][sub])
    return torch.cat(decoded)


@torch.no_grad()
def generate(adapter, groups: PromptGroups, cfg: Config, rollout_step: int, window: SDEWindow,
             initial_noise_BNC: torch.Tensor | None = None, progress=None, on_batch=None) -> Rollout:
    """Sample K images for each prompt group of this rank; record the window's trajectory.

    on_batch(images_B3HW, prompts, metadata) is called as each training batch (train.batch_size) is decoded,
    in sample order (e.g. to start scoring it while the next is decoded or generated)."""
    s, seed = cfg.sample, cfg.run.seed
    plan = _plan(adapter, groups, cfg, rollout_step, initial_noise_BNC)
    prompts_B, sample_ids_B, text_B, negative = plan.prompts_B, plan.sample_ids_B, plan.text_B, plan.negative
    sigmas, timesteps, micro = plan.sigmas, plan.timesteps, plan.micro
    h, w = s.height, s.width

    # train.timestep_staging: the trajectory waits on the CPU; the update copies each step's inputs back
    staged = (lambda t: t.cpu()) if cfg.train.timestep_staging else (lambda t: t)
    # sample.merge_lora: the steps outside the window run on merged weights (families/layers/merged_lora.py)
    off_window = (MergedLora(adapter.transformer, s.off_window_fp8, adapter.token_linears).applied if s.merge_lora
                  else contextlib.nullcontext)
    # sample.post_window_steps: the steps after the window may visit fewer of the schedule's points (MixGRPO-Flash)
    grid = step_grid(s.num_steps, window, s.post_window_steps, s.post_window_ratio)
    grid_sigmas, grid_timesteps = sigmas[grid], timesteps[grid[:-1]]
    traj_in, traj_out, log_probs, images, means = [], [], [], [], []
    keep_means = keeps_step_means(cfg)  # GRPO-Guard's ratio and Flow-DPPO's divergence compare the policy's step
                                        # mean with the rollout's
    for start in range(0, len(prompts_B), s.batch_size):
        batch = slice(start, start + s.batch_size)
        n = len(prompts_B[batch])
        # sample.kv_cache: only the off-window steps (never replayed) reuse the text prefix's keys/values; the
        # first of them fills the cache (on the merged weights under sample.merge_lora, as its later steps run)
        cond = batch_conditioning(adapter, text_B[batch], negative, s.guidance_scale, kv_cache=s.kv_cache)
        # the SDE-window steps run full forwards in the training batches (train.batch_size), each with its own
        # conditioning, as the update replays them: a forward's rounding depends on its batch (row count, text
        # padding) and on what it computes (a cached step's text keys/values come from another forward)
        subs = [slice(a, min(a + micro, n)) for a in range(0, n, micro)]
        window_conds = [cond] if len(subs) == 1 and not s.kv_cache else [
            batch_conditioning(adapter, text_B[batch][sub], negative, s.guidance_scale) for sub in subs]
        x = plan.initial_noise_BNC[batch].to(adapter.device, torch.float32)
        ins, outs, lps, mus = [], [], [], []
        ode_state = ODESolverState()  # sample.off_window_solver=dpm2: restarts at first order after the window
        # (under grad only the velocity, detached, could build a graph: the step arithmetic needs no grad inputs)
        with _training_graph(adapter, cfg.parallel.compile):
            for i in range(len(grid_sigmas) - 1):  # i < the window's end: the schedule's own step i
                if i in window:
                    noise = torch.cat(_noise(seed, "sde_noise", rollout_step, sample_ids_B[batch],
                                             lambda g: torch.randn((1, *x.shape[1:]), generator=g), i))
                    steps = [flow_sde_step(x[sub], adapter.velocity(x[sub], timesteps[i].expand(sub.stop - sub.start),
                                                                    c, h, w).detach(),
                                           sigmas[i], sigmas[i + 1], noise_level=s.noise_level, sigma_max=sigmas[1],
                                           sde_type=s.sde_type, noise=noise[sub], cps_log_prob=s.cps_log_prob)
                             for sub, c in zip(subs, window_conds)]
                    ins.append(x)
                    x = torch.cat([out.prev_sample for out in steps])
                    outs.append(x)
                    lps.append(torch.cat([out.log_prob for out in steps]))
                    if keep_means:
                        mus.append(torch.cat([out.mean for out in steps]))
                else:
                    with off_window():
                        v = adapter.velocity(x, grid_timesteps[i].expand(n), cond, h, w).detach()
                    x = ode_step(off_window_solver(s.off_window_solver, i, window), x, v, grid_sigmas, i, ode_state)
        traj_in.append(staged(torch.stack(ins, 1)))
        traj_out.append(staged(torch.stack(outs, 1)))
        log_probs.append(staged(torch.stack(lps, 1)))
        if keep_means:
            means.append(staged(torch.stack(mus, 1)))
        images.append(_decode(adapter, plan, batch, x, cfg, on_batch))
        if progress is not None:
            progress.update(n)

    steps = torch.tensor(list(window.steps), device=sigmas.device)
    return Rollout(
        prompts_B=prompts_B, metadata_B=plan.metadata_B, group_ids_B=plan.group_ids_B,
        text_B=text_B, negative=negative, latents_BSNC=torch.cat(traj_in), next_latents_BSNC=torch.cat(traj_out),
        log_probs_BS=torch.cat(log_probs), timesteps_S=timesteps[steps], sigmas_S=sigmas[steps],
        sigmas_next_S=sigmas[steps + 1], sigma_max=sigmas[1], images_B3HW=torch.cat(images), window=window,
        batch_size=micro, means_BSNC=torch.cat(means) if keep_means else None,
    )


@dataclass
class CleanRollout:
    """One rank's ODE rollout for DiffusionNFT: only the clean samples and the sampler's grid are kept.

    x0_BNC: float32 final latents (on the CPU with train.timestep_staging); sample_ids_B: global sample index
    (keys the training noise); timesteps_T / sigmas_T: float32, the grid's T = num_steps points (terminal 0
    excluded). Other fields as Rollout."""

    prompts_B: list[str]
    metadata_B: list[dict]
    group_ids_B: torch.Tensor
    sample_ids_B: list[int]
    text_B: list[torch.Tensor]
    x0_BNC: torch.Tensor
    timesteps_T: torch.Tensor
    sigmas_T: torch.Tensor
    images_B3HW: torch.Tensor
    batch_size: int

    def __len__(self) -> int:
        return len(self.prompts_B)

    def batches(self) -> list[slice]:
        return [slice(i, min(i + self.batch_size, len(self))) for i in range(0, len(self), self.batch_size)]


@torch.no_grad()
def generate_clean(adapter, groups: PromptGroups, cfg: Config, rollout_step: int, solver: str,
                   initial_noise_BNC: torch.Tensor | None = None, progress=None, on_batch=None) -> CleanRollout:
    """K deterministic ODE samples (nft.solver) per prompt group of this rank with the current weights (the caller
    swaps in the sampling policy), at sample.guidance_scale; on_batch as in generate()."""
    s = cfg.sample
    plan = _plan(adapter, groups, cfg, rollout_step, initial_noise_BNC)
    staged = (lambda t: t.cpu()) if cfg.train.timestep_staging else (lambda t: t)
    merged = (MergedLora(adapter.transformer, s.off_window_fp8, adapter.token_linears).applied if s.merge_lora
              else contextlib.nullcontext)
    x0s, images = [], []
    for start in range(0, len(plan.prompts_B), s.batch_size):
        batch = slice(start, start + s.batch_size)
        n = len(plan.prompts_B[batch])
        cond = batch_conditioning(adapter, plan.text_B[batch], plan.negative, s.guidance_scale, kv_cache=s.kv_cache)
        x = plan.initial_noise_BNC[batch].to(adapter.device, torch.float32)
        state = ODESolverState()
        with merged():
            for i in range(s.num_steps):
                v = adapter.velocity(x, plan.timesteps[i].expand(n), cond, s.height, s.width)
                x = ode_step(solver, x, v, plan.sigmas, i, state)
        x0s.append(staged(x))
        images.append(_decode(adapter, plan, batch, x, cfg, on_batch))
        if progress is not None:
            progress.update(n)
    return CleanRollout(plan.prompts_B, plan.metadata_B, plan.group_ids_B, plan.sample_ids_B, plan.text_B,
                        torch.cat(x0s), plan.timesteps, plan.sigmas[:-1], torch.cat(images), plan.micro)


@torch.no_grad()
def ode_sample(adapter, prompts: list[str], *, num_steps: int, guidance_scale: float, height: int, width: int,
               initial_noise_BNC: torch.Tensor, negative_prompt: str = " ", batch_size: int = 4,
               max_sequence_length: int = 512) -> torch.Tensor:
    """Deterministic sampling (noise level 0, the Euler ODE) as the family's diffusers pipeline: final
    packed latents (B, N, C), float32. Used by `imagerl sample` and evaluation."""
    text = adapter.encode_prompts(prompts, max_sequence_length)
    negative = adapter.encode_negative(negative_prompt, guidance_scale, max_sequence_length)
    sigmas = adapter.sigmas(num_steps, height, width)
    timesteps = flow_timesteps(sigmas, adapter.scheduler_config)
    out = []
    for start in range(0, len(prompts), batch_size):
        batch = slice(start, start + batch_size)
        n = len(prompts[batch])
        cond = batch_conditioning(adapter, text[batch], negative, guidance_scale)
        x = initial_noise_BNC[batch].to(adapter.device, torch.float32)
        for i in range(num_steps):
            v = adapter.velocity(x, timesteps[i].expand(n), cond, height, width)
            x = flow_sde_step(x, v, sigmas[i], sigmas[i + 1], noise_level=0.0, sigma_max=sigmas[1]).prev_sample
        out.append(x)
    return torch.cat(out)
