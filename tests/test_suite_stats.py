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
