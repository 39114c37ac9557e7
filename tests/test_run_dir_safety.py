"""A run directory cannot be turned against its owner, and every fault is one line (tiny checkpoint, CPU): run files
are never followed through symbolic links, a refused run changes nothing, a kill inside a checkpoint swap or inside
resume's rewrite of metrics.jsonl loses no history, pruning and --overwrite touch only what imagerl wrote, and a
full disk names the file, the space needed and the next step that works."""

import errno
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import tiny_config
from imagerl.cli import main
from imagerl.run.checkpoint import latest_checkpoint, prune_checkpoints, recover_interrupted, verify_checkpoint
from imagerl.run.lock import LOCK_FILE, RunDirInUse, acquire
from imagerl.train import train

pytestmark = pytest.mark.timeout(600)  # subprocesses and lock holders: a hang fails, it does not stall CI

COMMON = ["train.num_rollouts=2", "run.checkpoint_every=1", "run.keep_checkpoints=3"]
RECIPE = str(Path(__file__).parent / "tiny_recipe.yaml")


@pytest.fixture(scope="module")
def run(tiny_checkpoint, tmp_path_factory):
    """A finished 2-rollout run (checkpoints after rollouts 1 and 2), copied by each test that changes it."""
    run_dir = tmp_path_factory.mktemp("run_dir_safety") / "run"
    train(tiny_config(tiny_checkpoint, run_dir, *COMMON))
    return run_dir


def _copy(run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    return out


def _cli(checkpoint, run_dir, *extra):
    """`imagerl train` arguments for a tiny fresh run (tests/tiny_recipe.yaml on the tiny checkpoint)."""
    return ["train", "--recipe", RECIPE, "--output-dir", str(run_dir), f"model.path={checkpoint}", "model.device=cpu",
            "sample.height=64", "sample.width=64", "sample.prompts_per_rollout=2", "sample.group_size=2",
            "sample.batch_size=2", "train.num_rollouts=1", "run.tensorboard=false", "run.image_grid_every=0",
            "eval.interval=0", "eval.before_training=false", "data.test_prompts=", *extra]


def _snapshot(root: Path) -> dict:
    """Every entry at and below root, links not followed: kind, mtime, and the content of files and links."""
    out = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        if path.is_symlink():
            content = os.readlink(path)
        elif path.is_file():
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            content = None
        out[path.relative_to(root).as_posix()] = (st.st_mode, st.st_mtime_ns, st.st_size, content)
    return out


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("imagerl: error: "), err
    return err[0]


# ---------------------------------------------------------------- symbolic links


def test_a_symlinked_lock_file_is_refused_and_its_target_untouched(tiny_checkpoint, tmp_path, capsys):
    precious = tmp_path / "v.txt"
    precious.write_text("precious\n")
    run_dir = tmp_path / "d"
    run_dir.mkdir()
    (run_dir / LOCK_FILE).symlink_to(precious)
    (run_dir / "x").touch()
    assert main(_cli(tiny_checkpoint, run_dir)) == 2
    line = _one_error_line(capsys)
    assert f"{run_dir / LOCK_FILE} is a symbolic link" in line
    with pytest.raises(ValueError, match="is a symbolic link"):  # the lock itself never opens through a link
        acquire(run_dir)
    assert precious.read_text() == "precious\n"


def test_a_symlinked_metrics_file_is_refused_on_resume_and_its_target_untouched(run, tmp_path, tiny_checkpoint):
    run_dir = _copy(run, tmp_path)
    target = tmp_path / "elsewhere.jsonl"
    (run_dir / "metrics.jsonl").rename(target)
    (run_dir / "metrics.jsonl").symlink_to(target)
    before, content = _snapshot(run_dir), target.read_bytes()
    with pytest.raises(ValueError, match=re.escape(f"{run_dir / 'metrics.jsonl'} is a symbolic link")):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3"), resume="latest")
    assert _snapshot(run_dir) == before and target.read_bytes() == content


def test_metrics_are_never_written_through_a_link_made_while_the_run_goes(tmp_path):
    from imagerl.run.metrics import MetricsLogger

    logger = MetricsLogger(tmp_path / "run", True, False)
    logger.log(1, {"rollout/reward/raw_mean": 0.5}, echo=lambda line: None)
    target = tmp_path / "precious.txt"
    target.write_text("precious\n")
    (tmp_path / "run" / "metrics.jsonl").unlink()
    (tmp_path / "run" / "metrics.jsonl").symlink_to(target)
    with pytest.raises(ValueError, match="metrics.jsonl is a symbolic link"):
        logger.log(2, {"rollout/reward/raw_mean": 0.5}, echo=lambda line: None)
    with pytest.raises(ValueError, match="metrics.jsonl is a symbolic link"):
        logger.truncate_after(1)
    assert target.read_text() == "precious\n"


@pytest.mark.parametrize("link", ["checkpoints/step_000002", "checkpoints/step_000002/trainer/tensors.safetensors",
                                  "checkpoints/step_000003", "checkpoints"])
def test_a_symlinked_checkpoint_is_refused_on_resume_and_never_written_through(run, tmp_path, tiny_checkpoint, link):
    """A checkpoint directory or file that is a link (to be read, or the name of the next checkpoint, or the whole
    checkpoints/ folder) is refused before anything is read or written; what it points to stays as it was."""
    run_dir = _copy(run, tmp_path)
    entry, target = run_dir / link, tmp_path / "elsewhere" / Path(link).name
    target.parent.mkdir()
    if entry.exists():
        entry.rename(target)
    else:  # the name the resumed run would write its next checkpoint to
        target.mkdir()
        (target / "precious.txt").write_text("precious\n")
    entry.symlink_to(target, target_is_directory=target.is_dir())
    before, outside = _snapshot(run_dir), _snapshot(target.parent)
    with pytest.raises(ValueError, match=re.escape(f"{entry} is a symbolic link")):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3"), resume="latest")
    assert _snapshot(run_dir) == before and _snapshot(target.parent) == outside


# ---------------------------------------------------------------- kills


# Runs `imagerl train ARGS` in a fresh process that SIGKILLs itself at an injected point (the first argument):
# "swap": right after the rename that moves an existing checkpoint aside, before the new one is renamed into place;
# "metrics": at the first write while resume rewrites metrics.jsonl (the file has been opened for it).
KILLER = r"""
import os, pathlib, signal, sys

def die():
    os.kill(os.getpid(), signal.SIGKILL)

point = sys.argv.pop(1)
if point == "swap":
    rename = pathlib.Path.rename

    def killed_after_moving_aside(self, target):
        result = rename(self, target)
        if str(target).endswith(".old"):
            die()
        return result

    pathlib.Path.rename = killed_after_moving_aside
else:
    from imagerl.run.metrics import MetricsLogger
    truncate_after = MetricsLogger.truncate_after

    def killed_while_rewriting(self, step):
        def profile(frame, event, arg):
            if event == "c_call" and getattr(arg, "__name__", "") == "write":
                die()
        sys.setprofile(profile)
        truncate_after(self, step)
        sys.setprofile(None)

    MetricsLogger.truncate_after = killed_while_rewriting
from imagerl.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _killed(point: str, *args: str) -> None:
    proc = subprocess.run([sys.executable, "-c", KILLER, point, *args], capture_output=True, text=True, timeout=500)
    assert proc.returncode == -9, proc.stderr[-3000:]  # it died at the injected point, not before or after


def test_a_kill_between_the_renames_of_an_overwriting_swap_keeps_the_new_checkpoint(run, tmp_path, capsys):
    """Rollout 2 is trained again from step_000001 with train.lr=0.5 and killed between moving the old step_000002
    aside and renaming the new one into place. The resume finishes the swap: the new step_000002 (lr 0.5) stays,
    the abandoned one is gone, and pruning counts neither it nor anything else but step_<digits> checkpoints."""
    run_dir = _copy(run, tmp_path)
    ckpts = run_dir / "checkpoints"
    _killed("swap", "train", "--resume", str(ckpts / "step_000001"), "train.lr=0.5")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000001", "step_000002.old", "step_000002.tmp"]
    assert main(["train", "--resume", "latest", "--output-dir", str(run_dir), "train.num_rollouts=3",
                 "run.keep_checkpoints=2"]) == 0
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000003"]
    assert verify_checkpoint(ckpts / "step_000002")["config"]["train"]["lr"] == 0.5  # the trajectory resumed
    assert _steps(run_dir) == [1, 2, 3]


def test_a_kill_while_resume_rewrites_metrics_keeps_the_history(run, tmp_path):
    """Resuming from step_000001 rewrites metrics.jsonl without rollout 2; a kill at that moment leaves the file
    as it was or as it was to become, never shorter, and the next resume continues a complete history."""
    run_dir = _copy(run, tmp_path)
    _killed("metrics", "train", "--resume", str(run_dir / "checkpoints" / "step_000001"))
    assert _steps(run_dir) in ([1, 2], [1])
    assert main(["train", "--resume", "latest", "--output-dir", str(run_dir), "train.num_rollouts=3"]) == 0
    assert _steps(run_dir) == [1, 2, 3]
    assert not [p.name for p in run_dir.iterdir() if "metrics" in p.name and p.name != "metrics.jsonl"]


# ---------------------------------------------------------------- a refused run changes nothing


HOLD = "import sys, time; from imagerl.run.lock import acquire; acquire(sys.argv[1]); print('held', flush=True); " \
       "time.sleep(600)"


def test_a_refused_run_changes_nothing_in_the_run_directory(run, tmp_path, tiny_checkpoint):
    """A run directory left mid-swap (step_000002 moved aside, the new one complete in step_000002.tmp): a resume
    refused because another process holds the directory, one refused for a changed fixed setting, and a fresh run
    refused because the directory holds a run leave every entry, its content and its mtime as they were."""
    run_dir = _copy(run, tmp_path)
    ckpts = run_dir / "checkpoints"
    shutil.copytree(ckpts / "step_000002", ckpts / "step_000002.tmp")
    (ckpts / "step_000002").rename(ckpts / "step_000002.old")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = _snapshot(run_dir)
        with pytest.raises(RunDirInUse, match=f"pid {holder.pid}"):
            train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3"), resume="latest")
        assert _snapshot(run_dir) == before
    finally:
        holder.kill()
        holder.wait()
    with pytest.raises(ValueError, match="written by run.seed="):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON, "train.num_rollouts=3", "run.seed=7"), resume="latest")
    with pytest.raises(FileExistsError, match="already holds a run"):
        train(tiny_config(tiny_checkpoint, run_dir, *COMMON))
    assert _snapshot(run_dir) == before


# ---------------------------------------------------------------- pruning and --overwrite


def _fake_checkpoint(path: Path, step: int) -> Path:
    path.mkdir(parents=True)
    (path / "state.json").write_text(json.dumps({"format": 2, "step": step}))
    return path


def test_only_complete_step_digits_directories_count_as_checkpoints(tmp_path):
    ckpts = tmp_path / "checkpoints"
    for step in (1, 2, 3, 4):
        _fake_checkpoint(ckpts / f"step_{step:06d}", step)
    (ckpts / "step_000005").mkdir()  # no state.json: not a checkpoint, not imagerl's to delete
    _fake_checkpoint(ckpts / "step_000002_keep_me", 2)
    _fake_checkpoint(ckpts / "step_999999_backup", 999999)
    (ckpts / "step_notes.txt").write_text("mine")
    (ckpts / "step_000006.tmp").mkdir()  # a checkpoint a kill cut off while it was written
    assert latest_checkpoint(tmp_path) == ckpts / "step_000004"
    prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in ckpts.iterdir()) == sorted([
        "step_000003", "step_000004", "step_000005", "step_000006.tmp", "step_000002_keep_me", "step_999999_backup",
        "step_notes.txt"])
    assert (ckpts / "step_notes.txt").read_text() == "mine"
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 4, "rollout/reward_mean": 0.5}) + "\n")
    from imagerl.run.report import summarize

    assert summarize(tmp_path).checkpoints == ["step_000003", "step_000004"]  # `imagerl report` counts as prune does


def test_a_metrics_line_nested_past_the_recursion_limit_is_one_error_naming_the_line(tmp_path):
    from imagerl.run.best_checkpoint import read_best
    from imagerl.run.metrics import read_metrics

    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + deep + "\n" + json.dumps({"step": 2}) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: JSON nested too deeply"):
        read_metrics(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "best.json").write_text(deep)
    assert read_best(tmp_path) is None  # as any unreadable best.json: the next best checkpoint rewrites it


@pytest.mark.parametrize("left, kept", [
    ({"step_000002.old": 1, "step_000002.tmp": 2}, 2),  # killed between the two renames: the new one wins
    ({"step_000002": 2, "step_000002.old": 1}, 2),      # killed before the moved-aside copy was removed
    ({"step_000002.old": 1}, 1),                        # only the moved-aside copy is left of that name
    ({"step_000002": 1, "step_000002.tmp": 2}, 1),      # killed before the swap began: the name keeps its copy
])
def test_recovery_finishes_an_interrupted_swap_and_leaves_no_second_copy(tmp_path, left, kept):
    ckpts = tmp_path / "checkpoints"
    for name, version in left.items():
        _fake_checkpoint(ckpts / name, 2)
        (ckpts / name / "version").write_text(str(version))
    recover_interrupted(tmp_path)
    assert not (ckpts / "step_000002.old").exists()
    assert (ckpts / "step_000002" / "version").read_text() == str(kept)
    assert latest_checkpoint(tmp_path) == ckpts / "step_000002"


def test_overwrite_refuses_a_directory_imagerl_did_not_create(tiny_checkpoint, tmp_path, capsys):
    foreign = tmp_path / "photos"
    (foreign / "images").mkdir(parents=True)
    (foreign / "images" / "holiday.png").write_bytes(b"\x89PNG not really")
    (foreign / "config.yaml").write_text("camera: mine\n")
    before = _snapshot(foreign)
    assert main(_cli(tiny_checkpoint, foreign, "--overwrite")) == 2
    line = _one_error_line(capsys)
    assert f"{foreign} is not an imagerl run directory" in line and "config.yaml, images" in line
    assert _snapshot(foreign) == before


# ---------------------------------------------------------------- a full disk


def test_a_full_disk_at_the_first_checkpoint_names_the_path_and_size_and_says_to_start_over(tiny_checkpoint, tmp_path,
                                                                                          monkeypatch, capsys):
    import imagerl.run.checkpoint_tensors as checkpoint_tensors

    real = checkpoint_tensors.save_file

    def full(tensors, file, **kwargs):  # the device fills half-way through the first checkpoint's tensors
        real(dict(list(tensors.items())[:2]), file)
        raise OSError(errno.ENOSPC, "No space left on device", str(file))

    monkeypatch.setattr(checkpoint_tensors, "save_file", full)
    run_dir = tmp_path / "run"
    assert main(_cli(tiny_checkpoint, run_dir)) == 2
    line = _one_error_line(capsys)
    assert f"checkpoint step_000001 (it needs about" in line and str(run_dir / "checkpoints") in line
    size = re.search(r"it needs about ([\d.]+) (KB|MB|GB)", line)
    assert size and float(size[1]) > 0, line
    assert "no checkpoint exists yet" in line and "--overwrite" in line and "--resume" not in line
    assert not (run_dir / "checkpoints" / "step_000001.tmp").exists()
    monkeypatch.setattr(checkpoint_tensors, "save_file", real)
    assert main(_cli(tiny_checkpoint, run_dir, "--overwrite")) == 0  # the advice works
    assert _steps(run_dir) == [1]


class _FillsUp:
    """A file on a device that fills half-way through the next write."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        self.f.write(data[:len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_while_writing_metrics_leaves_no_torn_line_and_names_the_file(tmp_path, monkeypatch):
    import builtins

    import imagerl.run.metrics as metrics

    logger = metrics.MetricsLogger(tmp_path / "run", True, False)
    logger.log(1, {"rollout/reward/raw_mean": 0.5}, echo=lambda line: None)
    path = tmp_path / "run" / "metrics.jsonl"
    first = path.read_bytes()
    monkeypatch.setattr(metrics, "open", lambda *a, **k: _FillsUp(builtins.open(*a, **k)), raising=False)
    with pytest.raises(OSError, match=rf"{re.escape(str(path))}: .*record of step 2 .*{os.strerror(errno.ENOSPC)}"
                                      r".*free space"):
        logger.log(2, {"rollout/reward/raw_mean": 0.25}, echo=lambda line: None)
    assert path.read_bytes() == first  # the half-written line was taken back
    monkeypatch.undo()
    logger.log(2, {"rollout/reward/raw_mean": 0.25}, echo=lambda line: None)  # space freed: it goes on cleanly
    assert _steps(tmp_path / "run") == [1, 2]
