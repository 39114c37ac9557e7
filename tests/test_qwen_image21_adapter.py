"""The qwen_image21 adapter against diffusers' QwenImage21Pipeline on a tiny random 2.1 checkpoint.

Tolerances: on CPU fp32 the adapter runs the pipeline's operations in the same order on the same shapes, and
every comparison below was observed bit-identical (max difference 0.0). Where a tolerance is used (1e-6)
it only leaves room for BLAS/threading variation between machines; real discrepancies (padding, a wrong
hidden state, a wrong timestep or CFG formula) are orders of magnitude larger (>= 1e-3 here).
"""

import json
import shutil

import pytest
import torch
from diffusers import QwenImage21Pipeline

import imagerl
from conftest import tiny_config
from imagerl.run.checkpoint import save_lora
from imagerl.families.qwen_image21 import PROMPT_TEMPLATE, SYSTEM_PROMPT, QwenImage21Family
from imagerl.families.qwen_image21.tiny import load_processor21, make_tiny_qwen_image21
from imagerl.sampling import flow_sde_step, flow_timesteps
from imagerl.train import train

PROMPTS = ['A neon sign that says "OPEN" above a bakery door', "a cat"]
H = W = 64  # 4 x 4 latent grid: T = 16 target tokens, 4 image slots


@pytest.fixture(scope="module")
def tiny21(tmp_path_factory):
    return make_tiny_qwen_image21(tmp_path_factory.mktemp("ckpt21") / "tiny-qwen-image-2.1")


def load_pipe(path):
    # transformers cannot load a Qwen3VLProcessor without torchvision (see families/qwen_image21/tiny.py)
    pipe = QwenImage21Pipeline.from_pretrained(path, processor=load_processor21(path / "processor"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipe(tiny21):
    return load_pipe(tiny21)


@pytest.fixture(scope="module")
def adapter(tiny21):
    return QwenImage21Family.from_pretrained(tiny21, torch.device("cpu"), torch.float32)


def test_checkpoint_has_the_hub_layout(tiny21):
    index = json.loads((tiny21 / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImage21Pipeline"
    assert index["processor"] == ["transformers", "Qwen3VLProcessor"]
    assert index["text_encoder"] == ["transformers", "Qwen3VLForConditionalGeneration"]
    for sub in ["transformer", "vae", "scheduler", "text_encoder", "processor"]:
        assert (tiny21 / sub).is_dir(), sub
    for name in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "preprocessor_config.json",
                 "video_preprocessor_config.json"]:
        assert (tiny21 / "processor" / name).is_file(), name
    vae = json.loads((tiny21 / "vae" / "config.json").read_text())
    assert len(vae["dim_mult"]) == 5 and vae["latents_mean"] != [0.0] * vae["z_dim"]


def test_family_resolution_by_checkpoint_and_by_name(tiny21):
    assert imagerl.resolve_family(tiny21) == "qwen_image21"
    assert imagerl.resolve_family("Qwen/Qwen-Image-2.1") == "qwen_image21"
    assert imagerl.resolve_family("Qwen/Qwen-Image") == "qwen_image"


def test_drop_index_is_exactly_the_system_turn(adapter, pipe):
    """The pipeline derives its drop index from the chat template; ours is computed the same way."""
    tokenizer = pipe.processor.tokenizer
    system_turn = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
    message = [{"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]}]
    tokens = pipe.processor.apply_chat_template(message, tokenize=True, return_dict=False)[0]
    assert tokens == tokenizer(system_turn).input_ids
    assert adapter.drop_tokens == pipe._drop_idx == len(tokens)
    full = tokenizer(PROMPT_TEMPLATE.format("a cat")).input_ids
    assert full[: len(tokens)] == tokens and tokenizer.decode(full[len(tokens):]).startswith("<|im_start|>user\n")


def test_prompt_embeddings_equal_the_pipeline_and_are_pre_final_norm(adapter, pipe):
    ours = adapter.encode_prompts(PROMPTS)
    for prompt, emb in zip(PROMPTS, ours):
        theirs, mask, _ = pipe.encode_prompt([prompt], device="cpu")
        assert mask is None and torch.equal(emb, theirs[0])
    # the pipeline's left-padded batch agrees within rounding (a short prompt's positions shift)
    batch, mask, _ = pipe.encode_prompt(PROMPTS, device="cpu")
    for i, emb in enumerate(ours):
        assert torch.allclose(emb, batch[i, : emb.shape[0]], atol=1e-6)
    assert torch.equal(adapter.encode_prompts([""])[0], adapter.encode_prompts([" "])[0])
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(adapter.encode_prompts(PROMPTS), ours))  # cached
    # without the pipeline's hook, hidden_states[-1] is the post-norm output: ours is its input
    tokens = pipe.processor.tokenizer([PROMPT_TEMPLATE.format(PROMPTS[1])], return_tensors="pt")
    with torch.no_grad():
        post = pipe.text_encoder(**tokens, output_hidden_states=True).hidden_states[-1][0, adapter.drop_tokens:]
        norm = pipe.text_encoder.model.language_model.norm
        assert not torch.allclose(post, ours[1], atol=1e-2)
        assert torch.allclose(post, norm(ours[1]), atol=1e-6)


def test_initial_noise_is_the_pipelines_draw(adapter, pipe):
    c = adapter.latent_channels
    ours = adapter.initial_noise([torch.Generator().manual_seed(5)], H, W)
    theirs, _ = pipe.prepare_latents(None, 1, c, H, W, torch.float32, "cpu", torch.Generator().manual_seed(5))
    assert ours.shape == (1, 16, c) and torch.equal(ours, theirs)
    with pytest.raises(ValueError, match="multiples of 32"):
        adapter.latent_grid(48, 64)


def _ode(adapter, prompt, latents, steps, guidance, kv_cache):
    sigmas = adapter.sigmas(steps, H, W)
    timesteps = flow_timesteps(sigmas, adapter.scheduler_config)
    cond = adapter.conditioning(adapter.encode_prompts([prompt]), adapter.encode_prompts([" "]), guidance, kv_cache)
    x = latents
    for i in range(steps):
        v = adapter.velocity(x, timesteps[i].expand(1), cond, H, W)
        x = flow_sde_step(x, v, sigmas[i], sigmas[i + 1], noise_level=0.0, sigma_max=sigmas[1]).prev_sample
    return x


@pytest.mark.parametrize("guidance", [1.0, 3.0])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_ode_sampling_and_decode_match_the_pipeline(adapter, pipe, prompt, guidance):
    """Noise level 0 (the ODE) from the same latents: our loop == QwenImage21Pipeline, cache on or off."""
    steps = 6
    latents = adapter.initial_noise([torch.Generator().manual_seed(0)], H, W)
    cfg = dict(negative_prompt=" ", true_cfg_scale=guidance) if guidance > 1 else {}
    call = dict(prompt=[prompt], height=H, width=W, num_inference_steps=steps, **cfg)
    for ours_kv in (False, True):
        x = _ode(adapter, prompt, latents, steps, guidance, ours_kv)
        for theirs_kv in (False, True):
            ref = pipe(**call, latents=latents.clone(), output_type="latent", use_kv_cache=theirs_kv).images
            assert torch.allclose(x, ref, atol=1e-6, rtol=0), (ours_kv, theirs_kv, (x - ref).abs().max())
    images = pipe(**call, latents=latents.clone(), output_type="pt").images
    ours = adapter.decode_rgba(x, H, W)
    assert ours.shape == images.shape == (1, 4, H, W)
    assert torch.allclose(ours, images, atol=1e-6), (ours - images).abs().max()


def test_fixed_sigma_grid_from_model_index(tiny21, tmp_path):
    """model_index.json's sample_sigmas (2.1 Turbo) replaces the linspace grid, as in the pipeline."""
    path = tmp_path / "fixed-grid"
    shutil.copytree(tiny21, path)
    index = json.loads((path / "model_index.json").read_text())
    index["sample_sigmas"] = [1.0, 0.8, 0.45, 0.2]
    (path / "model_index.json").write_text(json.dumps(index))
    adapter = QwenImage21Family.from_pretrained(path, torch.device("cpu"), torch.float32)
    assert adapter.raw_sigmas == index["sample_sigmas"]
    pipe = load_pipe(path)
    pipe(prompt="a cat", height=H, width=W, output_type="latent")
    assert torch.equal(adapter.sigmas(4, H, W), pipe.scheduler.sigmas)
    with pytest.raises(ValueError, match="num_steps=4"):
        adapter.sigmas(6, H, W)


def test_mixed_length_batch_equals_single_prompts_and_padding_would_not(adapter):
    torch.manual_seed(1)
    x = torch.randn(2, 16, adapter.latent_channels)
    t = torch.tensor([700.0, 300.0])
    emb = adapter.encode_prompts(PROMPTS)
    neg = adapter.encode_prompts([" "]) * 2
    assert emb[0].shape[0] != emb[1].shape[0]
    for guidance in (1.0, 3.0):
        both = adapter.velocity(x, t, adapter.conditioning(emb, neg, guidance), H, W)
        for i in range(2):
            one = adapter.velocity(x[i : i + 1], t[i : i + 1], adapter.conditioning(emb[i : i + 1], neg[:1], guidance), H, W)
            assert torch.allclose(both[i], one[0], atol=1e-6, rtol=0)
    # one right-padded batch with a key mask (what qwen_image does) shifts the short prompt's target RoPE frame
    length = emb[0].shape[0]
    padded = torch.zeros(2, length, emb[0].shape[1])
    mask = torch.zeros(2, length, dtype=torch.bool)
    for i, e in enumerate(emb):
        padded[i, : e.shape[0]], mask[i, : e.shape[0]] = e, True
    img_mask = torch.cat([torch.zeros(2, length, dtype=torch.bool), torch.ones(2, 4, dtype=torch.bool)], 1)
    with torch.no_grad():
        naive = adapter.transformer(hidden_states=x, timestep=t / 1000, encoder_hidden_states=padded,
                                    encoder_hidden_states_mask=mask, img_shapes=[[(1, 4, 4)]] * 2, img_mask=img_mask,
                                    return_dict=False)[0][:, -16:]
    both = adapter.velocity(x, t, adapter.conditioning(emb, None, 1.0), H, W)
    assert torch.allclose(naive[0], both[0], atol=1e-6)  # the longest prompt is unpadded
    assert (naive[1] - both[1]).abs().max() > 1e-4


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_kv_cache_velocity_equals_full_forward(adapter, guidance):
    emb = adapter.encode_prompts(PROMPTS + PROMPTS[1:])  # 3 rows, 2 lengths -> 2 sub-batches (+ uncond)
    neg = adapter.encode_prompts([" "]) * 3
    cached = adapter.conditioning(emb, neg, guidance, kv_cache=True)
    full = adapter.conditioning(emb, neg, guidance)
    gen = torch.Generator().manual_seed(3)
    for step, t in enumerate([980.0, 800.0, 510.0, 120.0]):
        x = torch.randn(3, 16, adapter.latent_channels, generator=gen)
        ts = torch.full((3,), t)
        a, b = adapter.velocity(x, ts, cached, H, W), adapter.velocity(x, ts, full, H, W)
        assert cached.cache_filled and full.caches_G is None
        assert torch.allclose(a, b, atol=1e-6, rtol=0), (step, (a - b).abs().max())
    # the later calls really read the cache: corrupting it changes their output
    for cache in cached.caches_G:
        cache.get_layer(0).v.mul_(0)
    assert not torch.allclose(adapter.velocity(x, ts, cached, H, W), b, atol=1e-3)


def test_decode_is_rgba_composited_over_white(adapter):
    latents = adapter.initial_noise([torch.Generator().manual_seed(i) for i in range(2)], H, W)
    rgba = adapter.decode_rgba(latents, H, W)
    rgb = adapter.decode(latents, H, W)
    alpha = rgba[:, 3:]
    assert rgb.shape == (2, 3, H, W) and rgb.dtype == torch.float32
    assert ((alpha > 0.05) & (alpha < 0.95)).float().mean() > 0.5  # the composite matters
    assert torch.equal(rgb, rgba[:, :3] * alpha + (1 - alpha))
    assert not torch.allclose(rgb, rgba[:, :3], atol=1e-2)
    assert 0 <= rgb.min() and rgb.max() <= 1


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kv_cache", [False, True])
def test_training_run_is_exactly_on_policy(tiny21, tmp_path, kv_cache):
    """Rollout log-probs are replayed exactly by the training forward (always a full forward); with the
    prefix KV cache the rollout's cached velocities equal the full forward bit for bit on CPU fp32."""
    train(tiny_config(tiny21, tmp_path, f"sample.kv_cache={str(kv_cache).lower()}"))
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["train/log_prob_mean_abs_diff"] == 0.0
        assert r["train/grad_norm"] > 0


@pytest.mark.parametrize("merge_lora", [False, True])
def test_kv_cache_serves_only_the_steps_outside_the_window(tiny21, tmp_path, monkeypatch, merge_lora):
    """The SDE-window steps, the ones training replays, run full forwards as training does (a cached velocity
    equals the full forward on CPU fp32 but not on the GPU); the other steps reuse the text prefix's cache."""
    from test_training import _rollout

    cfg = tiny_config(tiny21, tmp_path, "sample.kv_cache=true", f"sample.merge_lora={str(merge_lora).lower()}",
                      "sample.batch_size=2", "train.batch_size=1", "sample.guidance_scale=1.0")
    calls = []  # (timestep, the conditioning had a cache)
    velocity = QwenImage21Family.velocity

    def recording(self, latents, timesteps, cond, height, width):
        calls.append((timesteps[0].item(), cond.caches_G is not None))
        return velocity(self, latents, timesteps, cond, height, width)

    monkeypatch.setattr(QwenImage21Family, "velocity", recording)
    _, rollout = _rollout(cfg)
    window = set(rollout.timesteps_S.tolist())
    assert {cached for t, cached in calls if t in window} == {False}
    assert {cached for t, cached in calls if t not in window} == {True}
    batches, subs = 2, 2  # 4 samples in rollout batches of 2, their window steps in training batches of 1
    assert len(calls) == batches * (cfg.sample.num_steps - len(window) + subs * len(window))


def test_lora_export_loads_into_the_pipeline(tiny21, tmp_path):
    adapter = QwenImage21Family.from_pretrained(tiny21, torch.device("cpu"), torch.float32)
    torch.manual_seed(0)
    adapter.add_lora(rank=4, alpha=8, init="gaussian")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    adapter.transformer.eval()
    assert len(adapter.lora_state_dict()) == 2 * 7 * adapter.transformer.config.num_layers
    save_lora(adapter, tmp_path / "lora")
    pipe = load_pipe(tiny21)
    pipe.load_lora_weights(tmp_path / "lora")
    gen = torch.Generator().manual_seed(2)
    inputs = dict(hidden_states=torch.randn(2, 16, adapter.latent_channels, generator=gen),
                  encoder_hidden_states=torch.randn(2, 7, 32, generator=gen), timestep=torch.tensor([0.7, 0.3]),
                  img_shapes=[[(1, 4, 4)]] * 2,
                  img_mask=torch.cat([torch.zeros(2, 7, dtype=torch.bool), torch.ones(2, 4, dtype=torch.bool)], 1),
                  return_dict=False)
    with torch.no_grad():
        ours = adapter.transformer(**inputs)[0]
        theirs = pipe.transformer(**inputs)[0]
        with adapter.lora_disabled():
            base = adapter.transformer(**inputs)[0]
    assert torch.allclose(theirs, ours, atol=1e-5), (theirs - ours).abs().max()
    assert (ours - base).abs().max() > 1e-2


def test_compile_prepares_every_block_before_compiling_it(tiny21):
    """parallel.compile for Qwen-Image 2.1 (the recipe's setting since benchmarks/LOG.md run Z): accepted, and
    apply_parallelism hands the blocks the RoPE as real pairs and runs their attention without cuDNN (whose
    compiled backward faulted on the GPU, run Y) before it compiles them."""
    from imagerl.components import resolve_family_defaults
    from imagerl.config import load_config
    from imagerl.distributed.fsdp import apply_parallelism
    from imagerl.distributed.parallel import World

    adapter = QwenImage21Family.from_pretrained(tiny21, torch.device("cpu"), torch.float32)  # not the shared one
    cfg = load_config("qwen_image21_jpeg", ["model.device=cpu"])
    assert cfg.parallel.compile
    resolve_family_defaults(cfg, adapter)
    apply_parallelism(adapter, cfg, World(0, 1, torch.device("cpu")))
    for block in adapter.transformer_blocks():
        assert block._compiled_call_impl is not None  # nn.Module.compile's wrapper
        assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in block._imagerl_sdpa_backends
    assert adapter.transformer.pos_embed._imagerl_real_pairs
