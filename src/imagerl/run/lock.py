"""One writer per run directory: `imagerl train` holds an exclusive flock on <run>/.imagerl.lock while it runs.

Two runs started into one directory would both pass the empty-directory check and then interleave their
checkpoints and metrics.jsonl; the second is refused instead, with the holder's pid and host (written into the
lock file). The kernel releases a flock when its holder exits or crashes, so a stale lock file never blocks a
later run. On several ranks rank 0 takes the lock and every rank learns the outcome through one collective.

A run directory cannot be turned against its owner: imagerl never follows a symbolic link among the files it keeps
there (a link would make it overwrite or delete what the link points to), and a run refused at start (the
directory in use, not empty, not a run directory, a link among its files, a resume that cannot continue) writes
nothing: every check that can refuse reads only, and the lock is taken before anything is written.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import shlex
import socket
import string
import time
from pathlib import Path

import torch

LOCK_FILE = ".imagerl.lock"
# the names imagerl gives its checkpoint directories: step_<digits>, with .tmp or .old while one is swapped in;
# nothing else in checkpoints/ (a user's step_000002_keep_me, step_notes.txt) is a checkpoint or imagerl's to delete
CHECKPOINT_NAME = re.compile(r"step_(\d+)(\.tmp|\.old)?")


class RunDirInUse(ValueError):
    pass


def _holder(fd: int) -> str:
    try:  # read through the descriptor that was opened without following links
        info = json.loads(os.pread(fd, 4096, 0))
        return f"pid {info['pid']} on host {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that did not record itself"


def link_refusal(path: Path) -> str:
    fix = "move the link out of checkpoints/" if "checkpoints" in Path(path).parts else "remove the link"
    return (f"{path} is a symbolic link among the files imagerl keeps in a run directory, and imagerl never follows "
            f"one (it would write or delete what the link points to): {fix}, or choose another --output-dir (the run "
            "directory itself may be a link)")


def nofollow_opener(path, flags: int) -> int:
    """os.open without following a symbolic link at `path` (an opener for open()); a link is a ValueError."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # what O_NOFOLLOW answers for a link
            raise ValueError(link_refusal(Path(path))) from None
        raise


def acquire(run_dir: Path) -> int:
    """Create run_dir if needed, take its lock (non-blocking) and record this process; return the lock's fd. A
    refusal (the directory in use, a link for the lock file) writes nothing."""
    import fcntl

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        check_output_dir(run_dir)  # creates it; an unwritable path is a ValueError naming it
    file = run_dir / LOCK_FILE
    while True:
        try:
            fd = nofollow_opener(file, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise ValueError(f"run.output_dir {run_dir} is not writable: {e}; choose another with --output-dir") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = _holder(fd)
            os.close(fd)
            raise RunDirInUse(f"{run_dir} is in use by another imagerl run ({holder}); two runs in one "
                              "directory would interleave their checkpoints and metrics. Wait for it to end, stop it, "
                              "or choose another --output-dir") from None
        try:  # the file we locked is still the one at the path (a failed run removes its lock file: see below)
            if os.lstat(file).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        check_output_dir(run_dir)  # a full disk or read-only mount, found now that the directory is this run's
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
    except BaseException:
        release(fd)
        raise
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
RUN_OUTPUTS = ("metrics.jsonl", "metrics.jsonl.tmp", "tensorboard", "images", "checkpoints", "plots", "config.yaml",
               "config.resumed_*.yaml", "wandb_run_id")  # a new run is a new W&B run: its steps start at 0 again
# every name imagerl keeps in a run directory (train and sft): none of them may be a symbolic link
RUN_FILES = (*RUN_OUTPUTS, LOCK_FILE, "sft_config.yaml")


def check_run_files(run_dir) -> None:
    """ValueError naming the first symbolic link among the files imagerl keeps in run_dir (RUN_FILES and everything
    below them), links not followed. Allowed: a full fine-tuning checkpoint's model/<component> links to the base
    model (checkpoints/step_N/model/*), which imagerl made. Reads only."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return
    for entry in sorted(run_dir.iterdir()):
        if not any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in RUN_FILES):
            continue
        if entry.is_symlink():
            raise ValueError(link_refusal(entry))
        for root, dirs, files in os.walk(entry):  # os.walk lists a link to a directory and does not enter it
            for name in sorted(dirs + files):
                path = Path(root) / name
                parts = path.relative_to(run_dir).parts
                made_by_imagerl = len(parts) == 4 and parts[0] == "checkpoints" and parts[2] == "model"
                if path.is_symlink() and not made_by_imagerl:
                    raise ValueError(link_refusal(path))


def is_run_dir(path) -> bool:
    """Whether imagerl ran in `path`: it holds imagerl's lock file (every run that got the directory leaves it) or a
    complete checkpoint."""
    path, checkpoints = Path(path), Path(path) / "checkpoints"
    return (path / LOCK_FILE).is_file() or (checkpoints.is_dir() and any(
        CHECKPOINT_NAME.fullmatch(p.name) and (p / "state.json").is_file() for p in checkpoints.iterdir()))


def check_fresh_run_dir(path, overwrite: bool, config: dict | None = None) -> bool:
    """A new run (no --resume) refuses a run directory that already holds files: a second `imagerl train` would
    overwrite its checkpoints, grids and plots and append a second history to metrics.jsonl. With overwrite, a
    directory imagerl did not run in is refused (its files are not imagerl's to delete). The same run (`config`,
    the new run's settings) started again after it stopped before its first checkpoint has nothing to continue: it
    is restartable (`restartable`), and True says its outputs are to be replaced. Reads only: the deleting is
    clear_run_outputs'."""
    path = Path(path)
    present = sorted(p.name for p in path.iterdir() if p.name != LOCK_FILE) if path.is_dir() else []
    if not present:  # absent, empty, or only the lock file (this run's, or one a finished run left)
        return False
    if overwrite:
        if not is_run_dir(path):
            listing = ", ".join(present[:6]) + (f" and {len(present) - 6} more" if len(present) > 6 else "")
            raise FileExistsError(f"--overwrite: {path} is not an imagerl run directory (it holds {listing}, and "
                                  f"neither {LOCK_FILE} nor a checkpoint); imagerl deletes only what its own runs "
                                  "wrote: choose another --output-dir")
        return True
    if restartable(path, config):
        return True
    ours = _outputs(path)
    held = ", ".join(p.name for p in ours[:4]) or ", ".join(present[:4])
    raise FileExistsError(f"{path} already holds a run ({held}); continue it with `{continue_command(path)}`, start "
                          f"over with --overwrite (deletes its checkpoints, metrics, images and plots), or choose "
                          f"another --output-dir")


def continue_command(run_dir) -> str:
    """The command that continues the run in run_dir from its last checkpoint, from any directory (the path made
    absolute: a relative one, a folder named `latest` or starting with `-` would be read otherwise)."""
    where = shlex.quote(str(Path(run_dir).absolute()))
    if (Path(run_dir) / "sft_config.yaml").is_file():
        command = f"imagerl sft --output-dir {where} --resume latest"
    else:
        command = f"imagerl train --resume {where}"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # started by torchrun: the same launcher (and its other flags, as before)
        command = f"torchrun --nproc_per_node {os.environ.get('LOCAL_WORLD_SIZE', world)} -m {command}"
    return command


def restartable(path, config: dict | None) -> bool:
    """Whether `path` holds this same run (its config.yaml equals `config`, settings left to the family aside),
    started by imagerl train (the lock file; no sft_config.yaml) and stopped before any checkpoint was due: none on
    disk, complete or being swapped in, and metrics.jsonl's last rollout below the first one due (run.checkpoint_every
    or the last rollout). Another config aimed at the directory, or a finished run whose checkpoints were deleted,
    is not: those are refused as before."""
    import yaml

    path, checkpoints = Path(path), Path(path) / "checkpoints"
    if config is None or not (path / LOCK_FILE).is_file() or (path / "sft_config.yaml").exists():
        return False
    if checkpoints.is_dir() and any(CHECKPOINT_NAME.fullmatch(p.name) for p in checkpoints.iterdir()):
        return False
    try:
        saved = yaml.safe_load((path / "config.yaml").read_text())
        metrics = path / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        done = max((int(json.loads(line)["step"]) for line in lines if line.strip()), default=0)
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError):
        return False
    new = yaml.safe_load(yaml.safe_dump(config, sort_keys=False))  # the types config.yaml holds
    if not isinstance(saved, dict) or not _same_settings(saved, new):
        return False
    # the first checkpoint is written after rollout first_due is logged: a run that logged it and has none failed
    # or was stopped while writing it, or lost it later (deleted), and is left to --overwrite
    first_due = min(new["run"]["checkpoint_every"] or new["train"]["num_rollouts"], new["train"]["num_rollouts"])
    return done < first_due


def _same_settings(saved: dict, new: dict) -> bool:
    """saved == new, except where new leaves a setting to the family (None: train fills it before saving)."""
    if saved.keys() != new.keys():
        return False
    for key, value in new.items():
        if isinstance(value, dict):
            if not isinstance(saved[key], dict) or not _same_settings(saved[key], value):
                return False
        elif value is not None and saved[key] != value:
            return False
    return True


def clear_run_outputs(path) -> None:
    """--overwrite: remove imagerl's outputs (RUN_OUTPUTS) from the run directory; other files are left alone. Call
    on rank 0 only, holding the lock, after check_fresh_run_dir(path, overwrite=True)."""
    import shutil

    for p in _outputs(Path(path)):
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _outputs(path: Path) -> list[Path]:
    return sorted({p for pattern in RUN_OUTPUTS for p in path.glob(pattern)})
