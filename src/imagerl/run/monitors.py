"""Drift monitors: simple image statistics of each rollout's images, to catch a policy gaming its reward (an OCR
reward blurring images, a compressibility reward flattening them, saturation creeping up) before held-out numbers
show it. Each is computed per image on float RGB in [0, 1]; a rollout logs their means, and each mean's drift from
the first rollout in units of the first rollout's spread across images:

  saturation      mean over pixels of HSV saturation (max - min) / max (0 where max = 0)
  contrast        standard deviation of the luma Y = 0.299 R + 0.587 G + 0.114 B (ITU-R BT.601) over pixels
  edge_density    fraction of pixels whose luma gradient |(Y[x+1] - Y[x], Y[y+1] - Y[y])| exceeds EDGE_THRESHOLD
                  (forward differences; the last row and column use their neighbour's difference)
  color_entropy   Shannon entropy in bits of the colours quantised to COLOR_LEVELS levels per channel
  dark_fraction   fraction of pixels with Y < DARK
  bright_fraction fraction of pixels with Y > BRIGHT
  jpeg_kb         JPEG size at quality 95 in kB (the jpeg rewards' measure)

drift = (mean_now - mean_first) / (std_first + 1e-6), std_first the population std over the first rollout's images.
"""

from __future__ import annotations

import math

import torch

from imagerl.rewards.jpeg import jpeg_sizes_kb

EDGE_THRESHOLD = 0.1
COLOR_LEVELS = 4
DARK, BRIGHT = 0.1, 0.9
MONITORS = ("saturation", "contrast", "edge_density", "color_entropy", "dark_fraction", "bright_fraction", "jpeg_kb")


def luma(images_B3HW: torch.Tensor) -> torch.Tensor:
    r, g, b = images_B3HW.double().unbind(1)
    return 0.299 * r + 0.587 * g + 0.114 * b


def _gradient_magnitude(y_BHW: torch.Tensor) -> torch.Tensor:
    """|(dY/dx, dY/dy)| by forward differences; the last column (row) repeats its left (upper) neighbour's."""
    dx, dy = torch.zeros_like(y_BHW), torch.zeros_like(y_BHW)
    if y_BHW.shape[2] > 1:
        dx[:, :, :-1] = y_BHW[:, :, 1:] - y_BHW[:, :, :-1]
        dx[:, :, -1] = dx[:, :, -2]
    if y_BHW.shape[1] > 1:
        dy[:, :-1, :] = y_BHW[:, 1:, :] - y_BHW[:, :-1, :]
        dy[:, -1, :] = dy[:, -2, :]
    return torch.sqrt(dx**2 + dy**2)


def image_statistics(images_B3HW: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each monitor's value per image (float64, (B,)), MONITORS' order."""
    x = images_B3HW.detach().double().clamp(0, 1).cpu()
    hi, lo = x.amax(dim=1), x.amin(dim=1)
    saturation = torch.where(hi > 0, (hi - lo) / hi.clamp_min(1e-12), torch.zeros_like(hi))
    y = luma(x)
    codes = (x * COLOR_LEVELS).floor().clamp(max=COLOR_LEVELS - 1).long()
    codes = (codes[:, 0] * COLOR_LEVELS + codes[:, 1]) * COLOR_LEVELS + codes[:, 2]
    entropy = []
    for c in codes.flatten(1):
        p = torch.bincount(c, minlength=COLOR_LEVELS**3).double() / c.numel()
        p = p[p > 0]
        entropy.append(float(-(p * torch.log2(p)).sum()))
    return {
        "saturation": saturation.flatten(1).mean(1),
        "contrast": y.flatten(1).std(dim=1, correction=0),
        "edge_density": (_gradient_magnitude(y) > EDGE_THRESHOLD).double().flatten(1).mean(1),
        "color_entropy": torch.tensor(entropy, dtype=torch.float64),
        "dark_fraction": (y < DARK).double().flatten(1).mean(1),
        "bright_fraction": (y > BRIGHT).double().flatten(1).mean(1),
        "jpeg_kb": jpeg_sizes_kb(x.float()),
    }


class DriftMonitor:
    """Per rollout: metrics monitor/<name> and monitor/<name>_drift; warning lines when |drift| > max_drift (the first
    time for each monitor, then every `warn_every` rollouts while it stays past); `stop` True when stop_on_drift and
    a monitor is past. The reference (first rollout's mean and spread) is kept in state() for a resume."""

    def __init__(self, max_drift: float, warn_every: int, stop_on_drift: bool):
        self.max_drift, self.warn_every, self.stop_on_drift = max_drift, warn_every, stop_on_drift
        self.reference: dict[str, tuple[float, float]] = {}
        self.last_warned: dict[str, int] = {}

    def observe(self, step: int, images_B3HW: torch.Tensor) -> tuple[dict[str, float], list[str], bool]:
        stats = image_statistics(images_B3HW)
        if not self.reference:
            self.reference = {k: (float(v.mean()), float(v.std(correction=0))) for k, v in stats.items()}
        metrics, warnings, past = {}, [], False
        for name, values in stats.items():
            mean = float(values.mean())
            first, spread = self.reference[name]
            drift = (mean - first) / (spread + 1e-6)
            metrics[f"monitor/{name}"], metrics[f"monitor/{name}_drift"] = mean, drift
            metrics[f"monitor/{name}_std"] = float(values.std(correction=0))
            if self.max_drift > 0 and math.isfinite(drift) and abs(drift) > self.max_drift:
                past = True
                if self.warns(name, step, drift):
                    warnings.append(f"rollout {step}: monitor {name} drifted {drift:+.1f} spreads from rollout 1 "
                                    f"({first:.4g} -> {mean:.4g}; monitor.max_drift={self.max_drift:g}): the policy "
                                    "may be gaming its reward; look at the sample grids")
        return metrics, warnings, past and self.stop_on_drift

    def warns(self, name: str, step: int, drift: float) -> bool:
        """Whether `name`'s drift at `step` gets a warning line (past max_drift, the first time and then every
        warn_every rollouts); records it. A resume replays the logged drifts through this."""
        if not (self.max_drift > 0 and math.isfinite(drift) and abs(drift) > self.max_drift):
            return False
        last = self.last_warned.get(name)
        if last is not None and step - last < self.warn_every:
            return False
        self.last_warned[name] = step
        return True

    def state(self) -> dict:
        return {"reference": self.reference, "last_warned": self.last_warned}

    def load_state(self, state: dict) -> None:
        self.reference = {k: tuple(v) for k, v in state.get("reference", {}).items()}
        self.last_warned = {k: int(v) for k, v in state.get("last_warned", {}).items()}
