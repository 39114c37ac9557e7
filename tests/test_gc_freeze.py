"""run.gc_freeze: after the first iteration one collection, then gc.freeze(); undone on exit."""

import gc
import weakref

import torch

from imagerl.run.gc_freeze import GCFreeze
from imagerl.run.metrics import PhaseTimer


class _Node:
    pass


def _cycle():
    """An object in a reference cycle (only the cyclic collector frees it) and a weak reference to it."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return a, weakref.ref(a)


def test_freeze_moves_the_survivors_out_of_later_collections_and_exit_undoes_it():
    assert gc.get_freeze_count() == 0
    garbage_before, gone_before = _cycle()
    del garbage_before
    kept, kept_ref = _cycle()  # alive at the freeze
    timer = PhaseTimer(torch.device("cpu"))
    with GCFreeze(True) as freeze:
        assert freeze.pending
        freeze.after_iteration(timer)
        assert gone_before() is None  # the collection before the freeze freed the garbage there was
        assert not freeze.pending and gc.get_freeze_count() > 0
        freeze.after_iteration(timer)  # once per run
        frozen = gc.get_freeze_count()
        timed = timer.pop_metrics()
        assert timed["time/gc_freeze_s"] > 0 and timed["perf/gc_full_collections"] >= 1  # timed, once
        del kept  # garbage now, but frozen: later collections do not walk it
        gc.collect()
        assert kept_ref() is not None
        new, new_ref = _cycle()  # made after the freeze: collected as usual
        del new
        gc.collect()
        # Collections add nothing to the frozen set; it may shrink, since a frozen object whose
        # refcount drops to 0 (any thread, any library) leaves it (CI saw 515990 -> 515988).
        assert new_ref() is None and gc.get_freeze_count() <= frozen
    assert gc.get_freeze_count() == 0  # unfrozen on exit: the next collection frees the frozen garbage
    gc.collect()
    assert kept_ref() is None


def test_disabled_freezes_nothing():
    timer = PhaseTimer(torch.device("cpu"))
    with GCFreeze(False) as freeze:
        assert not freeze.pending
        freeze.after_iteration(timer)
        assert gc.get_freeze_count() == 0
    assert "time/gc_freeze_s" not in timer.pop_metrics()


def test_a_freeze_made_by_someone_else_is_left_in_place():
    gc.freeze()
    try:
        with GCFreeze(True) as freeze:
            freeze.after_iteration(PhaseTimer(torch.device("cpu")))
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
