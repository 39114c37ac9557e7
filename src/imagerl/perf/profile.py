"""torch.profiler over one rollout forward and one training step of a bench configuration (imagerl bench
--profile): GPU kernel time by operator against the wall time.

Per phase it reports the wall time, the kernels' busy time and the GPU's idle share, the model FLOPs of the step
over the wall time (its MFU where the bench's ceiling is known) and over the matmul kernels' time, the kernel time
by kind, the attention kernels by name (which SDPA backend ran), the host syncs (CPU-side synchronising CUDA calls
and scalar reads of CUDA tensors; reads of CPU scalars apart) and the graphs Dynamo compiled while the step ran (a
recompile in the steady state shows here). With sample.merge_lora a third phase profiles the rollout's off-window
forward as the rollout runs it: on the merged (sample.off_window_fp8: e4m3) weights, under no grad."""

from __future__ import annotations

import contextlib

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from imagerl.components import prepare_adapter, resolve_family_defaults
from imagerl.distributed.fsdp import apply_parallelism
from imagerl.distributed.parallel import World
from imagerl.run.metrics import PhaseTimer
from imagerl.rollout import _training_graph, batch_conditioning
from imagerl.config import training_batch_size


KERNEL_KINDS = (("attention", ("flash", "fmha", "sdpa", "attention")),
                ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "addmm", "aten::mm", "aten::bmm", "matmul")),
                ("fused (Triton)", ("triton",)), ("copy / cast", ("copy",)))
# CUDA runtime calls that block the host until the device is done: the synchronisations and the synchronous copy
# (CUPTI's names; a per-thread default stream's variant carries a suffix, "cudaStreamSynchronize_ptsz")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
# scalar reads: of a CUDA tensor a copy to the host and a cudaStreamSynchronize (a host sync); of a CPU tensor no
# device work at all (a compiled block's 709 aten::item per forward were these, benchmarks/LOG.md run BC)
SCALAR_READS = ("aten::item", "aten::_local_scalar_dense")


def kernel_kind(name: str) -> str:
    """A kernel's (or operator's) kind by its name: matmul, attention, fused Triton, copy/cast, other."""
    lower = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lower for m in marks)), "other elementwise")


def device_kernels(averages) -> list:
    """The GPU kernels among the profile's key averages. Not Inductor's "## Call CompiledFxGraph ... ##" ranges:
    they carry device time too, the sum of the kernels they launched, which would count those kernels twice
    (benchmarks/LOG.md run BA: "kernels 0.373 s" in a 0.274 s step, their time listed as elementwise)."""
    return [e for e in averages if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0
            and not e.key.startswith("## ")]


def _is_sync_call(name: str) -> bool:
    return name.split("_")[0] in SYNC_CALLS  # not cudaMemcpyAsync: asynchronous


def _reaches_device(event) -> bool:
    """A CPU event with device work under it: a kernel or copy it launched, or a CUDA copy or sync call."""
    return bool(event.kernels) or any(_is_sync_call(c.name) or c.name.startswith("cudaMemcpy") or _reaches_device(c)
                                      for c in event.cpu_children)


def _within_scalar_read(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in SCALAR_READS:
            return True
        parent = parent.cpu_parent
    return False


def host_syncs(events) -> tuple[dict[str, int], int]:
    """The host syncs among a profile's events (prof.events(): each CPU event with its children and the kernels it
    launched): {name: count}, and apart the scalar reads of CPU tensors, which wait for nothing. torch.profiler
    records no input's device, so a scalar read (aten::item, aten::_local_scalar_dense) is a sync where the device
    worked under it: the copy to the host, its cudaMemcpyAsync and cudaStreamSynchronize. Each counts once, as its
    outermost read ("aten::item (CUDA tensor)"), not again as the sync call inside it; other synchronising calls by
    name. A profile of the CPU alone holds no CUDA events: every scalar read there is a CPU one."""
    syncs: dict[str, int] = {}
    cpu_reads = 0
    for event in events:
        if event.device_type != DeviceType.CPU or _within_scalar_read(event):
            continue
        if event.name in SCALAR_READS:
            if _reaches_device(event):
                name = f"{event.name} (CUDA tensor)"
                syncs[name] = syncs.get(name, 0) + 1
            else:
                cpu_reads += 1
        elif _is_sync_call(event.name):
            syncs[event.name] = syncs.get(event.name, 0) + 1
    return syncs, cpu_reads


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def _step_flops(bench, cfg, adapter, text_lengths: list[int], n: int, phase: str) -> int:
    """Model FLOPs of the profiled step (the bench's count, perf/bench.py): n samples' forwards; merged: without
    the LoRA's matmuls; training: forward + backward [+ the recomputed blocks' forward]."""
    from imagerl.perf.family_parts import _forward_flops
    from imagerl.perf.flops import training_flops
    from imagerl.perf.memory_estimate import checkpointed_blocks

    s = cfg.sample
    rank = 0 if phase == "merged" else cfg.model.lora_rank
    forward = _forward_flops(bench.family, bench.transformer, adapter.image_seq_len(s.height, s.width), text_lengths,
                             rank, adapter.lora_target_modules)
    if phase != "train":
        return n * forward
    blocks = len(adapter.transformer_blocks())
    return n * training_flops(forward, full_fine_tune=False, recompute=checkpointed_blocks(cfg.model, blocks) / blocks)


def _prod(shape) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def _op_flops(key: str, shapes: list) -> int | None:
    """FLOPs of one call of a matmul or attention operator from its input shapes (the profiler's record_shapes);
    None for another operator. Attention: 4 B H Sq Sk D forward, 2.5x that backward (five products to two)."""
    try:
        if key in ("aten::mm", "aten::_scaled_mm"):
            (m, k), (_, n) = shapes[0], shapes[1]
            return 2 * m * k * n
        if key == "aten::addmm":
            (m, k), (_, n) = shapes[1], shapes[2]
            return 2 * m * k * n
        if key in ("aten::bmm", "aten::baddbmm"):
            a, b = (shapes[0], shapes[1]) if key == "aten::bmm" else (shapes[1], shapes[2])
            return 2 * _prod(a) * b[-1]
        if key.startswith("aten::_scaled_dot_product") and "attention" in key:
            q, k = shapes[0], shapes[1]
            if "backward" in key:  # (grad_out, q, k, v, ...)
                q, k = shapes[1], shapes[2]
                return round(2.5 * 4 * _prod(q) * k[-2])
            return 4 * _prod(q) * k[-2]
    except (IndexError, TypeError, ValueError):
        return None
    return None


def _op_table(averages, rows: int = 14) -> list[str]:
    """The matmul and attention operators by input shape: calls, device time and the rate each shape reached (what
    a GEMM's shape or an attention backend costs). CPU-side operators, so their kernels' time is the operator's
    device time (compiled blocks call these as extern kernels)."""
    found = []
    for e in averages:
        flops = _op_flops(e.key, e.input_shapes) if e.device_type == DeviceType.CPU else None
        if flops is not None and e.device_time_total > 0:
            found.append((e.device_time_total, e, flops))
    found.sort(key=lambda item: item[0], reverse=True)
    lines = []
    for device_us, e, flops in found[:rows]:
        shapes = " x ".join("[" + "x".join(map(str, shape)) + "]" for shape in e.input_shapes if shape)
        lines.append(f"    {e.key.removeprefix('aten::')} {shapes} x{e.count}: {device_us / 1e3:.1f} ms, "
                     f"{flops * e.count / (device_us / 1e6) / 1e12:.0f} TFLOP/s")
    return lines


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def profile_step(bench, overrides: list[str], rows: int = 16, ceiling: float | None = None) -> str:
    """torch.profiler over one rollout forward (as the rollout runs it), with sample.merge_lora one off-window
    forward on the merged weights, and one training forward + backward of one batch of this config: GPU kernel
    time by operator, against the wall time (where the time goes). With parallel.compile the blocks are compiled
    (in the warm-up calls) and the rollout forward runs as the rollout runs it: as a training graph's forward.
    ceiling: the bench's matmul rate (FLOP/s), for the MFU of each step."""
    cfg = bench.config(overrides)
    adapter = prepare_adapter(bench.new_adapter(), cfg)
    resolve_family_defaults(cfg, adapter)
    apply_parallelism(adapter, cfg, World(0, 1, bench.device))
    s = cfg.sample
    text = adapter.encode_prompts([bench.prompts[0]] * s.batch_size, s.max_sequence_length)
    # the negative prompt only where the guidance uses one (none for FLUX.1's distilled guidance), as the rollout
    negative = adapter.encode_negative(s.negative_prompt, s.guidance_scale, s.max_sequence_length)
    lengths = [adapter.text_token_count(text[0])] + ([adapter.text_token_count(negative)] if negative is not None else [])
    inputs = {}

    def batch(n: int):  # (latents, timesteps, conditioning) of n samples
        if n not in inputs:
            inputs[n] = (adapter.initial_noise([torch.Generator().manual_seed(i) for i in range(n)], s.height, s.width),
                         torch.full((n,), 500.0, device=bench.device),
                         batch_conditioning(adapter, text[:n], negative, s.guidance_scale))
        return inputs[n]
    cuda = bench.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    timer, report = PhaseTimer(bench.device), []
    # the rollout's window steps run in training batches, as the update replays them (rollout.py); its other steps
    # in rollout batches (sample.batch_size), merged or not
    micro = training_batch_size(cfg)
    phases = [("rollout forward", "rollout", micro)]
    merged = None
    if s.merge_lora:
        from imagerl.families.layers.merged_lora import MergedLora

        merged = MergedLora(adapter.transformer, s.off_window_fp8, adapter.token_linears)
        phases.append((f"off-window forward (merged{' in FP8' if s.off_window_fp8 else ''}, no grad)", "merged",
                       s.batch_size))
    elif s.batch_size != micro:
        phases.append(("off-window forward (rollout batch)", "rollout", s.batch_size))
    phases.append(("training forward+backward", "train", micro))
    for title, phase, n in phases:
        x, t, cond = batch(n)

        def step():
            if phase == "train":  # train mode and grad on, as the update (algorithms/base.py, flow_grpo_update)
                # (not _training_graph: its forward_only_blocks cuts each block's outputs from the graph, so the
                # backward reached no block and this phase timed little more than a forward before run AY)
                adapter.transformer.train()
                try:
                    with torch.enable_grad():
                        adapter.velocity(x, t, cond, s.height, s.width).square().mean().backward()
                finally:
                    adapter.transformer.eval()
            else:  # as the rollout: the window steps as a training graph's forward, the merged ones under no grad
                off_window = merged.applied() if phase == "merged" else contextlib.nullcontext()
                with torch.no_grad(), _training_graph(adapter, cfg.parallel.compile), off_window:
                    adapter.velocity(x, t, cond, s.height, s.width).detach()
        graphs = _dynamo_graphs()
        with timer("warm-up"):  # compile, allocator, kernels; synchronised, so none of it reaches the profile
            step()
            step()
        warm_graphs, graphs = _dynamo_graphs() - graphs, _dynamo_graphs()
        with profile(activities=activities, record_shapes=cuda) as prof, timer("wall"):  # the timer synchronises inside the profile
            step()
        steady_graphs = _dynamo_graphs() - graphs
        wall = timer.pop_metrics()["time/wall_s"]
        averages = prof.key_averages()
        if cuda:  # the kernels themselves (compiled blocks launch Triton kernels, not aten operators)
            key = "self_device_time_total"
            events = device_kernels(averages)
        else:  # operators (their self time), not their children as well, which would count time twice
            key = "self_cpu_time_total"
            events = [e for e in averages if e.key.startswith("aten::")]
        events.sort(key=lambda e: getattr(e, key), reverse=True)
        busy = sum(getattr(e, key) for e in events) / 1e6
        by_kind: dict[str, float] = {}
        for e in events:
            by_kind[kernel_kind(e.key)] = by_kind.get(kernel_kind(e.key), 0.0) + getattr(e, key) / 1e6
        flops = _step_flops(bench, cfg, adapter, lengths, n, phase)
        mfu = f" = {flops / wall / ceiling:.1%} MFU" if ceiling else ""
        matmul_s = by_kind.get("matmul", 0.0)
        syncs, cpu_reads = host_syncs(prof.events())
        report.append(f"{title} ({' '.join(overrides) or 'defaults'}; batch {n}): wall {wall:.3f} s, kernels "
                      f"{busy:.3f} s ({1 - busy / wall:.0%} idle); "
                      + ", ".join(f"{k} {v / max(busy, 1e-9):.0%}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])))
        report.append(f"  {flops / 1e12:.2f} TFLOP: {flops / wall / 1e12:.0f} TFLOP/s over the wall time{mfu}"
                      + (f"; the matmul kernels {matmul_s:.3f} s" if matmul_s else "")
                      + f"; host syncs {sum(syncs.values())} ({', '.join(f'{k} x{v}' for k, v in syncs.items()) or 'none'})"
                      + (f", scalar reads of CPU tensors {cpu_reads} (no sync)" if cpu_reads else "")
                      + f"; Dynamo graphs compiled: {warm_graphs} in the warm-up, {steady_graphs} in the profiled step")
        if phase == "train":
            lora = [p for p in adapter.transformer.parameters() if p.requires_grad]
            report.append(f"  LoRA parameters with a gradient: {sum(p.grad is not None for p in lora)} of {len(lora)}")
        attention = [e for e in events if kernel_kind(e.key) == "attention"]
        if attention:
            report.append("  attention kernels: " + "; ".join(
                f"{_short(e.key, 70)} x{e.count} {getattr(e, key) / 1e3:.1f} ms" for e in attention[:6]))
        report += [f"  {getattr(e, key) / 1e6 / max(busy, 1e-9):6.1%} {getattr(e, key) / 1e3:9.1f} ms  x{e.count:<6} "
                   f"{_short(e.key)}" for e in events[:rows]]
        if cuda:
            table = _op_table(prof.key_averages(group_by_input_shape=True))
            report += ["  matmul and attention operators by shape:"] + table if table else []
    del merged
    bench.restore(adapter)
    return "\n".join(report)
