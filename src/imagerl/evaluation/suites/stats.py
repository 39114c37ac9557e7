"""Paired bootstrap over prompts: each model's mean score and its 95 % interval, and each model's difference to the
first (the base), all from the same resampled prompt sets (Efron & Tibshirani, "An Introduction to the Bootstrap",
ch. 13, percentile intervals; pairing by prompt as in Koehn 2004, "Statistical Significance Tests for MT").

scores_MP: M models x P prompts, one value per prompt (its images' mean). Resample r draws P prompt indices with
replacement from a numpy Generator seeded with `seed` (integers(0, P, size=(R, P))); the interval is the 2.5th and
97.5th percentile of the R resampled means (numpy's default linear interpolation between order statistics).

GenEval's overall (the mean of category means) is resampled within strata (the stratified bootstrap, Davison &
Hinkley 1997, "Bootstrap Methods and their Application"): prompts with the same categories are one stratum, each
resample draws each stratum's count from its own prompts (a one-prompt category then adds no variance). A free
resample can miss a category of one prompt entirely ((1 - 1/P)^P, about a third of the time), which drops it from
that resample's overall and pushes the interval off the point estimate.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float


def resample_indices(num_prompts: int, num_resamples: int, seed: int) -> np.ndarray:
    """The (R, P) prompt indices every model's resampled means share (the pairing)."""
    return np.random.default_rng(seed).integers(0, num_prompts, size=(num_resamples, num_prompts))


def stratified_resample_indices(strata_P: np.ndarray, num_resamples: int, seed: int) -> np.ndarray:
    """(R, P) prompt indices: the positions of each stratum (in the order of sorted stratum ids) redrawn with
    replacement from that stratum's prompts (integers(0, n_s, size=(R, n_s)) from one Generator seeded `seed`)."""
    strata_P = np.asarray(strata_P)
    rng = np.random.default_rng(seed)
    idx = np.empty((num_resamples, len(strata_P)), dtype=np.int64)
    for stratum in np.unique(strata_P):
        members = np.flatnonzero(strata_P == stratum)
        idx[:, members] = members[rng.integers(0, len(members), size=(num_resamples, len(members)))]
    return idx


def category_strata(scores_MPC: np.ndarray) -> np.ndarray:
    """(P,) stratum ids for the overall: prompts that have a score in the same categories (in any model) share one,
    numbered in order of first appearance."""
    pattern = np.isfinite(np.asarray(scores_MPC, dtype=np.float64)).any(axis=0)  # (P, C)
    ids: dict[bytes, int] = {}
    return np.array([ids.setdefault(row.tobytes(), len(ids)) for row in pattern], dtype=np.int64)


def prompt_mean(scores_MP, axis: int = -1):
    """The default statistic: the mean over prompts."""
    return np.mean(scores_MP, axis=axis)


def category_mean(scores_MPC, axis: int = -2):
    """GenEval's overall: the mean over categories of each category's mean over the prompts it has (NaN where a
    prompt is not in the category). A resample without any prompt of a category leaves it out of that mean."""
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a category no prompt of a resample has: all-NaN mean
        return np.nanmean(np.nanmean(scores_MPC, axis=axis), axis=-1)


def paired_bootstrap(scores_MP: np.ndarray, num_resamples: int = 1000, seed: int = 0, level: float = 0.95,
                     statistic=prompt_mean, strata=None) -> tuple[list[Interval], list[Interval | None]]:
    """(per model: the statistic and its interval; per model: its difference to model 0 and interval, None for
    model 0). scores: models x prompts (x anything the statistic reads, e.g. categories for category_mean, NaN
    allowed there); statistic(array, axis=prompt axis) reduces the prompt axis and what follows it. strata: (P,)
    ids to resample within (category_strata for the overall); None resamples all prompts together."""
    scores = np.asarray(scores_MP, dtype=np.float64)
    if scores.ndim < 2 or scores.shape[1] < 1:
        raise ValueError(f"scores must be models x prompts with at least one prompt, got shape {scores.shape}")
    if statistic is prompt_mean and not np.isfinite(scores).all():
        raise ValueError("scores must be finite: drop or fix the prompts whose score failed first")
    idx = (resample_indices(scores.shape[1], num_resamples, seed) if strata is None
           else stratified_resample_indices(strata, num_resamples, seed))
    full_M = statistic(scores, axis=1)
    resampled_MR = statistic(scores[:, idx], axis=2)
    q = [50 * (1 - level), 50 * (1 + level)]
    models = [Interval(float(f), *map(float, np.percentile(r, q))) for f, r in zip(full_M, resampled_MR)]
    diffs: list[Interval | None] = [None]
    for f, r in zip(full_M[1:], resampled_MR[1:]):
        diffs.append(Interval(float(f - full_M[0]), *map(float, np.percentile(r - resampled_MR[0], q))))
    return models, diffs
