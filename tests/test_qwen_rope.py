"""Qwen-Image's RoPE in real arithmetic for compiled blocks (families/qwen_rope.py) against diffusers' complex one."""

import json
import warnings

import pytest
import torch
from conftest import tiny_config
from diffusers.models.transformers import transformer_qwenimage

from imagerl.families.qwen_rope import install_real_rope, remove_real_rope, rotate_pairs
from imagerl.families.tiny_checkpoint import build_tiny_transformer


def _diffusers_rotation(x, freqs_cis):
    return getattr(transformer_qwenimage, "_imagerl_original_apply_rotary_emb_qwen",
                   transformer_qwenimage.apply_rotary_emb_qwen)(x, freqs_cis, use_real=False)


def _inputs(seed: int = 0, rows: int = 2, tokens: int = 24, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    transformer = build_tiny_transformer(seed)
    img_freqs, txt_freqs = transformer.pos_embed([(1, 4, 4)], max_txt_seq_len=8, device=torch.device("cpu"))
    x = torch.randn(rows, img_freqs.shape[0], 2, 16, generator=gen).to(dtype)
    angles = torch.rand(tokens, 32, generator=gen, dtype=torch.float64) * 100  # large angles: sin/cos far from 0, 1
    polar = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)
    y = torch.randn(rows, tokens, 3, 64, generator=gen).to(dtype)
    return (x, img_freqs), (y, polar)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_real_pairs_rotate_exactly_as_diffusers_complex_product(dtype):
    # eager float32: the same two products and one sum per component as c10::complex's operator*
    for x, freqs_cis in _inputs(dtype=dtype):
        assert freqs_cis.dtype == torch.complex64
        ours = rotate_pairs(x, torch.view_as_real(freqs_cis))
        assert ours.dtype == dtype
        assert torch.equal(ours, _diffusers_rotation(x, freqs_cis))


def test_rotation_is_a_rotation_in_float64():
    # the independent reference: each (x_2k, x_2k+1) pair turned by the angle, in float64
    gen = torch.Generator().manual_seed(1)
    angles = torch.rand(5, 4, generator=gen, dtype=torch.float64) * 6
    x = torch.randn(1, 5, 1, 8, generator=gen, dtype=torch.float64)
    table = torch.stack([angles.cos(), angles.sin()], -1)
    ours = rotate_pairs(x.float(), table.float()).double()
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = angles.cos()[None, :, None], angles.sin()[None, :, None]
    expected = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(3)
    assert torch.allclose(ours, expected, atol=1e-6)


def test_installed_real_tables_leave_an_eager_forward_bit_identical():
    transformer = build_tiny_transformer(0).eval()
    gen = torch.Generator().manual_seed(0)
    kwargs = dict(hidden_states=torch.randn(2, 16, 16, generator=gen), timestep=torch.tensor([0.5, 0.25]),
                  encoder_hidden_states=torch.randn(2, 6, 32, generator=gen),
                  encoder_hidden_states_mask=torch.tensor([[1] * 6, [1] * 4 + [0] * 2]).bool(),
                  img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)
    with torch.no_grad():
        before = transformer(**kwargs)[0]
        install_real_rope(transformer)
        install_real_rope(transformer)  # idempotent: one hook
        try:
            tables = transformer.pos_embed([(1, 4, 4)], max_txt_seq_len=6, device=torch.device("cpu"))
            assert all(t.dtype == torch.float32 and t.shape[-1] == 2 for t in tables)
            after = transformer(**kwargs)[0]
        finally:
            remove_real_rope(transformer)
        assert torch.is_complex(transformer.pos_embed([(1, 4, 4)], max_txt_seq_len=6, device=torch.device("cpu"))[0])
        assert torch.equal(after, transformer(**kwargs)[0])
    assert torch.equal(before, after)


def test_compiled_block_with_real_tables_has_no_complex_fallback():
    # Inductor warns when a compiled graph holds complex tensors (and runs them as aten fallbacks); with the real
    # tables the block compiles without that warning and matches the eager block within float rounding
    transformer = build_tiny_transformer(0).eval()
    install_real_rope(transformer)
    try:
        gen = torch.Generator().manual_seed(0)
        hidden, text = torch.randn(2, 16, 32, generator=gen), torch.randn(2, 8, 32, generator=gen)
        temb = torch.randn(2, 32, generator=gen)
        tables = transformer.pos_embed([(1, 4, 4)], max_txt_seq_len=8, device=torch.device("cpu"))
        block = transformer.transformer_blocks[0]
        args = dict(hidden_states=hidden, encoder_hidden_states=text, encoder_hidden_states_mask=None, temb=temb,
                    image_rotary_emb=tables)
        with torch.no_grad():
            eager = block(**args)
            torch._dynamo.reset()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                compiled = torch.compile(block, dynamic=True)(**args)
    finally:
        remove_real_rope(transformer)
        torch._dynamo.reset()
    assert not [w for w in caught if "complex" in str(w.message)]
    for ours, theirs in zip(compiled, eager):
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("real_rope", [True, False])
def test_parallel_compile_installs_the_real_tables_and_uncompile_removes_them(tiny_checkpoint, real_rope):
    from imagerl.config import load_config
    from imagerl.distributed.fsdp import apply_parallelism
    from imagerl.distributed.parallel import World
    from imagerl.families.qwen_image import QwenImageFamily

    adapter = QwenImageFamily.from_pretrained(tiny_checkpoint, torch.device("cpu"), torch.float32)
    rope = adapter.transformer.pos_embed
    cfg = load_config("quickstart", ["model.device=cpu", "parallel.compile=true",
                                     f"parallel.compile_real_rope={str(real_rope).lower()}"])
    apply_parallelism(adapter, cfg, World(0, 1, torch.device("cpu")))
    try:
        assert torch.is_complex(rope([(1, 4, 4)], max_txt_seq_len=6, device=torch.device("cpu"))[0]) != real_rope
    finally:
        adapter.uncompile()
    assert torch.is_complex(rope([(1, 4, 4)], max_txt_seq_len=6, device=torch.device("cpu"))[0])
    assert all(block._compiled_call_impl is None for block in adapter.transformer_blocks())


def test_compiled_training_replays_the_rollout_exactly(tiny_checkpoint, tmp_path):
    # rollout (window steps as training-graph forwards) and update run the same compiled graphs, real RoPE
    # included: the replayed log-probs equal the rollout's bit for bit (the H200 runs: tests/test_gpu.py)
    from imagerl.train import train

    torch._dynamo.reset()
    try:
        train(tiny_config(tiny_checkpoint, tmp_path, "parallel.compile=true", "train.num_rollouts=2"))
    finally:
        torch._dynamo.reset()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["train/log_prob_mean_abs_diff"] == 0.0 for r in records)
