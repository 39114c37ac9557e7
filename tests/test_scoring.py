"""AsyncScorer: order preserved, scoring overlaps generation (measured timestamps), failures reported."""

import time

import torch

from imagerl.rewards.registry import RewardBatch, RewardError
from imagerl.rewards.scoring import AsyncScorer


class WorkScorer:
    """A scorer doing real tensor work (which releases the GIL); reward = image mean, NaN for prompt 'nan'."""

    weights = {"mean": 1.0}

    def __init__(self, fail_on: str | None = None):
        self.fail_on = fail_on

    def score(self, images, prompts, metadata):
        a = torch.randn(384, 384)
        for _ in range(30):
            a = torch.tanh(a @ a / 384)
        if self.fail_on in prompts:
            raise RewardError("reward 'mean' failed: boom")
        values = images.double().mean(dim=(1, 2, 3))
        values[[p == "nan" for p in prompts]] = float("nan")
        return RewardBatch(values.clone(), {"mean": values.clone()}, torch.isfinite(values))


def _generate_and_score(scorer: AsyncScorer, batches):
    spans = []
    for i, images in enumerate(batches):
        start = time.perf_counter()
        a = torch.randn(384, 384)  # "generation" of this batch
        for _ in range(30):
            a = torch.tanh(a @ a / 384)
        spans.append((start, time.perf_counter()))
        scorer.submit(images, [f"p{i}"] * images.shape[0], [{}] * images.shape[0])
    return spans, scorer.collect()


def test_results_keep_submission_order():
    batches = [torch.full((3, 3, 8, 8), float(i) / 10) for i in range(5)]
    for enabled in (True, False):
        scoring = AsyncScorer(WorkScorer(), enabled=enabled)
        _, scored = _generate_and_score(scoring, batches)
        expected = torch.tensor([i / 10 for i in range(5) for _ in range(3)], dtype=torch.float64)
        assert torch.allclose(scored.rewards.total_B, expected)
        assert scored.rewards.valid_B.all() and not scored.errors
        scoring.close()


def test_scoring_overlaps_generation():
    batches = [torch.rand(2, 3, 8, 8) for _ in range(4)]
    scoring = AsyncScorer(WorkScorer(), enabled=True)
    gen_spans, scored = _generate_and_score(scoring, batches)
    scoring.close()
    # batch k is scored while batch k+1 is generated: the measured intervals intersect
    overlaps = [min(se, ge) - max(ss, gs) for (ss, se), (gs, ge) in zip(scored.spans[:-1], gen_spans[1:])]
    assert sum(o > 0 for o in overlaps) >= 2, (scored.spans, gen_spans)
    assert scored.wait_s < scored.compute_s  # most of the scoring was hidden behind generation


def test_synchronous_scoring_does_not_overlap():
    batches = [torch.rand(2, 3, 8, 8) for _ in range(3)]
    gen_spans, scored = _generate_and_score(AsyncScorer(WorkScorer(), enabled=False), batches)
    assert all(se <= gs for (ss, se), (gs, ge) in zip(scored.spans[:-1], gen_spans[1:]))


def test_a_failing_batch_is_reported_not_zeroed():
    batches = [torch.rand(2, 3, 8, 8) for _ in range(3)]
    scoring = AsyncScorer(WorkScorer(fail_on="p1"), enabled=True)
    _, scored = _generate_and_score(scoring, batches)
    scoring.close()
    assert scored.errors == ["reward 'mean' failed: boom"]
    assert scored.rewards.valid_B.tolist() == [True, True, False, False, True, True]
    assert torch.isnan(scored.rewards.total_B[2:4]).all() and torch.isnan(scored.rewards.components["mean"][2:4]).all()


def test_nan_rewards_are_invalid():
    scoring = AsyncScorer(WorkScorer(), enabled=True)
    scoring.submit(torch.rand(3, 3, 8, 8), ["a", "nan", "b"], [{}] * 3)
    scored = scoring.collect()
    scoring.close()
    assert scored.rewards.valid_B.tolist() == [True, False, True]
