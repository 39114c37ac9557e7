"""Drift monitors against hand-computed values on synthetic images, and the warning / stop rule; run.keep_best."""

import math
import re

import pytest
import torch

from imagerl.run.monitors import DriftMonitor, image_statistics


def _image(rgb_rows):
    """A (1, 3, H, W) image from rows of (r, g, b) pixels."""
    return torch.tensor(rgb_rows, dtype=torch.float64).permute(2, 0, 1)[None]


def test_each_monitor_on_a_hand_computed_image():
    # 2 x 2: black, white / pure red, grey 0.5
    img = _image([[(0, 0, 0), (1, 1, 1)], [(1, 0, 0), (0.5, 0.5, 0.5)]])
    s = {k: v.item() for k, v in image_statistics(img).items()}
    assert s["saturation"] == pytest.approx((0 + 0 + 1 + 0) / 4)  # only red is saturated
    y = [0.0, 1.0, 0.299, 0.5]
    mean = sum(y) / 4
    assert s["contrast"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in y) / 4))
    # gradients: (0,0): dx 1, dy .299 -> edge; (0,1): dx repeats 1 -> edge; (1,0): dx .201, dy .299 -> edge;
    # (1,1): dx .201, dy repeats -.5 -> edge: all four pass 0.1
    assert s["edge_density"] == 1.0
    # colours quantised to 4 levels: (0,0,0), (3,3,3), (3,0,0), (2,2,2): four colours, one pixel each -> 2 bits
    assert s["color_entropy"] == pytest.approx(2.0)
    assert s["dark_fraction"] == 0.25 and s["bright_fraction"] == 0.25  # black; white (red's Y 0.299 is neither)
    assert s["jpeg_kb"] > 0


def test_a_flat_image_has_no_edges_contrast_or_entropy():
    flat = torch.full((2, 3, 8, 8), 0.5, dtype=torch.float64)
    s = image_statistics(flat)
    assert s["contrast"].tolist() == [0.0, 0.0] and s["edge_density"].tolist() == [0.0, 0.0]
    assert s["color_entropy"].tolist() == [0.0, 0.0] and s["saturation"].tolist() == [0.0, 0.0]


def test_drift_warns_once_then_every_n_and_stops_when_asked():
    torch.manual_seed(0)
    first = torch.rand(8, 3, 8, 8)
    monitor = DriftMonitor(max_drift=3.0, warn_every=2, stop_on_drift=True)
    metrics, warnings, stop = monitor.observe(1, first)
    assert metrics["monitor/saturation_drift"] == 0.0 and not warnings and not stop
    grey = torch.full((8, 3, 8, 8), 0.5)  # saturation and contrast collapse
    _, warnings, stop = monitor.observe(2, grey)
    assert stop and any("monitor saturation drifted" in w for w in warnings)
    _, warnings3, _ = monitor.observe(3, grey)
    assert not any("saturation" in w for w in warnings3)  # warned at 2: next at 4
    _, warnings4, _ = monitor.observe(4, grey)
    assert any("saturation" in w for w in warnings4)
    restored = DriftMonitor(3.0, 2, False)
    restored.load_state(monitor.state())
    assert restored.observe(5, grey)[0] == monitor.observe(5, grey)[0]


def test_training_logs_the_monitors_and_stop_on_drift_saves_then_stops(tiny_checkpoint, tmp_path, capsys):
    """With max_drift 1e-9 any change of the images passes it at rollout 2: the run warns, saves the state and stops
    with one error line; a resume takes rollout 1's reference from metrics.jsonl."""
    import json

    from conftest import tiny_config
    from imagerl.train import DriftStop, train

    run = tmp_path / "run"
    cfg = tiny_config(tiny_checkpoint, run, "train.num_rollouts=3", "monitor.max_drift=1e-9",
                      "monitor.stop_on_drift=true", "run.checkpoint_every=10")
    with pytest.raises(DriftStop, match="rollout 2: a drift monitor passed"):
        train(cfg)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["monitor/contrast_drift"] == 0.0 and "monitor/jpeg_kb_std" in records[0]
    assert "imagerl: warning: rollout 2: monitor" in capsys.readouterr().out
    assert (run / "checkpoints" / "step_000002" / "state.json").is_file()
    train(tiny_config(tiny_checkpoint, run, "train.num_rollouts=3", "monitor.max_drift=0",
                      "run.checkpoint_every=10"), resume="latest")
    resumed = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert resumed["step"] == 3 and resumed["monitor/contrast_drift"] != 0.0  # measured against rollout 1


def test_keep_best_keeps_the_best_evaluation_beside_the_latest_and_survives_resume(tiny_checkpoint, tmp_path,
                                                                                     capsys):
    """keep_checkpoints=1 with evaluations every rollout: the best held-out value's checkpoint stays while older ones
    go; a resume continues comparing with the recorded best; report names it."""
    import json

    from conftest import tiny_config
    from imagerl.run.best_checkpoint import read_best
    from imagerl.cli import main
    from imagerl.train import train

    run = tmp_path / "run"
    common = ["eval.interval=1", "eval.num_steps=2", "data.test_prompts=split", "eval.max_prompts=2",
              "run.keep_checkpoints=1", "run.checkpoint_every=1", "run.keep_best=eval/reward/raw_mean",
              "train.lr=0.05"]
    train(tiny_config(tiny_checkpoint, run, "train.num_rollouts=2", *common))
    train(tiny_config(tiny_checkpoint, run, "train.num_rollouts=4", *common), resume="latest")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    values = {r["step"]: r["eval/reward/raw_mean"] for r in records if "eval/reward/raw_mean" in r}
    best_step = max(values, key=values.get)
    best = read_best(run)
    assert best["step"] == best_step and best["value"] == values[best_step]
    kept = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert kept == sorted({f"step_{best_step:06d}", "step_000004"})
    assert main(["report", str(run)]) == 0
    assert re.search(rf"best checkpoint\s+step_{best_step:06d}\s+\(eval/reward/raw_mean", capsys.readouterr().out)


def test_a_resumed_run_keeps_the_warning_schedule(tiny_checkpoint, tmp_path, capsys):
    """Warnings repeat every monitor.warn_every rollouts per monitor: a run that warned at rollout 2 and resumes after
    rollout 3 stays quiet at rollout 4 (2 + 10 not reached), as the uninterrupted run would."""
    from conftest import tiny_config
    from imagerl.train import train

    run = tmp_path / "run"
    common = ["monitor.max_drift=1e-9", "monitor.warn_every=10", "run.checkpoint_every=1"]
    train(tiny_config(tiny_checkpoint, run, "train.num_rollouts=3", *common))
    first = capsys.readouterr().out
    assert "rollout 2: monitor" in first and "rollout 3: monitor" not in first
    train(tiny_config(tiny_checkpoint, run, "train.num_rollouts=4", *common), resume="latest")
    assert "imagerl: warning: rollout 4: monitor" not in capsys.readouterr().out
