"""Are the LoRA gradients that training computes on the GPU the right ones? For each family, released-size blocks
(random weights, `--blocks` of them) with the bench geometry's LoRA, one training forward + backward of a fixed
linear loss, three ways:

  reference  eager, SDPA restricted to the flash / memory-efficient kernels (no cuDNN)
  eager      eager, the SDPA kernels the family leaves enabled (what an uncompiled run trains with)
  compiled   the recipe's regional compile (apply_parallelism), the family's kernels (what a compiled run trains with)

and prints the relative difference of each LoRA gradient vector to the reference, with the backward attention
kernels each one ran. bf16 alone gives about 1e-2; a wrong kernel gives about 1 (uncorrelated) or NaN.
Why: the cuDNN SDPA backward on an H100 (torch 2.11, cuDNN 9.19) returned uncorrelated gradients (relative
difference 1.41) when the output gradient's strides differ from the output's (benchmarks/cudnn_sdpa_repro.py,
case "grad_out contiguous"); the forward-only checks (the lp diff) cannot see it.

    python3 benchmarks/attention_grad_check.py [--families qwen_image,sd3,...] [--blocks 2] [--out DIR] [--dry-run]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

FAMILIES = ("qwen_image", "qwen_image21", "sd3", "flux")


def _lora_grads(adapter) -> torch.Tensor:
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    # (a LoRA on a stream the last block's output drops gets none: zeros, in every mode alike)
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().flatten()
                      for p in params])


def _attention_backward_kernels(prof) -> list[str]:
    names = {e.key for e in prof.key_averages() if e.device_type == DeviceType.CPU and "attention" in e.key
             and "backward" in e.key and not e.key.startswith("CachingAutotuner")}  # (Inductor's tuning runs)
    return sorted(names)


def check_family(family: str, device: torch.device, blocks: int, dry: bool) -> dict:
    from imagerl.components import prepare_adapter, resolve_family_defaults
    from imagerl.distributed.fsdp import apply_parallelism
    from imagerl.distributed.parallel import World
    from imagerl.perf.bench import Bench
    from imagerl.rollout import batch_conditioning
    from imagerl.config import training_batch_size

    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(family, device, dry, Path(tmp), warmup=0, iterations=1, blocks=blocks)
        cfg = bench.config(["parallel.compile=true", "model.gradient_checkpointing=false"])
        adapter = prepare_adapter(bench.new_adapter(), cfg)
        resolve_family_defaults(cfg, adapter)
        s, n = cfg.sample, training_batch_size(cfg)
        with torch.no_grad():  # LoRA B is zero at init: give it values, so every factor gets a gradient
            for name, p in adapter.transformer.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02, generator=torch.Generator(p.device).manual_seed(1))
        text = adapter.encode_prompts([bench.prompts[0]] * n, s.max_sequence_length)
        negative = adapter.encode_negative(s.negative_prompt, s.guidance_scale, s.max_sequence_length)
        x = adapter.initial_noise([torch.Generator().manual_seed(i) for i in range(n)], s.height, s.width)
        t = torch.full((n,), 500.0, device=device)
        cond = batch_conditioning(adapter, text, negative, s.guidance_scale)
        weight = None

        def gradients(backends=None) -> tuple[torch.Tensor, list[str]]:
            nonlocal weight
            adapter.transformer.zero_grad(set_to_none=True)
            adapter.transformer.train()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            try:
                with profile(activities=activities) as prof, torch.enable_grad():
                    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                        v = adapter.velocity(x, t, cond, s.height, s.width)
                        if weight is None:  # a fixed linear loss: its output gradient is a dense random tensor
                            weight = torch.randn(v.shape, generator=torch.Generator().manual_seed(2)).to(v)
                        (v * weight).sum().backward()
            finally:
                adapter.transformer.eval()
            return _lora_grads(adapter), _attention_backward_kernels(prof)

        reference, ref_kernels = gradients([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                         SDPBackend.MATH])
        rows = {"reference": {"kernels": ref_kernels}}
        eager, kernels = gradients()
        rows["eager"] = {"rel": float((eager - reference).norm() / reference.norm()), "kernels": kernels,
                         "finite": bool(torch.isfinite(eager).all())}
        apply_parallelism(adapter, cfg, World(0, 1, device))
        for attempt in ("compiled", "compiled again"):  # a garbage read need not repeat: run twice
            got, kernels = gradients()
            rows[attempt] = {"rel": float((got - reference).norm() / reference.norm()), "kernels": kernels,
                             "finite": bool(torch.isfinite(got).all())}
        rows["geometry"] = {"batch": n, "height": s.height, "width": s.width, "blocks": blocks,
                            "lora_params": int(reference.numel())}
        return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--dry-run", action="store_true", help="1-layer models on the CPU: checks the script")
    args = p.parse_args()
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    results = {}
    for family in args.families.split(","):
        try:
            results[family] = check_family(family, device, args.blocks, args.dry_run)
        except Exception as error:  # noqa: BLE001 (one family's failure is a result; the others still run)
            results[family] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        row = results[family]
        if "error" in row:
            print(f"{family}: {row['error']}", flush=True)
            continue
        for mode in ("eager", "compiled", "compiled again"):
            r = row[mode]
            print(f"{family} {mode}: |grad - ref| / |ref| {r['rel']:.3g}, finite {r['finite']}, backward "
                  f"attention {', '.join(k.replace('aten::', '') for k in r['kernels']) or '-'}", flush=True)
        if args.out:  # after every family, so a call cut short keeps what it measured
            Path(args.out).mkdir(parents=True, exist_ok=True)
            Path(args.out, "attention_grad_check.json").write_text(json.dumps(results, indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
