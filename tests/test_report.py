"""`imagerl report`: the summary table and plots/reward.png from metrics.jsonl (train reward, held-out reward,
either missing), from a real short training run, and clear errors for directories that are not runs."""

import json

import numpy as np
import pytest
from PIL import Image

from conftest import tiny_config
from imagerl.cli import main
from imagerl.run.metrics import plot_reward_curve, read_metrics
from imagerl.run.report import summarize

TRAIN_BLUE = (31, 119, 180)  # matplotlib C0: the train reward line
EVAL_RED = (214, 39, 40)  # matplotlib C3: the held-out reward markers


def _write(run_dir, records):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def _train_records(n=4, eval_every=0):
    records = []
    if eval_every:
        records.append({"step": 0, "eval/reward/raw_mean": -0.5, "eval/num_prompts": 8, "time/eval_s": 3.0,
                        "time/total_s": 3.0})
    for step in range(1, n + 1):
        r = {"step": step, "rollout/reward/raw_mean": [0.1, 0.4, 0.3, 0.2][step - 1], "rollout/reward/raw_std": 0.05,
             "rollout/reward/failed_count": 1 if step == 2 else 0,
             "train/loss": 0.01, "train/log_prob_mean_abs_diff": [0.0, 2e-8, 0.0, 1e-9][step - 1],
             "time/rollout_s": 2.0, "time/reward_s": 0.5, "time/train_s": 1.5 + step, "time/total_s": 4.0 + step,
             "perf/images_per_s": float(step), "memory/host_peak_rss_gib": 1.0 + step / 10,
             "memory/peak_allocated_gib": 10.0 * step}
        if eval_every and step % eval_every == 0:
            r.update({"eval/reward/raw_mean": -0.5 + step / 10, "time/eval_s": 3.0})
        records.append(r)
    return records


def _colour_pixels(path, rgb, tol=30):
    a = np.asarray(Image.open(path).convert("RGB")).astype(int)
    return int((np.abs(a - np.array(rgb)).sum(-1) < tol).sum())


def _table(out: str) -> dict[str, str]:
    rows = {}
    for line in out.splitlines():
        if "  " in line and not line.startswith("wrote "):
            key, value = line.split("  ", 1)
            rows[key.strip()] = value.strip()
    return rows


def test_report_without_eval(tmp_path, capsys):
    run = _write(tmp_path / "run", _train_records())
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000002" / "state.json").write_text("{}")
    (run / "checkpoints" / "step_000004.tmp").mkdir()  # an unfinished checkpoint is not listed
    (run / "config.yaml").write_text("train:\n  num_rollouts: 10\n")
    assert main(["report", str(run)]) == 0
    t = _table(capsys.readouterr().out)
    assert t["rollouts done"] == "4 of 10"
    assert t["train reward, first"] == "0.1  (rollout 1)" and t["train reward, last"] == "0.2  (rollout 4)"
    assert t["train reward, best"] == "0.4  (rollout 2)" and t["held-out reward, last"] == "-"
    assert t["seconds per rollout, rollout"] == "2.000" and t["seconds per rollout, train"] == "4.000"
    assert t["seconds per rollout, total"] == "6.500" and t["images/s (rollout, all ranks)"] == "2.500"
    assert t["peak GPU memory allocated (GiB)"] == "40.00" and t["peak host memory (RSS) (GiB)"] == "1.40"
    assert t["log_prob_mean_abs_diff, max"] == "2e-08" and t["failed rewards (all rollouts)"] == "1"
    assert t["checkpoints"] == "step_000002"
    reward_png = run / "plots" / "reward.png"
    assert _colour_pixels(reward_png, TRAIN_BLUE) > 100 and _colour_pixels(reward_png, EVAL_RED) == 0
    assert (run / "plots" / "phases.png").is_file()


def test_report_counts_toward_the_latest_target_and_omits_the_replay_row_without_it(tmp_path, capsys):
    """An extended run (`--resume latest train.num_rollouts=70`) reports its latest target, from the newest
    config*.yaml; a DiffusionNFT run (no log-probs, nothing replayed) has no log_prob_mean_abs_diff row."""
    import os

    records = [{k: v for k, v in r.items() if k != "train/log_prob_mean_abs_diff"} for r in _train_records()]
    run = _write(tmp_path / "run", records)
    (run / "config.yaml").write_text("train:\n  num_rollouts: 2\n")
    (run / "config.resumed_step_000002.yaml").write_text("train:\n  num_rollouts: 7\n")
    os.utime(run / "config.yaml", ns=(1_000_000_000, 1_000_000_000))  # the first config is the older one
    assert main(["report", str(run)]) == 0
    t = _table(capsys.readouterr().out)
    assert t["rollouts done"] == "4 of 7"
    assert "log_prob_mean_abs_diff, max" not in t


def test_report_with_eval_and_eval_only(tmp_path, capsys):
    run = _write(tmp_path / "run", _train_records(eval_every=2))
    assert main(["report", str(run), "--no-phases"]) == 0
    t = _table(capsys.readouterr().out)
    assert t["rollouts done"] == "4"  # the step-0 evaluation is not a rollout
    assert t["held-out reward, first"] == "-0.5  (rollout 0)" and t["held-out reward, last"] == "-0.1  (rollout 4)"
    assert t["seconds per evaluation"] == "3.000  (3 evaluations)"
    assert t["seconds per rollout, total"] == "6.500"  # the step-0 evaluation is not a rollout
    assert _colour_pixels(run / "plots" / "reward.png", EVAL_RED) > 50
    assert _colour_pixels(run / "plots" / "reward.png", TRAIN_BLUE) > 100
    assert not (run / "plots" / "phases.png").exists()

    only_eval = _write(tmp_path / "eval_only", [r for r in _train_records(eval_every=2)[:1]])
    out = plot_reward_curve(only_eval)  # what train.py calls: plots/reward.png
    assert out == only_eval / "plots" / "reward.png"
    assert _colour_pixels(out, EVAL_RED) > 20 and _colour_pixels(out, TRAIN_BLUE) == 0
    assert summarize(only_eval).rollouts_done == 0


def test_a_cut_off_last_line_is_skipped(tmp_path):
    run = _write(tmp_path / "run", _train_records(2))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rollout/rew')
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    (run / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        read_metrics(run)


def test_not_a_run_directory_is_a_clear_error(tmp_path, capsys):
    def error(path):
        assert main(["report", str(path)]) == 2
        return capsys.readouterr().err

    assert "does not exist" in error(tmp_path / "nowhere")
    (tmp_path / "file.txt").write_text("x")
    assert "is a file, not a run directory" in error(tmp_path / "file.txt")
    assert "not an imagerl run directory: no metrics.jsonl" in error(tmp_path)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "state.json").write_text("{}")
    assert "is a checkpoint, not a run directory" in error(ckpt)
    (tmp_path / "run" / "config.yaml").write_text("train: {}\n")
    assert "has not finished a rollout yet" in error(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    assert "has no records yet" in error(tmp_path / "run")


def test_report_of_a_real_training_run_with_evaluation(tiny_checkpoint, tmp_path, capsys):
    from imagerl.train import train

    run = tmp_path / "run"
    train(tiny_config(tiny_checkpoint, run, "data.test_prompts=split", "data.test_fraction=0.05", "eval.interval=1",
                      "eval.num_steps=2", "eval.max_prompts=3", "train.num_optimizer_steps=1"))
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["eval/num_prompts"] == 3 and "eval/reward/raw_mean" in r for r in records)
    assert (run / "images" / "eval_000001.png").is_file() and (run / "plots" / "reward.png").is_file()
    (run / "plots" / "reward.png").unlink()
    assert main(["report", str(run)]) == 0
    t = _table(capsys.readouterr().out)
    assert t["rollouts done"] == "2 of 2" and t["checkpoints"] == "step_000002"
    assert t["train reward, last"].endswith("(rollout 2)") and t["held-out reward, last"].endswith("(rollout 2)")
    assert float(t["train reward, last"].split()[0]) == pytest.approx(records[-1]["rollout/reward/raw_mean"], rel=1e-5)
    assert t["log_prob_mean_abs_diff, max"] == "0"
    assert _colour_pixels(run / "plots" / "reward.png", EVAL_RED) > 20
    assert (run / "plots" / "phases.png").is_file()


def test_eval_table_printed_at_the_end_of_training():
    from imagerl.run.report import format_eval_table

    records = _train_records(eval_every=2)
    for r in records:
        if "eval/reward/raw_mean" in r:
            r.update({"eval/reward/shapes_mean": r["eval/reward/raw_mean"] * 2, "eval/reward/ocr_mean": 0.25})
    lines = format_eval_table(records).splitlines()
    assert lines[0] == "held-out evaluation" and lines[1].split() == ["rollout", "reward", "ocr", "shapes"]
    assert [l.split() for l in lines[2:5]] == [["0", "-0.5000", "0.2500", "-1.0000"], ["2", "-0.3000", "0.2500", "-0.6000"],
                                                ["4", "-0.1000", "0.2500", "-0.2000"]]
    assert lines[5] == "before -> after: -0.5000 (rollout 0) -> -0.1000 (rollout 4), change +0.4000"
    single = [{k: v for k, v in r.items() if k != "eval/reward/ocr_mean"} for r in records]
    assert format_eval_table(single).splitlines()[1].split() == ["rollout", "reward"]
    assert format_eval_table(_train_records()) == ""  # no evaluation, no table


def test_reward_plot_smooths_the_train_curve_over_about_a_tenth_of_the_run():
    from imagerl.run.metrics import smoothed, smoothing_window

    assert smoothed([1.0, 2.0, 3.0, 10.0], 3) == [1.5, 2.0, 5.0, 6.5]  # centred, shrinking at the ends
    assert smoothed([4.0, 5.0], 1) == [4.0, 5.0]
    assert [smoothing_window(n) for n in (5, 6, 20, 60, 200)] == [1, 3, 3, 7, 21]
