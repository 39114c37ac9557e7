"""imagerl command line: train | sample | eval | make-tiny-checkpoint | recipes | report."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _train(args) -> int:
    from imagerl.config import load_config
    from imagerl.train import train

    flags = [f"model.path={args.model}"] if args.model else []
    flags += [f"model.family={args.family}"] if args.family else []
    cfg = load_config(args.recipe, flags + args.overrides)
    if args.output_dir:
        cfg.run.output_dir = args.output_dir
    run_dir = train(cfg, resume=args.resume)
    print(f"done: {run_dir} (metrics.jsonl, tensorboard/, images/, checkpoints/, plots/reward.png); "
          f"summary: imagerl report {run_dir}")
    return 0


def _make_tiny(args) -> int:
    if args.family == "qwen_image":
        from imagerl.families.tiny_checkpoint import make_tiny_qwen_image as make
    else:
        from imagerl.families.tiny_checkpoint21 import make_tiny_qwen_image21 as make
    print(f"wrote {make(args.directory, seed=args.seed)}")
    return 0


def _sample(args) -> int:
    from imagerl.sample import sample_images, save_images

    images = sample_images(args.model, args.prompt, family=args.family or "auto", lora=args.lora,
                           num_steps=args.steps, seed=args.seed, guidance_scale=args.guidance, height=args.height,
                           width=args.width, negative_prompt=args.negative_prompt, device=args.device)
    for path in save_images(images, args.out):
        print(f"wrote {path}")
    return 0


def _recipes(args) -> int:
    from imagerl.config import available_recipes, recipe_dir

    for name in available_recipes():
        first = (recipe_dir() / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
        print(f"{name:24s} {first}")
    return 0


def _report(args) -> int:
    from imagerl.report import write_report

    table, paths = write_report(Path(args.run_dir), phases=not args.no_phases)
    print(table)
    for path in paths:
        print(f"wrote {path}")
    return 0


def _eval(args) -> int:
    from imagerl.evaluation import cli_evaluate

    cli_evaluate(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="imagerl", description="Online RL (Flow-GRPO) for flow-matching text-to-image models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train with a recipe and dotted overrides (section.key=value)")
    p.add_argument("--recipe", default="quickstart", help="bundled recipe name or YAML path (default: quickstart)")
    p.add_argument("--resume", default=None, help="'latest', a run directory or a checkpoint directory")
    p.add_argument("--output-dir", default=None, help="run directory (default: run.output_dir of the recipe)")
    p.add_argument("--model", default=None, help="local diffusers-format checkpoint (same as model.path=)")
    p.add_argument("--family", default=None, help="qwen_image | qwen_image21 (default: from the checkpoint)")
    p.add_argument("overrides", nargs="*", help="e.g. train.lr=1e-4 sample.group_size=8")
    p.set_defaults(fn=_train)
    p = sub.add_parser("sample", help="generate images (ODE, the family's default guidance)")
    p.add_argument("--model", required=True, help="local diffusers-format checkpoint")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several images")
    p.add_argument("--family", default=None, help="qwen_image | qwen_image21 (default: from the checkpoint)")
    p.add_argument("--lora", default=None, help="a LoRA directory (the lora/ folder of an imagerl checkpoint)")
    p.add_argument("--steps", type=int, default=None, help="default: the pipeline's (50 / 40 for 2.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--guidance", type=float, default=None, help="default: the family's (4.0 / 1.0 for 2.1)")
    p.add_argument("--negative-prompt", default=" ")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="sample.png", help="PNG path (several prompts: _0, _1, ... appended)")
    p.set_defaults(fn=_sample)
    p = sub.add_parser("eval", help="held-out evaluation: ODE samples of a prompt file, scored (base model or a LoRA)")
    p.add_argument("--model", required=True, help="local diffusers-format checkpoint (or tiny / tiny21)")
    p.add_argument("--family", default=None, help="qwen_image | qwen_image21 (default: from the checkpoint)")
    p.add_argument("--lora", default=None, help="a LoRA directory (the lora/ folder of an imagerl checkpoint)")
    p.add_argument("--prompts", required=True, help=".txt (one prompt per line) or .jsonl (a 'prompt' field)")
    p.add_argument("--reward", action="extend", nargs="+", default=None, metavar="NAME",
                   help="reward(s), each weighted 1 (default: jpeg_compressibility)")
    p.add_argument("--steps", type=int, default=None, help="ODE steps (default: the family's, 50 / 40 for 2.1)")
    p.add_argument("--guidance", type=float, default=None, help="default: the family's (4.0 / 1.0 for 2.1)")
    p.add_argument("--height", type=int, default=None, help="default: the family's resolution")
    p.add_argument("--width", type=int, default=None, help="default: the family's resolution")
    p.add_argument("--max-prompts", type=int, default=0, help="only the first N prompts (default 0: all)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0, help="image i starts from the noise of (seed, i)")
    p.add_argument("--negative-prompt", default=" ")
    p.add_argument("--on-error", default="error", choices=["error", "skip"],
                   help="a failed/NaN reward stops (error) or is counted in eval/reward/failed_count (skip)")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--out", default="eval_out", help="directory for eval.json and eval_grid.png (default: eval_out)")
    p.add_argument("overrides", nargs="*", help="reward settings, e.g. reward.clip_model=/models/clip-vit-large-patch14")
    p.set_defaults(fn=_eval)
    p = sub.add_parser("make-tiny-checkpoint", help="write a tiny random checkpoint in the hub layout")
    p.add_argument("directory")
    p.add_argument("--family", default="qwen_image", choices=["qwen_image", "qwen_image21"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_make_tiny)
    p = sub.add_parser("recipes", help="list bundled recipes")
    p.set_defaults(fn=_recipes)
    p = sub.add_parser("report", help="summary table of a run; writes plots/reward.png and plots/phases.png")
    p.add_argument("run_dir")
    p.add_argument("--no-phases", action="store_true", help="skip plots/phases.png")
    p.set_defaults(fn=_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    from imagerl.rewards import RewardError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileExistsError, RewardError) as e:
        print(f"imagerl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
