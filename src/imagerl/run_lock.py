"""One writer per run directory: `imagerl train` holds an exclusive flock on <run>/.imagerl.lock while it runs.

Two runs started into one directory would both pass the empty-directory check and then interleave their
checkpoints and metrics.jsonl; the second is refused instead, with the holder's pid and host (written into the
lock file). The kernel releases a flock when its holder exits or crashes, so a stale lock file never blocks a
later run. On several ranks rank 0 takes the lock and every rank learns the outcome through one collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from pathlib import Path

import torch

LOCK_FILE = ".imagerl.lock"


class RunDirInUse(ValueError):
    pass


def _holder(file: Path) -> str:
    try:
        info = json.loads(file.read_text())
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that did not record itself"


def acquire(run_dir: Path) -> int:
    """Create run_dir if needed, take its lock (non-blocking) and record this process; return the lock's fd."""
    import fcntl

    from imagerl.validation import check_output_dir

    check_output_dir(run_dir)  # creates it; an unwritable path is a ValueError naming it
    file = Path(run_dir) / LOCK_FILE
    fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RunDirInUse(f"{run_dir} is in use by another imagerl run ({_holder(file)}); two runs in one directory "
                          "would interleave their checkpoints and metrics. Wait for it to end, stop it, or choose "
                          "another --output-dir") from None
    record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps(record).encode())
    return fd


def release(fd: int) -> None:
    import fcntl

    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


@contextlib.contextmanager
def hold_run_dir(run_dir: Path, world):
    """Within: this run (rank 0 for all ranks) holds run_dir's lock. Every rank raises alike when it cannot."""
    fd, error = None, None
    if world.is_main:
        try:
            fd = acquire(run_dir)
        except Exception as e:  # said after the agreement, so that no rank waits for a rank that left
            error = e
    if world.size > 1:
        failed = torch.tensor([0.0 if error is None else 1.0], device=world.device)
        if world.all_reduce_mean_(failed).item() > 0 and error is None:
            if fd is not None:
                release(fd)
            raise RunDirInUse(f"{run_dir}: rank 0 could not take the run directory (its message says why)")
    if error is not None:
        raise error
    try:
        yield
    finally:
        if fd is not None:
            release(fd)
