"""The reward-hacking table of a quickstart_sweep.py run over two rewards (benchmarks/LOG.md, "Several rewards and
reward hacking"): per variant and seed, the held-out shapes reward and GenEval-style overall at rollouts 0/20/40/60,
the held-out value of the second reward, and the first rollout at which each drift monitor passed max_drift.

    python benchmarks/hacking_table.py SWEEP_OUT SECOND_REWARD [--max-drift 3]

Reads SWEEP_OUT/<variant>_s<seed>/metrics.jsonl; prints Markdown (a per-run table, then the means and ranges over
seeds per variant).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MONITORS = ("jpeg_kb", "edge_density", "color_entropy", "contrast", "saturation", "dark_fraction", "bright_fraction")


def load(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def first_warning(records: list[dict], monitor: str, max_drift: float) -> int | None:
    for r in records:
        drift = r.get(f"monitor/{monitor}_drift")
        if isinstance(drift, (int, float)) and abs(drift) > max_drift:
            return r["step"]
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("second")
    p.add_argument("--max-drift", type=float, default=3.0)
    args = p.parse_args()
    runs = sorted(d for d in Path(args.out).iterdir() if (d / "metrics.jsonl").is_file())
    print("| variant | seed | held-out shapes 0 / 20 / 40 / 60 | gain | shapes overall 0 -> 60 | held-out "
          f"{args.second} 0 -> 60 | rollout {args.second} 60 | first warning (rollout): monitor |")
    print("|---|---|---|---|---|---|---|---|")
    summary: dict[str, list[tuple[float, float, float]]] = {}
    for run in runs:
        variant, _, seed = run.name.rpartition("_s")
        records = load(run)
        evals = {r["step"]: r for r in records if "eval/reward/shapes_mean" in r}
        steps = sorted(evals)
        shapes = [evals[s]["eval/reward/shapes_mean"] for s in steps]
        overall = [evals[s].get("eval/suite/shapes/overall", float("nan")) for s in steps]
        second = [evals[s][f"eval/reward/{args.second}_mean"] for s in steps]
        rollout_second = records[-1].get(f"rollout/reward/{args.second}_mean", float("nan"))
        warnings = sorted((step, m) for m in MONITORS if (step := first_warning(records, m, args.max_drift)))
        warned = ", ".join(f"{s}: {m}" for s, m in warnings) or "none"
        gain = shapes[-1] - shapes[0]
        summary.setdefault(variant, []).append((gain, second[-1] - second[0], overall[-1] - overall[0]))
        print(f"| {variant} | {seed} | {' / '.join(f'{v:.3f}' for v in shapes)} | {gain:+.3f} | {overall[0]:.3f} -> "
              f"{overall[-1]:.3f} | {second[0]:.3f} -> {second[-1]:.3f} | {rollout_second:.3f} | {warned} |")
    print()
    print(f"| variant | seeds | held-out shapes gain, mean [min, max] | {args.second} change, mean | shapes overall "
          "change, mean |")
    print("|---|---|---|---|---|")
    for variant, rows in summary.items():
        gains = [g for g, _, _ in rows]
        print(f"| {variant} | {len(rows)} | {sum(gains) / len(gains):+.3f} [{min(gains):+.3f}, {max(gains):+.3f}] | "
              f"{sum(s for _, s, _ in rows) / len(rows):+.3f} | {sum(o for _, _, o in rows) / len(rows):+.3f} |")


if __name__ == "__main__":
    main()
