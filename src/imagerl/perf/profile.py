"""torch.profiler over one rollout forward and one training step of a bench configuration (imagerl bench
--profile): GPU kernel time by operator against the wall time."""

from __future__ import annotations

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from imagerl.components import prepare_adapter, resolve_family_defaults
from imagerl.distributed.fsdp import apply_parallelism
from imagerl.distributed.parallel import World
from imagerl.metrics import PhaseTimer
from imagerl.rollout import _training_graph, batch_conditioning


KERNEL_KINDS = (("attention", ("flash", "fmha", "sdpa", "attention")),
                ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "addmm", "aten::mm", "aten::bmm", "matmul")),
                ("fused (Triton)", ("triton",)), ("copy / cast", ("copy",)))


def kernel_kind(name: str) -> str:
    """A kernel's (or operator's) kind by its name: matmul, attention, fused Triton, copy/cast, other."""
    lower = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lower for m in marks)), "other elementwise")


def profile_step(bench, overrides: list[str], rows: int = 12) -> str:
    """torch.profiler over one rollout forward (no grad) and one training forward + backward of one batch of
    this config: GPU kernel time by operator, against the wall time (where the time goes). With
    parallel.compile the blocks are compiled (in the warm-up calls) and the rollout forward runs as the
    rollout runs it: as a training graph's forward."""
    cfg = bench.config(overrides)
    adapter = prepare_adapter(bench.new_adapter(), cfg)
    resolve_family_defaults(cfg, adapter)
    apply_parallelism(adapter, cfg, World(0, 1, bench.device))
    s, n = cfg.sample, cfg.sample.batch_size
    text = adapter.encode_prompts([bench.prompts[0]] * n, s.max_sequence_length)
    # the negative prompt only where the guidance uses one (none for FLUX.1's distilled guidance), as the rollout
    cond = batch_conditioning(adapter, text, adapter.encode_negative(s.negative_prompt, s.guidance_scale,
                                                                     s.max_sequence_length), s.guidance_scale)
    x = adapter.initial_noise([torch.Generator().manual_seed(i) for i in range(n)], s.height, s.width)
    t = torch.full((n,), 500.0, device=bench.device)
    cuda = bench.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    timer, report = PhaseTimer(bench.device), []
    for phase, grad in (("rollout forward", False), ("training forward+backward", True)):
        def step():
            if grad:  # train mode and grad on, as flow_grpo_update
                with _training_graph(adapter, True):
                    adapter.velocity(x, t, cond, s.height, s.width).square().mean().backward()
            else:
                with torch.no_grad(), _training_graph(adapter, cfg.parallel.compile):
                    adapter.velocity(x, t, cond, s.height, s.width).detach()
        with timer("warm-up"):  # compile, allocator, kernels; synchronised, so none of it reaches the profile
            step()
            step()
        with profile(activities=activities) as prof, timer("wall"):  # the timer synchronises inside the profile
            step()
        wall = timer.pop_metrics()["time/wall_s"]
        if cuda:  # the kernels themselves (compiled blocks launch Triton kernels, not aten operators)
            key = "self_device_time_total"
            events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA and getattr(e, key) > 0]
        else:  # operators (their self time), not their children as well, which would count time twice
            key = "self_cpu_time_total"
            events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
        events.sort(key=lambda e: getattr(e, key), reverse=True)
        busy = sum(getattr(e, key) for e in events) / 1e6
        by_kind: dict[str, float] = {}
        for e in events:
            by_kind[kernel_kind(e.key)] = by_kind.get(kernel_kind(e.key), 0.0) + getattr(e, key) / 1e6
        report.append(f"{phase} ({' '.join(overrides) or 'defaults'}; batch {n}): wall {wall:.3f} s, kernels "
                      f"{busy:.3f} s ({1 - busy / wall:.0%} idle); "
                      + ", ".join(f"{k} {v / max(busy, 1e-9):.0%}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
        report += [f"  {getattr(e, key) / 1e6 / max(busy, 1e-9):6.1%} {getattr(e, key) / 1e3:9.1f} ms  x{e.count:<6} "
                   f"{e.key[:90]}" for e in events[:rows]]
    bench.restore(adapter)
    return "\n".join(report)

