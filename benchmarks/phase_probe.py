"""Where the qwen_image recipe's iteration time goes, on the GPU (`imagerl bench` rows, instrumented).

Runs `imagerl bench` variants (default: the recipe, no baseline) while
- nvidia-smi samples the SM clock, power and throttle reasons every 200 ms (DIR/smi.csv);
- CUDA events (no host synchronisation added) time on the GPU: every training micro-step (at each replayed window
  step and each gradient clip), and in the rollout every transformer velocity call (merged off-window steps: no
  grad; window steps: grad on), every VAE decode, every text encode and every merged-LoRA build;
- the first merged-LoRA build (a warm-up iteration) is also timed with the formula used before 2026-12-04 (fp32
  B @ A * scaling added to an fp32 copy of W, then rounded), side by side with the current one.
The bench itself records per iteration the phase times, the garbage-collection pauses inside them and the
allocator's retries.

    python benchmarks/phase_probe.py --out DIR [--iterations 4] [--baseline] [--variant NAME=OVERRIDES ...]

Prints one line per training phase (micro-steps in GPU ms, mean SM MHz and W), one per rollout (GPU ms by kind),
the merged-build comparison and the bench rows; writes DIR/probe.json. Run N (2026-12-04) used its first version,
benchmarks/training_spread_probe.py at commit d65c233 (training micro-steps and nvidia-smi only).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import time
from pathlib import Path

import torch

import imagerl.algorithms.base as update_base
import imagerl.algorithms.flow_grpo as flow_grpo
import imagerl.rollout as rollout_module
from imagerl.families.layers.merged_lora import MergedLora
from imagerl.families.qwen_image import QwenImageFamily
from imagerl.perf.bench import run_bench

SMI_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


class HostEvent:
    """torch.cuda.Event's interface on the host clock (--dry-run on a CPU)."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other: "HostEvent") -> float:
        return (other.t - self.t) * 1e3


def _event():
    return torch.cuda.Event(enable_timing=True) if torch.cuda.is_available() else HostEvent()


def _synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Marks:
    """(label, host time, CUDA event) in call order."""

    def __init__(self):
        self.items: list = []

    def mark(self, label: str) -> None:
        event = _event()
        event.record()
        self.items.append((label, time.time(), event))

    def around(self, label_of, fn):
        def wrapped(*args, **kwargs):
            label = label_of(*args, **kwargs)
            self.mark(label + ":start")
            try:
                return fn(*args, **kwargs)
            finally:
                self.mark(label + ":end")
        return wrapped


def _previous_merge(module, names, weight):
    """The merged weight as built before 2026-12-04 (commit 62ace0d's merged_lora.py), for the side-by-side time."""
    delta = sum(module.get_delta_weight(n).float() for n in names)
    return (weight.float() + delta).to(weight.dtype)


def _instrument(train_marks: Marks, rollout_marks: Marks, builds: list) -> None:
    step, clip = flow_grpo._step_log_prob, update_base.global_clip_grad_norm_

    def step_log_prob(*args, **kwargs):
        train_marks.mark("step")
        return step(*args, **kwargs)

    def clip_grad(*args, **kwargs):
        train_marks.mark("clip")
        return clip(*args, **kwargs)

    flow_grpo._step_log_prob, update_base.global_clip_grad_norm_ = step_log_prob, clip_grad  # run_optimizer_steps'

    merged_applied = [False]

    def velocity_label(self, latents, *args, **kwargs):  # the update runs the transformer in train mode
        kind = "train" if self.transformer.training else ("merged" if merged_applied[0] else "window")
        return f"velocity {kind} {latents.shape[0]}"

    QwenImageFamily.velocity = rollout_marks.around(velocity_label, QwenImageFamily.velocity)
    QwenImageFamily.decode = rollout_marks.around(lambda self, x, *a: f"decode {x.shape[0]}", QwenImageFamily.decode)
    QwenImageFamily.encode_prompts = rollout_marks.around(lambda self, p, *a: f"encode {len(p)}",
                                                          QwenImageFamily.encode_prompts)

    class TimedMergedLora(MergedLora):
        def __init__(self, transformer, fp8=False, token_linears=()):
            if not builds:  # once, in the warm-up: the previous formula over the same layers, timed alone
                from peft.tuners.lora import LoraLayer

                start, end = _event(), _event()
                _synchronize()
                start.record()
                with torch.no_grad():
                    for module in transformer.modules():
                        if isinstance(module, LoraLayer) and module.active_adapters:
                            _previous_merge(module, module.active_adapters, module.get_base_layer().weight)
                end.record()
                _synchronize()
                builds.append(("previous formula", start.elapsed_time(end)))
            rollout_marks.mark("merge build:start")
            super().__init__(transformer, fp8, token_linears)
            rollout_marks.mark("merge build:end")

        @contextlib.contextmanager
        def applied(self):
            with super().applied():
                merged_applied[0] = True
                try:
                    yield
                finally:
                    merged_applied[0] = False

    rollout_module.MergedLora = TimedMergedLora
    generate = rollout_module.generate

    def marked_generate(*args, **kwargs):
        rollout_marks.mark("rollout")
        try:
            return generate(*args, **kwargs)
        finally:
            rollout_marks.mark("rollout")

    rollout_module.generate = marked_generate


def _phases(items: list, gap_s: float) -> list[list]:
    """Consecutive marks split where the host time jumps by more than gap_s (another phase ran in between)."""
    phases, last = [], None
    for item in items:
        if last is None or item[1] - last > gap_s:
            phases.append([])
        phases[-1].append(item)
        last = item[1]
    return phases


def _rollouts(items: list) -> list[list]:
    """The marks of each generate() call, its two "rollout" marks included."""
    out, current = [], None
    for item in items:
        if item[0] == "rollout":
            if current is None:
                current = [item]
            else:
                out.append(current + [item])
                current = None
        elif current is not None:
            current.append(item)
    return out


def _rollout_summary(phase: list) -> dict:
    """GPU ms by call kind within one rollout (start/end pairs), and the GPU span of the whole."""
    open_, totals = {}, {}
    for label, _, event in phase:
        kind, _, edge = label.rpartition(":")
        if edge == "start":
            open_[kind] = event
        elif kind in open_:
            ms = open_.pop(kind).elapsed_time(event)
            count, total = totals.get(kind, (0, 0.0))
            totals[kind] = (count + 1, total + ms)
    span = phase[0][2].elapsed_time(phase[-1][2]) if len(phase) > 1 else 0.0
    return {"span_ms": round(span, 1), "by_kind": {k: {"calls": c, "ms": round(t, 1)} for k, (c, t) in totals.items()}}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--baseline", action="store_true", help="also the diffusers + peft baseline row")
    p.add_argument("--variant", action="append", default=[], help="NAME=comma-separated overrides")
    p.add_argument("--dry-run", action="store_true", help="the bench's CPU dry run, host-clock events (checks the probe)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    variants = {"recipe": ["sample.merge_lora=true", "train.batch_size=1"] if a.dry_run else []}
    for spec in a.variant:
        name, _, overrides = spec.partition("=")
        variants[name] = [o for o in overrides.split(",") if o]
    train_marks, rollout_marks, builds = Marks(), Marks(), []
    _instrument(train_marks, rollout_marks, builds)
    smi = None if a.dry_run else subprocess.Popen(
        ["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits", "-lms", "200"],
        stdout=(a.out / "smi.csv").open("w"), stderr=subprocess.DEVNULL)
    try:
        rows = run_bench("qwen_image", variants, baseline=a.baseline, warmup=1, iterations=a.iterations, out=a.out,
                         dry=a.dry_run)
    finally:
        if smi is not None:
            smi.terminate()
    _synchronize()

    samples = []
    for line in (a.out / "smi.csv").read_text().splitlines() if smi is not None else []:
        parts = [x.strip() for x in line.split(",")]
        try:
            t = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            samples.append((t, float(parts[1]), float(parts[3]), parts[5]))
        except (ValueError, IndexError):
            continue

    def clocks(t0, t1):
        inside = [s for s in samples if t0 - 1 <= s[0] <= t1 + 1]
        if not inside:
            return float("nan"), float("nan")
        return sum(s[1] for s in inside) / len(inside), sum(s[2] for s in inside) / len(inside)

    record = {"train": [], "rollout": [], "merge_build_ms": builds}
    print("training phase | micro-step GPU ms (fwd+bwd; after a clip: clip + optimizer step) | SM MHz | W")
    for ph in _phases(train_marks.items, 2.0):
        ms = [round(ph[i][2].elapsed_time(ph[i + 1][2]), 1) for i in range(len(ph) - 1)]
        mhz, watts = clocks(ph[0][1], ph[-1][1])
        record["train"].append({"host_start": ph[0][1], "gpu_ms": ms, "labels": [m[0] for m in ph], "sm_mhz": mhz,
                                "watts": watts})
        print(f"{time.strftime('%H:%M:%S', time.localtime(ph[0][1]))} | {' '.join(f'{x:.0f}' for x in ms)} | "
              f"{mhz:.0f} | {watts:.0f}")
    print("rollout | GPU span ms | GPU ms by kind (calls)")
    for ph in _rollouts(rollout_marks.items):
        summary = _rollout_summary(ph)
        mhz, watts = clocks(ph[0][1], ph[-1][1])
        summary.update(host_start=ph[0][1], sm_mhz=mhz, watts=watts)
        record["rollout"].append(summary)
        kinds = ", ".join(f"{k} {v['ms']:.0f} ({v['calls']})" for k, v in sorted(summary["by_kind"].items()))
        print(f"{time.strftime('%H:%M:%S', time.localtime(ph[0][1]))} | {summary['span_ms']:.0f} | {kinds} | "
              f"{mhz:.0f} MHz {watts:.0f} W")
    first_build = next((ms for label, ms in builds), None)
    print(f"merged-LoRA build, previous formula: {first_build} ms (warm-up); current: see 'merge build' above")
    (a.out / "probe.json").write_text(json.dumps(record, indent=1, default=str))
    for row in rows:
        for it in row.per_iteration:
            print(row.name, {k: round(v, 3) if isinstance(v, float) else v for k, v in it.items()})


if __name__ == "__main__":
    main()
