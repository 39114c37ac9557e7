"""Before a model loads on a CPU: how long one rollout would take there, so that a GPU recipe started without a
GPU says so (in hours or days) instead of running silently for them.

Before loading: the transformer's FLOPs (perf/flops.py's formulas for the Qwen families, torch's FLOP counter on the
meta device for sd3 and flux; from transformer/config.json) for one rollout and
its update, over the float32 matmul rate this CPU reaches (measured: a 512^3 matmul, ~50 ms). Text counted as 64
tokens; text encoder, VAE and rewards not counted, so it is a lower bound: it catches the released models (days).
After loading (`measured_rollout_seconds`): one transformer forward and one VAE decode of a rollout batch, timed on
this CPU and scaled to the rollout. Small models spend their time outside the matmuls the FLOP count sees (the tiny
model at a GPU recipe's 512 px and 512 images: minutes per rollout, which the FLOP bound put far below the warning).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

WARN_ABOVE_S = 600.0  # a rollout longer than this on a CPU is worth a warning
WARN_RUN_ABOVE_S = 2 * 3600.0  # and so is a run longer than this (the quickstart: 5 minutes)
TEXT_TOKENS = 64


def rollout_flops(cfg, family_name: str, transformer_config: dict) -> int:
    """FLOPs of one rollout (every step, x2 rows with CFG > 1) and its update (3 forwards per trained step)."""
    from imagerl.perf import flops

    from imagerl.perf.bench import MODULE_FAMILIES, family_module

    s = cfg.sample
    image_tokens = (s.height // 16) * (s.width // 16)  # every family: 16 px per token (8x VAE + 2x2 patch, 16x VAE)
    if family_name in MODULE_FAMILIES:  # sd3, flux: counted on the meta device (perf/counted_flops.py)
        from types import SimpleNamespace

        from diffusers.configuration_utils import FrozenDict

        transformer = SimpleNamespace(config=FrozenDict(transformer_config))
        forward = family_module(family_name).forward_flops(transformer, image_tokens, [TEXT_TOKENS], 0, ())
    elif family_name == "qwen_image21":
        forward = flops.qwen_image21_forward_flops(flops.QwenImage21Dims.from_config(transformer_config),
                                                   image_tokens, TEXT_TOKENS)
    else:
        forward = flops.qwen_image_forward_flops(flops.QwenImageDims.from_config(transformer_config),
                                                 image_tokens, TEXT_TOKENS)
    from imagerl.families.registry import FAMILIES, _import_builtin

    _import_builtin()
    rows = FAMILIES[family_name].cfg_rows(s.guidance_scale)  # flux: one row (its guidance is an input)
    trained = _trained_steps(cfg)
    samples = s.prompts_per_rollout * s.group_size
    return samples * rows * forward * (s.num_steps + 3 * trained)


def cpu_rollout_warning(cfg, path: Path, family_name: str) -> str | None:
    """A one-line warning when one rollout of `cfg` on this CPU would take over WARN_ABOVE_S, else None."""
    from imagerl.perf.flops import measure_matmul_flops_per_s

    config_file = Path(path) / "transformer" / "config.json"
    try:
        transformer_config = json.loads(config_file.read_text())
        work = rollout_flops(cfg, family_name, transformer_config)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # the loader reports a broken checkpoint with its own message
    rate = measure_matmul_flops_per_s(torch.device("cpu"), torch.float32, size=512, iterations=3)
    seconds = work / rate
    if seconds <= WARN_ABOVE_S:
        return None
    hours = seconds / 3600
    when = f"{hours / 24:.0f} days" if hours >= 48 else f"{hours:.1f} hours" if hours >= 1 else f"{seconds / 60:.0f} minutes"
    return (f"model.device is a CPU: one rollout of {cfg.sample.prompts_per_rollout * cfg.sample.group_size} images "
            f"at {cfg.sample.height}x{cfg.sample.width} px would take at least {when} here ({work / 1e15:.3g} PFLOP at "
            f"the {rate / 1e9:.0f} GFLOP/s this CPU measured); this recipe is meant for a GPU (model.device=cuda), "
            f"or try the CPU quickstart: imagerl train")


def _trained_steps(cfg) -> int:
    """Timesteps trained per image: DiffusionNFT's first floor(T x nft.timestep_fraction) of the grid (the
    quickstart: 4 of 10; counting all 10 put its estimate at twice the run), Flow-GRPO's SDE window."""
    from imagerl.algorithms.registry import algorithm_class

    return algorithm_class(cfg.train.algorithm).trained_steps(cfg)


def measured_rollout_seconds(adapter, cfg, ranks: int = 1) -> float:
    """One rollout's time on this device, from timed pieces: a transformer forward of a rollout batch (after one
    warm-up) per denoising step plus 3 per trained step (forward and backward), and a VAE decode, per batch."""
    import time

    from imagerl.rollout import batch_conditioning
    from imagerl.sampling import flow_timesteps

    s = cfg.sample
    batch = max(1, min(s.batch_size, s.prompts_per_rollout * s.group_size))
    text = adapter.encode_prompts(["a photo"] * batch, s.max_sequence_length)
    negative = adapter.encode_negative(s.negative_prompt, s.guidance_scale, s.max_sequence_length)
    cond = batch_conditioning(adapter, text, negative, s.guidance_scale)
    x = torch.cat([adapter.initial_noise([torch.Generator().manual_seed(i)], s.height, s.width) for i in range(batch)])
    x = x.to(adapter.device, torch.float32)
    t = flow_timesteps(adapter.sigmas(s.num_steps, s.height, s.width), adapter.scheduler_config)[:1].expand(batch)
    with torch.no_grad():
        adapter.velocity(x, t, cond, s.height, s.width)
        start = time.perf_counter()
        adapter.velocity(x, t, cond, s.height, s.width)
        forward = time.perf_counter() - start
        start = time.perf_counter()
        adapter.decode(x, s.height, s.width)
        decode = time.perf_counter() - start
    trained = _trained_steps(cfg)
    batches = s.prompts_per_rollout * s.group_size / ranks / batch  # each rank samples its share
    return batches * (forward * (s.num_steps + 3 * trained) + decode)


def measured_rollout_message(adapter, cfg, ranks: int = 1) -> tuple[str, bool]:
    """(the line to print, whether it is a warning) for one rollout measured on this CPU (`ranks` processes)."""
    note = busy_cpus_note()  # counted before this process's own threads are timed
    seconds = measured_rollout_seconds(adapter, cfg, ranks)
    images = cfg.sample.prompts_per_rollout * cfg.sample.group_size
    total = seconds * cfg.train.num_rollouts
    line = (f"one rollout of {images} images at {cfg.sample.height}x{cfg.sample.width} px takes "
            f"{_duration(seconds)} on this CPU ({cfg.train.num_rollouts} rollout{'s' if cfg.train.num_rollouts != 1 else ''}: "
            f"{_duration(total)}; timed "
            "from a forward and a decode, rewards and evaluation not counted)")
    line += note
    if seconds <= WARN_ABOVE_S and total <= WARN_RUN_ABOVE_S:
        return line, False
    return line + "; this recipe is meant for a GPU (model.device=cuda), or try the CPU quickstart: imagerl train", True


def busy_cpus_note(others: float | None = None, cores: int | None = None) -> str:
    """"; other processes keep ..." when other processes' runnable threads fill 3/4 of the cores or more, else "".
    Counted now (the median of 5 reads of /proc/loadavg's runnable count, 50 ms apart, less this thread), not the
    load average, which still holds a command that has just finished. Beside one 2-thread torch process on 2 cores,
    `imagerl eval` of the quickstart took 85.6 s instead of 14.7 with libgomp's spinning threads, 27.1 s with
    OMP_WAIT_POLICY=PASSIVE (imagerl's default) and 23.2 s with OMP_NUM_THREADS=1; 6 quickstart rollouts 108 / 86 /
    101 s instead of 42 (benchmarks/LOG.md, "CPUs shared with other work")."""
    import os

    if others is None:
        others = _runnable_others()
        if others is None:  # no /proc (not Linux)
            return ""
    if cores is None:  # the cores this process may use (a container's or taskset's limit), else all
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if others < 0.75 * cores:
        return ""
    return (f"; other processes keep these {cores} cores busy ({others:g} threads running besides imagerl): expect it "
            "to take about twice as long as on an idle machine or more; OMP_NUM_THREADS=1 can help when they use "
            "every core")


def _runnable_others(reads: int = 5, interval_s: float = 0.05) -> float | None:
    import statistics
    import time

    counts = []
    try:
        for i in range(reads):
            with open("/proc/loadavg") as f:  # "0.52 0.58 0.59 3/250 12345": 3 runnable now, this reader included
                counts.append(int(f.read().split()[3].split("/")[0]) - 1)
            if i + 1 < reads:
                time.sleep(interval_s)
    except (OSError, IndexError, ValueError):
        return None
    return statistics.median(counts)


def _duration(seconds: float) -> str:
    hours = seconds / 3600
    if hours >= 48:
        return f"about {hours / 24:.0f} days"
    if hours >= 1:
        return f"about {hours:.1f} hours"
    if seconds < 1:
        return "under a second"
    return f"about {seconds / 60:.0f} minutes" if seconds >= 90 else f"about {seconds:.0f} s"
