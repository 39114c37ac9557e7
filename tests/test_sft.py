"""`imagerl sft`: encode_images conventions, the flow-matching target, learning, bit-exact resume, export, data errors.

Data: solid-colour PNGs (80x64, so resize + center crop run) captioned with their colour; the tiny checkpoints
at 64x64 px (1.0: 16 tokens of 16 channels; 2.1: 16 tokens of 8 channels).
"""

import json
from types import SimpleNamespace

import pytest
import torch
from diffusers import QwenImagePipeline

from imagerl.cli import main
from imagerl.families.qwen_image import QwenImageFamily
from imagerl.sft.trainer import SFTConfig, draw_step, export_model, load_sft_config, sft
from imagerl.sft.data import load_examples

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30), "yellow": (230, 220, 30)}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("sft_data")
    lines = []
    for name, rgb in COLOURS.items():
        Image.new("RGB", (80, 64), rgb).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(name + "\n")
        lines.append(json.dumps({"image": f"{name}.png", "prompt" if name != "blue" else "caption": name}))
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module")
def tiny21(tmp_path_factory):
    from imagerl.families.qwen_image21.tiny import make_tiny_qwen_image21

    return make_tiny_qwen_image21(tmp_path_factory.mktemp("ckpt21") / "tiny-qwen-image21")


def config(model, root, out, **overrides) -> SFTConfig:
    base = dict(model=str(model), data=str(root / "data.jsonl"), output_dir=str(out), device="cpu", height=64, width=64,
                batch_size=8, num_steps=2, log_every=1, tensorboard=False, gradient_checkpointing=False, lr=1e-3)
    return SFTConfig(**{**base, **overrides})


def losses(run_dir) -> list[float]:
    return [json.loads(line)["sft/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "sft/loss" in line]


def solid(names) -> torch.Tensor:
    return torch.stack([torch.tensor(COLOURS[n], dtype=torch.float32).view(3, 1, 1).expand(3, 64, 64) / 255
                        for n in names])


# ---------------------------------------------------------------- encode_images


def test_encode_images_matches_the_pipeline_and_round_trips(tiny_checkpoint):
    adapter = QwenImageFamily.from_pretrained(tiny_checkpoint, CPU, torch.float32)
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    latents = adapter.encode_images(x)
    assert latents.shape == (2, adapter.image_seq_len(64, 64), 4 * adapter.latent_channels) and latents.dtype == torch.float32
    vae, c = adapter.vae, adapter.vae.config
    with torch.no_grad():
        z = vae.encode((x * 2 - 1).unsqueeze(2)).latent_dist.mode()
    z = (z - torch.tensor(c.latents_mean).view(1, -1, 1, 1, 1)) / torch.tensor(c.latents_std).view(1, -1, 1, 1, 1)
    assert torch.allclose(latents, QwenImagePipeline._pack_latents(z, 2, c.z_dim, 8, 8), atol=1e-6)
    images = adapter.decode(latents, 64, 64)
    assert images.shape == x.shape and images.dtype == torch.float32
    with pytest.raises(ValueError, match="multiples of 16"):
        adapter.encode_images(torch.rand(1, 3, 40, 64))


def test_encode_images_21_matches_the_pipeline(tiny21):
    from diffusers import QwenImage21Pipeline
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image

    from imagerl.families.qwen_image21 import QwenImage21Family

    adapter = QwenImage21Family.from_pretrained(tiny21, CPU, torch.float32)
    x = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    pil = Image.fromarray((x[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()).convert("RGBA")
    # the pipeline's own preprocessing of an RGB condition image: RGBA (opaque), [-1, 1], then _encode_vae_image
    pixels = VaeImageProcessor(vae_scale_factor=16, vae_latent_channels=adapter.latent_channels).preprocess(pil, 64, 64)
    pipe = SimpleNamespace(vae=adapter.vae, latent_channels=adapter.latent_channels)
    with torch.no_grad():
        encoded = QwenImage21Pipeline._encode_vae_image(pipe, pixels.unsqueeze(2), None)
    expected = QwenImage21Pipeline._pack_latents(encoded, 1, adapter.latent_channels, 4, 4)
    latents = adapter.encode_images((pixels[:, :3] + 1) / 2)
    assert latents.shape == (1, 16, adapter.latent_channels) and latents.dtype == torch.float32
    assert torch.allclose(latents, expected, atol=1e-6)
    assert adapter.decode(latents, 64, 64).shape == (1, 3, 64, 64)


# ---------------------------------------------------------------- the objective


def test_the_target_matches_an_independent_flow_matching_computation(tiny_checkpoint, data, tmp_path, monkeypatch):
    seen = {}
    original = QwenImageFamily.velocity

    def spy(self, latents, timesteps, cond, h, w):
        seen.update(x_t=latents.detach().clone(), t=timesteps.detach().clone(), embeds=cond.embeds_BLD.clone())
        pred = original(self, latents, timesteps, cond, h, w)
        seen["pred"] = pred.detach().clone()
        return pred

    monkeypatch.setattr(QwenImageFamily, "velocity", spy)
    cfg = config(tiny_checkpoint, data, tmp_path / "run", num_steps=1, caption_dropout=0.5, seed=3)
    run = sft(cfg)
    adapter, examples = run.adapter, load_examples(cfg.data)
    draw = draw_step(cfg, 0, len(examples), adapter)
    names = [examples[i].caption for i in draw.indices]
    x0 = adapter.encode_images(solid(names))  # solid colours: resize + crop change nothing
    s = draw.sigmas_B.view(-1, 1, 1)
    assert torch.allclose(seen["x_t"], (1 - s) * x0 + s * draw.noise_BNC, atol=1e-5)
    assert torch.allclose(seen["t"], draw.sigmas_B * 1000)
    expected_loss = ((seen["pred"] - (draw.noise_BNC - x0)) ** 2).mean().item()
    assert losses(run.run_dir)[0] == pytest.approx(expected_loss, rel=1e-5)
    assert draw.dropped_B.any() and not draw.dropped_B.all()
    captions = [" " if d else n for n, d in zip(names, draw.dropped_B.tolist())]
    expected = adapter.conditioning(adapter.encode_prompts(captions), None, 1.0).embeds_BLD
    assert torch.equal(seen["embeds"], expected)
    assert 0 < draw.sigmas_B.min() and draw.sigmas_B.max() < 1


# ---------------------------------------------------------------- learning, resume, export


@pytest.fixture(scope="module")
def full_run(tiny_checkpoint, data, tmp_path_factory):
    return sft(config(tiny_checkpoint, data, tmp_path_factory.mktemp("full"), lora_rank=0, num_steps=40,
                      checkpoint_every=20))


@pytest.fixture(scope="module")
def lora_run(tiny_checkpoint, data, tmp_path_factory):
    return sft(config(tiny_checkpoint, data, tmp_path_factory.mktemp("lora"), lora_rank=8, lora_alpha=16, lr=1e-2,
                      num_steps=40, checkpoint_every=20))


@pytest.mark.parametrize("which, ratio", [("full_run", 0.5), ("lora_run", 0.75)])
def test_loss_decreases(which, ratio, request):
    values = losses(request.getfixturevalue(which).run_dir)
    assert len(values) == 40
    first, last = sum(values[:5]) / 5, sum(values[-5:]) / 5
    assert last < ratio * first, (first, last)


@pytest.mark.parametrize("rank", [0, 4])
def test_resume_is_bit_exact(rank, tiny_checkpoint, data, tmp_path):
    kw = dict(lora_rank=rank, checkpoint_every=2, caption_dropout=0.3)
    straight = sft(config(tiny_checkpoint, data, tmp_path / "a", num_steps=4, **kw))
    sft(config(tiny_checkpoint, data, tmp_path / "b", num_steps=2, **kw))
    resumed = sft(config(tiny_checkpoint, data, tmp_path / "b", num_steps=4, **kw), resume="latest")
    assert losses(resumed.run_dir) == losses(straight.run_dir) and len(losses(straight.run_dir)) == 4
    a, b = straight.adapter.trainable_parameters(), resumed.adapter.trainable_parameters()
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    (tmp_path / "b" / ".imagerl.lock").unlink(missing_ok=True)
    before = sorted((str(p), p.stat().st_mtime_ns) for p in (tmp_path / "b").rglob("*"))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        sft(config(tiny_checkpoint, data, tmp_path / "b", num_steps=4, **kw))
    assert sorted((str(p), p.stat().st_mtime_ns) for p in (tmp_path / "b").rglob("*")) == before  # nothing touched


def _same_inputs(adapter):
    gen = torch.Generator().manual_seed(5)
    cond = adapter.conditioning(adapter.encode_prompts(["red", "a blue square"]), None, 1.0)
    return torch.randn(2, 16, 16, generator=gen), torch.tensor([700.0, 250.0]), cond


@pytest.mark.parametrize("which", ["full_run", "lora_run"])
def test_export_loads_everywhere_and_predicts_like_the_trained_model(which, request, tmp_path):
    run = request.getfixturevalue(which)
    with torch.no_grad():
        _check_export(run, which, tmp_path)


def _check_export(run, which, tmp_path):
    out = export_model(run.run_dir, tmp_path / "export")
    assert not any(p.is_symlink() for p in out.rglob("*"))  # standalone
    x, t, cond = _same_inputs(run.adapter)
    trained = run.adapter.velocity(x, t, cond, 64, 64)
    exported = QwenImageFamily.from_pretrained(out, CPU, torch.float32)
    assert not exported.trainable_parameters()  # a plain transformer: nothing of the LoRA left
    mine = exported.velocity(x, t, cond, 64, 64)
    tol = 0 if which == "full_run" else 1e-5  # the merged LoRA equals the adapter up to rounding
    assert (mine - trained).abs().max() <= tol
    pipe = QwenImagePipeline.from_pretrained(out)
    theirs = pipe.transformer(hidden_states=x, timestep=t / 1000, encoder_hidden_states=cond.embeds_BLD,
                              encoder_hidden_states_mask=cond.mask_BL, img_shapes=[[(1, 4, 4)]] * 2,
                              return_dict=False)[0]
    assert (theirs - trained).abs().max() <= max(tol, 1e-6)
    # the checkpoint itself is a loadable model for a full fine-tune
    if which == "full_run":
        ckpt = QwenImageFamily.from_pretrained(run.checkpoint / "model", CPU, torch.float32)
        assert torch.equal(ckpt.velocity(x, t, cond, 64, 64), trained)


# ---------------------------------------------------------------- data errors, CLI, 2.1


def test_bad_data_is_a_clear_error(tiny_checkpoint, data, tmp_path):
    def bad(lines, match):
        path = tmp_path / "bad.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        with pytest.raises(ValueError, match=match):
            sft(config(tiny_checkpoint, data, tmp_path / "run", data=str(path)))

    image = str(data / "red.png")
    bad([{"image": image, "prompt": "red"}, {"image": "missing.png", "prompt": "x"}], r"bad.jsonl:2: image file .* does not exist")
    bad([{"image": image}], r"bad.jsonl:1: missing or empty caption")
    bad([{"image": image, "prompt": "  "}], "missing or empty caption")
    bad([], "holds no examples")
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(ValueError, match="holds no examples"):
        load_examples(folder)
    (folder / "a.png").write_bytes((data / "red.png").read_bytes())
    with pytest.raises(ValueError, match="no caption file a.txt"):
        load_examples(folder)
    with pytest.raises(ValueError, match="does not exist"):
        load_examples(tmp_path / "nowhere.jsonl")
    with pytest.raises(ValueError, match="neither an sft run directory nor a checkpoint"):
        export_model(tmp_path, tmp_path / "export")
    with pytest.raises(ValueError, match="unknown sft setting 'lr_rate'"):
        load_sft_config(["lr_rate=1"])
    assert load_sft_config(["lr=1e-5", "validation_prompts=[a, b]"]).lr == 1e-5


def test_cli_trains_from_a_folder_resumes_and_exports(tiny_checkpoint, data, tmp_path):
    run = tmp_path / "run"
    common = ["--output-dir", str(run), "device=cpu", "height=64", "width=64", "batch_size=4", "tensorboard=false",
              "gradient_checkpointing=false", "lora_rank=0", "log_every=1"]
    assert main(["sft", "--model", str(tiny_checkpoint), "--data", str(data), *common, "num_steps=2",
                 "validation_prompts=[red]", "validation_steps=2"]) == 0
    assert (run / "images" / "validation_000000.png").is_file() and (run / "images" / "validation_000002.png").is_file()
    assert main(["sft", "--output-dir", str(run), "--resume", "latest", "num_steps=3"]) == 0  # settings from the run
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    assert main(["sft", "--export", str(run), str(tmp_path / "model")]) == 0
    assert (tmp_path / "model" / "transformer" / "config.json").is_file()
    assert main(["sft", "--export", str(run), str(tmp_path / "model")]) == 2  # not empty: refused
    from conftest import tiny_config
    from imagerl.train import train

    train(tiny_config(tmp_path / "model", tmp_path / "rl", "train.num_rollouts=1"))  # RL starts from the export
    assert (tmp_path / "rl" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("rank", [0, 4])
def test_qwen_image21_one_step(rank, tiny21, data, tmp_path):
    run = sft(config(tiny21, data, tmp_path / "run", num_steps=1, lora_rank=rank))
    assert run.adapter.name == "qwen_image21"
    assert torch.isfinite(torch.tensor(losses(run.run_dir))).all()
    assert (run.checkpoint / ("model" if rank == 0 else "lora")).is_dir()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rank", [0, 8])
def test_bf16_autocast_training_on_gpu(rank, tiny_checkpoint, data, tmp_path):
    run = sft(config(tiny_checkpoint, data, tmp_path / "run", device="cuda", dtype="bfloat16", lora_rank=rank,
                     lora_alpha=16, lr=1e-3 if rank == 0 else 1e-2, num_steps=40, gradient_checkpointing=True))
    params = run.adapter.trainable_parameters()
    assert all(p.dtype == torch.float32 and p.is_cuda for p in params)  # fp32 master weights
    values = losses(run.run_dir)
    assert sum(values[-5:]) < (0.5 if rank == 0 else 0.75) * sum(values[:5])
    out = export_model(run.run_dir, tmp_path / "export")
    exported = QwenImageFamily.from_pretrained(out, torch.device("cuda"), torch.bfloat16)
    x, t, cond = _same_inputs(exported)
    with torch.no_grad():
        trained = run.adapter.velocity(x.cuda(), t, cond, 64, 64)  # bf16 autocast over the fp32 master weights
        mine = exported.velocity(x.cuda(), t, cond, 64, 64)  # bf16 weights
    assert (mine - trained).norm() < 0.05 * trained.norm()
