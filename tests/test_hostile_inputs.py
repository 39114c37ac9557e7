"""Inputs a careless user or an attacker gives: a YAML alias bomb, long values in messages, bytes that are not text
in metrics.jsonl, groups of one, a symbolic link among the checkpoints. Each is refused or skipped quickly, with a
short message that names the thing."""

import json
import shutil
import time

import pytest

from conftest import tiny_config
from imagerl.config import load_config
from imagerl.run.metrics import MetricsLogger, read_metrics
from imagerl.train import train
from imagerl.validation import validate

BOMB = "\n".join(["a: &a [x, x, x, x, x, x, x, x, x]"]
                 + [f"{n}: &{n} [{', '.join([f'*{p}'] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi")]
                 + ["train: {lr: *i}"])  # 9^9 = 387 million values in about 400 bytes


def test_a_yaml_alias_bomb_is_refused_fast_with_a_short_message(tmp_path):
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(BOMB)
    assert len(BOMB) < 500
    with pytest.raises(ValueError, match=r"bomb.yaml expands to more than 100000 values through YAML aliases") as e:
        load_config(str(recipe))  # (expanded, it would not end: the per-test timeout and the perf test below bound it)
    assert len(str(e.value)) < 300
    with pytest.raises(ValueError, match="expands to more than"):  # an override's value is YAML too
        load_config("quickstart", ["reward.weights=" + "{" + BOMB.replace("\n", ", ").replace("train: {lr: *i}",
                                                                                              "z: *i") + "}"])


@pytest.mark.perf  # an absolute wall-clock bound: python -m pytest -m perf
def test_a_yaml_alias_bomb_is_refused_within_5_seconds(tmp_path):
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(BOMB)
    start = time.perf_counter()
    with pytest.raises(ValueError, match="expands to more than"):
        load_config(str(recipe))
    assert time.perf_counter() - start < 5


def test_a_wrongly_typed_long_value_is_cut_in_the_message(tmp_path):
    recipe = tmp_path / "long.yaml"
    row = "[" + ", ".join(["1.0"] * 500) + "]"
    recipe.write_text("train: {lr: [" + ", ".join([row] * 8) + "]}\n")  # 4000 values: 40 KB in a repr
    with pytest.raises(ValueError, match=r"train.lr: expected float, got \[\[1.0, 1.0, .*\.\.\.") as e:
        load_config(str(recipe))
    assert len(str(e.value)) < 200


def test_lines_that_are_not_utf8_are_skipped_with_a_warning_naming_the_file(tmp_path):
    logger = MetricsLogger(tmp_path, True, tensorboard=False)
    for step in (1, 2, 3):
        logger.log(step, {"rollout/reward/raw_mean": 0.1 * step}, echo=lambda line: None)
    logger.close()
    path = tmp_path / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"\xff\xfe garbage \x80\n" + b"".join(lines[1:]) + b"\xc3\x28\n")
    with pytest.warns(UserWarning, match=rf"{path}: line 2 is not UTF-8 text; skipped"):
        assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3]
    with pytest.warns(UserWarning, match="not UTF-8"):
        MetricsLogger(tmp_path, True, tensorboard=False).truncate_after(2)  # what a resume does
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize("algorithm", ["flow_grpo", "diffusion_nft"])
def test_a_group_of_one_is_refused_for_both_algorithms(algorithm):
    cfg = load_config("quickstart", [f"train.algorithm={algorithm}", "sample.group_size=1"])
    with pytest.raises(ValueError, match=r"sample.group_size=1: every advantage would be 0.*>= 2"):
        validate(cfg)


def test_a_symbolic_link_among_the_checkpoints_is_named(tiny_checkpoint, tmp_path):
    run_dir = tmp_path / "run"
    common = ["run.checkpoint_every=1", "run.keep_checkpoints=1"]
    train(tiny_config(tiny_checkpoint, run_dir, *common, "train.num_rollouts=1"))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run_dir / "checkpoints" / "step_000001", elsewhere)
    shutil.rmtree(run_dir / "checkpoints" / "step_000001")
    (run_dir / "checkpoints" / "step_000001").symlink_to(elsewhere, target_is_directory=True)
    link = run_dir / "checkpoints" / "step_000001"
    with pytest.raises(ValueError, match=rf"{link} is a symbolic link .*move the link out of checkpoints/"):
        train(tiny_config(tiny_checkpoint, run_dir, *common, "train.num_rollouts=2"), resume="latest")
    assert elsewhere.is_dir() and link.is_symlink()  # neither followed nor removed


def test_a_rollout_that_cannot_fit_in_memory_is_refused_before_it_allocates(tmp_path, capsys, monkeypatch):
    """The quickstart with 200000 samples per prompt would hold ~150 GiB of images and latents: refused by the memory
    estimate (perf/memory_estimate.py) after the model loads and before the first rollout, in one line, leaving
    nothing behind."""
    import imagerl.rollout
    import imagerl.train
    from imagerl.cli import main

    reached = []  # what comes after the estimate: the CPU rollout-time probe (a forward), then the first rollout
    for module, name in [(imagerl.train, "_report_cpu_rollout_time"), (imagerl.rollout, "generate")]:
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: reached.append(_name))
    run_dir = tmp_path / "run"
    assert main(["train", "--output-dir", str(run_dir), "sample.group_size=200000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("imagerl: error: quickstart: the ") and "settings that fit: " in err[-1]
    assert "does not fit" in err[-1]
    assert reached == [] and not run_dir.exists()  # refused before any of it ran
