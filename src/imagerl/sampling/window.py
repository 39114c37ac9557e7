"""Which denoising steps are stochastic (SDE) and trained; all others are deterministic ODE steps.

A window is `num_sde_steps` consecutive steps starting at `start`, inside `sde_window_range = (lo, hi)`
(start in [lo, hi - num_sde_steps]). `start` is either fixed (an int) or "random": drawn per rollout
from a generator seeded by (seed, rollout step), hence identical on every rank and reproducible on
resume. The last denoising step (sigma 0.02 -> 0) is never stochastic: flow_grpo keeps it ODE because
the Gaussian is too sharp there.

flow_grpo's Qwen-Image recipe asks for size 2 in range (0, 5), i.e. a random start in [0, 3], but its
pipeline calls `random.seed(0)` right before `random.randint(0, 3)`, which returns 3 every time, so
the effective window is always steps {3, 4} (sigmas 0.7666, 0.6733 at 512^2 / 10 steps;
flow_grpo's pipeline_with_logprob). Our default `sde_window_start = 3` reproduces that behaviour explicitly.

`sample.sde_window_schedule = sliding` (MixGRPO, arXiv 2507.21802): the start moves over training, by `stride`
steps every `period` rollouts, `forward` (toward the clean end) or `backward`, wrapping around inside the range;
it begins at sde_window_start (or lo when that is "random"). The steps outside the window stay ODE steps that are
never replayed, so the replay stays exact.

`sample.post_window_ratio` (MixGRPO-Flash's `--dpm_post_compress_ratio`, MixGRPO fastvideo/utils/sampling_utils.py
lines 33-50 at 2684bb9) or `sample.post_window_steps` (a fixed count) runs the steps after the window over fewer
points: a subset of the schedule's own sigmas, evenly spaced by index (`step_grid`). MixGRPO builds
num_post = int(max((N - last) * ratio, 1)) points from the sigma after the window's last step `last` to 0, i.e.
num_post - 1 steps (ratio 0.4, N = 10, window {3, 4}: int(6 x 0.4) = 2 points, 1 step); imagerl takes the same count
but at least one step (MixGRPO's trajectory would stop short of sigma 0 at num_post = 1). MixGRPO re-grids linearly
in unshifted time and applies FLUX's shift; a subset keeps each family's own shifted spacing without inverting it.

`sample.off_window_solver` (OFF_WINDOW_SOLVERS): "euler", "dpm2" (DPM-Solver++(2M) on both sides of the window), or
"dpm2_post", MixGRPO's `--dpm_apply_strategy post` (its Flash scripts): Euler before the window, DPM-Solver++ after.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from imagerl.distributed.rng import make_generator


@dataclass(frozen=True)
class SDEWindow:
    start: int
    size: int

    @property
    def steps(self) -> range:
        return range(self.start, self.start + self.size)

    def __contains__(self, step: int) -> bool:
        return self.start <= step < self.start + self.size


def validate_window(num_steps: int, num_sde_steps: int, window_range: tuple[int, int], start) -> None:
    """Raise ValueError with a fix if the window cannot fit the schedule."""
    lo, hi = window_range
    if num_sde_steps < 1:
        raise ValueError(f"sample.num_sde_steps must be >= 1, got {num_sde_steps}")
    if not 0 <= lo < hi <= num_steps - 1:
        raise ValueError(
            f"sample.sde_window_range={list(window_range)} must satisfy 0 <= lo < hi <= num_steps - 1 = {num_steps - 1} "
            "(the last step is always ODE)"
        )
    if num_sde_steps > hi - lo:
        raise ValueError(
            f"sample.num_sde_steps={num_sde_steps} does not fit sample.sde_window_range={list(window_range)} "
            f"({hi - lo} steps); widen the range or train fewer steps"
        )
    if start == "random":
        return
    if not isinstance(start, int) or isinstance(start, bool):
        raise ValueError(f"sample.sde_window_start must be an int or 'random', got {start!r}")
    if not lo <= start <= hi - num_sde_steps:
        raise ValueError(
            f"sample.sde_window_start={start} must lie in [{lo}, {hi - num_sde_steps}] so that "
            f"{num_sde_steps} SDE steps fit in sample.sde_window_range={list(window_range)}"
        )


@dataclass(frozen=True)
class Sliding:
    """MixGRPO's sliding window: `stride` steps every `period` rollouts, direction +1 (forward) or -1."""

    stride: int
    period: int
    direction: int


def sde_window(num_sde_steps: int, window_range: tuple[int, int], start, *, seed: int, rollout_step: int,
               sliding: Sliding | None = None) -> SDEWindow:
    """The window of one rollout; a random start depends only on (seed, rollout_step), a sliding one on the
    rollout step only (the same on every rank and after a resume)."""
    lo, hi = window_range
    if sliding is not None:
        positions = hi - num_sde_steps - lo + 1  # starts that fit: lo .. hi - num_sde_steps
        first = lo if start == "random" else int(start)
        moved = sliding.direction * sliding.stride * (rollout_step // sliding.period)
        return SDEWindow(lo + (first - lo + moved) % positions, num_sde_steps)
    if start == "random":
        gen = make_generator(seed, "sde_window", rollout_step)
        start = int(torch.randint(lo, hi - num_sde_steps + 1, (1,), generator=gen))
    return SDEWindow(int(start), num_sde_steps)


OFF_WINDOW_SOLVERS = ("euler", "dpm2", "dpm2_post")


def off_window_solver(name: str, step: int, window: SDEWindow) -> str:
    """The ODE solver of off-window step `step` (module docstring): dpm2_post is Euler before the window."""
    if name == "dpm2_post":
        return "euler" if step < window.start else "dpm2"
    return name


def post_window_count(num_steps: int, window: SDEWindow, post_window_steps: int | None,
                      post_window_ratio: float | None = None) -> int:
    """Steps after the window: the schedule's (None), a fixed count, or MixGRPO's compress ratio (module docstring);
    never more than the schedule's own."""
    remaining = num_steps - (window.start + window.size)
    if post_window_ratio is not None:
        last = window.start + window.size - 1  # MixGRPO's last_false_index
        n = int(max((num_steps - last) * post_window_ratio, 1)) - 1
    else:
        n = remaining if post_window_steps is None else int(post_window_steps)
    return max(1, min(n, remaining)) if remaining else 0


def step_grid(num_steps: int, window: SDEWindow, post_window_steps: int | None,
              post_window_ratio: float | None = None) -> list[int]:
    """Indices into the schedule's num_steps + 1 sigmas that one trajectory visits: every point up to the window's
    end (so the window's steps are the schedule's), then post_window_count steps to the terminal sigma, on points
    evenly spaced by index."""
    end = window.start + window.size
    remaining = num_steps - end
    n = post_window_count(num_steps, window, post_window_steps, post_window_ratio)
    post = [end + round(k * remaining / n) for k in range(1, n + 1)]
    return [*range(end + 1), *post]
