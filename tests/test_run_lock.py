"""One writer per run directory: a second `imagerl train` into a directory in use is refused with the holder's pid
and host; the lock dies with its holder (tiny checkpoint, CPU)."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from conftest import tiny_config
from imagerl.run.lock import LOCK_FILE, RunDirInUse, acquire, release
from imagerl.train import train

pytestmark = pytest.mark.timeout(300)  # each test starts lock-holding processes: a hang fails, it does not stall CI

HOLD = "import sys, time; from imagerl.run.lock import acquire; acquire(sys.argv[1]); print('held', flush=True); " \
       "time.sleep(600)"


def _holder(run_dir):
    """Another process holding run_dir's lock (as a running `imagerl train` does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_run_into_a_directory_in_use_is_refused_naming_the_holder(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    proc = _holder(run_dir)
    try:
        with pytest.raises(RunDirInUse, match=rf"{run_dir} is in use by another imagerl run \(pid {proc.pid} on "
                                              rf"host {socket.gethostname()}, since .*choose another --output-dir"):
            train(tiny_config(tiny_checkpoint, run_dir, "train.num_rollouts=1"))
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]  # nothing was written
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # a crash: the kernel drops its lock
        proc.wait()
    train(tiny_config(tiny_checkpoint, run_dir, "train.num_rollouts=1"))  # the stale lock file does not block
    assert (run_dir / "checkpoints" / "step_000001" / "state.json").is_file()
    held = _holder(run_dir)  # and a resume is refused as well while another process holds the directory
    try:
        with pytest.raises(RunDirInUse, match=f"pid {held.pid}"):
            train(tiny_config(tiny_checkpoint, run_dir, "train.num_rollouts=2"), resume="latest")
    finally:
        held.kill()
        held.wait()


def test_the_lock_is_released_when_a_run_ends_or_fails(tiny_checkpoint, tmp_path, monkeypatch):
    import imagerl.train as train_module

    run_dir = tmp_path / "run"

    def broken(*args, **kwargs):
        raise RuntimeError("the model failed to load")

    monkeypatch.setattr(train_module, "load_adapter", broken)  # fails while the lock is held
    with pytest.raises(RuntimeError, match="failed to load"):
        train(tiny_config(tiny_checkpoint, run_dir, "train.num_rollouts=1"))
    monkeypatch.undo()
    train(tiny_config(tiny_checkpoint, run_dir, "train.num_rollouts=1", "run.checkpoint_every=1"))
    fd = acquire(run_dir)  # train released it
    assert json.loads((run_dir / LOCK_FILE).read_text())["pid"] == os.getpid()
    release(fd)


def test_a_run_that_fails_before_writing_leaves_no_directory(tmp_path):
    from imagerl.config import load_config

    run_dir = tmp_path / "new" / "run"
    cfg = load_config("quickstart", [f"run.output_dir={run_dir}", f"model.path={tmp_path / 'no-such-model'}"])
    with pytest.raises(ValueError, match="no-such-model"):
        train(cfg)
    assert not (tmp_path / "new").exists()
