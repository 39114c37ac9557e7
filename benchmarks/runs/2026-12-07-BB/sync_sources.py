"""Where do the compiled FLUX.1 blocks' host syncs come from? (issue 56; run BA: 709 `aten::item` per compiled
window forward on the GPU, none in the CPU dry run.) Runs `imagerl bench`'s profile alone (no baseline, no
variant) with torch.cuda.set_sync_debug_mode("warn"): every implicitly synchronising CUDA call (aten::item's
_local_scalar_dense included) raises a Python warning at the Python frame that entered C++ (Inductor's generated
wrapper code included: its file under /tmp/torchinductor_*). Each distinct stack is counted; the most frequent
are printed and written to OUT/sync_stacks.txt. A stack seen 3 x 57 x k times (two warm-up steps and the profiled
one, 57 blocks) is a per-block source.

    python3 benchmarks/runs/2026-12-07-BB/sync_sources.py --profile 'parallel.compile=true,...' [--out DIR]
        [--top 12] [--dry-run]

Written in run BB's session, which got no device machine; checked on the CPU with --dry-run only (where CUDA
reports no sync, so only the wrapper itself is checked).
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
import warnings
from pathlib import Path

STACKS: collections.Counter = collections.Counter()
MESSAGES: dict = {}


def _record(message, category, filename, lineno, file=None, line=None):
    text = str(message)
    if "synchroniz" not in text:  # not a sync warning: shown as usual
        return _show(message, category, filename, lineno, file, line)
    frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith(("warnings.py", __file__))]
    key = tuple((f.filename, f.lineno, f.name, (f.line or "").strip()) for f in frames[-14:])
    STACKS[key] += 1
    MESSAGES.setdefault(key, text.splitlines()[0][:160])


_show = warnings.showwarning


def report(top: int) -> str:
    lines = [f"{sum(STACKS.values())} sync warnings, {len(STACKS)} distinct stacks"]
    for key, n in STACKS.most_common(top):
        lines += ["", f"x{n}: {MESSAGES[key]}"] + [f"  {f}:{ln} {name}: {src}" for f, ln, name, src in key]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", action="append", required=True)
    p.add_argument("--out", default=None)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()

    import torch

    from imagerl.perf.bench import run_bench

    warnings.simplefilter("always")
    warnings.showwarning = _record
    if torch.cuda.is_available() and not args.dry_run:
        torch.cuda.set_sync_debug_mode("warn")
    out = Path(args.out) if args.out else None
    try:
        run_bench("flux", {}, baseline=False, warmup=0, iterations=1, dry=args.dry_run, out=out,
                  profiles=[[o.strip() for o in spec.split(",") if o.strip()] for spec in args.profile])
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        text = report(args.top)
        print(text)
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            (out / "sync_stacks.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
