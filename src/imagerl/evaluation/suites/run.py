"""`imagerl eval --suite NAME [--lora A --lora B ...]`: the base model and each LoRA on one suite, side by side.

Every model samples the same images' noise (prompt i's image k from (seed, "eval", i * K + k)), so the comparison is
paired by prompt; each row's interval is the paired bootstrap over prompts (suites/stats.py). Writes
<out>/suite_<name>.json (every number, per prompt too) and .md (the table) on rank 0; ranks split the images.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch

from imagerl.evaluation.suites import Suite, build_suite
from imagerl.evaluation.suites.stats import Interval, category_mean, category_strata, paired_bootstrap

NUM_RESAMPLES = 1000
IMAGE_KEY = "suite_image"  # added to each image's metadata: its row in expand()'s list (the layout writer's key)


def lora_label(path: str) -> str:
    """A column name for a LoRA: runs/x/checkpoints/step_000060/lora -> x/step_000060, else the folder name."""
    p = Path(path).resolve()
    if p.name == "lora" and p.parent.parent.name == "checkpoints":
        return f"{p.parent.parent.parent.name}/{p.parent.name}"
    return p.parent.name if p.name == "lora" else p.name


def use_lora(adapter, directory: str) -> None:
    """Replace the adapter's LoRA (if any) by the one in `directory`."""
    from imagerl.run.checkpoint import load_lora

    if getattr(adapter.transformer, "peft_config", None):
        adapter.transformer.delete_adapters(list(adapter.transformer.peft_config))
    load_lora(adapter, Path(directory))


def expand(suite: Suite, images_per_prompt: int, max_prompts: int = 0):
    """(prompts, metadata) of every image: prompt i's K images are rows i * K ... i * K + K - 1."""
    n = len(suite.prompt_set) if max_prompts <= 0 else min(max_prompts, len(suite.prompt_set))
    meta = suite.prompt_set.metadata or [{} for _ in range(n)]
    rows = [(i, k) for i in range(n) for k in range(images_per_prompt)]
    metadata = [{**meta[i], IMAGE_KEY: j} for j, (i, _) in enumerate(rows)]
    return n, [suite.prompt_set.prompts[i] for i, _ in rows], metadata, rows


def per_prompt(table_IM: torch.Tensor, n: int, k: int) -> np.ndarray:
    """(n, M): each prompt's mean over its K images (NaN where the measure does not apply to the prompt)."""
    values = table_IM.numpy().reshape(n, k, -1)
    with np.errstate(invalid="ignore"):
        applicable = np.isfinite(values).any(axis=1)
        sums = np.nansum(values, axis=1)
        counts = np.isfinite(values).sum(axis=1)
        return np.where(applicable, sums / np.maximum(counts, 1), np.nan)


def summarise(suite: Suite, scores_MPC: np.ndarray, seed: int = 0) -> list[dict]:
    """One row per measure (and GenEval's overall): prompts counted, each model's interval, the difference to the
    base (model 0). A prompt enters a measure's row when every model has a value for it."""
    rows = []
    for c, measure in enumerate(suite.measures):
        keep = np.isfinite(scores_MPC[:, :, c]).all(axis=0)
        if not keep.any():
            continue
        models, diffs = paired_bootstrap(scores_MPC[:, keep, c], NUM_RESAMPLES, seed)
        rows.append({"measure": measure, "prompts": int(keep.sum()), "models": models, "diffs": diffs})
    if suite.overall and rows:
        models, diffs = paired_bootstrap(scores_MPC, NUM_RESAMPLES, seed, statistic=category_mean,
                                         strata=category_strata(scores_MPC))  # no category drops out
        rows.append({"measure": "overall", "prompts": scores_MPC.shape[1], "models": models, "diffs": diffs})
    return rows


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _cell(i: Interval, signed: bool = False) -> str:
    f = "{:+.3f}" if signed else "{:.3f}"
    return f"{f.format(i.mean)} [{f.format(i.low)}, {f.format(i.high)}]"


def markdown_table(labels: list[str], rows: list[dict]) -> str:
    head = ["measure", "prompts", *labels, *[f"{label} - {labels[0]}" for label in labels[1:]]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["measure"], str(r["prompts"]), *map(_cell, r["models"]),
                 *(_cell(d, signed=True) for d in r["diffs"][1:])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cli_suite(args) -> dict:
    """`imagerl eval --suite NAME`: build the suite, sample it with the base model and each --lora, print and write
    the table. Settings not given come from the model's imagerl_defaults.json, else the family's."""
    from imagerl.run.checkpoint import check_lora_dir
    from imagerl.components import resolve_dtype, resolve_model_path
    from imagerl.config import Config
    from imagerl.distributed.parallel import init_world
    from imagerl.evaluation.held_out import EvalSettings, apply_reward_overrides, check_eval_flags, generate_and_score
    from imagerl.families.registry import family_class
    from imagerl.families.model_defaults import model_defaults

    loras = list(args.lora or [])
    check_eval_flags(args)  # before anything loads
    for lora in loras:
        check_lora_dir(Path(lora))
    world = init_world(args.device)
    path = resolve_model_path(args.model, world)
    cfg = Config(recipe="eval")
    apply_reward_overrides(cfg, args.overrides)
    suite = build_suite(args.suite, args.prompts, cfg.reward, world.device)
    family = family_class(path, args.family or "auto")
    defaults = model_defaults(path)
    h, w, steps, guidance = defaults.sampling(family, height=args.height, width=args.width, num_steps=args.steps,
                                              guidance_scale=args.guidance)
    k = args.images_per_prompt or suite.images_per_prompt
    n, prompts, metadata, rows = expand(suite, k, args.max_prompts)
    settings = EvalSettings(steps, float(guidance), h, w, args.seed, args.batch_size, args.negative_prompt, len(prompts))
    out = Path(args.out)
    labels = ["base", *_unique([lora_label(p) for p in loras])]
    size = f"{_count(n, 'prompt')} x {_count(k, 'image')}"  # "32 prompts x 1 image", not "x 1 images"
    if world.is_main:
        print(f"suite {suite.name}: {size}, {h}x{w} px, {steps} steps, guidance {guidance:g}; {suite.source}; "
              f"models: {', '.join(labels)}")
    adapter = family.from_pretrained(path, world.device, resolve_dtype(args.dtype, world.device))
    width = max(1, len(suite.measures))
    scores, seconds = [], []
    for label, lora in zip(labels, [None, *loras]):
        if lora is not None:
            use_lora(adapter, lora)
        score = suite.score or _layout_writer(suite, out / suite.name / label.replace("/", "_"), rows)
        start = time.perf_counter()
        table, _ = generate_and_score(adapter, prompts, metadata, settings, world, score, width,
                                      progress=True, desc=label)
        seconds.append(time.perf_counter() - start)
        scores.append(per_prompt(table, n, k))
    if not world.is_main:
        world.barrier()
        return {}
    return _write_results(suite, labels, loras, np.stack(scores), seconds, settings, n, k, out, args, world)


def _unique(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def _layout_writer(suite: Suite, folder: Path, rows: list[tuple[int, int]]):
    """score_batch for a suite without measures (geneval): each image into GenEval's layout (by its row's
    IMAGE_KEY); 0 per image."""
    from imagerl.evaluation.suites.geneval_layout import write_image

    def write(images_B3HW, prompts, metadata):
        for image, prompt, meta in zip(images_B3HW, prompts, metadata):
            i, k = rows[meta[IMAGE_KEY]]
            record = {key: v for key, v in meta.items() if key != IMAGE_KEY} or {"prompt": prompt}
            write_image(folder, i, record, k, image)
        return torch.zeros(images_B3HW.shape[0], 1, dtype=torch.float64)

    return write


def _write_results(suite: Suite, labels, loras, scores_MPC, seconds, settings, n, k, out: Path, args, world) -> dict:
    import dataclasses

    rows = summarise(suite, scores_MPC, seed=args.seed)
    size = f"{_count(n, 'prompt')} x {_count(k, 'image')}"
    out.mkdir(parents=True, exist_ok=True)
    timing = ", ".join(f"{label} {s:.1f} s" for label, s in zip(labels, seconds))
    if suite.measures:
        table = markdown_table(labels, rows)
        print(table)
    else:
        table = f"{size} written in GenEval's layout under {out / suite.name}/<model>/"
        print(table + "; score them with GenEval's evaluation/evaluate_images.py")
    print(f"time: {timing} ({world.size} process{'es' if world.size > 1 else ''})")
    record = {
        "suite": suite.name, "source": suite.source, "model": str(args.model), "models": labels, "loras": loras,
        "prompts": n, "images_per_prompt": k, "settings": dataclasses.asdict(settings),
        "seconds": dict(zip(labels, seconds)), "ranks": world.size, "resamples": NUM_RESAMPLES,
        "rows": [{"measure": r["measure"], "prompts": r["prompts"],
                  "models": {lb: dataclasses.asdict(i) for lb, i in zip(labels, r["models"])},
                  "diffs": {lb: dataclasses.asdict(d) for lb, d in zip(labels[1:], r["diffs"][1:])}} for r in rows],
        "per_prompt": {lb: [[None if np.isnan(v) else float(v) for v in row] for row in s]
                       for lb, s in zip(labels, scores_MPC)},
        "measures": list(suite.measures), "prompt_texts": suite.prompt_set.prompts[:n],
    }
    (out / f"suite_{suite.name.replace(':', '_')}.json").write_text(json.dumps(record, indent=1) + "\n")
    md = out / f"suite_{suite.name.replace(':', '_')}.md"
    md.write_text(f"suite {suite.name} ({suite.source}): {size}\n\n{table}\n\ntime: {timing}\n")
    print(f"wrote {md} and {md.with_suffix('.json')}")
    world.barrier()
    return record


def check_suite_names(names: list[str], reward_cfg=None) -> None:
    """ValueError for an unknown suite name in eval.suites (before any model loads)."""
    from imagerl.rewards.registry import check_reward_names

    for name in names:
        if name.startswith("reward:"):
            check_reward_names({name.partition(":")[2]: 1.0}, reward_cfg)
        elif name not in ("shapes", "ocr", "geneval"):
            raise ValueError(f"eval.suites: unknown suite {name!r}; the suites: shapes, ocr, geneval, reward:NAME")


class TrainingSuites:
    """eval.suites during training: each suite built once, run on the current weights at every evaluation. A suite
    whose images are the held-out evaluation's (the same prompts in the same order, K images each: the quickstart's
    shapes-test x 4 and the shapes suite) is measured on those images (held_out_columns) instead of sampling again;
    the settings are the held-out evaluation's (eval_settings) either way, so image i*K+k has the same noise."""

    def __init__(self, cfg, world, test_set=None):
        self.cfg, self.world = cfg, world
        self.suites = [build_suite(name, test_set if name.startswith("reward:") else None, cfg.reward,
                                   world.device) for name in cfg.eval.suites]
        self.expanded = {s.name: expand(s, s.images_per_prompt, cfg.eval.suite_max_prompts) for s in self.suites}
        self.on_held_out = {s.name for s in self.suites if s.score is not None and test_set is not None
                            and self._same_images(s, test_set)}

    def _same_images(self, suite: Suite, test_set) -> bool:
        n_held_out = len(test_set) if self.cfg.eval.max_prompts <= 0 else min(self.cfg.eval.max_prompts, len(test_set))
        _, prompts, metadata, _ = self.expanded[suite.name]
        held_out_meta = test_set.metadata or [{} for _ in range(n_held_out)]
        return (prompts == list(test_set.prompts[:n_held_out])
                and [{k: v for k, v in m.items() if k != IMAGE_KEY} for m in metadata] == held_out_meta[:n_held_out])

    def held_out_columns(self) -> dict:
        """evaluation.run_evaluation's extra_columns: the suites measured on the held-out images."""
        return {s.name: (len(s.measures), s.score) for s in self.suites if s.name in self.on_held_out}

    def held_out_metrics(self, tables: dict[str, torch.Tensor]) -> dict[str, float]:
        return {k: v for s in self.suites if s.name in tables
                for k, v in self._metrics(s, per_prompt(tables[s.name], self.expanded[s.name][0],
                                                        s.images_per_prompt)).items()}

    def __call__(self, adapter, step: int, run_dir: Path | None) -> dict[str, float]:
        """The suites not measured on the held-out images, each sampled and scored now."""
        import dataclasses

        from imagerl.evaluation.held_out import eval_settings, generate_and_score

        metrics = {}
        for suite in self.suites:
            if suite.name in self.on_held_out:
                continue
            n, prompts, metadata, rows = self.expanded[suite.name]
            settings = dataclasses.replace(eval_settings(self.cfg, adapter, suite.prompt_set),
                                           num_prompts=len(prompts))
            folder = Path(run_dir or ".") / "suites" / suite.name / f"step_{step:06d}"
            score = suite.score or _layout_writer(suite, folder, rows)
            start = time.perf_counter()
            table, _ = generate_and_score(adapter, prompts, metadata, settings, self.world, score,
                                          max(1, len(suite.measures)), desc=suite.name)
            metrics.update(self._metrics(suite, per_prompt(table, n, suite.images_per_prompt)))
            metrics[f"time/suite_{suite.name}_s"] = time.perf_counter() - start
        return metrics

    @staticmethod
    def _metrics(suite: Suite, scores: np.ndarray) -> dict[str, float]:
        """eval/suite/<suite>/<measure>: each measure's mean over the prompts it applies to; overall."""
        metrics = {}
        for c, measure in enumerate(suite.measures):
            values = scores[:, c][np.isfinite(scores[:, c])]
            if values.size:
                metrics[f"eval/suite/{suite.name}/{measure}"] = float(values.mean())
        if suite.overall:
            metrics[f"eval/suite/{suite.name}/overall"] = float(category_mean(scores[None], axis=1)[0])
        return metrics
