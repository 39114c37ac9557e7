"""Regionally compiled Qwen-Image 2.1 blocks (apply_parallelism's `block.compile(dynamic=True)`): the LoRA
gradients against eager ones, on the CPU and (when present) on a GPU.

The log-prob replay check compares forwards only; a wrong backward kernel passes it (benchmarks/LOG.md
runs V, W: on the GPU the compiled backward crashed or gave NaN after another model ran in the same process; run
Y found the cuDNN attention backward, which prepare_compile now excludes). Prompts of three text lengths run
through one symbolic-shape graph; the compiled gradients run twice, since an out-of-bounds read need not repeat
its garbage.
"""

import pytest
import torch

from imagerl.families.qwen_image21 import QwenImage21Family
from imagerl.families.qwen_image21.tiny import make_tiny_qwen_image21
from imagerl.rollout import batch_conditioning

PROMPTS = ["a cat", 'A neon sign that says "OPEN" above a bakery door', "three red apples on a wooden table"]
H = W = 64

DEVICES = [pytest.param("cpu", marks=pytest.mark.slow),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_lora_gradients_equal_eager_ones(tmp_path, device):
    import torch._dynamo

    torch._dynamo.reset()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    path = make_tiny_qwen_image21(tmp_path / "tiny-qwen-image-2.1")
    adapter = QwenImage21Family.from_pretrained(path, torch.device(device), dtype)
    adapter.add_lora(rank=4, alpha=8, init="gaussian")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    params = dict((n, p) for n, p in adapter.transformer.named_parameters() if p.requires_grad)
    channels = adapter.transformer.config.in_channels
    generator = torch.Generator().manual_seed(1)
    cases = []
    for prompt in PROMPTS:
        text = adapter.encode_prompts([prompt, prompt])
        x = torch.randn(2, adapter.image_seq_len(H, W), channels, generator=generator).to(device)
        r = torch.randn(2, adapter.image_seq_len(H, W), channels, generator=generator).to(device)
        cases.append((text, x, r))
    assert len({text[0].shape[0] for text, _, _ in cases}) == 3  # three text lengths

    def gradients():
        adapter.transformer.train()
        out = []
        for text, x, r in cases:
            for p in params.values():
                p.grad = None
            cond = batch_conditioning(adapter, list(text), None, 1.0)
            with adapter.autocast():
                v = adapter.velocity(x, torch.full((2,), 700.0, device=device), cond, H, W)
            (v.float() * r).sum().backward()
            out.append({n: p.grad.detach().float().clone() for n, p in params.items()})
        return out

    eager = gradients()
    adapter.prepare_compile()  # as apply_parallelism: RoPE as real pairs
    for block in adapter.transformer_blocks():
        block.compile(dynamic=True)
    try:
        for compiled in (gradients(), gradients()):
            for k in range(len(cases)):
                num = sum((compiled[k][n] - eager[k][n]).square().sum() for n in params).sqrt()
                den = sum(eager[k][n].square().sum() for n in params).sqrt()
                assert torch.isfinite(num) and den > 0
                # fp32: reordered sums only (observed ~1e-6); bf16: roundings at other places (~1e-2)
                assert num / den < (1e-4 if dtype == torch.float32 else 3e-2), (k, (num / den).item())
    finally:
        for block in adapter.transformer_blocks():
            block._compiled_call_impl = None
        torch._dynamo.reset()
