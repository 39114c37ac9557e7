"""Which scaled_dot_product_attention backend is fastest at Qwen-Image's rollout / training shapes (GPU).

Shapes (512 px, true CFG): rows x 24 heads x (1024 image + L text tokens) x head dim 128, with the key padding
mask the cond+uncond batch needs (the uncond rows' text is shorter). Times forward and forward+backward per
backend, the default choice included, checks that each backend's forward is deterministic (the exact replay
needs the same bits twice) and how far each is from the math backend in float64.

    python benchmarks/attention_backends.py [--rows 16 32] [--text 48] [--out results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def _inputs(rows: int, text: int, short_text: int, heads: int = 24, dim: int = 128, image: int = 1024):
    seq = image + text
    q, k, v = (torch.randn(rows, heads, seq, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    keep = torch.ones(rows, seq, dtype=torch.bool, device="cuda")
    keep[rows // 2:, image + short_text:] = False  # the uncond half: padded text keys masked
    return q, k, v, keep[:, None, None, :]


def _time(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def measure(rows: int, text: int, short_text: int) -> list[dict]:
    q, k, v, mask = _inputs(rows, text, short_text)
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    flops_fwd = 4 * rows * q.shape[1] * q.shape[2] ** 2 * q.shape[3]  # QK^T and PV, unmasked count
    out = []
    for name, backend in BACKENDS.items():
        ctx = (lambda: sdpa_kernel([backend])) if backend is not None else contextlib.nullcontext
        masked = name != "flash"  # flash takes no mask: timed unmasked, as the speed a mask-free batch would get
        attn_mask = mask if masked else None

        def forward():
            with ctx(), torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

        def forward_backward():
            with ctx():
                F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask).sum().backward()

        try:
            a, b = forward(), forward()
            fwd_s, fb_s = _time(forward), _time(forward_backward)
        except RuntimeError as e:
            out.append({"rows": rows, "backend": name, "error": str(e).splitlines()[0][:120]})
            continue
        err = (a.double() - reference).abs().max().item() if masked else float("nan")
        out.append({"rows": rows, "backend": name, "masked": masked, "forward_ms": fwd_s * 1e3,
                    "forward_backward_ms": fb_s * 1e3, "forward_tflops": flops_fwd / fwd_s / 1e12,
                    "deterministic": bool(torch.equal(a, b)), "max_abs_err_vs_fp64": err})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--text", type=int, default=48)
    ap.add_argument("--short-text", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    results = [r for rows in args.rows for r in measure(rows, args.text, args.short_text)]
    print("| rows | backend | masked | fwd ms | fwd+bwd ms | fwd TFLOP/s | deterministic | max err vs fp64 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['rows']} | {r['backend']} | | error: {r['error']} | | | | |")
        else:
            print(f"| {r['rows']} | {r['backend']} | {r['masked']} | {r['forward_ms']:.2f} | {r['forward_backward_ms']:.2f} | "
                  f"{r['forward_tflops']:.0f} | {r['deterministic']} | {r['max_abs_err_vs_fp64']:.2e} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
