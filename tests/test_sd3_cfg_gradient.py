"""The sd3 family trains its CFG velocity as flow_grpo's scripts/train_sd3.py (compute_log_prob): the uncond
prediction is detached, so v = u + s (c - u) has the value of plain CFG and the gradient s x d(c)."""

import pytest
import torch

from imagerl.families.sd3 import SD3Family

H = W = 64


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    path = SD3Family.build_tiny_checkpoint(tmp_path_factory.mktemp("sd3") / "tiny-sd3")
    adapter = SD3Family.from_pretrained(path, torch.device("cpu"), torch.float64)
    adapter.add_lora(rank=4, alpha=8, init="gaussian")
    for p in adapter.trainable_parameters():  # the LoRA is kept in float32; float64 here for a tight comparison
        p.data = p.data.double()
    return adapter


def _grads(adapter, loss):
    params = adapter.trainable_parameters()
    return torch.autograd.grad(loss, params)


def test_cfg_velocity_is_plain_cfg_with_the_gradient_of_the_cond_rows_times_the_scale(adapter):
    torch.manual_seed(0)
    text = adapter.encode_prompts(["a red circle", "a cat"])
    negative = adapter.encode_prompts([" "])[0]
    x = torch.randn(2, adapter.image_seq_len(H, W), 16, dtype=torch.float64)
    t = torch.tensor([700.0, 300.0])
    s = 4.5
    guided = adapter.velocity(x, t, adapter.conditioning(text, [negative, negative], s), H, W)
    cond_only = adapter.velocity(x, t, adapter.conditioning(text, None, 1.0), H, W)
    with torch.no_grad():
        uncond = adapter.velocity(x, t, adapter.conditioning([negative, negative], None, 1.0), H, W)
    # the value: plain CFG of the two separate forwards (float64)
    torch.testing.assert_close(guided, uncond + s * (cond_only - uncond), rtol=0, atol=1e-12)
    # the gradient: s x the cond rows' gradient, for a loss that weighs every value differently. The family returns
    # float32 velocities, so the gradients agree to float32 rounding (2e-7 measured); without the detach they would
    # differ by (1 - s) x d(uncond), of the order of the gradient itself
    w = torch.randn_like(guided)
    for g_guided, g_cond in zip(_grads(adapter, (w * guided).sum()), _grads(adapter, (w * cond_only).sum())):
        torch.testing.assert_close(g_guided, s * g_cond, rtol=1e-5, atol=1e-6)
