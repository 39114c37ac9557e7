"""Regional compile of Qwen-Image 2.1 on the GPU: which way of compiling survives the backward, and at what speed.

Each variant runs `imagerl bench`'s own iteration (Bench.run_imagerl: rollout, rewards, Flow-GRPO update) in a
subprocess of its own, so that a CUDA error (run F: "an illegal memory access" in the first compiled backward)
ends that variant only. The released block dims (heads, widths) with `--layers` blocks (2: a minute per variant; the per-block
graph is the same as with the released 32). Probe switches, given as a variant's overrides beside config overrides:
  probe.force_compile   no effect now (2.1 compile is no longer refused, RESULTS.md run Z); accepted so that the
                        commands of runs T-W still run
  probe.static          compile the blocks with dynamic=False (a graph per text length)
  probe.complex_rope    skip QwenImage21Family.prepare_compile: compiled blocks keep diffusers' complex RoPE
                        product and any SDPA backend, cuDNN's included (the code of runs T-W)
  probe.baseline_first  run the diffusers + peft baseline first in the same process, as `imagerl bench` does
                        (run H: the compiled variant crashed after it, not alone)

    python3 benchmarks/qwen21_compile_probe.py --out $OUT --layers 2 \
        --variant "eager:" --variant "compile as is:parallel.compile=true,probe.force_compile"
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

PROBE_SWITCHES = ("probe.force_compile", "probe.static", "probe.complex_rope", "probe.baseline_first")


def run_variant(name: str, overrides: list[str], layers: int, iterations: int, out: Path) -> None:
    import torch

    from imagerl.families.qwen_image21 import QwenImage21Family
    from imagerl.perf.bench import Bench
    from imagerl.perf.flops import measure_matmul_flops_per_s

    switches = {o for o in overrides if o in PROBE_SWITCHES}
    overrides = [o for o in overrides if o not in PROBE_SWITCHES]
    if "probe.static" in switches:
        original = torch.nn.Module.compile
        torch.nn.Module.compile = lambda self, *a, **k: original(self, *a, **dict(k, dynamic=False))
    if "probe.complex_rope" in switches:
        QwenImage21Family.prepare_compile = lambda self: None
    device = torch.device("cuda")
    ceiling = measure_matmul_flops_per_s(device, torch.bfloat16, size=8192, iterations=10)
    # `layers` blocks at the released dims (the text encoder shrunk as in a dry run); 0: the released model
    bench = Bench("qwen_image21", device, False, out / "work", warmup=1, iterations=iterations, blocks=layers or None)
    if "probe.baseline_first" in switches:
        bench.run_baseline(ceiling)
    t0 = time.perf_counter()
    row = bench.run_imagerl(name, overrides, ceiling)
    record = dict(asdict(row), wall_s=time.perf_counter() - t0, switches=sorted(switches), layers=layers)
    (out / f"{name.replace(' ', '_').replace('/', '_')}.json").write_text(json.dumps(record, indent=1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=2, help="0: the released size")
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument("--variant", action="append", default=[], help="NAME:override,override,...")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child is not None:
        name, _, spec = args.child.partition(":")
        run_variant(name, [o for o in spec.split(",") if o], args.layers, args.iterations, args.out)
        return
    lines = ["| variant | result | e2e img/s | rollout / train s | MFU roll / train | lp diff | peak GiB | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for variant in args.variant:
        name = variant.partition(":")[0]
        log = args.out / f"{name.replace(' ', '_').replace('/', '_')}.log"
        t0 = time.perf_counter()
        cmd = [sys.executable, __file__, "--out", str(args.out), "--layers", str(args.layers), "--iterations",
               str(args.iterations), "--child", variant]
        try:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout,
                                    env=dict(os.environ)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.perf_counter() - t0
        result = args.out / f"{name.replace(' ', '_').replace('/', '_')}.json"
        if rc == 0 and result.is_file():
            r = json.loads(result.read_text())
            lines.append(f"| {name} | ok | {r['images_per_s']:.3f} | {r['rollout_s']:.2f} / {r['train_s']:.2f} | "
                         f"{r['rollout_mfu']:.1%} / {r['train_mfu']:.1%} | {r['log_prob_mean_abs_diff']:.2g} | "
                         f"{r['peak_gib']:.1f} | {wall:.0f} |")
        else:
            tail = [ln for ln in log.read_text().splitlines() if "Error" in ln or "error" in ln][-2:]
            lines.append(f"| {name} | rc={rc}: {' / '.join(t.strip()[:160] for t in tail)} | | | | | | {wall:.0f} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    (args.out / "table.md").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
