"""torch.profiler over one rollout forward and one training step of a bench configuration (imagerl bench
--profile): GPU kernel time by operator against the wall time."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from imagerl.components import prepare_adapter, resolve_family_defaults
from imagerl.metrics import PhaseTimer


def profile_step(bench, overrides: list[str], rows: int = 12) -> str:
    """torch.profiler over one rollout forward (no grad) and one training forward + backward of one batch of
    this config: GPU kernel time by operator, against the wall time (where the time goes)."""
    cfg = bench.config(overrides)
    adapter = prepare_adapter(bench.new_adapter(), cfg)
    resolve_family_defaults(cfg, adapter)
    s, n = cfg.sample, cfg.sample.batch_size
    text = adapter.encode_prompts([bench.prompts[0]] * n)
    negative = adapter.encode_prompts([s.negative_prompt])[0]
    cond = adapter.conditioning(text, [negative] * n, s.guidance_scale)
    x = adapter.initial_noise([torch.Generator().manual_seed(i) for i in range(n)], s.height, s.width)
    t = torch.full((n,), 500.0, device=bench.device)
    cuda = bench.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    timer, report = PhaseTimer(bench.device), []
    for phase, grad in (("rollout forward", False), ("training forward+backward", True)):
        def step():
            with torch.set_grad_enabled(grad):
                v = adapter.velocity(x, t, cond, s.height, s.width)
                if grad:
                    v.square().mean().backward()
        with timer("warm-up"):  # allocator, kernels; synchronised, so none of it reaches the profile
            step()
        with profile(activities=activities) as prof, timer("wall"):  # the timer synchronises inside the profile
            step()
        wall = timer.pop_metrics()["time/wall_s"]
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        # operators only (their self device time is the time of the kernels they launched), not the kernel
        # rows as well, which would count the same time twice
        events = sorted((e for e in prof.key_averages() if e.key.startswith("aten::")),
                        key=lambda e: getattr(e, key), reverse=True)
        busy = sum(getattr(e, key) for e in events) / 1e6
        report.append(f"{phase} ({' '.join(overrides) or 'defaults'}; batch {n}): wall {wall:.3f} s, kernels "
                      f"{busy:.3f} s")
        report += [f"  {getattr(e, key) / 1e6 / max(busy, 1e-9):6.1%} {getattr(e, key) / 1e3:9.1f} ms  x{e.count:<6} "
                   f"{e.key[:90]}" for e in events[:rows]]
    bench.restore(adapter)
    return "\n".join(report)

