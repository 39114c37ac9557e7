"""Where cuDNN attention's backward fails at FLUX.1-dev's shapes (benchmarks/LOG.md runs AS-AU: NaN LoRA gradients,
then an illegal memory access, eager and compiled): SDPA alone under the cuDNN backend over a matrix of conditions
(batch, sequence length, layout, dtype, mask, the gradient's layout), then FLUX.1-dev's real-size double- and
single-stream blocks (random weights) forward + backward under cuDNN, each beside the flash / memory-efficient
kernels' gradients on the same inputs.

    python3 benchmarks/cudnn_sdpa_repro.py [--out DIR] [--cases NAME,NAME] [--timeout S]

An illegal memory access leaves the process's CUDA context unusable, so the cases run in a child process that
starts again after the failing case. One line per case: finite gradients, the largest relative difference to the
reference kernel's gradients, or the error.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# name -> (batch, heads, seq, head_dim, dtype, layout, mask, grad_out layout); FLUX.1-dev at 512 px: 24 heads x 128,
# 1024 image + 512 text tokens = 1536; at 720 px (flux_ocr) 2025 + 512 = 2537. layout "bshd": q/k/v made (B, S, H, D)
# and transposed to (B, H, S, D), as diffusers' FluxAttnProcessor hands them to SDPA; "bhsd": contiguous
SDPA_CASES = {
    "flux512 b4 bshd bf16": (4, 24, 1536, 128, "bf16", "bshd", None, "bshd"),
    "flux512 b4 bhsd bf16": (4, 24, 1536, 128, "bf16", "bhsd", None, "bhsd"),
    "flux512 b4 bshd bf16, grad_out contiguous": (4, 24, 1536, 128, "bf16", "bshd", None, "bhsd"),
    "flux512 b1 bshd bf16": (1, 24, 1536, 128, "bf16", "bshd", None, "bshd"),
    "flux512 b8 bshd bf16": (8, 24, 1536, 128, "bf16", "bshd", None, "bshd"),
    "image only s1024 b4 bshd bf16": (4, 24, 1024, 128, "bf16", "bshd", None, "bshd"),
    "flux720 s2537 b4 bshd bf16": (4, 24, 2537, 128, "bf16", "bshd", None, "bshd"),
    "s1600 b4 bshd bf16": (4, 24, 1600, 128, "bf16", "bshd", None, "bshd"),
    "flux512 b4 bshd fp16": (4, 24, 1536, 128, "fp16", "bshd", None, "bshd"),
    "flux512 b4 bshd bf16, all-true bool mask": (4, 24, 1536, 128, "bf16", "bshd", "bool", "bshd"),
    "s1600 b4 bshd bf16, all-true bool mask": (4, 24, 1600, 128, "bf16", "bshd", "bool", "bshd"),
}
BLOCK_CASES = ("flux double block b4 (eager)", "flux single block b4 (eager)", "flux double block b4 (compiled)",
               "flux single block b4 (compiled)")
ALL = list(SDPA_CASES) + list(BLOCK_CASES)
DEFAULT = list(SDPA_CASES) + list(BLOCK_CASES[:2])  # the compiled blocks take ~1 min each to compile: --cases


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _grads(fn, inputs, grad_out, backends):
    import torch
    from torch.nn.attention import sdpa_kernel

    for t in inputs:
        t.grad = None
    with sdpa_kernel(backends):
        out = fn()
    out.backward(grad_out)
    torch.cuda.synchronize()
    return out.detach(), [t.grad.detach().clone() for t in inputs]


def run_sdpa_case(name: str) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    b, h, s, d, dtype, layout, mask, go_layout = SDPA_CASES[name]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    g = torch.Generator(device="cuda").manual_seed(0)

    def make(lay):
        if lay == "bshd":
            return torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
        return torch.randn(b, h, s, d, device="cuda", dtype=dtype, generator=g)

    q, k, v = (make(layout).requires_grad_() for _ in range(3))
    attn_mask = torch.ones(s, s, device="cuda", dtype=torch.bool) if mask == "bool" else None
    grad_out = make(go_layout)
    fn = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # noqa: E731
    ref_backend = SDPBackend.EFFICIENT_ATTENTION if attn_mask is not None else SDPBackend.FLASH_ATTENTION
    ref_out, ref = _grads(fn, (q, k, v), grad_out, [ref_backend])
    out, got = _grads(fn, (q, k, v), grad_out, [SDPBackend.CUDNN_ATTENTION])
    return dict(out_rel=_rel(out, ref_out), finite=all(bool(torch.isfinite(t).all()) for t in got),
                nan=[int(torch.isnan(t).sum()) for t in got], grad_rel=[_rel(a, r) for a, r in zip(got, ref)])


def run_block_case(name: str) -> dict:
    import torch
    from diffusers.models.transformers.transformer_flux import (FluxPosEmbed, FluxSingleTransformerBlock,
                                                                FluxTransformerBlock)
    from torch.nn.attention import SDPBackend

    torch.manual_seed(0)
    double = "double" in name
    with torch.device("cuda"):
        block = (FluxTransformerBlock(3072, 24, 128) if double else FluxSingleTransformerBlock(3072, 24, 128))
        block = block.to(torch.bfloat16)
        ids = torch.cat([torch.zeros(512, 3), torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(32.0),
                                                                         torch.arange(32.0), indexing="ij"),
                                                          -1).reshape(-1, 3)])
        rope = FluxPosEmbed(10000, [16, 56, 56])(ids)
        x = torch.randn(4, 1024, 3072, dtype=torch.bfloat16, requires_grad=True)
        ctx = torch.randn(4, 512, 3072, dtype=torch.bfloat16, requires_grad=True)
        temb = torch.randn(4, 3072, dtype=torch.bfloat16)
    call = torch.compile(block, dynamic=True) if "compiled" in name else block

    def fn():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            enc, hid = call(x, ctx, temb, rope)
        return torch.cat([enc, hid], 1).float()

    grad_out = torch.randn(4, 1536, 3072, device="cuda") * 1e-2
    ref_out, ref = _grads(fn, (x, ctx), grad_out, [SDPBackend.FLASH_ATTENTION])
    out, got = _grads(fn, (x, ctx), grad_out, [SDPBackend.CUDNN_ATTENTION])
    return dict(out_rel=_rel(out, ref_out), finite=all(bool(torch.isfinite(t).all()) for t in got),
                nan=[int(torch.isnan(t).sum()) for t in got], grad_rel=[_rel(a, r) for a, r in zip(got, ref)])


def child(names: list[str]) -> None:
    """Run the cases in order, one JSON line each (flushed), until one kills the process."""
    import torch

    for name in names:
        print(json.dumps({"case": name, "start": True}), flush=True)
        try:
            result = run_sdpa_case(name) if name in SDPA_CASES else run_block_case(name)
        except Exception as error:  # noqa: BLE001 (a cuDNN error is a result; an illegal access ends the process)
            result = dict(error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                print(json.dumps({"case": name, **result}), flush=True)
                sys.exit(3)  # the context is gone: the parent starts a new process at the next case
        print(json.dumps({"case": name, **result}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds for all cases")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        child(json.loads(a.child))
        return
    import torch

    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}",
          flush=True)
    todo = [c.strip() for c in a.cases.split(",")] if a.cases else list(DEFAULT)
    deadline, results = time.monotonic() + a.timeout, {}
    while todo and time.monotonic() < deadline:
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(todo)], capture_output=True,
                                  text=True, timeout=max(deadline - time.monotonic(), 1), env=dict(os.environ))
        except subprocess.TimeoutExpired as expired:  # what it finished is kept; the rest is reported as not run
            proc = subprocess.CompletedProcess(expired.cmd, -9, expired.stdout or "", "timed out")
            if isinstance(proc.stdout, bytes):
                proc.stdout = proc.stdout.decode()
        started = None
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if rec.pop("start", False):
                started = rec["case"]
            else:
                results[rec["case"]] = rec
                started = None
        if started is not None:  # the process died inside this case
            tail = " | ".join(proc.stderr.strip().splitlines()[-2:])[:300]
            results[started] = dict(case=started, error=f"process died (rc {proc.returncode}): {tail}")
        done = set(results)
        todo = [c for c in todo if c not in done]
    for name in ALL:
        r = results.get(name)
        if r is None:
            if name in todo:
                print(f"{name}: not run (time limit)")
            continue
        if "error" in r:
            print(f"{name}: {r['error']}")
        else:
            print(f"{name}: grads finite {r['finite']} (NaN {r['nan']}), |grad - ref| / |ref| "
                  f"{', '.join(f'{x:.2g}' for x in r['grad_rel'])}, out {r['out_rel']:.2g}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "cudnn_sdpa_repro.json").write_text(json.dumps(
            dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version(), device=torch.cuda.get_device_name(),
                 results=results), indent=1))


if __name__ == "__main__":
    main()
