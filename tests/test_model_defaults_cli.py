"""Shipped model and prompt-set names in every command, and defaults that come from the model
(imagerl_defaults.json: flag > the model's file > the family's class defaults), at the command line.

The quickstart model samples 64 px in well under a second per image on a CPU."""

import json
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from imagerl.cli import main
from imagerl.components import resolve_model_path
from imagerl.data.prompts import NAMED_PROMPT_SETS, bundled_prompt_file, load_prompts
from imagerl.families.qwen_image import QwenImageFamily
from imagerl.families.model_defaults import DEFAULTS_FILE, ModelDefaults, model_defaults
from imagerl.sft.trainer import load_sft_config, with_model_defaults


@pytest.fixture(scope="module")
def quickstart():
    return resolve_model_path("quickstart")


def model_with_defaults(quickstart, tmp_path, content):
    """The quickstart model (its files linked) with another imagerl_defaults.json (str: written as is)."""
    model = tmp_path / "model"
    model.mkdir()
    for entry in quickstart.iterdir():
        if entry.name != DEFAULTS_FILE:
            (model / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    (model / DEFAULTS_FILE).write_text(content if isinstance(content, str) else json.dumps(content))
    return model


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_data")
    for name, rgb in {"red": (220, 30, 30), "blue": (30, 30, 220)}.items():
        Image.new("RGB", (64, 64), rgb).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(f"a {name} square\n")
    return root


# ---------------------------------------------------------------- the file


def test_the_shipped_quickstart_model_recommends_its_recipe_settings(quickstart):
    from imagerl.families.quickstart_model import SAMPLING_DEFAULTS

    d = model_defaults(quickstart)
    assert (d.height, d.width, d.num_steps, d.guidance_scale, d.rewards) == (64, 64, 10, 1.0, ("shapes",))
    assert json.loads((quickstart / DEFAULTS_FILE).read_text()) == SAMPLING_DEFAULTS  # what the builder writes
    assert model_defaults(quickstart.parent / "no-such-model") == ModelDefaults()  # no file: all None


def test_fallback_order_flag_then_model_then_family():
    mine = ModelDefaults(height=64, width=64, num_steps=10, guidance_scale=1.0)
    assert mine.sampling(QwenImageFamily) == (64, 64, 10, 1.0)
    assert mine.sampling(QwenImageFamily, height=32, width=48, num_steps=3, guidance_scale=4) == (32, 48, 3, 4.0)
    assert ModelDefaults().sampling(QwenImageFamily) == (1024, 1024, 50, 4.0)
    assert ModelDefaults(num_steps=7).sampling(QwenImageFamily, guidance_scale=1.0) == (1024, 1024, 7, 1.0)


# ---------------------------------------------------------------- imagerl sample


def test_sample_quickstart_by_name_uses_its_defaults(tmp_path, capsys):
    out = tmp_path / "a.png"
    assert main(["sample", "--model", "quickstart", "--prompt", "two red circles", "--out", str(out)]) == 0
    assert Image.open(out).size == (64, 64)
    assert "64x64 px, 10 steps, guidance 1 (defaults: the model's imagerl_defaults.json)" in capsys.readouterr().out


def test_sample_flags_win_over_the_model_defaults(tmp_path, capsys):
    out = tmp_path / "b.png"
    assert main(["sample", "--model", "quickstart", "--prompt", "two red circles", "--height", "32", "--width", "48",
                 "--steps", "2", "--guidance", "3", "--out", str(out)]) == 0
    assert Image.open(out).size == (48, 32)
    assert "32x48 px, 2 steps, guidance 3" in capsys.readouterr().out


# ---------------------------------------------------------------- imagerl eval


def test_eval_quickstart_on_the_shipped_shapes_test_set(tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["eval", "--model", "quickstart", "--prompts", "shapes-test", "--max-prompts", "4", "--out",
                 str(out)]) == 0
    record = json.loads((out / "eval.json").read_text())
    assert record["rewards"] == {"shapes": 1.0} and "eval/reward/shapes_mean" in record["metrics"]
    s = record["settings"]
    assert (s["height"], s["width"], s["num_steps"], s["guidance_scale"], s["num_prompts"]) == (64, 64, 10, 1.0, 4)
    assert record["model_defaults"].endswith(DEFAULTS_FILE)
    assert [x["prompt"] for x in record["samples"]] == load_prompts(bundled_prompt_file("shapes-test"))[:4]
    assert "eval: 4 prompts, 64x64 px, 10 steps, guidance 1, reward shapes" in capsys.readouterr().out


def test_eval_flags_win_over_the_model_defaults(tmp_path):
    out = tmp_path / "eval"
    assert main(["eval", "--model", "quickstart", "--prompts", "shapes-test", "--max-prompts", "2", "--steps", "2",
                 "--guidance", "2.5", "--height", "32", "--width", "32", "--reward", "jpeg_compressibility",
                 "--out", str(out)]) == 0
    record = json.loads((out / "eval.json").read_text())
    assert record["rewards"] == {"jpeg_compressibility": 1.0}
    s = record["settings"]
    assert (s["height"], s["width"], s["num_steps"], s["guidance_scale"]) == (32, 32, 2, 2.5)


def test_eval_help_lists_the_shipped_prompt_sets(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in NAMED_PROMPT_SETS) and "quickstart / tiny / tiny21" in text


# ---------------------------------------------------------------- a bad imagerl_defaults.json


@pytest.mark.parametrize("content, key", [
    ({"height": "big", "width": 64}, "'height' must be a positive integer, got 'big'"),
    ({"height": 64, "width": 64, "num_steps": 0}, "'num_steps' must be a positive integer, got 0"),
    ({"guidance_scale": 0.5}, "'guidance_scale' must be a number >= 1"),
    ({"height": 64}, "give both 'height' and 'width'"),
    ({"steps": 10}, "unknown key 'steps'; valid: height, width, num_steps, guidance_scale, rewards"),
    ({"rewards": "shapes"}, "'rewards' must be a non-empty list of reward names"),
    ('{"height": 64,', "is not valid JSON"),
    ("[64, 64]", "must hold a JSON object"),
])
def test_sample_with_a_bad_defaults_file_names_the_file_and_key(quickstart, tmp_path, capsys, content, key):
    model = model_with_defaults(quickstart, tmp_path, content)
    assert main(["sample", "--model", str(model), "--prompt", "x", "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("imagerl: error: ") and str(model / DEFAULTS_FILE) in err and key in err
    assert not (tmp_path / "x.png").exists()


def test_eval_with_an_unknown_reward_in_the_defaults_file(quickstart, tmp_path, capsys):
    model = model_with_defaults(quickstart, tmp_path, {"height": 64, "width": 64, "num_steps": 2, "rewards": ["shapez"]})
    assert main(["eval", "--model", str(model), "--prompts", "shapes-test", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{model / DEFAULTS_FILE}: 'rewards': unknown reward(s) ['shapez']" in err
    assert not (tmp_path / "out").exists()
    # --reward replaces the file's rewards, so the bad name is never used
    assert main(["eval", "--model", str(model), "--prompts", "shapes-test", "--max-prompts", "1", "--reward", "shapes",
                 "--out", str(tmp_path / "out")]) == 0


# ---------------------------------------------------------------- an empty model directory


@pytest.mark.parametrize("command", ["sample", "eval", "sft", "train"])
def test_an_empty_model_directory_says_it_has_no_model_index(tmp_path, capsys, sft_data, command):
    empty = tmp_path / "my-model"
    empty.mkdir()
    argv = {"sample": ["sample", "--model", str(empty), "--prompt", "x"],
            "eval": ["eval", "--model", str(empty), "--prompts", "shapes-test"],
            "sft": ["sft", "--model", str(empty), "--data", str(sft_data), "--output-dir", str(tmp_path / "run")],
            "train": ["train", "--model", str(empty), "--output-dir", str(tmp_path / "run")]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{empty} has no model_index.json: not a diffusers-format checkpoint (expected model_index.json, " \
           "transformer/, vae/" in err
    assert "--family" not in err


# ---------------------------------------------------------------- imagerl sft


def test_sft_settings_left_unset_come_from_the_model():
    mine = ModelDefaults(height=64, width=64, num_steps=10, guidance_scale=1.0)
    cfg = with_model_defaults(load_sft_config([]), mine)
    assert (cfg.height, cfg.width, cfg.validation_steps, cfg.validation_guidance) == (64, 64, 10, 1.0)
    cfg = with_model_defaults(load_sft_config(["height=32", "validation_steps=3", "validation_guidance=4"]), mine)
    assert (cfg.height, cfg.width, cfg.validation_steps, cfg.validation_guidance) == (32, 64, 3, 4.0)
    cfg = with_model_defaults(load_sft_config([]), ModelDefaults())  # no file: 512 px, the family's sampling
    assert (cfg.height, cfg.width, cfg.validation_steps, cfg.validation_guidance) == (512, 512, 0, None)


def test_sft_on_quickstart_trains_at_its_size(tmp_path, sft_data):
    run = tmp_path / "run"
    assert main(["sft", "--model", "quickstart", "--data", str(sft_data), "--output-dir", str(run), "device=cpu",
                 "num_steps=1", "batch_size=2", "lora_rank=2", "lora_alpha=2", "tensorboard=false",
                 "gradient_checkpointing=false", "validation_prompts=[a red square]"]) == 0
    saved = yaml.safe_load((run / "sft_config.yaml").read_text())
    assert (saved["height"], saved["width"], saved["validation_steps"], saved["validation_guidance"]) == (64, 64, 10, 1.0)
    assert Image.open(run / "images" / "validation_000001.png").width == 64


# ---------------------------------------------------------------- image grid captions


def test_a_long_caption_stays_inside_its_tile(tmp_path):
    """At the quickstart's 64 px tiles: at most 3 lines, each within the tile, the last ending in '...'."""
    from PIL import ImageDraw

    from imagerl.run.metrics import _font, save_image_grid, wrap_text

    long = ("a chalkboard menu with SOUP OF THE DAY written on it in a cozy little cafe near the station, "
            "photographed at dusk with warm light and a bicycle leaning against the window")
    w = 64
    save_image_grid(torch.zeros(2, 3, w, w), torch.tensor([0.5, -0.25]), tmp_path / "g.png", captions=[long, long])
    grid = Image.open(tmp_path / "g.png").convert("L")
    font = _font(max(10, min(16, w // 32)))  # save_image_grid's font for this tile size
    draw = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    lines = wrap_text(long, w - 4, lambda s: draw.textlength(s, font=font), 3)
    assert len(lines) == 3 and lines[-1].endswith("...")
    for line in lines:  # drawn at x = 2: advance and ink both end inside the tile
        assert font.getlength(line) <= w - 4 and draw.textbbox((2, 0), line, font=font)[2] <= w
    line_h = font.getbbox("Ag|")[3] + 2
    assert grid.height == w + line_h * 4 + 2  # the reward line and 3 caption lines
    # no ink in the caption strip on the tiles' borders (tile 0 ends at column w - 1; tile 1 starts at w)
    strip = grid.crop((0, w, 2 * w, grid.height))
    for x in (w - 1, w, 2 * w - 1):
        assert min(strip.getpixel((x, y)) for y in range(strip.height)) == 255, f"ink at column {x}"
    assert strip.crop((0, 0, w, strip.height)).getextrema()[0] < 128  # the caption is drawn


def test_a_local_directory_named_like_a_shipped_model_is_named_in_one_note(tmp_path, monkeypatch, capsys):
    import imagerl.components

    monkeypatch.setattr(imagerl.components, "_SHADOW_NOTED", set())
    monkeypatch.chdir(tmp_path)
    (tmp_path / "quickstart").mkdir()
    (tmp_path / "quickstart" / "model_index.json").write_text("{}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a line of its own, not a raw UserWarning
        shipped = resolve_model_path("quickstart")
        resolve_model_path("quickstart")
    err = capsys.readouterr().err
    assert err.count("imagerl: note:") == 1 and "to use the directory, pass ./quickstart" in err  # once a process
    assert shipped.name == "quickstart-model" and shipped != tmp_path / "quickstart"
    assert resolve_model_path("./quickstart") == Path("./quickstart")
    monkeypatch.setattr(imagerl.components, "_SHADOW_NOTED", set())
    monkeypatch.chdir(tmp_path / "quickstart")
    resolve_model_path("quickstart")  # no such local directory: no note
    assert capsys.readouterr().err == ""


def test_a_tiny_checkpoint_made_from_the_command_line_samples_at_its_size_and_a_too_large_size_is_explained(
        tmp_path, monkeypatch, capsys):
    """make-tiny-checkpoint writes imagerl_defaults.json (64 px), says how to pass a folder named like a built-in
    model, and a size past the tiny SD3's position table is refused with the largest it takes, not diffusers'
    'cannot be greater than pos_embed_max_size'."""
    from imagerl.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["make-tiny-checkpoint", "--family", "sd3", "tiny_sd3"]) == 0
    assert "pass it as ./tiny_sd3" in capsys.readouterr().out
    assert json.loads((tmp_path / "tiny_sd3" / "imagerl_defaults.json").read_text())["height"] == 64
    assert main(["sample", "--model", "./tiny_sd3", "--prompt", "a red circle", "--out", "a.png"]) == 0
    assert "64x64 px" in capsys.readouterr().out and (tmp_path / "a.png").is_file()
    assert main(["sample", "--model", "./tiny_sd3", "--prompt", "a", "--height", "128", "--out", "b.png"]) == 2
    err = capsys.readouterr().err
    assert "at most 64 px a side" in err and "--height 64" in err and "pos_embed_max_size 16" in err
    # the built-in one (built into the cache on first use) has the same defaults
    assert main(["sample", "--model", "tiny_sd3", "--prompt", "a", "--out", "c.png"]) == 0
    captured = capsys.readouterr()
    assert "64x64 px" in captured.out and "built-in model tiny_sd3, not the checkpoint directory" in captured.err
