"""`imagerl bench` on a model of fewer blocks at the released block dims: side-by-side ratios on a smaller card.

The qwen_image recipe peaks at 121 GiB (LOG.md run P), so it does not run on an 80 GB card; with `--layers 30`
(half of its 60 blocks: 10.2 B transformer weights) the baseline and the recipe's variants fit one H100. Every
block has the released shapes, so per-block times, their ratios and the MFU carry over; the whole-iteration
ratio does not (text encoding, decode and reward do not shrink with the blocks). The text encoder is shrunk as in a
dry run (`layers` layers of a small MLP; the released hidden size, so the text conditioning is full width).

    python3 benchmarks/depth_bench.py --family qwen_image --layers 30 --out DIR [--no-baseline] \\
        --variant "recipe:" --variant "recipe, off-window FP8:sample.off_window_fp8=true"

Rows print as they finish and are saved after each (DIR/bench_FAMILY.json, .md); --dry-run checks the code path on
a CPU (the dry geometry, blocks of 2 heads).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from imagerl.perf.bench import parse_variants, run_bench


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", choices=["qwen_image", "qwen_image21"], default="qwen_image")
    p.add_argument("--layers", type=int, required=True, help="transformer blocks (qwen_image has 60, 2.1 has 32)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--variant", action="append", default=[], help="NAME:override,override (repeatable)")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error("--layers must be at least 1")
    # a dry run keeps its own 1-block, 2-head model
    run_bench(args.family, parse_variants(args.variant) if args.variant else None, baseline=not args.no_baseline,
              warmup=args.warmup, iterations=args.iterations, dry=args.dry_run, out=args.out, blocks=args.layers)


if __name__ == "__main__":
    main()
