"""What a run prints: one line per rollout without a terminal, progress and summaries on rank 0 only, the other
ranks' warnings with a rank prefix; the bundled recipes' batch arithmetic on 1, 2 and 4 ranks."""

import io
import os
import re
import socket

import pytest

from conftest import tiny_config
from spawn_ranks import spawn_and_join
from imagerl.config import available_recipes, load_config
from imagerl.run.console import RankPrefixed, format_duration
from imagerl.validation import validate


@pytest.mark.parametrize("name", available_recipes())
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_bundled_recipe_validates_unchanged_on_1_2_and_4_ranks(name, world_size):
    cfg = load_config(name)
    plan = validate(cfg, world_size)
    assert plan.samples_per_rank * world_size == plan.samples_per_rollout
    assert cfg.sample.batch_size <= plan.samples_per_rank and plan.samples_per_rank % cfg.sample.batch_size == 0


def test_rollout_batch_is_a_per_rank_ceiling():
    cfg = load_config("quickstart")  # 16 prompts x 8 samples in one forward of 128
    assert validate(cfg, 2).samples_per_rank == 64 and cfg.sample.batch_size == 64
    cfg = load_config("quickstart", ["train.batch_size=128"])
    validate(cfg, 4)
    assert (cfg.sample.batch_size, cfg.train.batch_size) == (32, 0)  # training batch: the rollout's
    with pytest.raises(ValueError, match="not a multiple of sample.batch_size=48"):  # below the ceiling: as given
        validate(load_config("quickstart", ["sample.batch_size=48"]), 2)


def test_rank_prefixed_stream_keeps_whole_lines_and_drops_progress_redraws():
    out = io.StringIO()
    stream = RankPrefixed(out, 3)
    stream.write("UserWarning: something\nhalf a ")
    stream.write("line\n\rrollouts:  10%|#  | 1/10\r\n")
    assert out.getvalue() == "[rank 3] UserWarning: something\n[rank 3] half a line\n"
    assert format_duration(42.4) == "42s" and format_duration(185) == "3m05s" and format_duration(3720) == "1h02m"


def test_without_a_terminal_a_run_logs_one_line_per_rollout(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    from imagerl.train import train

    monkeypatch.delenv("IMAGERL_PROGRESS", raising=False)  # pytest's captured streams are not terminals
    train(tiny_config(tiny_checkpoint, tmp_path, "train.num_rollouts=3"))
    out, err = capsys.readouterr()
    rollout_lines = [line for line in out.splitlines() if line.startswith("[rollout")]
    assert len(rollout_lines) == 3
    for k, line in enumerate(rollout_lines, 1):
        assert re.fullmatch(rf"\[rollout {k}\] .*reward/raw_mean=\S+.*  \[{k}/3, eta \d+s\]", line), line
    assert "\r" not in out and "\r" not in err and "rollouts:" not in err  # no progress-bar redraws


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cli_rank(rank: int, port: int, run_dir, logs, cache) -> None:
    """`imagerl train` (the quickstart recipe, 1 rollout, a few evaluation prompts) as torchrun's rank `rank`, its
    standard output and error in files."""
    import sys

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), IMAGERL_CACHE=cache, IMAGERL_PROGRESS="1")
    sys.stdout = open(logs / f"out{rank}.txt", "w")
    sys.stderr = open(logs / f"err{rank}.txt", "w")
    sys.__stderr__ = sys.stderr  # RankPrefixed writes to the process's original standard error
    from imagerl.cli import main

    try:
        assert main(["train", "--output-dir", str(run_dir), "train.num_rollouts=1", "eval.max_prompts=8",
                     "run.tensorboard=false"]) == 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_process_train_prints_progress_and_summary_on_rank_0_only(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    spawn_and_join(_cli_rank, (_free_port(), tmp_path / "run", logs, os.environ["IMAGERL_CACHE"]), 2, timeout_s=600)
    out0, err0 = (logs / "out0.txt").read_text(), (logs / "err0.txt").read_text()
    out1, err1 = (logs / "out1.txt").read_text(), (logs / "err1.txt").read_text()
    assert "[rollout 1]" in out0 and "done: " in out0 and "held-out evaluation" in out0
    assert "rollouts:" in err0  # IMAGERL_PROGRESS=1: rank 0 draws its bars
    assert out1 == ""  # rank 1: no progress lines, tables or summary
    assert "rollouts:" not in err1 and "\r" not in err1 and "done:" not in err1
    assert all(line.startswith("[rank 1] ") for line in err1.splitlines())  # its warnings, prefixed


def test_harmless_library_warnings_are_hidden_and_others_shown():
    import warnings

    from imagerl.run.console import quiet_harmless_warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_harmless_warnings()  # its filters go in front of "always"
        warnings.warn("There are modules in AutoencoderKLQwenImage21 that should be kept in float32: []. Casting ...")
        warnings.warn("torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to load "
                      "in a single process.")
        warnings.warn("There are modules in AutoencoderKL that should be kept in float32: ['norm']. Casting ...")
        warnings.warn("something else")
    assert [str(w.message)[:24] for w in seen] == ["There are modules in Aut", "something else"]
