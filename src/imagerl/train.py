"""The Flow-GRPO training loop: sample groups -> roll out -> score -> advantages -> update -> log."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from imagerl.algorithms.advantages import rollout_advantages
from imagerl.algorithms.flow_grpo import flow_grpo_update
from imagerl.checkpoint import load_checkpoint, resolve_resume, save_checkpoint
from imagerl.components import load_adapter, make_optimizer, resolve_family_defaults
from imagerl.config import Config, save_config, validate
from imagerl.data import GroupSampler, bundled_prompt_file, load_prompt_set
from imagerl.distributed.parallel import init_world
from imagerl.metrics import MetricsLogger, PhaseTimer, memory_metrics, plot_reward_curve, progress_bar, save_image_grid
from imagerl.rewards import RewardError, Scorer
from imagerl.rewards.registry import check_reward_names
from imagerl.rollout import generate
from imagerl.sampling import sde_window


def train(cfg: Config, resume: str | None = None) -> Path:
    """Run cfg.train.num_rollouts rollouts (continuing a checkpoint with `resume`); return the run directory."""
    world = init_world(cfg.model.device)
    plan = validate(cfg, world.size)  # every config error before anything slow
    check_reward_names(cfg.reward.weights)
    prompts = load_prompt_set(bundled_prompt_file() if cfg.data.train_prompts == "bundled" else cfg.data.train_prompts)
    run_dir = cfg.output_dir
    resume_from = resolve_resume(resume, run_dir) if resume else None
    adapter = load_adapter(cfg, world)
    resolve_family_defaults(cfg, adapter)
    if world.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / "config.yaml")
    optimizer = make_optimizer(adapter.trainable_parameters(), cfg)
    scorer = Scorer(cfg.reward.weights, world.device)
    sampler = GroupSampler(prompts, cfg.sample.prompts_per_rollout, cfg.run.seed, world.rank, world.size)
    start = load_checkpoint(resume_from, adapter, optimizer) if resume_from else 0
    logger = MetricsLogger(run_dir, world.is_main, cfg.run.tensorboard)
    logger.truncate_after(start)
    timer = PhaseTimer(world.device)
    bar = progress_bar(cfg.train.num_rollouts, "rollouts", world.is_main, unit="rollout")
    bar.update(start)
    window_steps = cfg.sample.num_sde_steps * plan.batches_per_rank

    for step in range(start, cfg.train.num_rollouts):
        groups = sampler.groups_for(step)
        window = sde_window(cfg.sample.num_sde_steps, tuple(cfg.sample.sde_window_range),
                            cfg.sample.sde_window_start, seed=cfg.run.seed, rollout_step=step)
        with timer("rollout"), progress_bar(plan.samples_per_rank, "  sample", world.is_main, "img", False) as pb:
            rollout = generate(adapter, groups, cfg, step, window, progress=pb)
        with timer("reward"):
            try:
                rewards = scorer.score(rollout.images_B3HW, rollout.prompts_B, rollout.metadata_B)
            except RewardError as e:
                _stop_on_reward_error(e, run_dir, step, adapter, optimizer, cfg, world)
            if cfg.reward.on_error == "error" and not bool(rewards.valid_B.all()):
                bad = (~rewards.valid_B).nonzero().flatten().tolist()
                _stop_on_reward_error(RewardError(f"rewards are NaN/inf for samples {bad[:8]} (reward.on_error=error; "
                                                  "set reward.on_error=skip to skip such samples)"),
                                      run_dir, step, adapter, optimizer, cfg, world)
            advantages, reward_metrics = rollout_advantages(rewards.total_B, rewards.valid_B, rollout.group_ids_B,
                                                            world, cfg.train.global_std)
        with timer("train"), progress_bar(window_steps, "  train", world.is_main, "fwd", False) as pb:
            stats = flow_grpo_update(adapter, rollout, advantages, optimizer, cfg, world, progress=pb)

        done = step + 1
        metrics = {**reward_metrics, **{f"rollout/reward/{k}_mean": world.all_reduce_mean_(v.mean().to(world.device)).item()
                                        for k, v in rewards.components.items()},
                   "rollout/sde_window_start": window.start, **stats.as_metrics(), **timer.pop_metrics(),
                   **memory_metrics(world.device)}
        metrics["perf/images_per_s"] = plan.samples_per_rank / metrics["time/total_s"] * world.size
        logger.log(done, metrics, echo=bar.write)
        bar.set_postfix(reward=f"{metrics['rollout/reward/raw_mean']:.4g}")
        bar.update(1)
        if world.is_main and cfg.run.image_grid_every and (done % cfg.run.image_grid_every == 0 or done == 1):
            save_image_grid(rollout.images_B3HW[:16], rewards.total_B[:16], run_dir / "images" / f"rollout_{done:06d}.png")
        if done % cfg.run.checkpoint_every == 0 or done == cfg.train.num_rollouts:
            if world.is_main:
                save_checkpoint(run_dir, done, adapter, optimizer, cfg.to_dict(), cfg.run.keep_checkpoints)
            world.barrier()

    bar.close()
    logger.close()
    if world.is_main and (run_dir / "metrics.jsonl").is_file():
        plot_reward_curve(run_dir)
    return run_dir


def _stop_on_reward_error(error: RewardError, run_dir: Path, step: int, adapter, optimizer, cfg: Config, world):
    """Save the state before this rollout (nothing is lost), then stop with what to do next."""
    where = ""
    if world.is_main and step > 0:
        where = f"; state after rollout {step} saved to {save_checkpoint(run_dir, step, adapter, optimizer, cfg.to_dict(), cfg.run.keep_checkpoints + 1)}"
    raise RewardError(f"rollout {step + 1}: {error}{where}. Fix the reward, then continue with "
                      f"`imagerl train --recipe {cfg.recipe} --resume {run_dir}`") from error


def load_run_config(run_dir: Path) -> dict:
    return json.loads((run_dir / "config.json").read_text())
