"""Metrics to console, metrics.jsonl, TensorBoard and (optionally) W&B; phase timers; sample grids with
captions; the reward and phase plots (plots/reward.png, plots/phases.png).

Every metric name is documented in docs/metrics.md. Only rank 0 writes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch


class _GCPauses:
    """Seconds the interpreter spent in garbage collection, and full (generation 2) collections, since the process
    installed it (gc.callbacks). A full collection walks every tracked object (the models' modules, Dynamo's guards
    and graphs) while the GPU drains its queue: a pause in the middle of a phase is lost GPU time."""

    def __init__(self):
        self.seconds, self.full, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.seconds += time.perf_counter() - self._start
        self.full += info.get("generation") == 2


_gc_pauses: _GCPauses | None = None


def gc_pauses() -> tuple[float, int]:
    """(seconds in garbage collection, full collections) so far; the meter starts on the first call."""
    global _gc_pauses
    if _gc_pauses is None:
        _gc_pauses = _GCPauses()
    return _gc_pauses.seconds, _gc_pauses.full


class PhaseTimer:
    """`with timer("rollout"):` accumulates wall seconds per phase (CUDA-synchronised), and the garbage
    collection pauses inside the phases (perf/gc_pause_s, perf/gc_full_collections)."""

    def __init__(self, device: torch.device):
        self.device, self.seconds, self.gc_seconds, self.gc_full = device, {}, 0.0, 0
        gc_pauses()

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._sync()
        start, (gc_start, full_start) = time.perf_counter(), gc_pauses()
        try:
            yield
        finally:
            self._sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
            gc_seconds, full = gc_pauses()
            self.gc_seconds += gc_seconds - gc_start
            self.gc_full += full - full_start

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def pop_metrics(self) -> dict[str, float]:
        out = {f"time/{k}_s": v for k, v in self.seconds.items()}
        out["time/total_s"] = sum(self.seconds.values())
        out["perf/gc_pause_s"], out["perf/gc_full_collections"] = self.gc_seconds, float(self.gc_full)
        self.seconds, self.gc_seconds, self.gc_full = {}, 0.0, 0
        return out


def memory_metrics(device: torch.device) -> dict[str, float]:
    gib = 1024**3
    out = {"memory/host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / gib}
    if device.type == "cuda":
        out["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / gib
        out["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / gib
        # since the process started: times the caching allocator found no cached block, freed its cache and
        # retried cudaMalloc (a synchronising stall; a growing count means fragmentation or memory pressure)
        out["memory/alloc_retries"] = float(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
        torch.cuda.reset_peak_memory_stats(device)
    return out


def require_wandb():
    """The wandb module, or a ValueError that says how to get it (or turn W&B off)."""
    try:
        import wandb
    except ImportError as e:
        raise ValueError("run.wandb=true but the wandb package is not installed: `pip install wandb` (and "
                         "`wandb login`, or WANDB_MODE=offline), or set run.wandb=false") from e
    return wandb


class MetricsWriteError(OSError):
    """metrics.jsonl could not be written (a full disk): the message names the file; the file is as it was."""


class MetricsLogger:
    """metrics.jsonl (+ TensorBoard, + Weights & Biases) on the main rank; the other ranks log nothing.

    metrics.jsonl is never opened through a symbolic link, a record is appended whole or not at all (a failed write
    is taken back), and resume's rewrite replaces the file atomically.

    W&B: the run id is kept in <run>/wandb_run_id, so a resumed run continues the same W&B run. The
    wandb import is checked on every rank (one clear error instead of rank 0 failing alone)."""

    CONSOLE_KEYS = ("rollout/reward/raw_mean", "rollout/reward/raw_std", "eval/reward/raw_mean", "train/loss",
                    "train/clipfrac", "train/approx_kl", "train/grad_norm", "train/log_prob_mean_abs_diff",
                    "time/total_s")  # train.py narrows the train/ ones to the algorithm's console_metrics()
    CONSOLE_LABELS = {"eval/reward/raw_mean": "eval_reward"}

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, wandb: bool = False, config=None):
        self.enabled, self.run_dir, self.writer, self.wandb_run = enabled, Path(run_dir), None, None
        wandb_module = require_wandb() if wandb else None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        if wandb_module is not None:
            self.wandb_run = self._init_wandb(wandb_module, config)

    def _init_wandb(self, wandb_module, config):
        import secrets

        id_file = self.run_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(8)
        id_file.write_text(run_id + "\n")
        project = config.run.wandb_project if config is not None else "imagerl"
        return wandb_module.init(project=project, name=self.run_dir.name, id=run_id, resume="allow",
                                 dir=str(self.run_dir), config=config.to_dict() if config is not None else None)

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines of rollouts after the checkpoint so the file has no duplicates, and lines that do
        not parse (a line torn by a kill mid-write), with a warning. The file is written whole to metrics.jsonl.tmp,
        flushed to disk and renamed over metrics.jsonl: a kill at any moment leaves the old history or the new."""
        if not self.enabled:
            return
        import warnings

        from imagerl.run.lock import nofollow_opener

        tmp = self.path.with_name(self.path.name + ".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # one a kill left behind (a link is removed, never followed)
        try:
            with open(self.path, "rb", opener=nofollow_opener) as f:
                data = f.read()
        except FileNotFoundError:
            return
        kept = []
        for number, line in text_lines(self.path, data):
            try:
                record = json.loads(line) if line.strip() else None
            except (json.JSONDecodeError, RecursionError):  # (a crafted line nested past the recursion limit)
                warnings.warn(f"{self.path}: line {number} is not JSON (cut off?); dropped", stacklevel=2)
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
                kept.append(line)
        try:
            with open(tmp, "xb", opener=nofollow_opener) as f:
                f.write("".join(line + "\n" for line in kept).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)  # replaces the name: a link put there since is replaced, not followed
            directory = os.open(self.run_dir, os.O_RDONLY)
            try:
                os.fsync(directory)  # the rename itself reaches the disk
            finally:
                os.close(directory)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise MetricsWriteError(f"{self.path}: rewriting it without the records after step {step} failed "
                                    f"({e.strerror or e}); the file is as it was. {_after_failure(self.run_dir, e)}"
                                    ) from None

    def log(self, step: int, metrics: dict[str, float], echo=print) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._append((json.dumps(record) + "\n").encode(), step)
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
                   and not isinstance(v, bool) and math.isfinite(v)}
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)
        shown = "  ".join(f"{self._label(k)}={_fmt(metrics[k])}" for k in self.CONSOLE_KEYS if k in metrics)
        echo(f"[rollout {step}] {shown}")

    def _append(self, line: bytes, step: int) -> None:
        """Append one record whole: a write that fails part-way (a full disk) is cut back off, so that no torn line
        is left, and raises MetricsWriteError naming the file."""
        from imagerl.run.lock import nofollow_opener

        with open(self.path, "ab", buffering=0, opener=nofollow_opener) as f:
            size = os.fstat(f.fileno()).st_size
            try:
                rest = memoryview(line)
                while rest:
                    rest = rest[f.write(rest):]
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.ftruncate(f.fileno(), size)
                raise MetricsWriteError(f"{self.path}: writing the record of step {step} failed "
                                        f"({e.strerror or e}); the file is as it was before it. "
                                        f"{_after_failure(self.run_dir, e)}") from None

    def _label(self, key: str) -> str:
        if key in self.CONSOLE_LABELS:
            return self.CONSOLE_LABELS[key]
        return key.split("/")[-1] if key.count("/") == 1 else key.split("/", 1)[1]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def _after_failure(run_dir: Path, e: OSError) -> str:
    import errno

    from imagerl.run.checkpoint import after_disk_full, latest_checkpoint
    from imagerl.run.lock import continue_command

    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        advice = after_disk_full(run_dir)
        return advice[0].upper() + advice[1:]
    if latest_checkpoint(run_dir) is None:
        return "Once the cause is fixed, run the same command again (no checkpoint exists yet: the run starts over)"
    return f"Once the cause is fixed, continue with `{continue_command(run_dir)}`"


def _clean(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null marks it
    return v


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# ---------------------------------------------------------------- image grids


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except (TypeError, ImportError, OSError):  # Pillow < 10.1 or without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def wrap_text(text: str, width_px: float, measure, max_lines: int) -> list[str]:
    """Greedy word wrap to `width_px` (measure(str) -> pixels); words wider than a line are broken; more
    than max_lines lines are cut, the last one ending in '...'."""
    lines, current = [], ""
    for word in text.split():
        trial = f"{current} {word}" if current else word
        if measure(trial) <= width_px:
            current = trial
            continue
        if current:
            lines.append(current)
        current = word
        while measure(current) > width_px and len(current) > 1:
            cut = max(1, max(i for i in range(1, len(current) + 1) if i == 1 or measure(current[:i]) <= width_px))
            lines.append(current[:cut])
            current = current[cut:]
    if current:
        lines.append(current)
    if len(lines) > max_lines:
        last = lines[max_lines - 1]
        while last and measure(last + "...") > width_px:
            last = last[:-1]
        lines = lines[: max_lines - 1] + [last.rstrip() + "..."]
    return lines


def save_image_grid(images_B3HW: torch.Tensor, rewards_B: torch.Tensor, path: Path, columns: int = 8,
                    captions: list[str] | None = None, caption_lines: int = 3) -> None:
    """A grid of sample images; under each tile its reward and, with `captions`, its prompt (wrapped to
    the tile width, at most caption_lines lines, '...' when cut)."""
    from PIL import Image, ImageDraw

    b, _, h, w = images_B3HW.shape
    if captions is not None and len(captions) != b:
        raise ValueError(f"{len(captions)} captions for {b} images")
    columns = max(1, min(columns, b))
    rows = math.ceil(b / columns)
    font = _font(max(10, min(16, w // 32)))
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    line_h = font.getbbox("Ag|")[3] + 2
    measure = lambda text: probe.textlength(text, font=font)  # noqa: E731
    wrapped = [wrap_text(c, w - 4, measure, caption_lines) for c in captions] if captions is not None else None
    label = line_h * (1 + (max((len(x) for x in wrapped), default=0) if wrapped else 0)) + 2
    grid = Image.new("RGB", (columns * w, rows * (h + label)), "white")
    draw = ImageDraw.Draw(grid)
    arrays = (images_B3HW.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    for i, array in enumerate(arrays):
        x, y = (i % columns) * w, (i // columns) * (h + label)
        grid.paste(Image.fromarray(array), (x, y))
        draw.text((x + 2, y + h + 1), f"{float(rewards_B[i]):.4g}", fill="black", font=font)
        for j, line in enumerate(wrapped[i] if wrapped else []):
            draw.text((x + 2, y + h + 1 + (j + 1) * line_h), line, fill=(70, 70, 70), font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)


# ---------------------------------------------------------------- metrics.jsonl and plots


def text_lines(path: Path, data: bytes | None = None) -> list[tuple[int, str]]:
    """(line number, text) of each line of `path` (or of its contents `data`) that decodes as UTF-8; a line that
    does not (bytes appended by something else, a disk error) is skipped with a warning naming the file and line."""
    import warnings

    out = []
    for number, raw in enumerate((path.read_bytes() if data is None else data).splitlines(), 1):
        try:
            out.append((number, raw.decode("utf-8")))
        except UnicodeDecodeError:
            warnings.warn(f"{path}: line {number} is not UTF-8 text; skipped", stacklevel=3)
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of <run_dir>/metrics.jsonl in file order. A cut-off last line (a crash while writing)
    is skipped; any other unreadable line is a ValueError naming it."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl; is it an imagerl run directory?")
    lines = text_lines(path)
    records = []
    for lineno, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except RecursionError as e:  # a crafted line nested past the recursion limit
            raise ValueError(f"{path}:{lineno}: JSON nested too deeply to be a metrics record") from e
        except json.JSONDecodeError as e:
            if lineno == lines[-1][0]:
                break
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path}:{lineno}: not a metrics record (a JSON object with a 'step')")
        records.append(record)
    return records


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    pairs = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pairs], [float(p[1]) for p in pairs]


def smoothed(values: list[float], window: int) -> list[float]:
    """Centred moving average over `window` points (odd; shrinks to what exists at the ends)."""
    half = window // 2
    return [sum(values[max(0, i - half): i + half + 1]) / len(values[max(0, i - half): i + half + 1])
            for i in range(len(values))]


def smoothing_window(n: int) -> int:
    """An odd window of about a tenth of the curve, at least 3 (1 for curves shorter than 6)."""
    return 1 if n < 6 else max(3, (n // 10) | 1)


def plot_rewards(records: list[dict], out: Path, title: str = "") -> Path:
    """Train reward (rollout/reward/raw_mean, and its moving average over a tenth of the run, bold) and held-out
    reward (eval/reward/raw_mean, markers) against rollout; either may be absent. The spread of single samples
    (raw_std, often larger than the whole learning effect) is in the legend, not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    steps, mean = _series(records, "rollout/reward/raw_mean")
    if steps:
        stds = _series(records, "rollout/reward/raw_std")[1]
        spread = f", sample std {sum(stds) / len(stds):.2g}" if stds else ""
        window = smoothing_window(len(steps))
        ax.plot(steps, mean, color="C0", alpha=0.45 if window > 1 else 1.0, linewidth=1 if window > 1 else 1.5,
                marker="o" if len(steps) < 30 else None, ms=2, label=f"train reward (rollout mean{spread})")
        if window > 1:
            ax.plot(steps, smoothed(mean, window), color="C0", linewidth=2.5,
                    label=f"train reward, moving average of {window}")
    eval_steps, eval_mean = _series(records, "eval/reward/raw_mean")
    if eval_steps:
        ax.plot(eval_steps, eval_mean, color="C3", marker="D", ms=6, linestyle="--", label="held-out reward (eval)")
    if not steps and not eval_steps:
        ax.text(0.5, 0.5, "no reward logged yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("rollout")
    ax.set_ylabel("reward")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if steps or eval_steps:
        ax.legend(fontsize=8)
    return _save_figure(fig, out)


PHASES = ("rollout", "reward", "train", "eval")


def _save_figure(fig, out: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_phases(records: list[dict], out: Path, title: str = "") -> Path:
    """Stacked wall seconds per phase (time/<phase>_s) for each rollout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    phases = [p for p in PHASES if any(f"time/{p}_s" in r for r in records)]
    phases += sorted({k[5:-2] for r in records for k in r if k.startswith("time/") and k.endswith("_s")}
                     - set(phases) - {"total", "reward_compute"})
    timed = [r for r in records if any(f"time/{p}_s" in r for p in phases)]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    steps = [r["step"] for r in timed]
    bottom = [0.0] * len(timed)
    for i, phase in enumerate(phases):
        values = [float(r.get(f"time/{phase}_s") or 0.0) for r in timed]
        ax.bar(steps, values, bottom=bottom, color=f"C{i}", label=phase, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
    if not timed:
        ax.text(0.5, 0.5, "no timings logged yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    else:
        ax.legend(fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("rollout")
    ax.set_ylabel("seconds")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    return _save_figure(fig, out)


def plot_reward_curve(run_dir: Path, out: Path | None = None) -> Path:
    """<run_dir>/plots/reward.png (or `out`) from metrics.jsonl: train reward and held-out reward per rollout."""
    run_dir = Path(run_dir)
    return plot_rewards(read_metrics(run_dir), Path(out) if out else run_dir / "plots" / "reward.png",
                        title=run_dir.resolve().name)


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "it", leave: bool = True, initial: int = 0):
    """A tqdm bar on standard error, drawn only when `enabled` and on a terminal (console.interactive): in a log
    file the per-rollout lines that MetricsLogger echoes through bar.write are the progress. `initial`: steps done
    before (a resume), counted in the bar but not in its rate and ETA."""
    from tqdm.auto import tqdm

    from imagerl.run.console import interactive

    return tqdm(total=total, desc=desc, disable=not (enabled and interactive()), unit=unit, leave=leave,
                file=sys.stderr, dynamic_ncols=True, initial=initial)
