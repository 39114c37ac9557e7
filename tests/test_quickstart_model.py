"""The quickstart-model builder end to end at toy sizes: synthetic data -> VAE -> SFT -> hub-layout model."""

import json

import torch

from conftest import tiny_config
from imagerl.cli import main
from imagerl.families.qwen_image import QwenImageFamily
from imagerl.train import train


def test_build_quickstart_model_at_toy_size_loads_and_trains(tmp_path):
    out = tmp_path / "model"
    rc = main(["build-quickstart-model", str(out), "--work-dir", str(tmp_path / "work"), "--num-images", "32",
               "--vae-steps", "2", "--sft-steps", "2", "--sft-batch", "4", "--device", "cpu"])
    assert rc == 0
    build = json.loads((out / "BUILD.json").read_text())
    assert build["vae_steps"] == 2 and build["sft_steps"] == 2 and "imagerl build-quickstart-model" in build["command"]
    assert json.loads((out / "imagerl_defaults.json").read_text()) == {  # what imagerl sample / eval / sft default to
        "height": 64, "width": 64, "num_steps": 10, "guidance_scale": 1.0, "rewards": ["shapes"]}
    adapter = QwenImageFamily.from_pretrained(out, torch.device("cpu"), torch.float32)
    assert adapter.vae.config.latents_std != [1.0] * 4  # statistics of the trained VAE's latents were stored
    shapes = tmp_path / "work" / "shapes"
    run = tmp_path / "run"
    train(tiny_config(out, run, "train.num_rollouts=1", f"data.train_prompts={shapes / 'prompts_train.txt'}",
                      "reward.weights={shapes: 1.0}"))
    (record,) = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert 0.0 <= record["rollout/reward/shapes_mean"] <= 1.0 and record["train/log_prob_mean_abs_diff"] == 0.0
