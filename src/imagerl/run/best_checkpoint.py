"""run.keep_best: <run>/checkpoints/best.json names the checkpoint of a held-out metric's best value, which
checkpoint pruning spares (written atomically, after that checkpoint is complete)."""

from __future__ import annotations

import json
from pathlib import Path

BEST_FILE = "best.json"


def read_best(run_dir: Path) -> dict | None:
    """<run>/checkpoints/best.json (run.keep_best): metric, mode, value, step, checkpoint; None without one."""
    path = Path(run_dir) / "checkpoints" / BEST_FILE
    if not path.is_file():
        return None
    try:
        best = json.loads(path.read_text())
        return best if isinstance(best, dict) and isinstance(best.get("checkpoint"), str) else None
    except (json.JSONDecodeError, RecursionError, OSError):
        return None


def is_new_best(run_dir: Path, metric: str, mode: str, value: float) -> bool:
    """Whether `value` of `metric` beats the recorded best (a recorded best of another metric or mode does not count)."""
    best = read_best(run_dir)
    if best is None or best.get("metric") != metric or best.get("mode") != mode:
        return True
    return value > best["value"] if mode == "max" else value < best["value"]


def write_best(run_dir: Path, metric: str, mode: str, value: float, step: int) -> None:
    path = Path(run_dir) / "checkpoints" / BEST_FILE
    record = {"metric": metric, "mode": mode, "value": value, "step": step, "checkpoint": f"step_{step:06d}"}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)  # atomic: a kill leaves the old record or the new one
