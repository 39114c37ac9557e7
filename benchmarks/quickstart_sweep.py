"""Held-out learning of the quickstart under several settings and seeds, one run after another (2 CPU cores).

    python benchmarks/quickstart_sweep.py OUT "name:override override ..." [...] [--seeds 42 1 2] [--rollouts 60]

Each variant runs `imagerl train --recipe R` (default: quickstart; the quickstart model and data; evaluation every 20 rollouts on the 125 held-out
captions x 4 images) for every seed, and a table of the held-out reward at rollouts 0/20/40/60 with the gain and the
wall time is printed and written to OUT/table.md (the runs stay in OUT/<name>_s<seed>/).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def _held_out(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["eval/reward/raw_mean"] for r in rows if "eval/reward/raw_mean" in r}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("variants", nargs="+", help='"name:section.key=value section.key=value"')
    parser.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2])
    parser.add_argument("--rollouts", type=int, default=60)
    parser.add_argument("--recipe", default="quickstart", help="the recipe the overrides apply to")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    points = list(range(0, args.rollouts + 1, 20))
    header = f"| variant | seed | {' | '.join(str(p) for p in points)} | gain | wall time |"
    lines = [header, "|" + "---|" * (len(points) + 4)]
    print(header, flush=True)
    for variant in args.variants:
        name, _, overrides = variant.partition(":")
        for seed in args.seeds:
            run = out / f"{name}_s{seed}"
            cmd = [sys.executable, "-m", "imagerl", "train", "--recipe", args.recipe, "--output-dir", str(run),
                   "--overwrite",
                   f"run.seed={seed}", f"train.num_rollouts={args.rollouts}", "eval.interval=20",
                   "run.image_grid_every=0", "run.tensorboard=false", *overrides.split()]
            start = time.perf_counter()
            done = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - start
            if done.returncode:
                print(f"{name} seed {seed} failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
                continue
            held = _held_out(run)
            cells = [f"{held[p]:.4f}" if p in held else "" for p in points]
            gain = held.get(args.rollouts, float("nan")) - held.get(0, float("nan"))
            line = f"| {name} | {seed} | {' | '.join(cells)} | {gain:+.4f} | {wall:.0f} s |"
            lines.append(line)
            print(line, flush=True)
            (out / "table.md").write_text("\n".join(lines) + "\n")
            (run / "sweep.json").write_text(json.dumps({"variant": name, "overrides": overrides, "seed": seed,
                                                        "held_out": held, "wall_s": wall}))


if __name__ == "__main__":
    main()
