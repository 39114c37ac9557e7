"""The qwen_image adapter against diffusers' QwenImagePipeline on the tiny checkpoint."""

import warnings

import pytest
import torch
from diffusers import QwenImagePipeline

from imagerl.families.qwen_image import QwenImageFamily, pack_latents, unpack_latents
from imagerl.families.qwen_image.tiny import QWEN_IMAGE_TEMPLATE_DROP, build_tiny_tokenizer, template_prefix_length
from imagerl.sampling import flow_sde_step, flow_sigmas, flow_timesteps

PROMPTS = ['A neon sign that says "OPEN" above a bakery door', "a cat"]


@pytest.fixture(scope="module")
def adapter(tiny_checkpoint):
    return QwenImageFamily.from_pretrained(tiny_checkpoint, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def pipe(tiny_checkpoint):
    return QwenImagePipeline.from_pretrained(tiny_checkpoint)


def test_tiny_tokenizer_template_prefix_is_34_tokens_like_diffusers_drop_index():
    assert template_prefix_length(build_tiny_tokenizer()) == QWEN_IMAGE_TEMPLATE_DROP == 34


def test_checkpoint_has_the_hub_layout(tiny_checkpoint):
    for sub in ["transformer", "vae", "scheduler", "text_encoder", "tokenizer"]:
        assert (tiny_checkpoint / sub).is_dir(), sub
    assert (tiny_checkpoint / "model_index.json").is_file()


def test_prompt_embeddings_equal_the_pipeline(adapter, pipe):
    ours = adapter.encode_prompts(PROMPTS)
    theirs, mask = pipe.encode_prompt(PROMPTS, device="cpu")
    for i, emb in enumerate(ours):
        n = int(mask[i].sum())
        assert emb.shape[0] == n
        assert torch.equal(emb, theirs[i, :n])
    # a second call is served from the cache (same tensors, no text-encoder pass)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(adapter.encode_prompts(PROMPTS), ours))


def test_truncation_to_max_sequence_length_is_the_pipelines_and_warns_once(adapter, pipe):
    full = adapter.encode_prompts(PROMPTS[:1])[0]
    cap = full.shape[0] - 2
    with pytest.warns(UserWarning, match=f"truncated to sample.max_sequence_length={cap}"):
        (short,) = adapter.encode_prompts(PROMPTS[:1], max_sequence_length=cap)
    theirs, _ = pipe.encode_prompt(PROMPTS[:1], device="cpu", max_sequence_length=cap)
    assert torch.equal(short, theirs[0]) and torch.equal(short, full[:cap])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same prompt again: no second warning
        adapter.encode_prompts(PROMPTS[:1], max_sequence_length=cap)


def test_pack_unpack_match_diffusers():
    x = torch.randn(2, 4, 1, 8, 6)
    packed = pack_latents(x)
    assert torch.equal(packed, QwenImagePipeline._pack_latents(x, 2, 4, 8, 6))
    assert torch.equal(unpack_latents(packed, 8, 6), QwenImagePipeline._unpack_latents(packed, 64, 48, 8))


@pytest.mark.parametrize("guidance", [4.0, 1.0])
def test_ode_sampling_and_decode_match_the_pipeline(adapter, pipe, guidance):
    """At noise level 0 our sampler (batched CFG, fp32 latents) reproduces QwenImagePipeline."""
    h = w = 64
    steps = 6
    gen = torch.Generator().manual_seed(0)
    latents = pack_latents(torch.randn(2, 4, 1, h // 8, w // 8, generator=gen))
    sigmas = flow_sigmas(steps, adapter.image_seq_len(h, w), adapter.scheduler_config)
    timesteps = flow_timesteps(sigmas, adapter.scheduler_config)
    cond = adapter.conditioning(adapter.encode_prompts(PROMPTS), adapter.encode_prompts([" "]) * 2, guidance)
    x = latents
    for i in range(steps):
        v = adapter.velocity(x, timesteps[i].expand(2), cond, h, w)
        x = flow_sde_step(x, v, sigmas[i], sigmas[i + 1], noise_level=0.0, sigma_max=sigmas[1]).prev_sample
    ref = pipe(prompt=PROMPTS, negative_prompt=" ", true_cfg_scale=guidance, height=h, width=w,
               num_inference_steps=steps, latents=latents.clone(), output_type="latent").images
    assert torch.allclose(x, ref, atol=1e-5, rtol=1e-5), (x - ref).abs().max()
    images = pipe(prompt=PROMPTS, negative_prompt=" ", true_cfg_scale=guidance, height=h, width=w,
                  num_inference_steps=steps, latents=latents.clone(), output_type="pt").images
    ours = adapter.decode(x, h, w)
    assert ours.shape == (2, 3, h, w)
    assert torch.allclose(ours, images, atol=1e-4), (ours - images).abs().max()


def test_velocity_is_deterministic_and_cfg_changes_it(adapter):
    torch.manual_seed(1)
    x = torch.randn(2, 16, 16)
    t = torch.tensor([700.0, 300.0])
    emb = adapter.encode_prompts(PROMPTS)
    neg = adapter.encode_prompts([" "]) * 2
    with_cfg = adapter.velocity(x, t, adapter.conditioning(emb, neg, 4.0), 64, 64)
    again = adapter.velocity(x, t, adapter.conditioning(emb, neg, 4.0), 64, 64)
    no_cfg = adapter.velocity(x, t, adapter.conditioning(emb, neg, 1.0), 64, 64)
    assert torch.equal(with_cfg, again)
    assert not torch.allclose(with_cfg, no_cfg)
    # norm rescale: the guided velocity has the conditional prediction's per-token norm
    assert torch.allclose(with_cfg.norm(dim=-1), no_cfg.norm(dim=-1), rtol=1e-4)


def test_rope_tables_are_built_on_the_compute_device(adapter):
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    rope = adapter.transformer.pos_embed
    with torch.device(adapter.device):
        device_built = QwenEmbedRope(theta=rope.theta, axes_dim=list(rope.axes_dim), scale_rope=True)
    assert rope.pos_freqs.device.type == adapter.device.type
    assert torch.equal(rope.pos_freqs, device_built.pos_freqs) and torch.equal(rope.neg_freqs, device_built.neg_freqs)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_grouping_rows_by_text_length_equals_the_padded_masked_forward(adapter, guidance):
    """model.group_text_lengths: one unmasked forward per text length (two prompts of different lengths,
    and the uncond rows) gives the padded, masked forward's velocity, rows in the same order."""
    torch.manual_seed(2)
    x = torch.randn(3, 16, 16)
    t = torch.tensor([900.0, 500.0, 100.0])
    emb = adapter.encode_prompts([PROMPTS[0], PROMPTS[1], PROMPTS[0]])
    assert emb[0].shape[0] != emb[1].shape[0]
    neg = adapter.encode_prompts([" "]) * 3
    padded = adapter.conditioning(emb, neg, guidance)
    assert padded.mask_BL is not None
    adapter.group_text_lengths = True
    try:
        grouped = adapter.conditioning(emb, neg, guidance)
        assert grouped.embeds_BLD is None and grouped.num_images == 3
        assert len(grouped.rows_G) == (3 if guidance > 1 else 2)
        v_grouped = adapter.velocity(x, t, grouped, 64, 64)
    finally:
        adapter.group_text_lengths = False
    v_padded = adapter.velocity(x, t, padded, 64, 64)
    torch.testing.assert_close(v_grouped, v_padded, rtol=1e-5, atol=1e-5)


def test_bf16_vae_decode_is_close_to_fp32(tiny_checkpoint):
    """model.vae_dtype=bfloat16: prepare_adapter casts the VAE; decode still returns float32 images in [0, 1],
    close to the fp32 decode (bf16 keeps 8 bits of mantissa: errors of a few 1e-3 on [0, 1])."""
    from imagerl.components import prepare_adapter
    from imagerl.config import load_config

    adapter = QwenImageFamily.from_pretrained(tiny_checkpoint, torch.device("cpu"), torch.float32)
    torch.manual_seed(3)
    latents = torch.randn(2, 16, 16)
    reference = adapter.decode(latents, 64, 64)
    prepare_adapter(adapter, load_config("quickstart", ["model.vae_dtype=bfloat16", "model.lora_rank=2"]))
    assert adapter.vae.dtype == torch.bfloat16
    images = adapter.decode(latents, 64, 64)
    assert images.dtype == torch.float32 and images.shape == reference.shape
    diff = (images - reference).abs()
    assert 0 < diff.max() < 0.05 and diff.mean() < 5e-3, (diff.max(), diff.mean())


def test_text_padded_to_a_multiple_gives_the_same_velocity(adapter):
    """model.text_length_multiple: the cond/uncond batch padded further, to a multiple of m tokens (masked keys),
    gives the velocity of the batch padded to its longest row only; the default pads nothing extra."""
    torch.manual_seed(4)
    x = torch.randn(2, 16, 16)
    t = torch.tensor([900.0, 300.0])
    emb = adapter.encode_prompts([PROMPTS[0], PROMPTS[1]])
    neg = adapter.encode_prompts([" "]) * 2
    longest = max(e.shape[0] for e in emb)
    tight = adapter.conditioning(emb, neg, 4.0)
    assert tight.embeds_BLD.shape[1] == longest
    m = next(m for m in (8, 7, 5) if longest % m)  # one that needs padding
    adapter.text_length_multiple = m
    try:
        padded = adapter.conditioning(emb, neg, 4.0)
    finally:
        adapter.text_length_multiple = 1
    assert padded.embeds_BLD.shape[1] % m == 0 and longest < padded.embeds_BLD.shape[1] < longest + m
    assert not padded.mask_BL[:, longest:].any()
    torch.testing.assert_close(adapter.velocity(x, t, padded, 64, 64), adapter.velocity(x, t, tight, 64, 64),
                               rtol=1e-5, atol=1e-5)


def test_text_length_multiple_resolves_from_compile(tiny_checkpoint):
    """0 (the default) pads to a multiple of 8 under parallel.compile and not at all in eager; negatives are refused."""
    from imagerl.components import prepare_adapter
    from imagerl.config import load_config
    from imagerl.validation import validate

    with pytest.raises(ValueError, match="text_length_multiple"):
        validate(load_config("quickstart", ["model.text_length_multiple=-1"]))
    for overrides, expected in (([], 1), (["parallel.compile=true"], 8), (["model.text_length_multiple=16"], 16)):
        adapter = QwenImageFamily.from_pretrained(tiny_checkpoint, torch.device("cpu"), torch.float32)
        prepare_adapter(adapter, load_config("quickstart", overrides + ["model.lora_rank=2"]))
        assert adapter.text_length_multiple == expected
