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
    while True:
        fd = os.open(file, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RunDirInUse(f"{run_dir} is in use by another imagerl run ({_holder(file)}); two runs in one "
                              "directory would interleave their checkpoints and metrics. Wait for it to end, stop it, "
                              "or choose another --output-dir") from None
        try:  # the file we locked is still the one at the path (a failed run removes its lock file: see below)
            if os.stat(file).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
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
    """Within: this run (rank 0 for all ranks) holds run_dir's lock. Every rank raises alike when it cannot. A
    directory this run created and left holding only the lock file (a failure before anything was written, e.g. a
    bad --model) is removed again."""
    fd, error = None, None
    new = [d for d in (Path(run_dir), *Path(run_dir).parents) if not d.exists()]  # made by this run, innermost first
    created = bool(new)
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
            left_empty = created and [p.name for p in Path(run_dir).iterdir()] == [LOCK_FILE]
            if left_empty:  # unlinked while locked: a process waiting on this file retries on a new one
                (Path(run_dir) / LOCK_FILE).unlink()
            release(fd)
            for directory in new if left_empty else []:
                with contextlib.suppress(OSError):  # a directory something else wrote into meanwhile stays
                    directory.rmdir()
