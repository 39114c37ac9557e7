"""The training loop: sample groups -> roll out (scored as it goes) -> advantages -> update -> log. The algorithm
(train.algorithm: Flow-GRPO or DiffusionNFT, algorithms/) owns its rollout and its update."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from imagerl.data import load_train_test
from imagerl.algorithms import make_algorithm
from imagerl.algorithms.advantages import rollout_advantages
from imagerl.algorithms.base import NonFiniteError
from imagerl.run.best_checkpoint import is_new_best, write_best
from imagerl.run.checkpoint import (check_checkpoint, check_resume_config, load_checkpoint, prune_checkpoints,
                                   resolve_resume, save_checkpoint)
from imagerl.components import load_adapter, make_optimizer, resolve_family_defaults
from imagerl.config import Config, save_config
from imagerl.run.console import format_duration, quiet_library_progress
from imagerl.distributed.fsdp import apply_parallelism, set_deterministic
from imagerl.distributed.parallel import init_world, resolve_device
from imagerl.run.gc_freeze import GCFreeze
from imagerl.run.metrics import (MetricsLogger, PhaseTimer, memory_metrics, plot_reward_curve, progress_bar,
                             read_metrics, require_wandb, save_image_grid)
from imagerl.data.mixture import make_sampler, sample_weights, set_ids, set_metrics, set_weights
from imagerl.perf.memory_estimate import check_memory
from imagerl.rewards import RewardError, Scorer
from imagerl.rewards.registry import check_reward_config
from imagerl.run.lock import hold_run_dir
from imagerl.rewards.scoring import AsyncScorer, ScoredRollout
from imagerl.run.lock import LOCK_FILE, check_fresh_run_dir, check_run_files, clear_run_outputs, continue_command
from imagerl.run.checkpoint import recover_interrupted
from imagerl.validation import validate


def train(cfg: Config, resume: str | None = None, overwrite: bool = False) -> Path:
    """Run cfg.train.num_rollouts rollouts (continuing a checkpoint with `resume`); return the run directory.
    Without `resume` the run directory must be empty or absent (overwrite=True clears imagerl's outputs first)."""
    quiet_library_progress()  # in a log file: no loading bars either
    if cfg.parallel.deterministic:  # before CUDA starts (CUBLAS_WORKSPACE_CONFIG)
        set_deterministic(cfg.run.seed, resolve_device(cfg.model.device))
    world = init_world(cfg.model.device)
    plan = validate(cfg, world.size)  # every config error before anything slow
    if cfg.sample.off_window_fp8:
        from imagerl.families.layers.fp8_linear import check_fp8_device

        check_fp8_device(world.device)
    check_reward_config(cfg.reward)  # names and model paths, before any model loads
    if cfg.run.wandb:
        require_wandb()
    train_set, test_set = load_train_test(cfg.data)
    run_dir = cfg.output_dir
    # every check that can refuse the run reads only and comes before the lock: a refused run (a link among the
    # run's files, a resume that cannot continue, a directory that holds a run or is not imagerl's) changes nothing
    check_run_files(run_dir)
    resume_from, changed, done_before = _resume_point(cfg, resume, run_dir) if resume else (None, [], 0)
    if resume_from is not None and done_before >= cfg.train.num_rollouts:  # nothing to do: say so before loading
        if world.is_main:
            print(f"{run_dir} is complete: {done_before} of train.num_rollouts={cfg.train.num_rollouts} rollouts "
                  f"done ({resume_from}). To train further: --resume {resume} "
                  f"train.num_rollouts={done_before + cfg.train.num_rollouts}")
        return run_dir
    if resume_from is None:
        check_fresh_run_dir(run_dir, overwrite, cfg.to_dict())  # every rank alike
    with hold_run_dir(run_dir, world):  # one writer: a second run into run_dir is refused, naming this one
        if resume_from is not None:
            if world.is_main:  # the run directory is this run's now: finish a checkpoint swap a kill interrupted
                recover_interrupted(run_dir)
            world.barrier()
            if resolve_resume(resume, run_dir) != resume_from:  # recovery renamed it (step_N.tmp -> step_N)
                resume_from, changed, done_before = _resume_point(cfg, resume, run_dir)
            if world.is_main:
                print(f"resuming {run_dir} after rollout {done_before} of {cfg.train.num_rollouts} from {resume_from}"
                      + (f"; changed settings, applied: {', '.join(changed)}" if changed else ""))
        return _train(cfg, world, plan, train_set, test_set, resume_from, overwrite)


def _resume_point(cfg: Config, resume: str, run_dir: Path) -> tuple[Path, list[str], int]:
    """The checkpoint `resume` names, the changed settings it applies and the rollouts it has done. Reads only."""
    resume_from = resolve_resume(resume, run_dir)
    changed = check_resume_config(resume_from, cfg.to_dict())
    return resume_from, changed, check_checkpoint(resume_from)["step"]  # its files, before a model loads


def _train(cfg: Config, world, plan, train_set, test_set, resume_from: Path | None, overwrite: bool) -> Path:
    run_dir = cfg.output_dir
    restart = False
    if resume_from is None and not overwrite:  # every rank raises alike; with overwrite rank 0 alone clears below
        restart = check_fresh_run_dir(run_dir, False, cfg.to_dict())  # True: this run, stopped before a checkpoint
        world.barrier()  # every rank has looked before rank 0 writes anything there
    scorer = Scorer(cfg.reward, world.device, set_weights=set_weights(cfg))  # data.mixture: each set its rewards
    for prompt_set in (train_set, test_set) if test_set is not None else (train_set,):
        scorer.validate_prompts(prompt_set.prompts, prompt_set.metadata)  # e.g. OCR prompts without a quoted target

    if world.is_main and resume_from is None and (overwrite or restart):  # after every config error, before the
        if restart:                                                          # slow part
            replaced = ", ".join(sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE))
            print(f"{run_dir} holds this run, stopped before its first checkpoint: starting it again (replacing "
                  f"{replaced})")
        clear_run_outputs(run_dir)
    if world.is_main and world.device.type == "cpu":
        _warn_if_slow_on_cpu(cfg, world)
    adapter = load_adapter(cfg, world)  # LoRA added, activation checkpointing on
    resolve_family_defaults(cfg, adapter)
    apply_parallelism(adapter, cfg, world)  # compile, shard (FSDP2); before the optimizer sees the params
    check_memory(cfg, adapter, world)  # a run that cannot fit is refused now, not out of memory after compiling
    if world.device.type == "cpu":  # every rank: under FSDP the timed forward gathers weights collectively
        _report_cpu_rollout_time(cfg, adapter, world)
    if world.is_main:  # a resumed run keeps the original config.yaml and records its own beside it
        run_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, run_dir / ("config.yaml" if resume_from is None else f"config.resumed_{resume_from.name}.yaml"))
    optimizer = make_optimizer(adapter.trainable_parameters(), cfg)
    algo = make_algorithm(cfg, adapter)
    scoring = AsyncScorer(scorer, enabled=cfg.reward.async_scoring)
    sampler = make_sampler(cfg, train_set, world)
    # the optimizer keeps this run's lr, betas, eps and weight decay (load_trainer_state)
    start = load_checkpoint(resume_from, adapter, optimizer, world, algo.checkpoint_state()) if resume_from else 0
    save = _saver(cfg, adapter, optimizer, algo, run_dir, world)
    logger = MetricsLogger(run_dir, world.is_main, cfg.run.tensorboard, wandb=cfg.run.wandb, config=cfg)
    rewards = [k for k in logger.CONSOLE_KEYS if not k.startswith(("train/", "time/"))]
    logger.CONSOLE_KEYS = (*rewards, *algo.console_metrics(cfg), "time/total_s")  # what moves for this algorithm
    logger.truncate_after(start)
    timer = PhaseTimer(world.device)
    maybe_eval = _evaluator(cfg, adapter, algo, save, scorer, test_set, world, run_dir, timer)
    if start == 0 and cfg.eval.before_training:
        logger.log(0, {**maybe_eval(0, force=True), **timer.pop_metrics()})
    monitor = _drift_monitor(cfg, run_dir, start, world)
    bar = progress_bar(cfg.train.num_rollouts, "rollouts", world.is_main, unit="rollout", initial=start)
    loop_start = time.perf_counter()

    with GCFreeze(cfg.run.gc_freeze) as gc_freeze:  # one collection + gc.freeze() after the first rollout
        for step in range(start, cfg.train.num_rollouts):
            groups = sampler.groups_for(step)
            with timer("rollout"), progress_bar(plan.samples_per_rank, "  sample", world.is_main, "img", False) as pb:
                rollout = algo.generate(adapter, groups, step, progress=pb, on_batch=scoring.submit)
            with timer("reward"):
                scored = scoring.collect()
                rewards = scored.rewards
                per_reward = cfg.train.advantage == "per_reward"  # GDPO: each reward normalised on its own
                advantages, reward_metrics = rollout_advantages(
                    rewards.total_B, rewards.valid_B, rollout.group_ids_B, world, cfg.train.global_std,
                    rewards.components if per_reward else None,
                    sample_weights(rollout.metadata_B, cfg.reward.weights, set_weights(cfg)) if per_reward else None,
                    set_ids(rollout.metadata_B, [m.name for m in cfg.data.mixture]))  # each set on its own
                failed = reward_metrics["rollout/reward/failed_count"]
                _check_rewards(scored, failed, cfg, run_dir, step, save)
                if failed and world.is_main:  # reward.on_error=skip
                    bar.write(f"imagerl: warning: rollout {step + 1}: the rewards of {failed} of "
                              f"{plan.samples_per_rank * world.size} samples failed and are skipped"
                              + (f": {_reasons(scored)}" if scored.errors else ""))
            stats = None
            if failed < plan.samples_per_rank * world.size:  # every sample failed: no optimizer step moves the weights
                with timer("train"), progress_bar(algo.forwards_per_update(plan.batches_per_rank), "  train",
                                                  world.is_main, "fwd", False) as pb:
                    try:
                        stats = algo.update(adapter, rollout, advantages, optimizer, world, step, progress=pb)
                    except NonFiniteError as e:  # raised before the optimizer step: the weights are the last good
                        raise NonFiniteError(f"rollout {step + 1}: {e}; nothing was saved after the last checkpoint "
                                             f"({cfg.output_dir / 'checkpoints'})") from e

            done = step + 1
            metrics = {**reward_metrics, **_component_means(rewards, world), **algo.rollout_metrics(rollout),
                       **set_metrics("rollout", [m.name for m in cfg.data.mixture], rollout.metadata_B,
                                     rewards.total_B, rewards.valid_B, rewards.components, world),
                       "time/reward_compute_s": scored.compute_s, **(stats.as_metrics() if stats else {})}
            drifted = monitor(done, rollout.images_B3HW, metrics, bar.write) if monitor else False
            metrics.update(maybe_eval(done))
            gc_freeze.after_iteration(timer)
            metrics.update({**timer.pop_metrics(), **memory_metrics(world.device)})
            iteration_s = metrics["time/total_s"] - metrics.get("time/eval_s", 0.0)
            metrics["perf/images_per_s"] = plan.samples_per_rank * world.size / iteration_s
            eta = (time.perf_counter() - loop_start) / (done - start) * (cfg.train.num_rollouts - done)
            logger.log(done, metrics, echo=lambda line: bar.write(
                f"{line}  [{done}/{cfg.train.num_rollouts}, eta {format_duration(eta)}]"))
            bar.set_postfix(reward=f"{metrics['rollout/reward/raw_mean']:.4g}")
            bar.update(1)
            if world.is_main and cfg.run.image_grid_every and (done % cfg.run.image_grid_every == 0 or done == 1):
                save_image_grid(rollout.images_B3HW[:16], rewards.total_B[:16],
                                run_dir / "images" / f"rollout_{done:06d}.png", captions=rollout.prompts_B[:16])
                plot_reward_curve(run_dir)
            best = _is_new_best(cfg, run_dir, metrics, world)  # run.keep_best
            if done % cfg.run.checkpoint_every == 0 or done == cfg.train.num_rollouts or drifted or best:
                path = save(done, cfg.run.keep_checkpoints)
            if best and world.is_main:  # after the checkpoint is complete; then the previous best may go
                write_best(run_dir, cfg.run.keep_best, cfg.run.keep_best_mode, metrics[cfg.run.keep_best], done)
                prune_checkpoints(run_dir, cfg.run.keep_checkpoints)
            if drifted:  # monitor.stop_on_drift
                raise DriftStop(f"rollout {done}: a drift monitor passed monitor.max_drift={cfg.monitor.max_drift:g} "
                                f"(the warning above) and monitor.stop_on_drift is on; the state is saved in {path}. "
                                f"Look at {run_dir / 'images'}; continue with `{continue_command(run_dir)} "
                                "monitor.stop_on_drift=false` if the change is wanted")

    bar.close()
    scoring.close()
    logger.close()
    if world.is_main and (run_dir / "metrics.jsonl").is_file():
        plot_reward_curve(run_dir)
    return run_dir


def _warn_if_slow_on_cpu(cfg: Config, world) -> None:
    """A GPU recipe started on a CPU: say how long one rollout would take before the model loads."""
    import sys

    from imagerl.components import resolve_model_path
    from imagerl.run.cpu_estimate import cpu_rollout_warning
    from imagerl.families.registry import family_class

    try:
        path = resolve_model_path(cfg.model.path, world)
        family = family_class(path, cfg.model.family)
    except ValueError:
        return  # load_adapter reports it
    warning = cpu_rollout_warning(cfg, path, family.name)
    if warning:
        print(f"imagerl: warning: {warning}", file=sys.stderr)


def _is_new_best(cfg: Config, run_dir: Path, metrics: dict, world) -> bool:
    """run.keep_best: this rollout's evaluation beats the recorded best (the same answer on every rank)."""
    import math

    value = metrics.get(cfg.run.keep_best) if cfg.run.keep_best else None
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    flag = torch.tensor([float(world.is_main and is_new_best(run_dir, cfg.run.keep_best, cfg.run.keep_best_mode,
                                                              value))], device=world.device)
    return bool(world.all_reduce_mean_(flag).item() > 0)  # rank 0 decides (it reads best.json)


class DriftStop(ValueError):
    """monitor.stop_on_drift stopped the run (a one-line error; the state is saved)."""


def _drift_monitor(cfg: Config, run_dir: Path, start: int, world):
    """monitor(done, images, metrics, write) -> stop?, adding monitor/* to metrics (this rank's images) and writing
    warnings on rank 0; None when monitor.enabled is off. A resumed run takes its reference (rollout 1's means and
    spreads) from metrics.jsonl."""
    from imagerl.run.monitors import MONITORS, DriftMonitor

    if not cfg.monitor.enabled:
        return None
    m = cfg.monitor
    monitor = DriftMonitor(m.max_drift, m.warn_every, m.stop_on_drift)
    if start > 0 and (run_dir / "metrics.jsonl").is_file():
        records = read_metrics(run_dir)
        first = next((r for r in records if r.get("step") == 1 and "monitor/saturation" in r), None)
        keys = [f"monitor/{n}{s}" for n in MONITORS for s in ("", "_std")]
        if first is not None and not all(type(first.get(k)) in (int, float) for k in keys):
            import warnings

            warnings.warn(f"{run_dir / 'metrics.jsonl'}: rollout 1's record lacks some drift-monitor values; the drift "
                          f"monitors measure from rollout {start + 1} instead", stacklevel=2)
            first = None
        if first is not None:
            monitor.load_state({"reference": {n: (first[f"monitor/{n}"], first[f"monitor/{n}_std"]) for n in MONITORS}})
            for r in records:  # replay the warning schedule, so a resumed run warns as an
                if 0 < r.get("step", 0) <= start:  # uninterrupted one would
                    for n in MONITORS:
                        drift = r.get(f"monitor/{n}_drift")
                        if isinstance(drift, (int, float)):
                            monitor.warns(n, r["step"], drift)

    def observe(done: int, images, metrics: dict, write) -> bool:
        values, warnings, stop = monitor.observe(done, images)
        metrics.update(values)
        if world.is_main:
            for line in warnings:
                write(f"imagerl: warning: {line}")
        # each rank watches its own images: stop when any rank's monitor says so, every rank alike (the save is
        # collective, so ranks deciding apart would wait on each other)
        flag = torch.tensor([float(stop)], device=world.device)
        return bool(world.all_reduce_mean_(flag).item() > 0)

    return observe


def _report_cpu_rollout_time(cfg: Config, adapter, world) -> None:
    """On a CPU: one rollout's time, measured on the loaded model; a warning when it is a GPU-sized run. Every rank
    measures (the same forward), rank 0 prints."""
    import sys

    from imagerl.run.cpu_estimate import measured_rollout_message

    line, slow = measured_rollout_message(adapter, cfg, world.size)
    if world.is_main:
        print(f"imagerl: warning: {line}" if slow else line, file=sys.stderr if slow else sys.stdout, flush=True)


def _saver(cfg: Config, adapter, optimizer, algo, run_dir: Path, world):
    """save(step, keep) -> checkpoint path (every rank): lora/ holds the weights the algorithm evaluates with."""

    def save(step: int, keep: int) -> Path:
        with algo.evaluation_weights():  # cloned: on a CPU the state's tensors are the parameters themselves
            lora = {k: v.clone() for k, v in adapter.lora_state_dict().items()}  # a collective under FSDP
        return save_checkpoint(run_dir, step, adapter, optimizer, cfg.to_dict(), keep, world, lora_state=lora,
                               extra=algo.checkpoint_state())

    return save


def _evaluator(cfg: Config, adapter, algo, save, scorer, test_set, world, run_dir: Path, timer):
    """maybe_eval(done, force=False) -> eval metrics every eval.interval rollouts and after the last one.
    A failing eval reward saves the state after rollout `done` first, so the update is not lost."""

    from imagerl.evaluation.suites.run import TrainingSuites

    suites = TrainingSuites(cfg, world, test_set) if cfg.eval.suites else None

    def maybe_eval(done: int, force: bool = False) -> dict[str, float]:
        due = cfg.eval.interval and (done % cfg.eval.interval == 0 or done == cfg.train.num_rollouts)
        if (test_set is None and suites is None) or not (force or due):
            return {}
        from imagerl.run.console import interactive
        from imagerl.evaluation.held_out import eval_settings, evaluate

        if world.is_main and not interactive():  # a log has no bar: say what the next minutes are spent on
            held_out = _held_out_count(eval_settings(cfg, adapter, test_set).num_prompts,
                                       cfg.data.test_samples_per_prompt) if test_set is not None else ""
            print(f"evaluating after rollout {done}: " + ", ".join(
                filter(None, [held_out, *(f"suite {n}" + (" (on those images)" if n in suites.on_held_out else "")
                                          for n in cfg.eval.suites)])), flush=True)
        try:
            with timer("eval"), algo.evaluation_weights():
                metrics = {} if test_set is None else evaluate(adapter, scorer, test_set, cfg, world, done,
                                                               run_dir=run_dir if world.is_main else None,
                                                               suites=suites)
                return {**metrics, **(suites(adapter, done, run_dir) if suites else {})}
        except RewardError as e:
            advice = "; once fixed, run the same command again (no checkpoint exists yet)"
            if done > 0:  # every rank gets here (the eval reward error is raised on all ranks)
                path = save(done, cfg.run.keep_checkpoints + 1)
                advice = (f"; the state after rollout {done} is saved in {path}; continue with "
                          f"`{continue_command(run_dir)}`")
            raise RewardError(f"evaluation after rollout {done}: {e}{advice}") from e

    return maybe_eval


def _held_out_count(images: int, per_prompt: int) -> str:
    """"500 held-out images (125 prompts x 4)": the test set repeats each prompt data.test_samples_per_prompt times."""
    if per_prompt > 1 and images % per_prompt == 0:
        prompts = images // per_prompt
        return f"{images} held-out images ({prompts} prompt{'s' if prompts != 1 else ''} x {per_prompt})"
    return f"{images} held-out images" if per_prompt > 1 else f"{images} held-out prompts"


def _component_means(rewards, world) -> dict[str, float]:
    """Mean raw value of each reward component over the samples it scored (all ranks)."""
    out = {}
    for name, values in rewards.components.items():
        ok = torch.isfinite(values)
        sums = torch.tensor([values[ok].sum().item(), ok.sum().item()], dtype=torch.float64, device=world.device)
        total, count = world.all_reduce_mean_(sums).tolist()
        out[f"rollout/reward/{name}_mean"] = total / count if count else float("nan")
    return out


def _reasons(scored: ScoredRollout) -> str:
    """The failed batches' messages, each once: 'reward server X: cannot be reached (...) (8 batches)'."""
    counts = {message: scored.errors.count(message) for message in scored.errors}
    return "; ".join(m + (f" ({n} batches)" if n > 1 else "") for m, n in counts.items())


def _which(scored: ScoredRollout, bad: list[int], cfg: Config) -> str:
    """' (from shapes, served by http://...)': the components that were not finite for those samples."""
    if cfg.data.mixture:  # there a component is NaN wherever its set does not use it: no telling
        return ""
    names = [name for name, values in scored.rewards.components.items() if not torch.isfinite(values[bad]).all()]
    where = [f"{n}, served by {cfg.reward.remote[n]}" if n in cfg.reward.remote else n for n in names]
    return f" (from {'; '.join(where)})" if where else ""


def _check_rewards(scored: ScoredRollout, failed_count: int, cfg: Config, run_dir: Path, step: int, save) -> None:
    """Stop on a failed or non-finite reward (any rank: failed_count is global, so all ranks stop together)
    unless reward.on_error=skip; the state before this rollout is saved so nothing is lost."""
    if cfg.reward.on_error == "skip" or not failed_count:
        return
    bad = (~scored.rewards.valid_B).nonzero().flatten().tolist()
    reason = _reasons(scored) or (f"rewards are NaN/inf for samples {bad[:8]}{_which(scored, bad, cfg)}"
                                  if bad else f"{failed_count} rewards failed on other ranks")
    advice = "Fix the reward, then run the same command again (no checkpoint exists yet)"
    if step > 0:  # every rank gets here: failed_count is global
        path = save(step, cfg.run.keep_checkpoints + 1)
        advice = (f"The state after rollout {step} is saved in {path}; fix the reward, then continue with "
                  f"`{continue_command(run_dir)}`")
    raise RewardError(f"rollout {step + 1}: {reason} (reward.on_error=error; reward.on_error=skip drops such "
                      f"samples). {advice}")
