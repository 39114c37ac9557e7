"""Is the regionally compiled Qwen-Image 2.1 backward right? LoRA gradients eager vs compiled on the GPU.

The log-prob replay check (lp diff) compares forwards only: a wrong backward kernel passes it. This script takes
`layers` blocks at the released dims (as qwen21_compile_probe.py), a LoRA with B != 0, and for prompts of
different text lengths compares the LoRA gradients of sum(v * r) (r fixed random) eager against
`prepare_compile()` + `block.compile(dynamic=True)` (apply_parallelism's calls), relative to the gradient's
norm. bf16 forwards: compiled and eager round differently, so agreement is to about 1e-2, not bitwise; an
out-of-bounds read shows as NaN or O(1). `--baseline-first` runs the diffusers + peft baseline before, in the
same process, as `imagerl bench` does (the compiled variant crashed after it, RESULTS.md run V).

    python3 benchmarks/qwen21_compile_grad_check.py --layers 2 --baseline-first --out $OUT
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--baseline-first", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--complex-rope", action="store_true", help="skip prepare_compile: diffusers' complex RoPE "
                   "product and any SDPA backend, cuDNN's included, in the compiled graph (the code of runs T-X)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    from imagerl.components import prepare_adapter, resolve_family_defaults
    from imagerl.perf.bench import Bench
    from imagerl.rollout import batch_conditioning
    device = torch.device(args.device)
    bench = Bench("qwen_image21", device, False, args.out / "work", warmup=1, iterations=1,
                  blocks=args.layers or None)  # 0: the released model
    if args.baseline_first:
        bench.run_baseline(1.0)
    cfg = bench.config([])
    adapter = prepare_adapter(bench.new_adapter(), cfg)
    resolve_family_defaults(cfg, adapter)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in adapter.transformer.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.01)
    params = {n: q for n, q in adapter.transformer.named_parameters() if q.requires_grad}
    s = cfg.sample
    n_tokens = adapter.image_seq_len(s.height, s.width)
    channels = adapter.transformer.config.in_channels
    cases = []
    for i, prompt in enumerate(bench.prompts[:3]):
        text = adapter.encode_prompts([prompt] * 2)
        g = torch.Generator(device).manual_seed(i)
        x = torch.randn(2, n_tokens, channels, device=device, generator=g)
        r = torch.randn(2, n_tokens, channels, device=device, generator=g)
        cases.append((text[0].shape[0], x, r, list(text)))

    def gradients():
        adapter.transformer.train()
        out = []
        for length, x, r, text in cases:
            for q in params.values():
                q.grad = None
            cond = batch_conditioning(adapter, text, None, 1.0)
            v = adapter.velocity(x, torch.full((2,), 700.0, device=device), cond, s.height, s.width)
            (v.float() * r).sum().backward()
            out.append({n: q.grad.detach().float().clone() for n, q in params.items()})
        return out

    eager = gradients()
    if not args.complex_rope:
        adapter.prepare_compile()  # as apply_parallelism: RoPE as real pairs
    for block in adapter.transformer_blocks():
        block.compile(dynamic=True)
    compiled = [gradients(), gradients()]  # twice: an out-of-bounds read need not repeat its garbage
    rows = []
    for k, (length, *_rest) in enumerate(cases):
        for run, grads in enumerate(compiled):
            num = sum((grads[k][n] - eager[k][n]).square().sum() for n in params).sqrt().item()
            den = sum(eager[k][n].square().sum() for n in params).sqrt().item()
            worst = max(params, key=lambda n: ((grads[k][n] - eager[k][n]).norm() / (eager[k][n].norm() + 1e-30)).item())
            rel = ((grads[k][worst] - eager[k][worst]).norm() / (eager[k][worst].norm() + 1e-30)).item()
            rows.append({"text_tokens": length, "compiled_run": run, "relative_error": num / den,
                         "worst_param": worst, "worst_relative_error": rel})
            print(f"text {length:4d} run {run}: grad rel error {num / den:.3e}; worst {worst} {rel:.3e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "grad_check.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
