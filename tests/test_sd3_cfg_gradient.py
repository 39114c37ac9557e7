"""The sd3 family trains its CFG velocity as flow_grpo's scripts/train_sd3.py compute_log_prob does at 9745241
(November 2025): v = u + s (c - u) with the gradient through both rows, s d(c) + (1 - s) d(u). flow_grpo detached u
from 2d76907 (2025-07-15) until a482878 (2025-08-19, "fix cfg gradient detach"); the reference below is the current
form, written out from two separate float64 forwards."""

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
    return torch.autograd.grad(loss, adapter.trainable_parameters(), retain_graph=True)


def test_cfg_velocity_and_gradient_are_those_of_train_sd3_compute_log_prob(adapter):
    torch.manual_seed(0)
    text = adapter.encode_prompts(["a red circle", "a cat"])
    negative = adapter.encode_prompts([" "])[0]
    x = torch.randn(2, adapter.image_seq_len(H, W), 16, dtype=torch.float64)
    t = torch.tensor([700.0, 300.0])
    s = 4.5
    guided = adapter.velocity(x, t, adapter.conditioning(text, [negative, negative], s), H, W)
    cond = adapter.velocity(x, t, adapter.conditioning(text, None, 1.0), H, W)
    uncond = adapter.velocity(x, t, adapter.conditioning([negative, negative], None, 1.0), H, W)
    # train_sd3.py lines 190-195 at 9745241: noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
    reference = uncond + s * (cond - uncond)
    torch.testing.assert_close(guided, reference, rtol=0, atol=1e-12)
    # the gradient, for a loss that weighs every value differently. The family returns float32 velocities, so the
    # gradients agree to float32 rounding
    w = torch.randn_like(guided)
    g_guided = _grads(adapter, (w * guided).sum())
    g_reference = _grads(adapter, (w * reference).sum())
    g_cond = _grads(adapter, (w * cond).sum())
    for a, b in zip(g_guided, g_reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # and it is not the detached form s d(c) of 2d76907: the two differ by (1 - s) d(u), of the order of the gradient
    relative = torch.cat([(a - s * c).flatten() for a, c in zip(g_guided, g_cond)]).norm() / \
        torch.cat([a.flatten() for a in g_guided]).norm()
    assert relative > 0.1, relative
