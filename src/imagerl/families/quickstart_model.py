"""Build the small pretrained Qwen-Image-layout model that the quickstart trains with RL.

Recipe (every step seeded; `imagerl build-quickstart-model OUT` reruns it):
  1. the synthetic shapes world (imagerl.data.synthetic): N captioned 64 px images;
  2. a tiny Qwen2.5-VL text encoder (random, frozen) and a BPE tokenizer trained on the template,
     the bundled prompts and the shapes captions (template prefix = 34 tokens, as the real one);
  3. a tiny AutoencoderKLQwenImage trained for reconstruction (foreground-weighted MSE + 1e-6 KL) on the
     images, so that decode(encode(x)) reproduces them (shipped build: reconstructions score 0.998 under the
     shapes reward, ground truth 1.0);
  4. a small QwenImageTransformer2DModel, saved with the rest in the hub layout, then trained by
     `imagerl sft` (full fine-tuning, flow matching) on the captioned images;
  5. the exported checkpoint is what ships in imagerl/assets/quickstart-model (its BUILD.json records the
     command) and its imagerl_defaults.json the settings `imagerl sample` / `eval` / `sft` default to for it
     (SAMPLING_DEFAULTS: the quickstart recipe's 64 px, 10 steps, no CFG, shapes reward). The defaults are the
     shipped build's: 4096 images, VAE 2000 steps, SFT 1200 steps of 64 at lr 1e-3; on one H200 that took
     about 200 s (benchmarks/quickstart_model_build.py, which also judged longer SFT: held-out reward with
     300/600/1200/2400 steps 0.22/0.37/0.46/0.68 at CFG 4; benchmarks/LOG.md).
     1200 steps leaves room for RL to show a gain within minutes on a CPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

VAE_CONFIG = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
                  latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
SFT_LR = 1e-3
# imagerl_defaults.json (imagerl.families.model_defaults): the training size, the quickstart recipe's sampling (10 steps,
# guidance 1: no CFG, half the compute) and its reward
SAMPLING_DEFAULTS = dict(height=64, width=64, num_steps=10, guidance_scale=1.0, rewards=["shapes"])
TRANSFORMER_CONFIG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=4, attention_head_dim=32,
                          num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(8, 12, 12))


def load_images(captions_file: Path, size: int) -> torch.Tensor:
    """(N, 3, size, size) float in [0, 1] from a captions.jsonl written by imagerl.data.synthetic."""
    from PIL import Image
    import numpy as np

    rows = [json.loads(l) for l in captions_file.read_text().splitlines() if l.strip()]
    arrays = [np.asarray(Image.open(captions_file.parent / r["image"]).convert("RGB").resize((size, size)))
              for r in rows]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() / 255


def train_vae(images: torch.Tensor, steps: int, device: torch.device, seed: int = 0, batch_size: int = 64,
              lr: float = 1e-3, log=print):
    """A tiny Qwen-Image VAE trained to reconstruct `images`; returns it (fp32, CPU) and the final MSE."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(**VAE_CONFIG).to(device).train()
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    data = images.to(device) * 2 - 1
    start, mse = time.perf_counter(), float("nan")
    for step in range(steps):
        x = data[torch.randint(0, len(data), (batch_size,), generator=gen).to(device)][:, :, None]
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        # Foreground (non-white) pixels weigh 10x: with plain MSE the white background dominates and the
        # VAE lost colour (H200 build, 1200 steps: MSE plateau 0.12, every object grey, reconstructions of
        # ground truth scored 0.0 by the shapes reward); weighted, a CPU run of 1400 steps at batch 16
        # reached foreground MSE 0.013 and reconstructions scoring 0.984 (2026-12-02).
        weight = 1 + 9 * (x.amin(dim=1, keepdim=True) < 0.9).float()
        mse_t = ((recon - x) ** 2).mean()
        loss = (weight * (recon - x) ** 2).mean() + 1e-6 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        mse = mse_t.item()
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            log(f"vae step {step}: mse {mse:.5f} ({time.perf_counter() - start:.0f}s)")
    return vae.eval().cpu(), mse


def latent_statistics(vae, images: torch.Tensor, device: torch.device) -> tuple[list[float], list[float]]:
    """Per-channel mean/std of the posterior means, stored as latents_mean/std (as Qwen-Image's VAE does)."""
    vae = vae.to(device)
    with torch.no_grad():
        z = torch.cat([vae.encode((images[i:i + 256].to(device) * 2 - 1)[:, :, None]).latent_dist.mode()
                       for i in range(0, len(images), 256)])
    vae.cpu()
    return z.mean(dim=(0, 2, 3, 4)).tolist(), z.std(dim=(0, 2, 3, 4)).tolist()


def build_base_checkpoint(out_dir: Path, vae, latents_mean, latents_std, captions: list[str], seed: int = 0) -> Path:
    """Hub-layout Qwen-Image checkpoint: the trained VAE, a fresh transformer, tiny text encoder + tokenizer."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    from imagerl.families.qwen_image.tiny import (QWEN_IMAGE_SCHEDULER_CONFIG, build_tiny_text_encoder,
                                                  build_tiny_tokenizer, template_prefix_length)

    tokenizer = build_tiny_tokenizer(extra_corpus=captions)
    if template_prefix_length(tokenizer) != 34:
        raise RuntimeError("tokenizer does not encode the Qwen-Image template prefix to 34 tokens")
    final_vae = AutoencoderKLQwenImage(**{**VAE_CONFIG, "latents_mean": latents_mean, "latents_std": latents_std})
    final_vae.load_state_dict(vae.state_dict())
    torch.manual_seed(seed)
    pipe = QwenImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER_CONFIG), vae=final_vae,
        text_encoder=build_tiny_text_encoder(len(tokenizer), seed), tokenizer=tokenizer,
        transformer=QwenImageTransformer2DModel(**TRANSFORMER_CONFIG))
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_quickstart_model(out_dir: str | Path, work_dir: str | Path, *, num_images: int = 4096, seed: int = 0,
                           vae_steps: int = 2000, sft_steps: int = 1200, sft_batch: int = 64, device: str = "auto",
                           log=print) -> Path:
    from imagerl.distributed.parallel import resolve_device
    from imagerl.families.model_defaults import write_model_defaults
    from imagerl.sft.trainer import export_model, sft
    from imagerl.data.synthetic import generate_dataset

    out_dir, work_dir = Path(out_dir), Path(work_dir)
    dev = resolve_device(device)
    data_dir = work_dir / "shapes"
    if not (data_dir / "captions.jsonl").is_file():
        generate_dataset(data_dir, num_images, seed, size=64)
    captions_file = data_dir / "captions.jsonl"
    images = load_images(captions_file, 64)
    captions = sorted({json.loads(l)["prompt"] for l in captions_file.read_text().splitlines() if l.strip()})
    vae, mse = train_vae(images, vae_steps, dev, seed, log=log)
    mean, std = latent_statistics(vae, images, dev)
    base = build_base_checkpoint(work_dir / "base", vae, mean, std, captions, seed)
    run = sft(sft_config(base, captions_file, work_dir / "sft", steps=sft_steps, batch=sft_batch, seed=seed, device=dev))
    export_model(work_dir / "sft", out_dir, dtype="float32")
    write_build_record(out_dir, num_images=num_images, seed=seed, vae_steps=vae_steps, vae_final_mse=mse,
                       sft_steps=sft_steps, sft_batch=sft_batch, device=str(dev))
    write_model_defaults(out_dir, **SAMPLING_DEFAULTS)
    log(f"quickstart model written to {out_dir} (sft run: {run.run_dir})")
    return out_dir


def sft_config(base: Path, captions_file: Path, output_dir: Path, *, steps: int, batch: int, seed: int, device,
               **overrides):
    """The SFT of the quickstart model: full transformer, flow matching at 64 px, lr SFT_LR after 100 warm-up
    steps, caption dropout 0.1 (keeps CFG's unconditional branch), fp32; `overrides` for logging/checkpoints."""
    from imagerl.sft.trainer import SFTConfig

    settings = dict(model=str(base), data=str(captions_file), height=64, width=64, lora_rank=0, lr=SFT_LR,
                    lr_warmup_steps=100, weight_decay=0.0, batch_size=batch, num_steps=steps, seed=seed,
                    caption_dropout=0.1, gradient_checkpointing=False, output_dir=str(output_dir),
                    checkpoint_every=steps, log_every=max(1, steps // 20), tensorboard=False, device=str(device),
                    dtype="float32")
    return SFTConfig(**{**settings, **overrides})


def write_build_record(model_dir: Path, *, num_images: int, seed: int, vae_steps: int, vae_final_mse: float,
                       sft_steps: int, sft_batch: int, device: str) -> None:
    """BUILD.json: how the model was made, with the command that rebuilds it."""
    (Path(model_dir) / "BUILD.json").write_text(json.dumps(dict(
        num_images=num_images, seed=seed, vae_steps=vae_steps, vae_final_mse=vae_final_mse, sft_steps=sft_steps,
        sft_batch=sft_batch, sft_lr=SFT_LR, transformer=TRANSFORMER_CONFIG, vae=VAE_CONFIG, device=device,
        command=f"imagerl build-quickstart-model OUT --seed {seed} --num-images {num_images} --vae-steps {vae_steps} "
                f"--sft-steps {sft_steps} --sft-batch {sft_batch}"), indent=1))
