"""Keep Python's full garbage collections from stalling the GPU (run.gc_freeze).

A full (generation 2) collection walks every object the collector tracks. After the first rollout these are mostly
long-lived: the models' modules and parameters, Dynamo's guards, Inductor's compiled code. On the H200 machine one
full collection of the qwen_image recipe took about 1 s, and when it landed inside a training phase the GPU sat
idle for ~0.9 s of it (run N, benchmarks/LOG.md: one micro-step 1555 ms instead of ~640 ms, the train phase
6.23 s instead of 5.3 s); the collector starts one every few rollouts.

After the first iteration (compile done, everything built) GCFreeze collects once and calls gc.freeze(): the
survivors move to the permanent generation, which later collections do not walk, so a full collection costs what
the young objects cost (tens of ms). Frozen objects are still freed by reference counting; only a frozen object
that ends up in unreachable reference cycle would stay (the collection right before the freeze clears what is
garbage then). The context manager unfreezes on exit, so a caller that trains again in the same process (tests,
`imagerl bench` variants) gets its garbage collected as usual. The same idea as vLLM's gc.freeze() after start-up.
"""

from __future__ import annotations

import gc


class GCFreeze:
    """`with GCFreeze(enabled) as freeze:` ... `freeze.after_iteration(timer)` at the end of each loop iteration."""

    def __init__(self, enabled: bool):
        self.enabled, self.frozen, self._frozen_before = enabled, False, 0

    def __enter__(self) -> "GCFreeze":
        return self

    @property
    def pending(self) -> bool:
        """The next after_iteration() collects and freezes (a ~1 s pause on the H200 machine, once per run)."""
        return self.enabled and not self.frozen

    def after_iteration(self, timer) -> None:
        """The first call collects and freezes, timed as the phase "gc_freeze" of `timer` (a metrics.PhaseTimer),
        so the pause counts in that iteration's total; later calls do nothing."""
        if not self.pending:
            return
        self._frozen_before = gc.get_freeze_count()  # someone else's freeze: left as it was on exit
        with timer("gc_freeze"):
            gc.collect()
            gc.freeze()
        self.frozen = True

    def close(self) -> None:
        """Unfreeze (what the freeze moved goes back to the oldest generation), unless it was frozen before."""
        if self.frozen and not self._frozen_before:
            gc.unfreeze()
        self.frozen = False

    def __exit__(self, *exc) -> None:
        self.close()
