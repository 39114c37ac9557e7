"""The paired bootstrap against a direct computation on fixed numbers: the same resampled prompt sets, means and
differences summed by hand, the percentile interpolated by hand."""

import math

import numpy as np
import pytest

from imagerl.evaluation.suites.stats import paired_bootstrap, resample_indices

BASE = [0.2, 0.5, 0.9, 0.4]
LORA = [0.3, 0.7, 0.8, 0.6]


def _percentile(values, q):
    """Linear interpolation between order statistics (numpy's default, Hyndman & Fan type 7), by hand."""
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def test_paired_bootstrap_equals_a_direct_computation():
    models, diffs = paired_bootstrap(np.array([BASE, LORA]), num_resamples=7, seed=3)
    rows = resample_indices(4, 7, 3).tolist()
    base_means = [sum(BASE[i] for i in r) / 4 for r in rows]
    lora_means = [sum(LORA[i] for i in r) / 4 for r in rows]
    deltas = [a - b for a, b in zip(lora_means, base_means)]
    assert models[0].mean == pytest.approx(0.5) and models[1].mean == pytest.approx(0.6)
    assert models[0].low == pytest.approx(_percentile(base_means, 2.5))
    assert models[0].high == pytest.approx(_percentile(base_means, 97.5))
    assert models[1].low == pytest.approx(_percentile(lora_means, 2.5))
    assert diffs[0] is None and diffs[1].mean == pytest.approx(0.1)
    assert diffs[1].low == pytest.approx(_percentile(deltas, 2.5))
    assert diffs[1].high == pytest.approx(_percentile(deltas, 97.5))


def test_pairing_makes_a_constant_shift_certain():
    """Every prompt gains 0.1: unpaired intervals overlap, the paired difference is exactly 0.1 in every resample."""
    base = np.linspace(0, 1, 20)
    models, diffs = paired_bootstrap(np.stack([base, base + 0.1]), num_resamples=200)
    assert models[0].high > models[1].low  # the models' own intervals overlap
    assert diffs[1].low == pytest.approx(0.1) and diffs[1].high == pytest.approx(0.1)


def test_bad_scores_are_refused():
    with pytest.raises(ValueError, match="finite"):
        paired_bootstrap(np.array([[0.1, float("nan")]]))
    with pytest.raises(ValueError, match="models x prompts"):
        paired_bootstrap(np.array([0.1, 0.2]))


def _overall_by_hand(scores_MPC, prompts):
    """GenEval's overall of one model's resampled prompts: each category's mean over the drawn prompts it has, then
    the mean over the categories present."""
    cats = []
    for c in range(len(scores_MPC[0])):
        values = [scores_MPC[p][c] for p in prompts if not math.isnan(scores_MPC[p][c])]
        if values:
            cats.append(sum(values) / len(values))
    return sum(cats) / len(cats)


def test_the_overall_resamples_within_each_group_of_categories_so_none_drops_out():
    """GenEval-style overall over categories of very different sizes (one prompt in 'single'): resampling prompts
    freely drops 'single' from a resample about a third of the time ((1 - 1/P)^P), moving its overall away from the
    point estimate (the interval then excludes it). Stratified by the categories a prompt is in, each resample has
    every category with its own prompt count; the interval equals the by-hand percentile of by-hand overalls over
    the same draws, and contains the point estimate."""
    from imagerl.evaluation.suites.stats import category_mean, category_strata, stratified_resample_indices

    nan = float("nan")
    # categories: single (1 prompt, always passes), pair (6 prompts, half pass), position (2 prompts, never)
    base = [[1.0, nan, nan]] + [[nan, float(i % 2), nan] for i in range(6)] + [[nan, nan, 0.0]] * 2
    lora = [[1.0, nan, nan]] + [[nan, 1.0, nan] for _ in range(6)] + [[nan, nan, 0.5]] * 2
    scores = np.array([base, lora])
    strata = category_strata(scores)
    assert strata.tolist() == [0, 1, 1, 1, 1, 1, 1, 2, 2]
    idx = stratified_resample_indices(strata, 50, 4)
    assert all(sorted(strata[row].tolist()) == strata.tolist() for row in idx)  # every group keeps its count
    models, diffs = paired_bootstrap(scores, num_resamples=50, seed=4, statistic=category_mean, strata=strata)
    base_overall = [_overall_by_hand(base, row) for row in idx.tolist()]
    lora_overall = [_overall_by_hand(lora, row) for row in idx.tolist()]
    assert models[0].mean == pytest.approx(_overall_by_hand(base, range(9)))  # (1 + 0.5 + 0) / 3
    assert models[0].low == pytest.approx(_percentile(base_overall, 2.5))
    assert models[1].high == pytest.approx(_percentile(lora_overall, 97.5))
    deltas = [a - b for a, b in zip(lora_overall, base_overall)]
    assert diffs[1].low == pytest.approx(_percentile(deltas, 2.5)) and diffs[1].low <= diffs[1].mean <= diffs[1].high
    for m in models:
        assert m.low <= m.mean <= m.high
    # unstratified, the resamples that miss 'single' or 'position' move the overall by a category's weight: its
    # interval of the difference is wider than the stratified one
    free = paired_bootstrap(scores, num_resamples=1000, seed=4, statistic=category_mean)[1][1]
    strat = paired_bootstrap(scores, num_resamples=1000, seed=4, statistic=category_mean, strata=strata)[1][1]
    assert free.high - free.low > 1.5 * (strat.high - strat.low), (free, strat)
