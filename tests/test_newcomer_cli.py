"""What a newcomer sees from the command line: piped runs without loading bars or harmless library warnings, a line
before each evaluation when there is no progress bar, a GPU recipe on a CPU that says so with a measured time, and
bad --lora / --out / --model values refused before anything loads or is created."""

import os
import subprocess
import sys
from pathlib import Path

from imagerl.cli import main

TINY_RECIPE = str(Path(__file__).parent / "tiny_recipe.yaml")
NOISE = ("Loading weights", "should be kept in float32", "returned a view tensor", "Traceback", "requires torchvision")


def _piped(*args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "IMAGERL_PROGRESS"}  # a pipe: no terminal, no bars
    done = subprocess.run([sys.executable, "-m", "imagerl", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout + done.stderr


def test_piped_train_and_sample_print_no_loading_bars_or_harmless_warnings(tiny_checkpoint, tmp_path):
    out = _piped("train", "--recipe", TINY_RECIPE, "--output-dir", str(tmp_path / "run"), f"model.path={tiny_checkpoint}",
                 "model.device=cpu", "sample.height=64", "sample.width=64", "sample.prompts_per_rollout=2",
                 "sample.group_size=2", "sample.batch_size=2", "train.num_rollouts=1", "run.tensorboard=false",
                 "run.image_grid_every=0", "eval.interval=0", "eval.max_prompts=2", "eval.num_steps=2", cwd=tmp_path)
    assert not [n for n in NOISE if n in out], out
    assert "evaluating after rollout 0: 2 held-out prompts" in out  # the minutes before rollout 1
    assert "one rollout of 4 images at 64x64 px takes" in out  # measured on this CPU
    out = _piped("sample", "--model", str(tiny_checkpoint), "--prompt", "a cat", "--steps", "2", "--height", "64",
                 "--width", "64", "--out", str(tmp_path / "cat.png"), cwd=tmp_path)
    assert not [n for n in NOISE if n in out], out
    assert (tmp_path / "cat.png").is_file()


def test_a_gpu_recipe_on_a_cpu_says_so_with_a_measured_time(tiny_checkpoint):
    from imagerl.components import load_adapter, resolve_family_defaults
    from imagerl.config import load_config
    from imagerl.run.cpu_estimate import measured_rollout_message
    from imagerl.distributed.parallel import World, resolve_device

    cfg = load_config("qwen_image_jpeg", [f"model.path={tiny_checkpoint}", "model.device=cpu",
                                          "parallel.compile=false", "model.text_encoder_offload=false"])
    adapter = load_adapter(cfg, World(0, 1, resolve_device("cpu")))
    resolve_family_defaults(cfg, adapter)
    line, slow = measured_rollout_message(adapter, cfg)
    # 512 images at 512 px, 10 steps with CFG and 2 trained steps, 300 rollouts: hours on a CPU even for the tiny model
    assert slow and "one rollout of 512 images at 512x512 px" in line and "meant for a GPU" in line, line
    small = load_config(TINY_RECIPE, [f"model.path={tiny_checkpoint}", "model.device=cpu", "sample.height=64",
                                      "sample.width=64", "sample.prompts_per_rollout=2", "sample.group_size=2"])
    resolve_family_defaults(small, adapter)
    line, slow = measured_rollout_message(adapter, small)
    assert not slow and "one rollout of 4 images at 64x64 px takes" in line, line


def test_bad_lora_out_and_model_are_refused_before_loading_or_creating(tmp_path, capsys, monkeypatch):
    import imagerl.sample

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad flag was refused")

    monkeypatch.setattr(imagerl.sample, "resolve_model_path", must_not_load)
    assert main(["sample", "--model", "quickstart", "--prompt", "a", "--lora", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "--lora" in err and "it does not exist" in err
    assert main(["sample", "--model", "quickstart", "--prompt", "a", "--out", str(tmp_path / "picture")]) == 2
    assert "give an image file name ending in .png" in capsys.readouterr().err
    run = tmp_path / "run"
    assert main(["train", "--model", str(tmp_path / "no-such-model"), "--output-dir", str(run)]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert not run.exists()  # nothing left behind


def test_commands_that_load_no_model_start_without_torch_and_help_names_every_built_in_model():
    """`imagerl recipes` (and `--help`) import neither torch nor diffusers: it answered in 8 s instead of 0.2."""
    code = ("import sys; from imagerl.cli import main; main(['recipes']); "
            "assert 'torch' not in sys.modules and 'diffusers' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "quickstart" in done.stdout, done.stderr[-2000:]
    from imagerl.cli import MODEL_HELP
    from imagerl.components import NAMED_MODELS

    assert all(name in MODEL_HELP.split(" / ") or f"or {name}" in MODEL_HELP for name in NAMED_MODELS), MODEL_HELP


def test_sd3_loads_quietly(tmp_path):
    """A piped `imagerl sample` of an SD3 checkpoint: no transformers 'requires torchvision' line (its image
    processor is never used)."""
    from imagerl.cli import main as cli_main

    assert cli_main(["make-tiny-checkpoint", "--family", "sd3", str(tmp_path / "sd3")]) == 0
    out = _piped("sample", "--model", str(tmp_path / "sd3"), "--prompt", "a", "--out", str(tmp_path / "a.png"),
                 cwd=tmp_path)
    assert not [n for n in NOISE if n in out], out


def test_shared_cpus_openmp_threads_sleep_and_a_busy_machine_is_named():
    """The CLI makes idle OpenMP threads sleep instead of spin (OMP_WAIT_POLICY=PASSIVE, set before torch loads;
    a user's value wins), and other processes' running threads on 3/4 of the cores or more add a note with what
    helps."""
    code = ("import os, sys; from imagerl.cli import main; main(['recipes']); "
            "print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        run_env = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=run_env, timeout=120)
        assert done.stdout.splitlines()[-1] == f"{expected} False", done.stderr[-1000:]  # set before torch loads
    from imagerl.run.cpu_estimate import busy_cpus_note

    assert busy_cpus_note(others=1, cores=2) == ""
    note = busy_cpus_note(others=2, cores=2)
    assert "2 threads running besides imagerl" in note and "OMP_NUM_THREADS=1" in note
