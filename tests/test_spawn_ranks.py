"""tests/spawn_ranks.py, the deadline the multi-process tests join their ranks with: a hanging rank fails the test in
time and no rank outlives it; a failing rank's exception comes through as it did with join=True."""

import os
import time

import pytest
from torch.multiprocessing import ProcessRaisedException

from spawn_ranks import spawn_and_join


def _hang_on_rank_1(rank: int, out) -> None:
    (out / f"pid{rank}").write_text(str(os.getpid()))
    if rank == 1:
        time.sleep(600)  # a rank waiting on a collective whose peer is gone


def _fail_on_rank_0(rank: int) -> None:
    if rank == 0:
        raise RuntimeError("rank 0 broke")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is not running
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.timeout(120)
def test_a_hanging_rank_fails_at_the_deadline_and_is_killed(tmp_path):
    start = time.monotonic()
    # (rank 0 may still be starting when the deadline comes: it is killed too)
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] of 2 still running after 10 s: killed"):
        spawn_and_join(_hang_on_rank_1, (tmp_path,), 2, timeout_s=10)
    assert time.monotonic() - start < 60  # the deadline, plus killing
    pids = [int(f.read_text()) for f in tmp_path.glob("pid*")]
    assert (tmp_path / "pid1").is_file() and not any(_alive(pid) for pid in pids)


@pytest.mark.timeout(120)
def test_a_failing_rank_raises_its_exception():
    with pytest.raises(ProcessRaisedException, match="rank 0 broke"):
        spawn_and_join(_fail_on_rank_0, (), 2, timeout_s=60)
