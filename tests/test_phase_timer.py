"""PhaseTimer: wall seconds per phase and the garbage-collection pauses inside the phases."""

import gc
import time

import torch

from imagerl.run.metrics import PhaseTimer


def test_gc_pauses_inside_phases_are_counted_and_outside_are_not():
    timer = PhaseTimer(torch.device("cpu"))
    garbage = [[i] for i in range(200_000)]  # objects for the full collections to walk
    gc.disable()  # only the collections this test makes
    try:
        with timer("rollout"):
            time.sleep(0.01)
        gc.collect()  # between phases: not counted
        quiet = timer.pop_metrics()
        with timer("train"):
            gc.collect()
            gc.collect(0)  # a young collection: a pause, not a full one
        with timer("reward"):
            start = time.perf_counter()
            gc.collect()
            full_pause = time.perf_counter() - start
        busy = timer.pop_metrics()
    finally:
        gc.enable()
    del garbage
    assert quiet["perf/gc_pause_s"] == 0.0 and quiet["perf/gc_full_collections"] == 0.0
    assert quiet["time/total_s"] == quiet["time/rollout_s"] >= 0.01
    assert busy["perf/gc_full_collections"] == 2.0
    assert full_pause * 0.5 < busy["perf/gc_pause_s"] <= busy["time/train_s"] + busy["time/reward_s"]
    assert busy["time/total_s"] == busy["time/train_s"] + busy["time/reward_s"]  # the pauses are not a phase
