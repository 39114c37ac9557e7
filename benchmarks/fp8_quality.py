"""What sample.off_window_fp8 does to images and rewards: held-out prompts sampled twice from the same noise,
once with the merged weights in the model dtype and once with every step in FP8 (families/layers/fp8_linear.py).

Every step in FP8 bounds the rollout's effect from above: a Flow-GRPO rollout runs only its off-window steps
in FP8 (e.g. 7 of 10) and the window steps, the ones trained on, in bf16. Reports the paired reward difference
(mean and its standard error over prompts) and the pixel difference of the first images.

    python benchmarks/fp8_quality.py --model quickstart --lora runs/quickstart/checkpoints/step_000060/lora \
        --prompts shapes-test --out fp8_quality                        # CPU, the quickstart model (a minute)
    python benchmarks/fp8_quality.py --model /models/Qwen-Image --prompts ocr-test --reward ocr --steps 10 \
        --height 512 --width 512 --device cuda --out $OUT              # GPU, a released checkpoint
"""
from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="quickstart")
    p.add_argument("--lora", default=None)
    p.add_argument("--prompts", default="shapes-test")
    p.add_argument("--reward", action="append", default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--guidance", type=float, default=None)
    p.add_argument("--max-prompts", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    from imagerl.run.checkpoint import load_lora
    from imagerl.components import resolve_dtype, resolve_model_path
    from imagerl.config import Config
    from imagerl.data.prompts import load_prompt_set, resolve_prompt_file
    from imagerl.distributed.parallel import init_world
    from imagerl.evaluation.held_out import run_evaluation
    from imagerl.families.layers.merged_lora import MergedLora
    from imagerl.families.registry import family_class
    from imagerl.families.model_defaults import model_defaults
    from imagerl.rewards import Scorer

    world = init_world(args.device)
    path = resolve_model_path(args.model, world)
    defaults = model_defaults(path)
    family = family_class(path, "auto")
    cfg = Config(recipe="fp8_quality")
    cfg.reward.weights = {name: 1.0 for name in (args.reward or defaults.rewards or ["jpeg_compressibility"])}
    cfg.sample.height, cfg.sample.width, cfg.eval.num_steps, cfg.eval.guidance_scale = defaults.sampling(
        family, height=args.height, width=args.width, num_steps=args.steps, guidance_scale=args.guidance)
    cfg.eval.max_prompts, cfg.eval.batch_size = args.max_prompts, args.batch_size
    adapter = family.from_pretrained(path, world.device, resolve_dtype("auto", world.device))
    if args.lora:
        load_lora(adapter, Path(args.lora))
    else:  # a LoRA as training holds it (B = 0: the merge is the base weight), so that MergedLora has layers
        adapter.add_lora(cfg.model.lora_rank, cfg.model.lora_alpha, "gaussian")
    test_set = load_prompt_set(resolve_prompt_file(args.prompts), key="--prompts")
    scorer = Scorer(cfg.reward, world.device)

    results = {}
    for mode, fp8 in (("merged", False), ("fp8", True)):
        merged = MergedLora(adapter.transformer, fp8=fp8, token_linears=adapter.token_linears)
        swapped = merged.swaps or merged.fp8_swaps or merged.frozen_fp8_swaps
        with merged.applied() if swapped else contextlib.nullcontext():
            results[mode] = run_evaluation(adapter, scorer, test_set, cfg, world, progress=False)
        del merged
    a, b = results["merged"], results["fp8"]
    both = a.valid_N & b.valid_N
    diff = (b.total_N - a.total_N)[both]
    grid_a, grid_b = a.grid_images_B3HW.float(), b.grid_images_B3HW.float()  # the first images, in [0, 1]
    mse = (grid_a - grid_b).square().mean().item()
    report = {
        "model": str(path), "lora": args.lora, "prompts": int(both.sum()), "reward": list(cfg.reward.weights),
        "steps": a.settings.num_steps, "size": [a.settings.height, a.settings.width],
        "reward_merged": a.total_N[both].mean().item(), "reward_fp8": b.total_N[both].mean().item(),
        "reward_diff_mean": diff.mean().item(),
        "reward_diff_stderr": (diff.std() / diff.numel() ** 0.5).item() if diff.numel() > 1 else float("nan"),
        "reward_merged_std": a.total_N[both].std().item(),
        "pixel_mean_abs_diff": (grid_a - grid_b).abs().mean().item(),
        "psnr_db": float("inf") if mse == 0 else -10 * torch.log10(torch.tensor(mse)).item(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fp8_quality.json").write_text(json.dumps(report, indent=1))
    print("| model | prompts | steps | reward bf16 merged | reward FP8 | paired diff (± s.e.) | pixel |diff| | PSNR dB |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {path.name} | {report['prompts']} | {report['steps']} | {report['reward_merged']:.4f} | "
          f"{report['reward_fp8']:.4f} | {report['reward_diff_mean']:+.4f} ± {report['reward_diff_stderr']:.4f} | "
          f"{report['pixel_mean_abs_diff']:.4f} | {report['psnr_db']:.1f} |")


if __name__ == "__main__":
    main()
