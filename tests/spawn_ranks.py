"""Start a multi-process test's ranks and wait for them with a deadline: a rank that hangs (a collective whose peer
died, a deadlocked gloo group) fails the test after `timeout_s` instead of hanging CI, and every rank still alive is
killed, so no orphan keeps the test session (or the port) busy. The tests that use this are also marked
@pytest.mark.timeout (pytest-timeout, the `test` extra) as a second net: its signal interrupts the wait below, and
the `finally` still kills the ranks."""

from __future__ import annotations

import time

import torch.multiprocessing as mp


def spawn_and_join(fn, args: tuple, nprocs: int, timeout_s: float = 600) -> None:
    """mp.start_processes(fn, args, nprocs, start_method="spawn") joined within timeout_s seconds. A rank's exception
    is raised as torch's ProcessRaisedException (the others are terminated, as join=True does); past the deadline,
    TimeoutError naming the ranks still running."""
    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=min(5.0, max(0.1, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                alive = [rank for rank, p in enumerate(context.processes) if p.is_alive()]
                raise TimeoutError(f"ranks {alive} of {nprocs} still running after {timeout_s:.0f} s: killed")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
        for p in context.processes:
            p.join(10)
