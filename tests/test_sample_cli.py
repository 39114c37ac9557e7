"""`imagerl sample`: plain ODE inference equals the diffusers pipeline, with and without a trained LoRA."""

import pytest
import torch
from diffusers import QwenImagePipeline
from PIL import Image

from conftest import tiny_config
from imagerl.cli import main
from imagerl.distributed.rng import make_generator
from imagerl.families.qwen_image import pack_latents
from imagerl.sample import sample_images
from imagerl.train import train

PROMPTS = ['a mug that says "GOOD MORNING"', "a red bicycle"]


def _noise(seed, n, h=64, w=64):
    return torch.cat([pack_latents(torch.randn(1, 4, 1, h // 8, w // 8, generator=make_generator(seed, "sample", i)))
                      for i in range(n)])


def _pipeline_images(checkpoint, lora=None, seed=3):
    pipe = QwenImagePipeline.from_pretrained(checkpoint)
    if lora is not None:
        pipe.load_lora_weights(lora)
    return pipe(prompt=PROMPTS, negative_prompt=" ", true_cfg_scale=4.0, height=64, width=64, num_inference_steps=5,
                latents=_noise(seed, 2), output_type="pt").images


def test_sample_equals_the_pipeline(tiny_checkpoint):
    ours = sample_images(str(tiny_checkpoint), PROMPTS, num_steps=5, seed=3, height=64, width=64, device="cpu")
    assert ours.shape == (2, 3, 64, 64)
    assert torch.allclose(ours, _pipeline_images(tiny_checkpoint), atol=1e-4)


@pytest.fixture(scope="module")
def trained_lora(tiny_checkpoint, tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    train(tiny_config(tiny_checkpoint, run, "train.num_rollouts=2", "train.lr=0.05", "train.clip_range=0.5"))
    return run / "checkpoints" / "step_000002" / "lora"


def test_sample_with_lora_equals_the_pipeline_with_load_lora_weights(tiny_checkpoint, trained_lora):
    ours = sample_images(str(tiny_checkpoint), PROMPTS, num_steps=5, seed=3, height=64, width=64, device="cpu",
                         lora=str(trained_lora))
    base = sample_images(str(tiny_checkpoint), PROMPTS, num_steps=5, seed=3, height=64, width=64, device="cpu")
    assert not torch.allclose(ours, base, atol=1e-4)  # the LoRA changes the images
    assert torch.allclose(ours, _pipeline_images(tiny_checkpoint, lora=str(trained_lora)), atol=1e-4)


def test_cli_sample_writes_pngs(tiny_checkpoint, tmp_path):
    out = tmp_path / "img.png"
    rc = main(["sample", "--model", str(tiny_checkpoint), "--prompt", PROMPTS[0], "--steps", "3", "--height", "64",
               "--width", "64", "--device", "cpu", "--out", str(out)])
    assert rc == 0 and Image.open(out).size == (64, 64)
    rc = main(["sample", "--model", str(tiny_checkpoint), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--steps",
               "3", "--height", "64", "--width", "64", "--device", "cpu", "--out", str(out)])
    assert rc == 0 and (tmp_path / "img_0.png").is_file() and (tmp_path / "img_1.png").is_file()


def test_cli_sample_rejects_a_bad_lora_dir(tiny_checkpoint, tmp_path, capsys):
    rc = main(["sample", "--model", str(tiny_checkpoint), "--prompt", "x", "--lora", str(tmp_path), "--device", "cpu"])
    assert rc == 2 and "adapter_config.json" in capsys.readouterr().err


def test_train_flags_model_and_family_reach_the_config(tmp_path, capsys):
    rc = main(["train", "--model", str(tmp_path / "nowhere"), "--output-dir", str(tmp_path / "run")])
    assert rc == 2 and "nowhere' is not a directory" in capsys.readouterr().err
    rc = main(["train", "--model", str(tmp_path), "--family", "sdxl", "--output-dir", str(tmp_path / "run")])
    assert rc == 2 and "unknown family 'sdxl'" in capsys.readouterr().err
