"""Build the quickstart model on a GPU and judge it at several SFT lengths (a record, not a timed test).

    python3 benchmarks/quickstart_model_build.py --out $OUT [--vae-steps 2000] [--stages 300,600,1200,2400]

Steps (the same functions `imagerl build-quickstart-model` runs, with the SFT split into stages):
  1. shapes data (seed 0), VAE training; reconstruction check: the shapes reward of decode(encode(x)) on
     training images must be >= 0.9 (else the VAE loses what the reward reads: stop);
  2. base checkpoint, then full-transformer SFT, resumed stage by stage; after each stage the model is
     exported and judged: mean shapes reward of ODE samples (10 steps, 64 px) on the held-out prompts and
     on as many training prompts, 4 seeds each, with guidance 1 and 4;
  3. each exported model goes to $OUT as a tar (the candidates for imagerl/assets/quickstart-model).
Prints one table; details in $OUT/build.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from imagerl.distributed.rng import make_generator  # noqa: E402
from imagerl.families.qwen_image import QwenImageFamily  # noqa: E402
from imagerl.families.quickstart_model import (build_base_checkpoint, latent_statistics, load_images,  # noqa: E402
                                      sft_config, train_vae, write_build_record)
from imagerl.rewards.shapes import ShapesReward  # noqa: E402
from imagerl.rollout import ode_sample  # noqa: E402
from imagerl.sft.trainer import export_model, sft  # noqa: E402
from imagerl.data.synthetic import generate_dataset  # noqa: E402


@torch.no_grad()
def judge(model_dir: Path, prompts: list[str], seeds: int, guidance: float, device) -> float:
    adapter = QwenImageFamily.from_pretrained(model_dir, device, torch.float32)
    reward = ShapesReward()
    rows = [(p, s) for s in range(seeds) for p in prompts]
    noise = torch.cat([adapter.initial_noise([make_generator(1234, "judge", i)], 64, 64) for i in range(len(rows))])
    latents = ode_sample(adapter, [p for p, _ in rows], num_steps=10, guidance_scale=guidance, height=64, width=64,
                         initial_noise_BNC=noise, batch_size=256)
    images = adapter.decode(latents, 64, 64)
    return reward(images, [p for p, _ in rows], [{} for _ in rows]).mean().item()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/tmp/qm-build")
    ap.add_argument("--num-images", type=int, default=4096)
    ap.add_argument("--vae-steps", type=int, default=2000)
    ap.add_argument("--stages", default="300,600,1200,2400")
    ap.add_argument("--sft-batch", type=int, default=64)
    ap.add_argument("--min-recon-reward", type=float, default=0.9)
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    record: dict = {"args": vars(args), "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"}
    tic = time.perf_counter()
    data = work / "shapes"
    generate_dataset(data, args.num_images, 0, size=64)
    captions_file = data / "captions.jsonl"
    images = load_images(captions_file, 64)
    captions = sorted({json.loads(l)["prompt"] for l in captions_file.read_text().splitlines() if l.strip()})
    record["data_s"] = time.perf_counter() - tic
    vae, mse = train_vae(images, args.vae_steps, dev, 0)
    record.update(vae_s=time.perf_counter() - tic, vae_mse=mse)
    vae = vae.to(dev)
    with torch.no_grad():
        x = images[:256].to(dev) * 2 - 1
        recon = (vae.decode(vae.encode(x[:, :, None]).latent_dist.mode()).sample[:, :, 0] + 1) / 2
    rows = [json.loads(l) for l in captions_file.read_text().splitlines()[:256]]
    reward = ShapesReward()
    record["recon_reward"] = reward(recon.clamp(0, 1), [r["prompt"] for r in rows], [{} for _ in rows]).mean().item()
    record["gt_reward"] = reward(images[:256], [r["prompt"] for r in rows], [{} for _ in rows]).mean().item()
    print(f"vae: mse {mse:.4f}, reward of decode(encode(x)) {record['recon_reward']:.3f} (ground truth "
          f"{record['gt_reward']:.3f}), {record['vae_s']:.0f}s", flush=True)
    (out / "build.json").write_text(json.dumps(record, indent=1))
    if record["recon_reward"] < args.min_recon_reward:
        raise SystemExit(f"VAE reconstructions score below {args.min_recon_reward}: not building further")
    mean, std = latent_statistics(vae.cpu(), images, dev)
    base = build_base_checkpoint(work / "base", vae.cpu(), mean, std, captions, 0)
    test_prompts = (data / "prompts_test.txt").read_text().splitlines()
    train_prompts = (data / "prompts_train.txt").read_text().splitlines()[:len(test_prompts)]
    record["stages"] = []
    for n, steps in enumerate(int(s) for s in args.stages.split(",")):
        cfg = sft_config(base, captions_file, work / "sft", steps=steps, batch=args.sft_batch, seed=0, device=dev,
                         keep_checkpoints=1, log_every=50)
        sft(cfg, resume="latest" if n else None)
        model = export_model(work / "sft", work / f"model_{steps}", dtype="float32")
        write_build_record(model, num_images=args.num_images, seed=0, vae_steps=args.vae_steps, vae_final_mse=mse,
                           sft_steps=steps, sft_batch=args.sft_batch, device=record["device"])
        stage = {"sft_steps": steps, "elapsed_s": time.perf_counter() - tic}
        for g in (1.0, 4.0):
            stage[f"test_g{g:g}"] = judge(model, test_prompts, 4, g, dev)
            stage[f"train_g{g:g}"] = judge(model, train_prompts, 4, g, dev)
        loss = [json.loads(l) for l in (work / "sft" / "metrics.jsonl").read_text().splitlines()][-1]["sft/loss"]
        stage["sft_loss"] = loss
        record["stages"].append(stage)
        with tarfile.open(out / f"model_{steps}.tar", "w") as tar:
            tar.add(model, arcname="quickstart-model")
        (out / "build.json").write_text(json.dumps(record, indent=1))
        print(f"sft {steps:5d}: loss {loss:.4f} | held-out g1 {stage['test_g1']:.3f} g4 {stage['test_g4']:.3f} | "
              f"train g1 {stage['train_g1']:.3f} g4 {stage['train_g4']:.3f} | {stage['elapsed_s']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
