"""Bad checkpoint directories, prompt files and command lines, as a user would hit them: clear errors, fast."""

import json
import re
import shutil
import time

import pytest
import torch

import imagerl.train
from imagerl.cli import main
from imagerl.families.qwen_image import QwenImageFamily
from imagerl.families.registry import FAMILIES, family_class, resolve_family


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """The session's tiny checkpoint (conftest.py)."""
    return tiny_checkpoint


def broken_copy(tiny, tmp_path, name="broken"):
    dst = tmp_path / name
    shutil.copytree(tiny, dst)
    return dst


def load(path):
    return QwenImageFamily.from_pretrained(path, torch.device("cpu"), torch.float32)


# ---------------------------------------------------------------- QwenImageFamily on bad directories


def test_the_intact_copy_loads(tiny, tmp_path):
    """Control for the cases below: copying alone breaks nothing."""
    adapter = load(broken_copy(tiny, tmp_path))
    assert adapter.transformer.config.in_channels == 16


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match=r"model\.path='.*does-not-exist' is not a directory"):
        load(tmp_path / "does-not-exist")


def test_a_file_is_not_a_checkpoint_directory(tmp_path):
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"is not a directory"):
        load(f)


def test_directory_without_model_index(tmp_path):
    with pytest.raises(ValueError, match=r"has no model_index\.json: not a diffusers-format checkpoint"):
        load(tmp_path)


def test_model_index_with_invalid_json(tiny, tmp_path):
    path = broken_copy(tiny, tmp_path)
    (path / "model_index.json").write_text('{"_class_name": "QwenImagePipeline",')
    with pytest.raises(ValueError, match=r"model_index\.json is not valid JSON"):
        load(path)


def test_model_index_with_the_wrong_transformer_class(tiny, tmp_path):
    path = broken_copy(tiny, tmp_path)
    index = json.loads((path / "model_index.json").read_text())
    index["transformer"] = ["diffusers", "FluxTransformer2DModel"]
    (path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"component 'transformer' is FluxTransformer2DModel, expected "
                                         r"QwenImageTransformer2DModel; wrong model\.family\?"):
        load(path)


def test_model_index_without_a_vae_entry(tiny, tmp_path):
    path = broken_copy(tiny, tmp_path)
    index = json.loads((path / "model_index.json").read_text())
    del index["vae"]
    (path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lists no 'vae' component \(needed: AutoencoderKLQwenImage\)"):
        load(path)


@pytest.mark.parametrize("folder", ["vae", "transformer", "text_encoder", "tokenizer"])
def test_checkpoint_missing_a_component_folder(tiny, tmp_path, folder):
    path = broken_copy(tiny, tmp_path)
    shutil.rmtree(path / folder)
    with pytest.raises(ValueError, match=rf"lacks the {folder}/ folder"):
        load(path)


def test_checkpoint_missing_the_scheduler_config(tiny, tmp_path):
    path = broken_copy(tiny, tmp_path)
    (path / "scheduler" / "scheduler_config.json").unlink()
    with pytest.raises(ValueError, match=r"checkpoint lacks .*scheduler_config\.json"):
        load(path)


# ---------------------------------------------------------------- family resolution


def test_resolve_explicit_family(tmp_path):
    assert resolve_family(tmp_path, "qwen_image") == "qwen_image"  # explicit wins, nothing is read
    assert family_class(tmp_path, "qwen_image") is QwenImageFamily


def test_resolve_from_model_index(tiny, tmp_path):
    neutral = tmp_path / "my-model"  # the name gives no hint: model_index.json must decide
    shutil.copytree(tiny, neutral)
    assert resolve_family(neutral) == "qwen_image"
    assert family_class(neutral) is QwenImageFamily


def test_resolve_from_the_directory_name(tmp_path):
    path = tmp_path / "Qwen-Image-local"
    path.mkdir()
    assert resolve_family(path) == "qwen_image"


@pytest.mark.parametrize("name", ["my-model", "Qwen-Image"])
def test_loading_a_missing_directory_says_so(tmp_path, name):
    """Not "set model.family": that advice would not help with a mistyped path."""
    with pytest.raises(ValueError, match=rf"model\.path='.*{name}' is not a directory"):
        family_class(tmp_path / name)


@pytest.mark.parametrize("name", ["my-model", "Qwen-Image-local"])
def test_loading_an_empty_directory_says_it_has_no_model_index(tmp_path, name):
    """Before any family question (pass --family would not help), whatever the name suggests."""
    path = tmp_path / name
    path.mkdir()
    with pytest.raises(ValueError, match=r"has no model_index\.json: not a diffusers-format checkpoint \(expected "
                                         r"model_index\.json, transformer/"):
        family_class(path)


def test_loading_a_directory_with_an_invalid_model_index_says_so(tmp_path):
    (tmp_path / "model_index.json").write_text("not json")
    with pytest.raises(ValueError, match=r"model_index\.json is not valid JSON"):
        family_class(tmp_path)


def test_unknown_explicit_family_lists_the_known_ones(tiny):
    with pytest.raises(ValueError, match=r"unknown family 'sdxl'; available: flux, qwen_image"):
        resolve_family(tiny, "sdxl")


@pytest.mark.parametrize("index", [None, '{"_class_name": "StableDiffusionXLPipeline"}', "not json"])
def test_unrecognisable_directory_says_to_set_the_family(tmp_path, index):
    path = tmp_path / "mystery-model"
    path.mkdir()
    if index is not None:
        (path / "model_index.json").write_text(index)
    with pytest.raises(ValueError, match=r"cannot tell the model family of .*mystery-model.*; pass --family \(or "
                                         r"model\.family=\) with one of: flux, qwen_image, qwen_image21, sd3"):
        resolve_family(path)


def test_registry_holds_the_qwen_image_family():
    resolve_family("unused", "qwen_image")  # imports the built-in families
    assert FAMILIES["qwen_image"] is QwenImageFamily
    assert QwenImageFamily.pipeline_class_name == "QwenImagePipeline"


@pytest.mark.parametrize("name, family", [("Qwen/Qwen-Image", "qwen_image"), ("qwen-image", "qwen_image"),
                                          ("/data/QWEN_IMAGE-finetune", "qwen_image")])
def test_public_resolve_family_by_name(name, family):
    import imagerl

    assert imagerl.resolve_family(name) == family


def test_public_resolve_family_unknown_name():
    import imagerl

    with pytest.raises(ValueError, match="--family"):
        imagerl.resolve_family("some-lab/some-unknown-model")
    assert imagerl.resolve_family("stabilityai/stable-diffusion-3.5-medium") == "sd3"


# ---------------------------------------------------------------- the command line fails fast


@pytest.fixture
def no_model_load(monkeypatch):
    """The CLI errors below must be raised before any model is loaded."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the error was reported")

    monkeypatch.setattr(imagerl.train, "load_adapter", refuse)


def run_cli(argv, capsys):
    """main(argv), its exit code and output. That the errors come before any model load is what no_model_load
    asserts; their wall-clock time is test_cli_errors_come_back_within_5_seconds's (perf marker)."""
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.perf  # an absolute wall-clock bound: python -m pytest -m perf
@pytest.mark.parametrize("argv", [["train", "train.lr=abc"], ["train", "sample.group_sise=4"],
                                  ["train", "--recipe", "nope"], ["train", "data.train_prompts=/nonexistent.txt"],
                                  ["recipes"]])
def test_cli_errors_come_back_within_5_seconds(tmp_path, capsys, no_model_load, argv):
    start = time.perf_counter()
    main([*argv, "--output-dir", str(tmp_path / "run")] if argv[0] == "train" else argv)
    elapsed = time.perf_counter() - start
    capsys.readouterr()
    assert elapsed < 5, f"{argv} took {elapsed:.1f} s"


def test_cli_missing_prompt_file(tmp_path, capsys, no_model_load):
    run_dir = tmp_path / "run"
    code, _, err = run_cli(["train", "data.train_prompts=/nonexistent.txt", "--output-dir", str(run_dir)], capsys)
    assert code == 2
    assert err.startswith("imagerl: error: ")
    assert "/nonexistent.txt" in err and "does not exist" in err
    assert not run_dir.exists()  # nothing written for a run that never started


@pytest.mark.parametrize("content, name, match", [
    ("", "empty.txt", "contains no prompts"),
    ("\n  \n", "blank.txt", "contains no prompts"),
    ('{"prompt": "a cat"}\n{"prompt": \n', "bad.jsonl", r"bad\.jsonl:2: not valid JSON"),
    ('{"prompt": "a cat"}\n{"text": "a dog"}\n', "nofield.jsonl", r'nofield\.jsonl:2: each line must be a JSON object '
                                                                   r'with a non-empty "prompt" string'),
    ("a cat\n", "prompts.csv", r"unknown extension '\.csv'"),
    (b"\xff\xfe\x00a cat", "latin.txt", "is not UTF-8 text"),
])
def test_cli_bad_prompt_files(tmp_path, capsys, no_model_load, content, name, match):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    code, _, err = run_cli(["train", f"data.train_prompts={path}", "--output-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert re.search(match, err), err
    assert str(path) in err


def test_cli_bad_override_value(tmp_path, capsys, no_model_load):
    code, _, err = run_cli(["train", "train.lr=abc", "--output-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert "train.lr: expected float, got 'abc'" in err


def test_cli_unknown_key_suggests(tmp_path, capsys, no_model_load):
    code, _, err = run_cli(["train", "sample.group_sise=4", "--output-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert "did you mean sample.group_size?" in err


def test_cli_inconsistent_batch_sizes(tmp_path, capsys, no_model_load):
    code, _, err = run_cli(["train", "sample.batch_size=3", "--output-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert "not a multiple of sample.batch_size=3" in err


def test_cli_unknown_reward(tmp_path, capsys, no_model_load):
    code, _, err = run_cli(["train", "reward.weights={hpsv2: 1.0}", "--output-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert "unknown reward(s) ['hpsv2']" in err and "jpeg_compressibility" in err


def test_cli_missing_model_directory(tmp_path, capsys):
    code, _, err = run_cli(["train", f"model.path={tmp_path / 'models' / 'mine'}", "--output-dir",
                            str(tmp_path / "run")], capsys)
    assert code == 2
    assert f"model.path='{tmp_path / 'models' / 'mine'}' is not a directory" in err


def test_cli_bad_device_name(tmp_path, capsys, no_model_load):
    code, _, err = run_cli(["train", "model.device=gpu", "--output-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert "model.device='gpu' is not a device" in err


def test_cli_unknown_recipe(capsys, no_model_load):
    code, _, err = run_cli(["train", "--recipe", "nope"], capsys)
    assert code == 2
    assert "unknown recipe 'nope'" in err


def test_cli_lists_recipes(capsys):
    code, out, _ = run_cli(["recipes"], capsys)
    assert code == 0
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    assert "quickstart" in names and "qwen_image_jpeg" in names
    from imagerl.config import available_recipes

    for line in out.splitlines()[:len(available_recipes())]:  # one whole sentence each, not a cut comment
        summary = line.split(maxsplit=1)[1]
        assert summary.endswith(".") and len(line) <= 125 and "reference/" not in summary, line


@pytest.mark.parametrize("resume", ["dir", "latest"])
def test_cli_resume_without_a_checkpoint(tmp_path, capsys, no_model_load, resume):
    empty = tmp_path / "empty"
    empty.mkdir()
    run_dir = tmp_path / "run"
    arg = str(empty) if resume == "dir" else "latest"
    code, _, err = run_cli(["train", "--resume", arg, "--output-dir", str(run_dir)], capsys)
    assert code == 2
    assert "no checkpoint found" in err and f"--resume {arg}" in err
    assert not run_dir.exists()


def test_cli_resume_from_a_missing_directory(tmp_path, capsys, no_model_load):
    code, _, err = run_cli(["train", "--resume", str(tmp_path / "gone"), "--output-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert "no checkpoint found" in err
