"""`imagerl train` on an existing run directory, as a newcomer uses it: a second run is refused (or --overwrite
starts over), `--resume` without --recipe continues with the run's own settings, a finished run says so, Ctrl-C
ends with one line and the last checkpoint resumes."""

import json
import re
import shlex
import shutil
from pathlib import Path


from imagerl.cli import main

RECIPE = str(Path(__file__).parent / "tiny_recipe.yaml")


def _args(checkpoint, run_dir, *extra):
    """A tiny run through the CLI: tests/tiny_recipe.yaml on the tiny checkpoint, 2 prompts x 2 samples."""
    return ["train", "--recipe", RECIPE, "--output-dir", str(run_dir), f"model.path={checkpoint}", "model.device=cpu",
            "sample.height=64", "sample.width=64", "sample.prompts_per_rollout=2", "sample.group_size=2",
            "sample.batch_size=2", "train.num_rollouts=1", "run.tensorboard=false", "run.image_grid_every=0",
            "eval.interval=0", "eval.before_training=false", "data.test_prompts=", "model.lora_rank=2",
            "model.lora_alpha=4", *extra]


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_second_run_is_refused_and_overwrite_starts_over(tiny_checkpoint, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_args(tiny_checkpoint, run)) == 0
    config, metrics = (run / "config.yaml").read_text(), (run / "metrics.jsonl").read_text()
    (run / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert main(_args(tiny_checkpoint, run, "train.lr=0.5")) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and f"imagerl train --resume {run}" in err and "--overwrite" in err
    assert (run / "config.yaml").read_text() == config and (run / "metrics.jsonl").read_text() == metrics
    assert main(_args(tiny_checkpoint, run, "train.lr=0.5", "--overwrite")) == 0
    assert _steps(run) == [1]  # one history, not two
    assert "lr: 0.5" in (run / "config.yaml").read_text()
    assert (run / "notes.txt").read_text() == "mine"  # --overwrite removes imagerl's outputs only
    assert main(_args(tiny_checkpoint, run, "--overwrite", "--resume", "latest")) == 2


def test_resume_without_recipe_uses_the_runs_settings_and_a_finished_run_says_so(tiny_checkpoint, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_args(tiny_checkpoint, run)) == 0
    original = (run / "config.yaml").read_text()
    capsys.readouterr()
    # no --recipe: the default recipe (quickstart: rank 2 vs this run's... and another model) must not be used
    assert main(["train", "--resume", str(run), "train.num_rollouts=2"]) == 0
    out = capsys.readouterr().out
    assert f"resuming {run} after rollout 1 of 2" in out and "changed settings, applied: train.num_rollouts" in out
    assert _steps(run) == [1, 2]
    assert (run / "config.yaml").read_text() == original  # the original is kept
    state = json.loads((run / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["config"]["model"]["path"] == str(tiny_checkpoint) and state["config"]["model"]["lora_rank"] == 2
    # finished: nothing loads, nothing is written
    assert main(["train", "--resume", "latest", "--output-dir", str(run), "train.num_rollouts=2"]) == 0
    out = capsys.readouterr().out
    assert f"{run} is complete: 2 of train.num_rollouts=2 rollouts done" in out and "train.num_rollouts=4" in out
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.resumed_step_000001.yaml", "config.yaml"]
    # a setting that defines the run is refused by name, not a raw size mismatch
    assert main(["train", "--resume", str(run), "train.num_rollouts=3", "model.lora_rank=8"]) == 2
    assert "model.lora_rank" in capsys.readouterr().err


def test_ctrl_c_stops_with_one_line_and_the_last_checkpoint_resumes(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from imagerl.rewards.scoring import AsyncScorer

    run = tmp_path / "run"
    collect, calls = AsyncScorer.collect, []

    def interrupted_on_the_second_rollout(self):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return collect(self)

    monkeypatch.setattr(AsyncScorer, "collect", interrupted_on_the_second_rollout)
    assert main(_args(tiny_checkpoint, run, "train.num_rollouts=3", "run.checkpoint_every=1")) == 130
    err = capsys.readouterr().err
    assert "imagerl: interrupted" in err and "step_000001, is kept" in err and "Traceback" not in err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_000001"]
    monkeypatch.setattr(AsyncScorer, "collect", collect)
    # the printed command, run from another directory: it names this run's directory, not the default one
    command = shlex.split(re.search(r"continue with `([^`]*)`", err).group(1))
    assert command == ["imagerl", "train", "--resume", str(run)]
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(command[1:]) == 0
    assert _steps(run) == [1, 2, 3]


def test_ctrl_c_before_the_first_checkpoint_and_the_same_command_starts_again(tiny_checkpoint, tmp_path, capsys,
                                                                             monkeypatch):
    """Interrupted before any checkpoint: the message says so (no --resume to give), and the same command, without
    --overwrite, starts the run again in that directory: one history, not two. A directory imagerl did not run in,
    or one with a checkpoint, is still refused."""
    from imagerl.rewards.scoring import AsyncScorer

    run = tmp_path / "run"
    collect = AsyncScorer.collect

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(AsyncScorer, "collect", interrupted)
    monkeypatch.chdir(tmp_path)
    args = _args(tiny_checkpoint, "run", "train.num_rollouts=2")  # relative, as a user types it
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "run holds no checkpoint yet: the same command starts the run again" in err and "--resume" not in err
    assert (run / "config.yaml").is_file() and not list(run.glob("checkpoints/step_*"))
    monkeypatch.setattr(AsyncScorer, "collect", collect)
    config = (run / "config.yaml").read_text()
    assert main(_args(tiny_checkpoint, "run", "train.num_rollouts=2", "train.lr=0.5")) == 2  # another run: refused
    assert "already holds a run" in capsys.readouterr().err and (run / "config.yaml").read_text() == config
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "stopped before its first checkpoint: starting it again (replacing config.yaml" in out
    assert _steps(run) == [1, 2]
    assert main(args) == 2  # now it holds a checkpoint: refused, naming the command that continues it, absolute
    assert f"imagerl train --resume {run.absolute()}`" in capsys.readouterr().err
    for step in run.glob("checkpoints/step_*"):  # a finished run whose checkpoints were deleted: refused too
        shutil.rmtree(step)
    assert main(args) == 2 and _steps(run) == [1, 2]
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("")  # not imagerl's (no lock file): refused, nothing deleted
    assert main(_args(tiny_checkpoint, other)) == 2
    assert (other / "metrics.jsonl").is_file()


def test_a_resume_continues_toward_an_extension_stopped_before_its_first_checkpoint(tiny_checkpoint, tmp_path,
                                                                                   capsys, monkeypatch):
    """`--resume latest train.num_rollouts=3`, interrupted before the extension's first checkpoint, then
    `--resume latest`: it continues toward 3 (the run's latest config), not the checkpoint's 1. run.output_dir is
    not listed as a changed setting."""
    from imagerl.rewards.scoring import AsyncScorer

    run = tmp_path / "run"
    assert main(_args(tiny_checkpoint, run)) == 0
    collect = AsyncScorer.collect

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(AsyncScorer, "collect", interrupted)
    assert main(["train", "--resume", "latest", "--output-dir", str(run), "train.num_rollouts=3"]) == 130
    monkeypatch.setattr(AsyncScorer, "collect", collect)
    capsys.readouterr()
    assert main(["train", "--resume", "latest", "--output-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "continuing toward train.num_rollouts=3, the run's latest target (config.resumed_step_000001.yaml)" in out
    assert f"resuming {run} after rollout 1 of 3" in out and "run.output_dir" not in out
    assert _steps(run) == [1, 2, 3]
