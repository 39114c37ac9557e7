"""`imagerl report RUN_DIR`: a summary table of a run and its plots (plots/reward.png, plots/phases.png).

Reads only what a run writes (metrics.jsonl, config.yaml, checkpoints/), so it works on a run that is
still going, one that crashed, and one copied from another machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from imagerl.run.best_checkpoint import read_best
from imagerl.run.lock import CHECKPOINT_NAME
from imagerl.run.metrics import PHASES, plot_phases, plot_rewards, read_metrics

TRAIN_REWARD = "rollout/reward/raw_mean"
EVAL_REWARD = "eval/reward/raw_mean"
MEMORY_LABELS = {"memory/peak_allocated_gib": "peak GPU memory allocated", "memory/peak_reserved_gib":
                 "peak GPU memory reserved", "memory/host_peak_rss_gib": "peak host memory (RSS)"}


@dataclass
class RunSummary:
    run_dir: Path
    rollouts_done: int
    rollouts_planned: int | None
    first_reward: tuple[int, float] | None  # (rollout, train reward)
    last_reward: tuple[int, float] | None
    best_reward: tuple[int, float] | None
    first_eval: tuple[int, float] | None  # (rollout, held-out reward); rollout 0 = before training
    last_eval: tuple[int, float] | None
    best_eval: tuple[int, float] | None
    phase_seconds: dict[str, tuple[float, int]]  # phase -> (mean seconds over the rollouts that ran it, count)
    images_per_s: float | None  # mean perf/images_per_s
    peak_memory_gib: dict[str, float]  # memory/* -> max over the run
    log_prob_diff_max: float | None
    failed_rewards: int
    checkpoints: list[str] = field(default_factory=list)
    best: dict | None = None  # run.keep_best's checkpoints/best.json


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # NaN-free (JSON null is None)


def load_run(run_dir: str | Path) -> list[dict]:
    """metrics.jsonl records of a run directory; ValueError that says what the directory is instead."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ValueError(f"{run_dir} does not exist; give a run directory (the run.output_dir of a training run)")
    if not run_dir.is_dir():
        raise ValueError(f"{run_dir} is a file, not a run directory (the folder that holds metrics.jsonl)")
    if not (run_dir / "metrics.jsonl").is_file():
        if (run_dir / "state.json").is_file() or (run_dir / "adapter_config.json").is_file():
            raise ValueError(f"{run_dir} is a checkpoint, not a run directory; give the run directory that holds "
                             f"checkpoints/ and metrics.jsonl (e.g. {run_dir.resolve().parent.parent})")
        hint = (" (it has config.yaml: the run has not finished a rollout yet)" if (run_dir / "config.yaml").is_file()
                else "")
        raise ValueError(f"{run_dir} is not an imagerl run directory: no metrics.jsonl{hint}")
    records = read_metrics(run_dir)
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no records yet (the first rollout has not finished)")
    return records


def _planned(run_dir: Path) -> int | None:
    from imagerl.config import planned_rollouts

    found = planned_rollouts(run_dir)  # the latest target: an extended run's config.resumed_*.yaml
    return found[0] if found else None


def summarize(run_dir: str | Path, records: list[dict] | None = None) -> RunSummary:
    run_dir = Path(run_dir)
    records = load_run(run_dir) if records is None else records
    train = [(r["step"], float(r[TRAIN_REWARD])) for r in records if _is_number(r.get(TRAIN_REWARD))]
    evals = [(r["step"], float(r[EVAL_REWARD])) for r in records if _is_number(r.get(EVAL_REWARD))]
    rollouts = [r for r in records if r["step"] > 0 and any(k.startswith(("rollout/", "train/")) for k in r)]

    phases = [p for p in PHASES if any(f"time/{p}_s" in r for r in records)]
    phases += sorted({k[5:-2] for r in records for k in r if k.startswith("time/") and k.endswith("_s")}
                     - set(phases) - {"total"})
    phase_seconds = {}
    for phase in [*phases, "total"]:
        # evaluations: all of them (also the one before training, step 0); other phases: rollouts only
        timed = records if phase == "eval" else [r for r in records if r["step"] > 0]
        values = [float(r[f"time/{phase}_s"]) for r in timed if _is_number(r.get(f"time/{phase}_s"))]
        if values:
            phase_seconds[phase] = (sum(values) / len(values), len(values))
    ips = [float(r["perf/images_per_s"]) for r in records if _is_number(r.get("perf/images_per_s"))]
    memory = {}
    for r in records:
        for k, v in r.items():
            if k.startswith("memory/") and _is_number(v):
                memory[k] = max(memory.get(k, float("-inf")), float(v))
    diffs = [float(r["train/log_prob_mean_abs_diff"]) for r in records
             if _is_number(r.get("train/log_prob_mean_abs_diff"))]
    failed = sum(int(r.get("rollout/reward/failed_count") or 0) for r in records)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")  # complete step_<digits> ones
                         if (m := CHECKPOINT_NAME.fullmatch(p.name)) and not m[2] and (p / "state.json").is_file())
    return RunSummary(
        run_dir=run_dir, rollouts_done=max((r["step"] for r in rollouts), default=0),
        rollouts_planned=_planned(run_dir),
        first_reward=train[0] if train else None, last_reward=train[-1] if train else None,
        best_reward=max(train, key=lambda x: x[1]) if train else None,
        first_eval=evals[0] if evals else None, last_eval=evals[-1] if evals else None,
        best_eval=max(evals, key=lambda x: x[1]) if evals else None,
        phase_seconds=phase_seconds, images_per_s=sum(ips) / len(ips) if ips else None, peak_memory_gib=memory,
        log_prob_diff_max=max(diffs) if diffs else None, failed_rewards=failed, checkpoints=checkpoints,
        best=read_best(run_dir),
    )


def _at(value: tuple[int, float] | None) -> str:
    return "-" if value is None else f"{value[1]:.6g}  (rollout {value[0]})"


def format_summary(s: RunSummary) -> str:
    planned = f" of {s.rollouts_planned}" if s.rollouts_planned else ""
    rows = [
        ("run", str(s.run_dir)),
        ("rollouts done", f"{s.rollouts_done}{planned}"),
        ("train reward, first", _at(s.first_reward)),
        ("train reward, last", _at(s.last_reward)),
        ("train reward, best", _at(s.best_reward)),
        ("held-out reward, first", _at(s.first_eval)),
        ("held-out reward, last", _at(s.last_eval)),
        ("held-out reward, best", _at(s.best_eval)),
    ]
    for phase, (mean, count) in s.phase_seconds.items():
        if phase == "eval":
            rows.append(("seconds per evaluation", f"{mean:.3f}  ({count} evaluations)"))
            continue
        every = "" if count >= s.rollouts_done else f"  (mean of the {count} rollouts that logged it)"
        rows.append((f"seconds per rollout, {phase}", f"{mean:.3f}{every}"))
    rows.append(("images/s (rollout, all ranks)", "-" if s.images_per_s is None else f"{s.images_per_s:.3f}"))
    for key, value in sorted(s.peak_memory_gib.items()):
        rows.append((f"{MEMORY_LABELS.get(key, key)} (GiB)", f"{value:.2f}"))
    if s.log_prob_diff_max is not None:  # Flow-GRPO's replay check; DiffusionNFT replays nothing
        rows.append(("log_prob_mean_abs_diff, max", f"{s.log_prob_diff_max:.3g}"))
    rows.append(("failed rewards (all rollouts)", str(s.failed_rewards)))
    rows.append(("checkpoints", ", ".join(s.checkpoints) or "none"))
    if s.best is not None:
        rows.append(("best checkpoint", f"{s.best['checkpoint']}  ({s.best['metric']} {s.best['value']:.4g}, "
                                        f"{s.best['mode']})"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def format_eval_table(records: list[dict]) -> str:
    """Held-out reward at each evaluation and the before -> after change ("" when the run has no evaluation)."""
    evals = [(r["step"], float(r[EVAL_REWARD])) for r in records if _is_number(r.get(EVAL_REWARD))]
    if not evals:
        return ""
    names = sorted({k[len("eval/reward/"):-len("_mean")] for r in records for k in r
                    if k.startswith("eval/reward/") and k.endswith("_mean") and k != EVAL_REWARD})
    names = names if len(names) > 1 else []  # one component: it is the reward itself
    lines = ["held-out evaluation", f"{'rollout':>7}  {'reward':>8}" + "".join(f"  {n:>10}" for n in names)]
    by_step = {r["step"]: r for r in records if _is_number(r.get(EVAL_REWARD))}
    for step, value in evals:
        cells = [by_step[step].get(f"eval/reward/{n}_mean") for n in names]  # null (no finite value) or absent: -
        parts = "".join(f"  {c:>10.4f}" if _is_number(c) else f"  {'-':>10}" for c in cells)
        lines.append(f"{step:>7}  {value:>8.4f}{parts}")
    (s0, first), (s1, last) = evals[0], evals[-1]
    lines.append(f"before -> after: {first:.4f} (rollout {s0}) -> {last:.4f} (rollout {s1}), change {last - first:+.4f}")
    return "\n".join(lines)


def format_suite_tables(records: list[dict], prefix: str = "eval/suite/", title: str = "suite") -> str:
    """Each eval.suites suite over training: one row per evaluation, one column per measure ("" when none ran).
    With prefix "eval/set/" and title "held-out set": each data.mixture set's held-out rewards likewise."""
    suites = sorted({k[len(prefix):].split("/")[0] for r in records for k in r if k.startswith(prefix)})
    blocks = []
    for suite in suites:
        keys = list(dict.fromkeys(k for r in records for k in r if k.startswith(f"{prefix}{suite}/")))
        names = [k.rsplit("/", 1)[1] for k in keys]
        width = max(8, *map(len, names))
        lines = [f"{title} {suite}", f"{'rollout':>7}" + "".join(f"  {n:>{width}}" for n in names)]
        for r in records:
            if any(k in r for k in keys):
                cells = "".join(f"  {r[k]:>{width}.4f}" if _is_number(r.get(k)) else f"  {'-':>{width}}" for k in keys)
                lines.append(f"{r['step']:>7}{cells}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def write_report(run_dir: str | Path, phases: bool = True) -> tuple[str, list[Path]]:
    """(summary table, plot paths): plots/reward.png and, with `phases`, plots/phases.png."""
    run_dir = Path(run_dir)
    records = load_run(run_dir)
    summary = summarize(run_dir, records)
    title = run_dir.resolve().name
    paths = [plot_rewards(records, run_dir / "plots" / "reward.png", title=title)]
    if phases:
        paths.append(plot_phases(records, run_dir / "plots" / "phases.png", title=f"{title}: seconds per phase"))
    tables = [t for t in (format_suite_tables(records), format_suite_tables(records, "eval/set/", "held-out set")) if t]
    return "\n\n".join([format_summary(summary), *tables]), paths
