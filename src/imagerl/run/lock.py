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
import string
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


def validate_output_dir(cfg) -> Path:
    """run.output_dir formats (only {recipe}), and a recipe name put into it cannot leave its parent directory."""
    out = cfg.output_dir  # ValueError for an unknown or malformed placeholder
    uses_recipe = any(field is not None for _, field, _, _ in string.Formatter().parse(cfg.run.output_dir))
    if uses_recipe and (not cfg.recipe or any(bad in cfg.recipe for bad in ("/", "\\", ".."))):
        raise ValueError(f"recipe name {cfg.recipe!r} cannot be used in run.output_dir={cfg.run.output_dir!r}: it is "
                         "empty or contains '/', '\\' or '..', so the run directory would leave its parent; rename the "
                         "recipe or set run.output_dir (--output-dir) to a path without {recipe}")
    return out


def check_output_dir(path) -> Path:
    """Create the run directory if needed and write and remove a probe file in it, before any model loads: an
    unwritable path or a full disk is a ValueError naming the path and the OS reason."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"run.output_dir {path} is a file, not a directory; choose another with --output-dir")
    probe = path / f".imagerl_write_probe_{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"imagerl")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"run.output_dir {path} is not writable: {e}; choose another with --output-dir") from e
    return path


# what `imagerl train` writes in a run directory (--overwrite removes these and nothing else)
RUN_OUTPUTS = ("metrics.jsonl", "tensorboard", "images", "checkpoints", "plots", "config.yaml", "config.resumed_*.yaml")


def check_fresh_run_dir(path, overwrite: bool) -> None:
    """A new run (no --resume) refuses a run directory that already holds files: a second `imagerl train` would
    overwrite its checkpoints, grids and plots and append a second history to metrics.jsonl. overwrite=True
    removes imagerl's outputs (RUN_OUTPUTS) first; other files are left alone. Call on rank 0 only."""
    import shutil

    path = Path(path)
    present = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE) if path.is_dir() else []
    if not present:  # absent, empty, or only the lock file (this run's, or one a finished run left)
        return
    ours = sorted({p for pattern in RUN_OUTPUTS for p in path.glob(pattern)})
    if not overwrite:
        held = ", ".join(p.name for p in ours[:4]) or ", ".join(present[:4])
        raise FileExistsError(f"{path} already holds a run ({held}); continue it with `--resume latest` (same "
                              f"--recipe/--output-dir), start over with --overwrite (deletes its checkpoints, "
                              f"metrics, images and plots), or choose another --output-dir")
    for p in ours:
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
