"""Evaluation suites: OCR measures on images rendered with known text, GenEval's folder layout read back by a reader
written from GenEval's README, and `imagerl eval --suite` end to end (base and a LoRA side by side)."""

import json
from pathlib import Path

import pytest
import torch

from imagerl.cli import main
from imagerl.evaluation.suites.geneval_layout import write_image
from imagerl.evaluation.suites.ocr_suite import measures_of


def test_ocr_measures_on_rendered_text():
    pytest.importorskip("rapidocr_onnxruntime")
    from test_reward_models import render

    from imagerl.config import RewardConfig
    from imagerl.rewards.ocr import OcrReward
    from imagerl.evaluation.suites.ocr_suite import score_images

    engine = OcrReward(RewardConfig(), torch.device("cpu"))
    prompts = ['a sign that says "OPEN 24 HOURS"', 'a chalkboard that says "Hello World"',
               'a banner reading "GOOD"']
    images = torch.stack([render("OPEN 24 HOURS"), render("Hello Wand"), render("VERY GOOD NEWS")])
    rows = score_images(engine, images, prompts).tolist()
    assert rows[0] == [1.0, 1.0]  # read exactly
    assert rows[1] == [pytest.approx(0.7), 0.0]  # 3 edits (orld -> and) of 10 characters: 1 - 3/10, not exact
    assert rows[2] == [1.0, 0.0]  # the target inside longer text: flow_grpo's accuracy 1, not an exact match
    assert measures_of("hello world", 'x "Hello World"') == (1.0, 1.0)  # spaces and case do not count


def _read_geneval_folder(outdir: Path) -> list[dict]:
    """GenEval's README: 'an <outdir> with one folder per prompt, <outdir>/<index>/metadata.jsonl (the prompt's
    metadata line) and <outdir>/<index>/samples/<k>.png', indices 00000... in the metadata file's order."""
    from PIL import Image

    out = []
    for folder in sorted(p for p in outdir.iterdir() if p.is_dir()):
        record = json.loads((folder / "metadata.jsonl").read_text().splitlines()[0])
        images = [Image.open(p) for p in sorted((folder / "samples").glob("*.png"))]
        out.append({"index": int(folder.name), "record": record, "images": images})
    return out


def test_geneval_layout_reads_back(tmp_path):
    records = [{"tag": "counting", "include": [{"class": "cup", "count": 2}], "prompt": "a photo of two cups"},
               {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "a red car"}]
    for i, record in enumerate(records):
        for k in range(3):
            write_image(tmp_path, i, record, k, torch.full((3, 8, 8), k / 4))
    folders = _read_geneval_folder(tmp_path)
    assert [f["index"] for f in folders] == [0, 1] and [f["record"] for f in folders] == records
    assert [p.name for p in sorted((tmp_path / "00001" / "samples").iterdir())] == ["0000.png", "0001.png", "0002.png"]
    assert [f["images"][2].getpixel((0, 0)) for f in folders] == [(128, 128, 128)] * 2  # round(0.5 * 255)


def test_eval_suite_shapes_puts_base_and_lora_side_by_side(tiny_checkpoint, tmp_path, capsys):
    """`imagerl eval --suite shapes` on the tiny model (random weights: a timing and format check) with a LoRA twice:
    the two LoRA columns are equal, every interval holds its mean, and the JSON has every prompt's values."""
    from conftest import tiny_config
    from imagerl.train import train

    run = tmp_path / "run"
    train(tiny_config(tiny_checkpoint, run, "train.num_rollouts=1"))
    lora = str(run / "checkpoints" / "step_000001" / "lora")
    args = ["eval", "--suite", "shapes", "--model", str(tiny_checkpoint), "--lora", lora, "--lora", lora,
            "--max-prompts", "6", "--images-per-prompt", "2", "--steps", "2", "--height", "64", "--width", "64",
            "--out", str(tmp_path / "out")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "suite shapes: 6 prompts x 2 images" in out and "| overall |" in out and "time: base" in out
    record = json.loads((tmp_path / "out" / "suite_shapes.json").read_text())
    assert record["models"] == ["base", "run/step_000001", "run/step_000001#2"]
    per = record["per_prompt"]
    assert per["run/step_000001"] == per["run/step_000001#2"] and len(per["base"]) == 6
    for row in record["rows"]:
        for interval in row["models"].values():
            assert interval["low"] - 1e-12 <= interval["mean"] <= interval["high"] + 1e-12
    assert main(["eval", "--suite", "shapes", "--model", str(tiny_checkpoint), "--lora", str(tmp_path / "none")]) == 2
    assert "--lora" in capsys.readouterr().err
    assert main(["eval", "--model", str(tiny_checkpoint), "--prompts", "shapes-test", "--lora", lora,
                 "--lora", lora]) == 2
    assert "need a suite" in capsys.readouterr().err
    for flag, value in (("--steps", "0"), ("--images-per-prompt", "0"), ("--batch-size", "0")):
        assert main(["eval", "--suite", "shapes", "--model", str(tiny_checkpoint), flag, value]) == 2
        assert f"{flag} must be >= 1, got 0" in capsys.readouterr().err


def test_eval_suite_geneval_writes_the_layout(tiny_checkpoint, tmp_path, capsys):
    args = ["eval", "--suite", "geneval", "--model", str(tiny_checkpoint), "--max-prompts", "3", "--steps", "2",
            "--height", "64", "--width", "64", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    assert "GenEval's layout" in capsys.readouterr().out
    folders = _read_geneval_folder(tmp_path / "out" / "geneval" / "base")
    assert len(folders) == 3 and all(len(f["images"]) == 4 for f in folders)
    assert folders[0]["record"]["prompt"] == "a photo of two wine glasses" and "tag" in folders[0]["record"]


def test_training_runs_its_suites_at_each_evaluation_and_report_shows_them(tiny_checkpoint, tmp_path, capsys):
    from conftest import tiny_config
    from imagerl.train import train

    run = tmp_path / "run"
    train(tiny_config(tiny_checkpoint, run, "train.num_rollouts=2", "eval.interval=2", "eval.before_training=true",
                      "eval.num_steps=2", "eval.suites=[shapes,geneval]", "eval.suite_max_prompts=3",
                      "data.test_prompts=split", "eval.max_prompts=2"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r for r in records if "eval/suite/shapes/overall" in r]
    assert [r["step"] for r in evaluated] == [0, 2]
    assert all(0 <= r["eval/suite/shapes/overall"] <= 1 for r in evaluated)
    assert len(list((run / "suites" / "geneval" / "step_000002").glob("*/samples/*.png"))) == 3 * 4
    assert main(["report", str(run)]) == 0
    out = capsys.readouterr().out
    assert "suite shapes" in out and "overall" in out
    with pytest.raises(ValueError, match="unknown suite 'nope'"):
        train(tiny_config(tiny_checkpoint, tmp_path / "bad", "eval.suites=[nope]", "eval.interval=1"))


def test_a_suite_on_the_held_out_images_scores_them_instead_of_sampling_again(tiny_checkpoint, tmp_path, monkeypatch):
    """The quickstart's case: the held-out set is the shapes suite's prompts with its 4 images each, so the suite is
    scored on the held-out evaluation's images (no second sampling) and equals `imagerl eval --suite shapes` with the
    same settings (before training the LoRA is zero: the base model)."""
    from conftest import tiny_config

    from imagerl.evaluation import held_out as evaluation
    from imagerl.train import train

    calls = []
    real = evaluation.generate_and_score
    monkeypatch.setattr(evaluation, "generate_and_score", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    run = tmp_path / "run"
    train(tiny_config(tiny_checkpoint, run, "train.num_rollouts=1", "eval.interval=1", "eval.before_training=true",
                      "eval.num_steps=2", "eval.suites=[shapes]", "data.train_prompts=shapes-train",
                      "data.test_prompts=shapes-test",
                      "data.test_samples_per_prompt=4", "eval.max_prompts=12", "eval.suite_max_prompts=3",
                      "reward.weights={shapes: 1.0}", "sample.guidance_scale=1"))
    assert calls == [12, 12]  # one sampling of the 3 x 4 held-out images per evaluation, none for the suite
    first = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][0]
    assert first["step"] == 0 and "time/suite_shapes_s" not in first

    assert main(["eval", "--suite", "shapes", "--model", str(tiny_checkpoint), "--max-prompts", "3", "--steps", "2",
                 "--height", "64", "--width", "64", "--guidance", "1", "--out", str(tmp_path / "out")]) == 0
    rows = json.loads((tmp_path / "out" / "suite_shapes.json").read_text())["rows"]
    assert rows and {f"eval/suite/shapes/{r['measure']}": r["models"]["base"]["mean"] for r in rows} == {
        k: v for k, v in first.items() if k.startswith("eval/suite/shapes/")}
