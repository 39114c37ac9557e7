"""sample.merge_lora: the rollout's off-window steps on merged weights (families/layers/merged_lora.py)."""

import pytest
import torch

from conftest import tiny_config
from imagerl.components import load_adapter, resolve_family_defaults
from imagerl.data.prompts import GroupSampler, bundled_prompt_file, load_prompt_set
from imagerl.distributed.parallel import World
from imagerl.families.layers.merged_lora import MergedLora
from imagerl.rollout import generate
from imagerl.sampling import sde_window
from imagerl.algorithms.flow_grpo import _step_log_prob


def _adapter(cfg):
    adapter = load_adapter(cfg, World(0, 1, torch.device("cpu")))
    resolve_family_defaults(cfg, adapter)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained-looking LoRA: B != 0 (gaussian init leaves B = 0, the merge a no-op)
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    return adapter


def _inputs(adapter):
    emb = adapter.encode_prompts(["a red circle", "two blue squares"])
    cond = adapter.conditioning(emb, adapter.encode_prompts([" "]) * 2, 4.0)
    torch.manual_seed(1)
    x = torch.randn(2, adapter.image_seq_len(64, 64), adapter.transformer.config.in_channels)
    return x, torch.tensor([500.0, 500.0]), cond


def _velocities(adapter):
    """(inputs, the velocity with the LoRA, the base model's velocity)."""
    x, t, cond = _inputs(adapter)
    with torch.no_grad():
        with_lora = adapter.velocity(x, t, cond, 64, 64)
        with adapter.lora_disabled():
            base = adapter.velocity(x, t, cond, 64, 64)
    return (x, t, cond), with_lora, base


def test_merged_weights_give_the_lora_model_and_are_swapped_back(tiny_checkpoint, tmp_path):
    adapter = _adapter(tiny_config(tiny_checkpoint, tmp_path))
    (x, t, cond), with_lora, base = _velocities(adapter)
    before = {n: p for n, p in adapter.transformer.named_parameters()}
    merged = MergedLora(adapter.transformer)
    assert len(merged.swaps) > 0
    with merged.applied():
        assert not torch.is_grad_enabled()
        folded = adapter.velocity(x, t, cond, 64, 64)
    # the same function as base + LoRA (fp32: rounding only), and not the base model
    torch.testing.assert_close(folded, with_lora, rtol=1e-4, atol=1e-5)
    assert (with_lora - base).abs().max() > 100 * (folded - with_lora).abs().max()
    # the original parameter objects are back, the adapters on, gradients reach the LoRA as before
    assert all(p is before[n] for n, p in adapter.transformer.named_parameters())
    adapter.velocity(x, t, cond, 64, 64).square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in adapter.transformer.named_parameters()
               if "lora_B" in n and "transformer_blocks.0." in n)


def test_merge_keeps_a_disabled_adapter_disabled(tiny_checkpoint, tmp_path):
    adapter = _adapter(tiny_config(tiny_checkpoint, tmp_path))
    x, t, cond = _inputs(adapter)
    with torch.no_grad(), adapter.lora_disabled():
        base = adapter.velocity(x, t, cond, 64, 64)
        merged = MergedLora(adapter.transformer)  # adapters disabled: nothing to merge
        with merged.applied():
            assert torch.equal(adapter.velocity(x, t, cond, 64, 64), base)
        assert torch.equal(adapter.velocity(x, t, cond, 64, 64), base)


def test_rollout_with_merged_off_window_steps_replays_exactly(tiny_checkpoint, tmp_path):
    """The window steps keep the unmerged weights: the training forwards reproduce their log-probs bit for bit;
    the trajectory is the unmerged rollout's up to rounding (merged) or FP8 error (sample.off_window_fp8)."""
    rollouts = {}
    for mode, overrides in {"plain": [], "merged": ["sample.merge_lora=true"],
                            "fp8": ["sample.merge_lora=true", "sample.off_window_fp8=true"]}.items():
        cfg = tiny_config(tiny_checkpoint, tmp_path, *overrides, "train.num_optimizer_steps=1")
        adapter = _adapter(cfg)
        groups = GroupSampler(load_prompt_set(bundled_prompt_file()), 2, cfg.run.seed).groups_for(0)
        window = sde_window(2, (0, 5), 3, seed=cfg.run.seed, rollout_step=0)
        rollout = generate(adapter, groups, cfg, 0, window)
        adapter.transformer.train()
        for batch in rollout.batches():
            cond = rollout.conditioning(adapter, batch, cfg.sample.guidance_scale)
            for j in range(2):
                out = _step_log_prob(adapter, rollout, batch, j, cond, cfg)
                assert torch.equal(out.log_prob, rollout.log_probs_BS[batch, j])
        rollouts[mode] = rollout
    plain, merged, fp8 = rollouts["plain"], rollouts["merged"], rollouts["fp8"]
    assert not torch.equal(merged.latents_BSNC, plain.latents_BSNC)  # steps 0-2 did run on other weights
    torch.testing.assert_close(merged.latents_BSNC, plain.latents_BSNC, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(merged.images_B3HW, plain.images_B3HW, rtol=1e-3, atol=1e-3)
    fp8_error = (fp8.latents_BSNC - plain.latents_BSNC).norm() / plain.latents_BSNC.norm()
    assert 1e-4 < fp8_error < 2e-2, fp8_error  # 3 FP8 steps moved the trajectory, by little


def test_merge_lora_is_turned_off_with_a_warning_under_fsdp(tiny_checkpoint, tmp_path):
    """A one-GPU speed setting: under FSDP (sharded weights) the recipe still runs, unmerged, and says so."""
    from imagerl.validation import validate

    cfg = tiny_config(tiny_checkpoint, tmp_path, "sample.merge_lora=true", "train.num_optimizer_steps=1")
    with pytest.warns(UserWarning, match="sample.merge_lora has no effect under FSDP"):
        validate(cfg, world_size=2)
    assert cfg.sample.merge_lora is False
    cfg = tiny_config(tiny_checkpoint, tmp_path, "sample.merge_lora=true", "train.num_optimizer_steps=1",
                      "parallel.strategy=replicate")
    validate(cfg, world_size=2)
    assert cfg.sample.merge_lora is True


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merged_weight_is_w_plus_scaled_lora_product_rounded_once(dtype):
    """Each merged weight against float64: W + scaling * B~ @ A~, with B~, A~ the LoRA factors in the base
    weight's dtype (what the bf16 autocast forward multiplies), rounded to that dtype once."""
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.GELU(), torch.nn.Linear(160, 64))
    model = inject_adapter_in_model(LoraConfig(r=16, lora_alpha=32, target_modules=["0", "2"]), model)
    model.to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data = torch.randn(p.shape) * 0.05  # fp32 master weights, B != 0
    merged = MergedLora(model)
    assert len(merged.swaps) == 2
    for module, base, original, weight in merged.swaps:
        a, b = (m["default"].weight.to(dtype).double() for m in (module.lora_A, module.lora_B))
        reference = (original.double() + 2.0 * b @ a).to(dtype)  # scaling = alpha / r = 2
        assert weight.dtype == dtype and weight.shape == original.shape
        if dtype == torch.float32:  # fp32 GEMM accumulation: within an ulp or so
            torch.testing.assert_close(weight, reference, rtol=2e-6, atol=1e-7)
        else:  # fp32 accumulation then one rounding: the float64 value's rounding, up to ties
            ulp = reference.abs().float() * 2**-7
            assert ((weight.float() - reference.float()).abs() <= ulp).all()
            assert (weight == reference).float().mean() > 0.99
