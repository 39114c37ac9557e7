"""Metrics to console, metrics.jsonl and TensorBoard; phase timers; sample grids; the reward curve.

Every metric name is documented in docs/metrics.md. Only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import sys
import time
from pathlib import Path

import torch


class PhaseTimer:
    """`with timer("rollout"):` accumulates wall seconds per phase (CUDA-synchronised)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds = device, {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def pop_metrics(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out["time/total_s"] = sum(self.seconds.values())
        self.seconds = {}
        return out


def memory_metrics(device: torch.device) -> dict[str, float]:
    gib = 1024**3
    out = {"memory/host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}
    if device.type == "cuda":
        out["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / gib
        out["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / gib
        torch.cuda.reset_peak_memory_stats(device)
    return out


class MetricsLogger:
    CONSOLE_KEYS = ("rollout/reward/raw_mean", "rollout/reward/raw_std", "train/loss", "train/clipfrac",
                    "train/approx_kl", "train/grad_norm", "train/log_prob_mean_abs_diff", "time/total_s")

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.enabled, self.run_dir, self.writer = enabled, run_dir, None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "metrics.jsonl"
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(run_dir / "tensorboard"))

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines of rollouts after the checkpoint so the file has no duplicates."""
        if self.enabled and self.path.is_file():
            lines = [l for l in self.path.read_text().splitlines() if l.strip() and json.loads(l)["step"] <= step]
            self.path.write_text("".join(l + "\n" for l in lines))

    def log(self, step: int, metrics: dict[str, float], echo=print) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(k, v, step)
            self.writer.flush()
        shown = "  ".join(f"{k.split('/')[-1] if k.count('/') == 1 else k.split('/', 1)[1]}={_fmt(metrics[k])}"
                          for k in self.CONSOLE_KEYS if k in metrics)
        echo(f"[rollout {step}] {shown}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _clean(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null marks it
    return v


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def save_image_grid(images_B3HW: torch.Tensor, rewards_B: torch.Tensor, path: Path, columns: int = 8) -> None:
    """A grid of sample images with each reward written under its tile."""
    from PIL import Image, ImageDraw

    b, _, h, w = images_B3HW.shape
    columns = min(columns, b)
    rows = math.ceil(b / columns)
    label = 12
    grid = Image.new("RGB", (columns * w, rows * (h + label)), "white")
    draw = ImageDraw.Draw(grid)
    arrays = (images_B3HW.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    for i, array in enumerate(arrays):
        x, y = (i % columns) * w, (i // columns) * (h + label)
        grid.paste(Image.fromarray(array), (x, y))
        draw.text((x + 2, y + h), f"{float(rewards_B[i]):.3g}", fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)


def plot_reward_curve(run_dir: Path, out: Path | None = None) -> Path:
    """reward_curve.png from metrics.jsonl: raw mean reward per rollout with a +-std band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl; is it an imagerl run directory?")
    records = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    steps = [r["step"] for r in records]
    mean = [r.get("rollout/reward/raw_mean") for r in records]
    std = [r.get("rollout/reward/raw_std") or 0.0 for r in records]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, mean, marker="o", ms=3, label="reward (raw mean)")
    ax.fill_between(steps, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.2)
    ax.set_xlabel("rollout")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out) if out else Path(run_dir) / "reward_curve.png"
    fig.savefig(out)
    plt.close(fig)
    return out


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "it", leave: bool = True):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, unit=unit, leave=leave, file=sys.stderr,
                dynamic_ncols=True)
