"""User-input errors caught before any model loads: each is a ValueError naming the key (imagerl.validation), and
the CLI turns it, or an OSError from an unwritable path, into `imagerl: error: ...` with exit status 2."""

import errno
import os
import re
import shutil
from pathlib import Path

import pytest

from imagerl.cli import main
from imagerl.config import load_config, recipe_dir
from imagerl.run.lock import check_output_dir
from imagerl.validation import validate


def rejects(overrides, match):
    cfg = load_config("quickstart", overrides)  # loading succeeds: these are semantic errors
    with pytest.raises(ValueError, match=match):
        validate(cfg, world_size=1)


# ---------------------------------------------------------------- numeric settings


@pytest.mark.parametrize("alpha", [0, -4])
def test_lora_alpha_must_be_positive(alpha):
    rejects([f"model.lora_alpha={alpha}"], rf"model\.lora_alpha must be > 0 .*got {alpha}")


@pytest.mark.parametrize("raw, shown", [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf")])
def test_non_finite_reward_weight_is_rejected_up_front(raw, shown):
    rejects([f"reward.weights={{shapes: {raw}}}"], rf"reward\.weights\.shapes must be a finite number, got {shown}")


@pytest.mark.parametrize("weights", ["{shapes: -1.0}", "{shapes: 0.0}", "{shapes: 1.0, jpeg_compressibility: -0.5}"])
def test_zero_and_negative_reward_weights_are_legitimate(weights):
    validate(load_config("quickstart", [f"reward.weights={weights}"]), world_size=1)


@pytest.mark.parametrize("key, value", [("adam_beta1", "2"), ("adam_beta1", "1"), ("adam_beta1", "-0.1"),
                                        ("adam_beta2", "1.0"), ("adam_beta2", ".nan")])
def test_adam_betas_must_be_in_0_1(key, value):
    rejects([f"train.{key}={value}"], rf"train\.{key} must be in \[0, 1\)")


def test_adam_beta1_of_0_is_accepted():
    validate(load_config("quickstart", ["train.adam_beta1=0"]), world_size=1)


@pytest.mark.parametrize("key", ["height", "width"])
@pytest.mark.parametrize("value", [63, 72, 8])
def test_image_size_must_be_a_multiple_of_16(key, value):
    rejects([f"sample.{key}={value}"], rf"sample\.{key} must be a positive multiple of 16 .*VAE.*8.*patch size 2.*"
                                       rf"got {value}")


@pytest.mark.parametrize("value", [16, 32, 48, 64])
def test_image_sizes_in_steps_of_16_are_accepted(value):
    validate(load_config("quickstart", [f"sample.height={value}", f"sample.width={value}"]), world_size=1)


# ---------------------------------------------------------------- run.output_dir and the recipe name


@pytest.mark.parametrize("template, error", [("{nope}", "KeyError"), ("runs/{0}", "IndexError"),
                                             ("runs/{recipe", "ValueError"), ("runs/{recipe.x}", "AttributeError")])
def test_bad_output_dir_template_is_a_value_error_naming_recipe(template, error):
    cfg = load_config("quickstart", [f"run.output_dir='{template}'"])
    with pytest.raises(ValueError, match=rf"run\.output_dir=.*not a valid template \({error}.*only placeholder "
                                         r"available is \{recipe\}"):
        cfg.output_dir
    with pytest.raises(ValueError, match=r"run\.output_dir"):
        validate(cfg, world_size=1)


def test_escaped_braces_in_output_dir_are_literal():
    cfg = load_config("quickstart", ["run.output_dir='runs/{{x}}/{recipe}'"])
    validate(cfg, world_size=1)
    assert cfg.output_dir == Path("runs/{x}/quickstart")


@pytest.mark.parametrize("recipe", ["../x", "a/b", "/tmp/x", "..", "a\\b", "a..b", ""])
def test_recipe_name_cannot_move_the_run_dir_out_of_its_parent(recipe):
    cfg = load_config("quickstart")
    cfg.recipe = recipe
    message = f"recipe name {recipe!r} cannot be used in run.output_dir='runs/{{recipe}}'"
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(cfg, world_size=1)


def test_unsafe_recipe_name_is_fine_when_output_dir_does_not_use_it(tmp_path):
    cfg = load_config("quickstart", [f"run.output_dir={tmp_path / 'run'}"])
    cfg.recipe = "../x"
    validate(cfg, world_size=1)
    assert cfg.output_dir == tmp_path / "run"


def test_recipe_file_path_with_dotdot_uses_its_stem(tmp_path):
    (tmp_path / "sub").mkdir()
    shutil.copy(recipe_dir() / "quickstart.yaml", tmp_path / "sub" / "mine.yaml")
    cfg = load_config(str(tmp_path / "sub" / ".." / "sub" / "mine.yaml"))
    validate(cfg, world_size=1)
    assert cfg.output_dir == Path("runs/mine")


# ---------------------------------------------------------------- check_output_dir


def test_check_output_dir_creates_the_directory_and_leaves_no_probe(tmp_path):
    out = tmp_path / "a" / "b"
    assert check_output_dir(out) == out
    assert out.is_dir() and list(out.iterdir()) == []
    (out / "metrics.jsonl").write_text("{}\n")
    check_output_dir(str(out))  # an existing run directory: its files are kept
    assert [p.name for p in out.iterdir()] == ["metrics.jsonl"]


def test_check_output_dir_under_a_file_names_the_path_and_the_os_reason(tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "run"
    with pytest.raises(ValueError, match=rf"run\.output_dir {out} is not writable: \[Errno {errno.ENOTDIR}\] .*"
                                         "choose another with --output-dir"):
        check_output_dir(out)


def test_check_output_dir_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"is a file, not a directory; choose another with --output-dir"):
        check_output_dir(tmp_path / "file")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_check_output_dir_in_proc():
    with pytest.raises(ValueError, match=r"run\.output_dir /proc/imagerl-x/run is not writable: \[Errno"):
        check_output_dir("/proc/imagerl-x/run")


def test_check_output_dir_full_disk(tmp_path, monkeypatch):
    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(ValueError, match=rf"run\.output_dir {tmp_path} is not writable: \[Errno {errno.ENOSPC}\] "
                                         rf"{os.strerror(errno.ENOSPC)}"):
        check_output_dir(tmp_path)


# ---------------------------------------------------------------- CLI


def test_cli_reports_an_os_error_without_a_traceback(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "data"  # a path under a regular file: NotADirectoryError, also as root
    assert main(["make-synthetic-data", str(out), "--n", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("imagerl: error: [Errno")
    assert str(tmp_path / "file") in err and "Traceback" not in err


@pytest.mark.parametrize("args, match", [
    (["--output-dir", "{nope}"], "run.output_dir='{nope}' is not a valid template (KeyError: 'nope'); the only "
                                 "placeholder available is {recipe}"),
    (["model.lora_alpha=0"], "model.lora_alpha must be > 0"),
    (["sample.height=63"], "sample.height must be a positive multiple of 16"),
])
def test_cli_train_rejects_bad_input_before_loading_a_model(args, match, capsys, monkeypatch):
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)  # restored after: train() sets it
    assert main(["train", "model.device=cpu", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("imagerl: error: ") and match in err


def test_a_gpu_recipe_on_a_cpu_warns_with_the_expected_time(tmp_path):
    """The released Qwen-Image transformer's config (the class defaults) under the qwen_image recipe: one rollout
    on a CPU is days; the quickstart model's is well under the threshold."""
    import inspect
    import json

    from diffusers import QwenImageTransformer2DModel

    from imagerl.components import resolve_model_path
    from imagerl.config import load_config
    from imagerl.run.cpu_estimate import cpu_rollout_warning, rollout_flops

    released = tmp_path / "Qwen-Image" / "transformer"
    released.mkdir(parents=True)
    defaults = {k: p.default for k, p in inspect.signature(QwenImageTransformer2DModel.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty}  # the released model's config: the class defaults
    (released / "config.json").write_text(json.dumps(defaults))
    cfg = load_config("qwen_image_jpeg")
    flops = rollout_flops(cfg, "qwen_image", json.loads((released / "config.json").read_text()))
    # 512 samples x 2 rows x (10 + 3 x 2) forwards of ~1.0e13 FLOPs (20B params x 2 x ~1100 tokens): ~1.7e17
    assert 1e17 < flops < 3e17
    warning = cpu_rollout_warning(cfg, released.parent, "qwen_image")
    assert warning is not None and "days" in warning and "model.device=cuda" in warning
    quick = load_config("quickstart")
    assert cpu_rollout_warning(quick, resolve_model_path("quickstart"), "qwen_image") is None


@pytest.mark.parametrize("family, recipe, low, high", [
    # 1152 samples x 2 rows x (10 + 3 x 9) forwards of ~2.0e12 FLOPs (SD3.5-M at 1024 image + 64 text tokens)
    ("sd3", "sd3_5_ocr", 1e17, 3e17),
    # 192 samples x 1 row x (25 + 3 x 4) forwards of ~3e13 FLOPs (FLUX.1-dev at 2025 image + 64 text tokens: each
    # token through its own stream's weights in the 19 double blocks, through all of the 38 single blocks')
    ("flux", "flux_ocr", 1e17, 4e17)])
def test_the_cpu_estimate_counts_sd3_and_flux_from_their_released_configs(tmp_path, family, recipe, low, high):
    """A released SD3.5 Medium / FLUX.1-dev on a CPU is warned about before it loads: their FLOPs are counted on the
    meta device from transformer/config.json (the Qwen formula does not apply to them)."""
    import json

    from imagerl.config import load_config
    from imagerl.run.cpu_estimate import cpu_rollout_warning, rollout_flops
    from imagerl.perf.bench_flux import FLUX_DEV
    from imagerl.perf.bench_sd3 import SD35_MEDIUM

    released = tmp_path / family / "transformer"
    released.mkdir(parents=True)
    spec = {"sd3": SD35_MEDIUM, "flux": FLUX_DEV}[family]
    (released / "config.json").write_text(json.dumps({"_class_name": "x", **spec}, default=list))
    cfg = load_config(recipe)
    assert low < rollout_flops(cfg, family, json.loads((released / "config.json").read_text())) < high
    warning = cpu_rollout_warning(cfg, released.parent, family)
    assert warning is not None and "model.device=cuda" in warning


def test_a_prompt_cache_without_room_is_refused():
    from imagerl.validation import validate

    for override in ("model.prompt_cache_gib=0", "model.prompt_cache_size=0"):
        cfg = load_config("quickstart", [override])
        with pytest.raises(ValueError, match="model.prompt_cache_gib must be > 0"):
            validate(cfg, world_size=1)
