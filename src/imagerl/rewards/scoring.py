"""Reward scoring that overlaps with generation.

`AsyncScorer.submit` hands each decoded rollout batch to one background thread (so results keep the
submission order) and returns at once; at most `max_pending` batches wait, after which submit blocks
(backpressure: images are not piled up faster than the reward models take them). `collect` waits for
the rest and joins the batches. The thread releases the GIL inside the reward models' kernels, so on
a GPU the policy keeps generating while the reward models run.

Failures never become numbers: a batch whose reward raises is marked failed (all its samples invalid)
and reported; the caller stops or skips according to reward.on_error.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from imagerl.rewards.registry import RewardBatch, RewardError


@dataclass
class ScoredRollout:
    """All of a rollout's rewards in sample order. errors: one message per failed batch."""

    rewards: RewardBatch
    errors: list[str]
    compute_s: float  # seconds the reward models ran (in the background thread when async)
    wait_s: float  # seconds the caller waited for rewards after generation (the part not overlapped)
    spans: list[tuple[float, float]]  # (start, end) perf_counter of each batch's scoring


class AsyncScorer:
    def __init__(self, scorer, enabled: bool = True, max_pending: int = 2):
        self.scorer, self.enabled, self.max_pending = scorer, enabled, max_pending
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward") if enabled else None
        self._pending: list[tuple[int, Future]] = []

    def _score(self, images, prompts, metadata):
        start = time.perf_counter()
        try:
            result = self.scorer.score(images, prompts, metadata)
        except RewardError as e:
            result = e
        return result, (start, time.perf_counter())

    def submit(self, images_B3HW: torch.Tensor, prompts: list[str], metadata: list[dict]) -> None:
        n = images_B3HW.shape[0]
        if not self.enabled:
            future: Future = Future()
            future.set_result(self._score(images_B3HW, prompts, metadata))
        else:
            running = [f for _, f in self._pending if not f.done()]
            if len(running) >= self.max_pending:
                running[0].result()
            future = self._executor.submit(self._score, images_B3HW, prompts, metadata)
        self._pending.append((n, future))

    def collect(self) -> ScoredRollout:
        start = time.perf_counter()
        parts, errors, spans = [], [], []
        for n, future in self._pending:
            result, span = future.result()
            spans.append(span)
            if isinstance(result, RewardError):
                errors.append(str(result))
                nan = torch.full((n,), float("nan"), dtype=torch.float64)
                result = RewardBatch(nan, {name: nan for name in self.scorer.weights}, torch.zeros(n, dtype=torch.bool))
            parts.append(result)
        wait = time.perf_counter() - start
        self._pending = []
        rewards = RewardBatch(
            torch.cat([p.total_B for p in parts]),
            {k: torch.cat([p.components[k] for p in parts]) for k in parts[0].components},
            torch.cat([p.valid_B for p in parts]),
        )
        return ScoredRollout(rewards, errors, sum(e - s for s, e in spans), wait, spans)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
