"""imagerl command line: train | sample | eval | sft | reward-server | make-tiny-checkpoint | make-synthetic-data |
recipes | report | convert-checkpoint."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path



# components.NAMED_MODELS (not imported here: the parser is built without torch)
MODEL_HELP = "a local diffusers-format checkpoint directory, or quickstart / tiny / tiny21 / tiny_sd3 / tiny_flux"


def _train(args) -> int:
    from imagerl.config import load_config
    from imagerl.run.console import quiet_other_ranks
    from imagerl.train import train

    quiet_other_ranks()  # torchrun: rank 0 prints progress and summaries

    flags = [f"model.path={args.model}"] if args.model else []
    flags += [f"model.family={args.family}"] if args.family else []
    flags += ["parallel.deterministic=true"] if args.deterministic else []
    if args.resume and args.overwrite:
        raise ValueError("--resume continues a run and --overwrite starts one over: give one of them")
    if args.resume and args.recipe is None:  # the run's own settings, then this command's overrides
        cfg = _resume_config(args.resume, args.output_dir, flags + args.overrides)
    else:
        cfg = load_config(args.recipe or "quickstart", flags + args.overrides)
        if args.output_dir:
            cfg.run.output_dir = args.output_dir
    args.run_dir, args.run_config = cfg.output_dir, cfg.to_dict()  # for the Ctrl-C message
    run_dir = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if (run_dir / "metrics.jsonl").is_file():
        from imagerl.run.report import format_eval_table, format_suite_tables, load_run

        records = load_run(run_dir)
        for table in (format_eval_table(records), format_suite_tables(records),
                      format_suite_tables(records, "eval/set/", "held-out set")):
            if table:
                print(table)
    print(f"done: {run_dir} (metrics.jsonl, tensorboard/, images/, checkpoints/, plots/reward.png); "
          f"summary: imagerl report {run_dir}")
    return 0


def _resume_config(resume: str, output_dir: str | None, overrides: list[str]):
    """`--resume` without --recipe: the config the checkpoint was written with (its state.json), then `overrides`;
    the run directory is the checkpoint's (or --output-dir). `latest` looks in --output-dir, else in the default
    recipe's run directory."""
    from imagerl.run.checkpoint import read_state, resolve_resume
    from imagerl.config import config_from_dict, load_config, planned_rollouts

    where = Path(output_dir) if output_dir else load_config("quickstart").output_dir
    checkpoint = resolve_resume(resume, where)
    saved = read_state(checkpoint).get("config")
    if not isinstance(saved, dict):
        raise ValueError(f"{checkpoint / 'state.json'} holds no config; resume with --recipe NAME_OR_YAML")
    cfg = config_from_dict(saved, overrides)
    # the directory the checkpoint is in (runs/X/checkpoints/step_N), braces escaped for the {recipe} template
    run_dir = Path(output_dir or checkpoint.parent.parent)
    cfg.run.output_dir = str(run_dir).replace("{", "{{").replace("}", "}}")
    target = planned_rollouts(run_dir)  # an extension given since this checkpoint (e.g. stopped before the next)
    if target and target[0] != cfg.train.num_rollouts and not any(o.startswith("train.num_rollouts=") for o in overrides):
        print(f"continuing toward train.num_rollouts={target[0]}, the run's latest target ({target[1].name})")
        cfg.train.num_rollouts = target[0]
    return cfg


def _sft(args) -> int:
    from imagerl.sft.trainer import SFTConfig, export_model, load_sft_config, read_saved_sft_config, sft

    if args.export:
        if args.model or args.data or args.resume or args.overrides:
            raise ValueError("--export RUN_DIR OUT_DIR takes no --model/--data/--resume/overrides")
        print(f"wrote {export_model(args.export[0], args.export[1], dtype=args.export_dtype, link=args.link)}")
        return 0
    saved = Path(args.output_dir or SFTConfig.output_dir) / "sft_config.yaml"
    base = read_saved_sft_config(saved) if args.resume and saved.is_file() else None
    flags = [f"model={args.model}"] if args.model else []
    flags += [f"data={args.data}"] if args.data else []
    flags += [f"family={args.family}"] if args.family else []
    flags += [f"output_dir={args.output_dir}"] if args.output_dir else []
    cfg = load_sft_config(flags + args.overrides, base=base)
    if not cfg.data:
        raise ValueError("imagerl sft needs --data (a JSONL file or a folder of images with .txt captions)")
    args.run_dir = Path(cfg.output_dir)  # for the Ctrl-C message
    run = sft(cfg, resume=args.resume)
    print(f"done: {run.run_dir} (metrics.jsonl, checkpoints/); last checkpoint {run.checkpoint}; a standalone model: "
          f"imagerl sft --export {run.run_dir} OUT_DIR")
    return 0


def _make_tiny(args) -> int:
    from imagerl.components import NAMED_MODELS
    from imagerl.families.model_defaults import TINY_DEFAULTS, write_model_defaults
    from imagerl.families.registry import FAMILIES, _import_builtin

    _import_builtin()
    if args.family not in FAMILIES:
        raise ValueError(f"--family {args.family!r}: the families are {', '.join(sorted(FAMILIES))}")
    path = FAMILIES[args.family].build_tiny_checkpoint(args.directory, seed=args.seed)
    write_model_defaults(path, **TINY_DEFAULTS)
    print(f"wrote {path}")
    if args.directory in NAMED_MODELS:  # `--model tiny_sd3` would name the built-in one
        print(f"pass it as ./{args.directory}: the bare name {args.directory} is imagerl's built-in model of that name")
    return 0


def _make_synthetic(args) -> int:
    from imagerl.data.synthetic import generate_dataset

    out = generate_dataset(args.out_dir, args.n, seed=args.seed, size=args.size, num_test_prompts=args.num_test_prompts)
    print(f"wrote {args.n} images to {out / 'images'}, {out / 'captions.jsonl'}, {out / 'prompts_train.txt'}, "
          f"{out / 'prompts_test.txt'} (score with reward.weights={{shapes: 1.0}})")
    return 0


def _sample(args) -> int:
    from imagerl.sample import check_image_path, sample_images, save_images

    check_image_path(args.out)
    _note_busy_cpus(args.device)
    images = sample_images(args.model, args.prompt, family=args.family or "auto", lora=args.lora,
                           num_steps=args.steps, seed=args.seed, guidance_scale=args.guidance, height=args.height,
                           width=args.width, negative_prompt=args.negative_prompt, device=args.device,
                           log=lambda line: print(f"sampling {len(args.prompt)} image(s): {line}"))
    for path in save_images(images, args.out):
        print(f"wrote {path}")
    return 0


def _recipes(args) -> int:
    from imagerl.config import available_recipes, recipe_dir

    for name in available_recipes():  # each recipe's first line is its one-sentence summary
        first = (recipe_dir() / f"{name}.yaml").read_text().splitlines()[0].lstrip("# ")
        print(f"{name:24s} {first}")
    print("details: the comments at the top of each recipe (imagerl/recipes/NAME.yaml); use: imagerl train --recipe NAME")
    return 0


def _report(args) -> int:
    from imagerl.run.report import write_report

    table, paths = write_report(Path(args.run_dir), phases=not args.no_phases)
    print(table)
    for path in paths:
        print(f"wrote {path}")
    return 0


def _note_busy_cpus(device: str) -> None:
    """imagerl eval / sample on a CPU that other processes keep busy: say it will be slower, and what helps."""
    if device in ("auto", "cpu"):
        from imagerl.run.cpu_estimate import busy_cpus_note

        note = busy_cpus_note()
        if note and (device == "cpu" or not __import__("torch").cuda.is_available()):
            print(f"imagerl: note: {note[2:]}", file=sys.stderr)


def _eval(args) -> int:
    _note_busy_cpus(args.device)
    if args.reward:  # `--reward NAME reward.key=value`: --reward takes several names, and would take the setting too
        args.overrides += [item for item in args.reward if "=" in item]
        args.reward = [item for item in args.reward if "=" not in item] or None
    if args.suite:
        from imagerl.evaluation.suites.run import cli_suite

        cli_suite(args)
        return 0
    from imagerl.evaluation.held_out import cli_evaluate

    if not args.prompts:
        raise ValueError("give --prompts FILE (or a shipped set), or --suite NAME (imagerl eval --help lists both)")
    if args.lora and len(args.lora) > 1:
        raise ValueError("several --lora side by side need a suite: --suite shapes | ocr | geneval | reward:NAME")
    if args.images_per_prompt is not None:
        raise ValueError("--images-per-prompt belongs to --suite; without it, repeat prompts in the file")
    args.lora = args.lora[0] if args.lora else None
    cli_evaluate(args)
    return 0


def _build_quickstart_model(args) -> int:
    from imagerl.families.quickstart_model import build_quickstart_model

    build_quickstart_model(args.directory, args.work_dir, num_images=args.num_images, seed=args.seed,
                           vae_steps=args.vae_steps, sft_steps=args.sft_steps, sft_batch=args.sft_batch,
                           device=args.device)
    return 0


def _reward_server(args) -> int:
    from imagerl.config import Config
    from imagerl.evaluation.held_out import apply_reward_overrides
    from imagerl.rewards.registry import check_reward_config
    from imagerl.rewards.remote import read_token
    from imagerl.rewards.server import serve

    cfg = Config(recipe="reward-server")
    apply_reward_overrides(cfg, args.overrides)  # reward.plugins, reward.options.NAME, model paths, batch size
    cfg.reward.weights = dict.fromkeys(args.reward, 1.0)
    check_reward_config(cfg.reward)
    token = read_token(args.token_file, "--token-file")
    if args.host not in ("127.0.0.1", "localhost") and not token:
        print(f"imagerl: warning: --host {args.host} serves anyone who can reach this machine; --token-file "
              "limits it to clients that hold the token", file=sys.stderr)
    serve(cfg.reward, args.reward, host=args.host, port=args.port, device=args.device, token=token,
          max_body_mb=args.max_body_mb)
    return 0


def _bench(args) -> int:
    from pathlib import Path

    from imagerl.perf.bench import DEFAULT_VARIANTS, parse_variants, run_bench

    variants = parse_variants(args.variant) if args.variant else None
    if variants is None and args.family not in DEFAULT_VARIANTS:
        raise ValueError(f"unknown family {args.family!r}; choose one of {', '.join(DEFAULT_VARIANTS)}")
    run_bench(args.family, variants, baseline=not args.no_baseline, warmup=args.warmup, iterations=args.iterations,
              dry=args.dry_run, out=Path(args.out) if args.out else None,
              profiles=[[o.strip() for o in spec.split(",") if o.strip()] for spec in args.profile],
              algorithm=args.algorithm, baseline_batch_sizes=args.baseline_batch_size)
    return 0


def _convert_checkpoint(args) -> int:
    from imagerl.run.checkpoint_convert import check_convertible, convert_checkpoint

    paths = [Path(p) for p in args.checkpoints]
    for path in paths:  # state.json, format and checksums: nothing unpickled yet
        check_convertible(path)
    print("imagerl: format 1 keeps its metadata and optimizer entries as Python pickles, and reading a pickle can "
          f"run code (any code its author chose): convert only checkpoints you trust ({', '.join(map(str, paths))})",
          file=sys.stderr)
    if not args.trust_pickle:
        if not sys.stdin.isatty():
            raise ValueError("nothing converted: convert-checkpoint reads pickles only with --trust-pickle (or a "
                             "yes on a terminal); pass --trust-pickle for checkpoints you trust")
        if input("Read these pickles? [y/N] ").strip().lower() not in ("y", "yes"):
            raise ValueError("nothing converted (not confirmed); --trust-pickle converts without asking")
    for path in paths:
        convert_checkpoint(path, trust_pickle=True)
        print(f"converted {path} to format 2 (trainer/: safetensors + JSON); resume it with --resume {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="imagerl", description="Online RL (Flow-GRPO, DiffusionNFT) for flow-matching text-to-image models")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train with a recipe and dotted overrides (section.key=value)")
    p.add_argument("--recipe", default=None, help="bundled recipe name or YAML path (default: quickstart; with "
                   "--resume: the settings the checkpoint was written with)")
    p.add_argument("--resume", default=None, help="'latest' (in the run directory), a run directory or a checkpoint "
                   "directory; overrides given with it are applied, or refused by name where a run cannot change them")
    p.add_argument("--overwrite", action="store_true", help="start over in a run directory that holds a run "
                   "(deletes its checkpoints, metrics, images and plots); without it such a directory is refused")
    p.add_argument("--output-dir", default=None, help="run directory (default: run.output_dir of the recipe)")
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (same as model.path=)")
    p.add_argument("--family", default=None, help="qwen_image | qwen_image21 | sd3 | flux (default: from the checkpoint)")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels and seeds (same as "
                   "parallel.deterministic=true); several GPUs: torchrun --nproc_per_node N -m imagerl train ...")
    p.add_argument("overrides", nargs="*", help="e.g. train.lr=1e-4 sample.group_size=8")
    p.set_defaults(fn=_train)
    p = sub.add_parser("sample", help="generate images (ODE; size, steps and guidance: the model's defaults)",
                       description="Settings not given: the model's imagerl_defaults.json (the quickstart model: 64 px, "
                       "10 steps, guidance 1), else the family's (1024 px; 50 steps, guidance 4 / 2.1: 40, 1).")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--prompt", action="append", required=True, help="repeat for several images")
    p.add_argument("--family", default=None, help="qwen_image | qwen_image21 | sd3 | flux (default: from the checkpoint)")
    p.add_argument("--lora", default=None, help="a LoRA directory (the lora/ folder of an imagerl checkpoint)")
    p.add_argument("--steps", type=int, default=None, help="ODE steps (default: the model's, else the family's: "
                   "50 / 40 for 2.1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--guidance", type=float, default=None, help="CFG scale, 1: none (default: the model's, else the "
                   "family's: 4.0 / 1.0 for 2.1)")
    p.add_argument("--negative-prompt", default=" ")
    p.add_argument("--height", type=int, default=None, help="default: the model's, else the family's (1024)")
    p.add_argument("--width", type=int, default=None, help="default: the model's, else the family's (1024)")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="sample.png", help="PNG path (several prompts: _0, _1, ... appended)")
    p.set_defaults(fn=_sample)
    p = sub.add_parser("eval", help="held-out evaluation: ODE samples of a prompt file, scored (base model or a LoRA)",
                       description="Settings not given (size, steps, guidance, reward): the model's "
                       "imagerl_defaults.json (the quickstart model: 64 px, 10 steps, guidance 1, shapes), else the "
                       "family's (1024 px; 50 steps, guidance 4 / 2.1: 40, 1; jpeg_compressibility).")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--family", default=None, help="qwen_image | qwen_image21 | sd3 | flux (default: from the checkpoint)")
    p.add_argument("--lora", action="append", default=None, help="a LoRA directory (the lora/ folder of an imagerl "
                   "checkpoint); with --suite repeat it to compare several beside the base model")
    p.add_argument("--suite", default=None, help="shapes | ocr | geneval | reward:NAME: the measures papers report, "
                   "the base model and each --lora side by side with 95%% intervals (docs/evaluation.md)")
    p.add_argument("--images-per-prompt", type=int, default=None, help="with --suite (default: the suite's: 4 for "
                   "shapes and geneval, 1 for ocr and reward:NAME)")
    p.add_argument("--prompts", default=None, help=".txt (one prompt per line) or .jsonl (a 'prompt' field), or a "
                   "shipped set: bundled (128 OCR prompts), shapes-train, shapes-test (the quickstart's held-out 125), "
                   "ocr-test (flow_grpo's 1018), geneval (GenEval's 553); with --suite it replaces the suite's")
    p.add_argument("--reward", action="extend", nargs="+", default=None, metavar="NAME",
                   help="reward(s), each weighted 1 (default: the model's, else jpeg_compressibility)")
    p.add_argument("--steps", type=int, default=None, help="ODE steps (default: the model's, else the family's: "
                   "50 / 40 for 2.1)")
    p.add_argument("--guidance", type=float, default=None, help="CFG scale, 1: none (default: the model's, else the "
                   "family's: 4.0 / 1.0 for 2.1)")
    p.add_argument("--height", type=int, default=None, help="default: the model's, else the family's (1024)")
    p.add_argument("--width", type=int, default=None, help="default: the model's, else the family's (1024)")
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
    p = sub.add_parser("sft", help="supervised flow-matching fine-tuning on image-caption pairs (LoRA or full)",
                       description="Train: imagerl sft --model PATH --data FILE_OR_DIR --output-dir DIR [key=value ...]. "
                       "Export: imagerl sft --export RUN_DIR OUT_DIR. Settings: docs/sft.md (SFTConfig).")
    p.add_argument("--model", default=None, help=f"{MODEL_HELP} (same as model=)")
    p.add_argument("--data", default=None, help="JSONL ({\"image\": path, \"prompt\": text} per line) or folder of images + .txt")
    p.add_argument("--output-dir", default=None, help="run directory (default runs/sft)")
    p.add_argument("--family", default=None, help="qwen_image | qwen_image21 | sd3 | flux (default: from the checkpoint)")
    p.add_argument("--resume", default=None, help="'latest', a run directory or a checkpoint directory; settings "
                   "not given again come from <output-dir>/sft_config.yaml")
    p.add_argument("--export", nargs=2, metavar=("RUN_DIR", "OUT_DIR"), default=None,
                   help="write a standalone diffusers checkpoint (LoRA merged) from a run's latest checkpoint")
    p.add_argument("--export-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="transformer dtype of the export (auto: the base checkpoint's)")
    p.add_argument("--link", action="store_true", help="export: symlink the base components instead of copying")
    p.add_argument("overrides", nargs="*", help="SFTConfig fields, e.g. lora_rank=0 lr=1e-5 num_steps=2000")
    p.set_defaults(fn=_sft)
    p = sub.add_parser("make-tiny-checkpoint", help="write a tiny random checkpoint in the hub layout")
    p.add_argument("directory")
    p.add_argument("--family", default="qwen_image", help="a registered family (qwen_image, qwen_image21, sd3, flux)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=_make_tiny)
    p = sub.add_parser("make-synthetic-data", help="write a shapes-world data set (images, captions, prompt files)")
    p.add_argument("out_dir")
    p.add_argument("--n", type=int, required=True, help="number of training images")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=64, help="image side in px (default 64)")
    p.add_argument("--num-test-prompts", type=int, default=64, help="held-out captions in prompts_test.txt (default 64)")
    p.set_defaults(fn=_make_synthetic)
    p = sub.add_parser("build-quickstart-model", help="build the small pretrained shapes-world model (synthetic "
                                                      "data, VAE training, SFT); see imagerl/families/quickstart_model.py")
    p.add_argument("directory")
    p.add_argument("--work-dir", default="runs/quickstart-model-build")
    p.add_argument("--num-images", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vae-steps", type=int, default=2000)
    p.add_argument("--sft-steps", type=int, default=1200)
    p.add_argument("--sft-batch", type=int, default=64)
    p.add_argument("--device", default="auto")
    p.set_defaults(fn=_build_quickstart_model)
    p = sub.add_parser("bench", help="throughput and MFU of whole RL iterations on released-size random "
                       "models (GPU), imagerl beside a diffusers + peft flow_grpo-style baseline")
    p.add_argument("--family", default="qwen_image", help="qwen_image | qwen_image21 | sd3 | flux (each with its diffusers + peft baseline)")
    p.add_argument("--variant", action="append", default=[], help="'name:override,override' (repeatable), e.g. "
                   "'compile b8:parallel.compile=true,sample.batch_size=8'; default: the family's standard set")
    p.add_argument("--algorithm", default="flow_grpo", help="flow_grpo | diffusion_nft (default variants: the NFT "
                   "recipe with and without train.timestep_staging beside the family's Flow-GRPO recipe; a variant's "
                   "'recipe=NAME' override picks its recipe)")
    p.add_argument("--no-baseline", action="store_true", help="skip the diffusers + peft baseline")
    p.add_argument("--baseline-batch-size", type=int, action="append", default=[], help="samples per baseline "
                   "forward (sampling and training; repeatable: a baseline row each, the first one the reference); "
                   "default: the upstream trainer's")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured iterations per variant (default 2: compiled "
                   "variants compile on their first two prompt lengths)")
    p.add_argument("--iterations", type=int, default=2, help="measured iterations per variant (default 2)")
    p.add_argument("--out", default=None, help="write bench_<family>.json and .md here")
    p.add_argument("--profile", action="append", default=[], help="'override,override' (repeatable; '' for the "
                   "defaults): first print torch.profiler's GPU time by operator for one forward and one training step")
    p.add_argument("--dry-run", action="store_true", help="1-layer models at 64 px on the CPU: checks the code path")
    p.set_defaults(fn=_bench)
    p = sub.add_parser("reward-server", help="serve rewards over HTTP (a reward on a GPU or node of its own); runs use "
                       "it with reward.remote={NAME: URL}",
                       description="Serves registered rewards (imagerl's, reward.plugins, entry points) over HTTP; the "
                       "format, for servers in any language: docs/rewards.md. Stop it with Ctrl-C.")
    p.add_argument("--reward", action="append", required=True, metavar="NAME", help="a reward to serve (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                   "0.0.0.0 for other nodes, with --token-file)")
    p.add_argument("--port", type=int, default=8765, help="default 8765; 0: a free port (printed)")
    p.add_argument("--device", default="auto", help="where the reward models run, e.g. cuda:4 (default: cuda if "
                   "available, else cpu)")
    p.add_argument("--token-file", default="", help="a file holding a shared token; clients then need "
                   "reward.remote_token_file")
    p.add_argument("--max-body-mb", type=float, default=256.0, help="refuse larger requests (default 256 MiB; 32 "
                   "images of 1024x1024 in uint8 are 96 MiB)")
    p.add_argument("overrides", nargs="*", help="reward settings, e.g. reward.plugins=[./my_rewards.py] "
                   "reward.options.redness.scale=2 reward.pickscore_model=/models/PickScore_v1 reward.batch_size=16")
    p.set_defaults(fn=_reward_server)
    p = sub.add_parser("recipes", help="list bundled recipes")
    p.set_defaults(fn=_recipes)
    p = sub.add_parser("report", help="summary table of a run; writes plots/reward.png and plots/phases.png")
    p.add_argument("run_dir")
    p.add_argument("--no-phases", action="store_true", help="skip plots/phases.png")
    p.set_defaults(fn=_report)
    p = sub.add_parser("convert-checkpoint", help="rewrite a checkpoint of imagerl's format 1 (torch.distributed."
                       "checkpoint, pickles) in format 2 (safetensors + JSON), in place",
                       description="Format 1's dcp/ holds Python pickles, which can run code when read: resume refuses "
                       "it. This command reads it once with torch.distributed.checkpoint's loader, only with "
                       "--trust-pickle (or a yes on a terminal); run it only on checkpoints you trust.")
    p.add_argument("--trust-pickle", action="store_true", help="read the format-1 pickles without asking (they can "
                   "run code: only for checkpoints you trust)")
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help="checkpoint directories (runs/X/checkpoints/"
                   "step_N)")
    p.set_defaults(fn=_convert_checkpoint)
    return parser


def _how_to_continue(args) -> str:
    """After Ctrl-C in train or sft: the exact command that continues this run (its directory named), or, before
    its first checkpoint, that the same command starts it again."""
    from imagerl.run.checkpoint import latest_checkpoint
    from imagerl.run.lock import continue_command, restartable

    run_dir = getattr(args, "run_dir", None)
    if run_dir is None or not run_dir.is_dir():  # interrupted before the run directory was known or made
        return ""
    last = latest_checkpoint(run_dir)
    if last is not None:
        return f"; the last checkpoint, {last.name}, is kept: continue with `{continue_command(run_dir)}`"
    if args.command == "sft" or restartable(run_dir, getattr(args, "run_config", None)):
        return f"; {run_dir} holds no checkpoint yet: the same command starts the run again"
    return f"; {run_dir} holds no complete checkpoint: start it over with the same command and --overwrite"


def _is_reward_error(e: Exception) -> bool:
    """Whether e is a RewardError, without importing imagerl.rewards (torch) for commands that never score: the
    class can only have been raised once its module was imported."""
    registry = sys.modules.get("imagerl.rewards.registry")
    return registry is not None and isinstance(e, registry.RewardError)


def main(argv: list[str] | None = None) -> int:
    # OpenMP threads with no work spin before they sleep (libgomp's default); on cores shared with other processes
    # the spinning takes the cores the others need. Beside one 2-thread torch process on 2 cores `imagerl eval` of
    # the quickstart took 85.6 s with the default, 27.1 s with PASSIVE (alone: 14.7 and 15.2 s; benchmarks/LOG.md,
    # "CPUs shared with other work"). Read when torch loads OpenMP, which the command line has not done yet (a
    # caller that imported torch first keeps its policy); a value the user set wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from imagerl.run.console import quiet_harmless_warnings, quiet_library_progress

    args = build_parser().parse_args(argv)
    quiet_harmless_warnings()
    if args.command not in ("recipes", "report", "make-synthetic-data"):  # these load no model: no diffusers import
        quiet_library_progress()  # piped or logged: no "Loading weights" bars (a terminal keeps them)
    try:
        return args.fn(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; checkpoints are written whole or not at all
        print(f"\nimagerl: interrupted{_how_to_continue(args)}", file=sys.stderr)
        return 130
    except (ValueError, FileExistsError) as e:
        print(f"imagerl: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an unwritable path, a full disk: the message names the path (FileExistsError: above)
        print(f"imagerl: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if not _is_reward_error(e):
            raise
        print(f"imagerl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
