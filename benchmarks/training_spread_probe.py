"""Where does the recipe's training phase spread come from (GPU)? Runs the qwen_image recipe in `imagerl bench`
(no baseline) while it samples the GPU's clocks, power and throttle reasons (nvidia-smi, every 200 ms), and times
each training micro-step on the GPU (CUDA events at every replayed window step and at each gradient clip, read
after the run; no host synchronisation added). The bench itself records per iteration the phase times, the
garbage-collection pauses inside them and the allocator's retries.

    python benchmarks/training_spread_probe.py --out DIR [--iterations 4] [--variant NAME=OVERRIDES ...]

Writes DIR/bench_qwen_image.{json,md} (the bench's), DIR/smi.csv and DIR/microsteps.json; prints a table per
iteration: train seconds, the micro-steps' GPU milliseconds, GC pause, mean SM clock and power in the phase.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch

import imagerl.algorithms.flow_grpo as flow_grpo
from imagerl.perf.bench import run_bench

SMI_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def _instrument(marks: list):
    """Record (label, host time, CUDA event) at each replayed step and each gradient clip."""
    step, clip = flow_grpo._step_log_prob, flow_grpo.global_clip_grad_norm_

    def mark(label):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((label, time.time(), event))

    def step_log_prob(*args, **kwargs):
        mark("step")
        return step(*args, **kwargs)

    def clip_grad(*args, **kwargs):
        mark("clip")
        return clip(*args, **kwargs)

    flow_grpo._step_log_prob, flow_grpo.global_clip_grad_norm_ = step_log_prob, clip_grad


def _smi(path: Path) -> subprocess.Popen | None:
    try:
        return subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                                 "-lms", "200"], stdout=path.open("w"), stderr=subprocess.DEVNULL)
    except FileNotFoundError:
        return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iterations", type=int, default=4)
    p.add_argument("--variant", action="append", default=[], help="NAME=comma-separated overrides")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    variants = {"recipe": []}
    for spec in a.variant:
        name, _, overrides = spec.partition("=")
        variants[name] = [o for o in overrides.split(",") if o]
    marks: list = []
    _instrument(marks)
    smi = _smi(a.out / "smi.csv")
    try:
        rows = run_bench("qwen_image", variants, baseline=False, warmup=1, iterations=a.iterations, out=a.out)
    finally:
        if smi is not None:
            smi.terminate()
    torch.cuda.synchronize()
    # micro-steps: consecutive marks of one training phase (a gap of more than 2 s host time starts a new phase)
    phases, last = [], None
    for label, host, event in marks:
        if last is None or host - last > 2.0:
            phases.append([])
        phases[-1].append((label, host, event))
        last = host
    record = [{"host_start": ph[0][1], "host_end": ph[-1][1],
               "gpu_ms": [round(ph[i][2].elapsed_time(ph[i + 1][2]), 2) for i in range(len(ph) - 1)],
               "labels": [m[0] for m in ph]} for ph in phases]
    (a.out / "microsteps.json").write_text(json.dumps(record, indent=1))
    samples = []
    for line in (a.out / "smi.csv").read_text().splitlines() if (a.out / "smi.csv").is_file() else []:
        parts = [x.strip() for x in line.split(",")]
        try:
            t = time.mktime(time.strptime(parts[0].split(".")[0], "%Y/%m/%d %H:%M:%S"))
            samples.append((t, float(parts[1]), float(parts[3]), parts[5]))
        except (ValueError, IndexError):
            continue
    print("training phase | micro-step GPU ms (fwd+bwd; before a clip: + clip/step) | mean SM MHz | mean W | throttle")
    for ph in record:
        inside = [s for s in samples if ph["host_start"] - 1 <= s[0] <= ph["host_end"] + 1]
        mhz = sum(s[1] for s in inside) / len(inside) if inside else float("nan")
        watts = sum(s[2] for s in inside) / len(inside) if inside else float("nan")
        reasons = sorted({s[3] for s in inside})
        print(f"{time.strftime('%H:%M:%S', time.localtime(ph['host_start']))} | {' '.join(f'{x:.0f}' for x in ph['gpu_ms'])}"
              f" | {mhz:.0f} | {watts:.0f} | {' '.join(reasons)}")
    for row in rows:
        for it in row.per_iteration:
            print(row.name, {k: round(v, 3) if isinstance(v, float) else v for k, v in it.items()})


if __name__ == "__main__":
    main()
