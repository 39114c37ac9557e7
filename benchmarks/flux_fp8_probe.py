"""Why the merged FP8 off-window steps of FLUX.1-dev were slower than the unmerged ones (benchmarks/RESULTS.md runs
AW, AX): one off-window velocity of a rollout batch at the bench's geometry, timed in each mode, eager and compiled,
with Dynamo's recompiles and graph breaks counted.

    python3 benchmarks/flux_fp8_probe.py --out DIR [--dry-run]

Modes: the unmerged LoRA forward; the LoRA merged in bf16 (MergedLora); merged and FP8 on the LoRA targets only;
merged and FP8 on every token linear (the family's token_linears). Each compiled mode is timed on a first and a
second MergedLora build, as two rollouts build them: a rebuild that recompiles shows in its first call.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

import torch


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    from torch._dynamo.utils import counters

    from imagerl.components import prepare_adapter, resolve_family_defaults
    from imagerl.distributed.fsdp import apply_parallelism
    from imagerl.distributed.parallel import World
    from imagerl.families.layers.merged_lora import MergedLora
    from imagerl.perf.bench import Bench
    from imagerl.rollout import _training_graph, batch_conditioning

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--compiled-only", action="store_true", help="skip the eager modes and the targets-only FP8")
    p.add_argument("--layers-only", action="store_true", help="time the layers alone, not the model")
    a = p.parse_args()
    dry = a.dry_run
    device = torch.device("cpu" if dry or not torch.cuda.is_available() else "cuda")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    if device.type == "cuda":  # the layers alone at FLUX.1-dev's shapes (batch x 1536 tokens), eager and compiled
        from imagerl.families.layers.fp8_linear import Fp8Linear

        x_rows = a.batch * 1536
        for k, n_out in ((3072, 3072), (3072, 12288), (15360, 3072)):
            linear = torch.nn.Linear(k, n_out, device=device, dtype=torch.bfloat16)
            fp8 = Fp8Linear(linear.weight.detach(), linear.bias.detach())
            xs = torch.randn(x_rows, k, device=device, dtype=torch.bfloat16)
            x32 = xs.float()
            for name, layer in (("bf16", linear), ("fp8", fp8), ("bf16 compiled", torch.compile(linear)),
                                ("fp8 compiled", torch.compile(fp8))):
                with torch.no_grad():
                    times = _timed(lambda: [layer(xs) for _ in range(20)], device, 4)
                row = dict(layer=name, m=x_rows, k=k, n=n_out, ms=min(times[1:]) / 20 * 1e3,
                           tflops=2 * x_rows * k * n_out / (min(times[1:]) / 20) / 1e12)
                rows.append(row)
                print(" | ".join(f"{k_} {v:.3f}" if isinstance(v, float) else f"{k_} {v}" for k_, v in row.items()),
                      flush=True)
            for name, layer in (("bf16, fp32 in, autocast", linear), ("fp8, fp32 in, autocast", fp8)):
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    times = _timed(lambda: [layer(x32) for _ in range(20)], device, 4)
                rows.append(dict(layer=name, m=x_rows, k=k, n=n_out, ms=min(times[1:]) / 20 * 1e3))
                print(rows[-1], flush=True)
    if a.layers_only:
        (out / "flux_fp8_probe.json").write_text(json.dumps(rows, indent=1))
        return
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench("flux", device, dry, Path(tmp), 0, 1)
        for compiled in (True,) if a.compiled_only else (False, True):
            size = [] if dry else [f"sample.batch_size={a.batch}"]  # the dry geometry's own batch
            cfg = bench.config([f"parallel.compile={str(compiled).lower()}", *size])
            adapter = prepare_adapter(bench.new_adapter(), cfg)
            resolve_family_defaults(cfg, adapter)
            apply_parallelism(adapter, cfg, World(0, 1, device))
            with torch.no_grad():
                for p_ in adapter.transformer.parameters():  # a trained-looking LoRA
                    if p_.requires_grad:
                        p_.normal_(std=0.01)
            s = cfg.sample
            n = s.batch_size
            cond = batch_conditioning(adapter, adapter.encode_prompts([bench.prompts[0]] * n, s.max_sequence_length),
                                      None, s.guidance_scale)
            x = adapter.initial_noise([torch.Generator().manual_seed(i) for i in range(n)], s.height, s.width)
            x = x.to(device)
            t = torch.full((n,), 700.0, device=device)
            modes = {"unmerged": None, "merged bf16": dict(fp8=False), "merged FP8 (LoRA targets)": dict(fp8=True),
                     "merged FP8 (every token linear)": dict(fp8=True, token_linears=adapter.token_linears)}
            if a.compiled_only:
                modes.pop("merged FP8 (LoRA targets)")
            for mode, kwargs in modes.items():
                for build in (1, 2):
                    if kwargs is None and build == 2:
                        continue
                    counters.clear()
                    _sync(device)
                    t0 = time.perf_counter()
                    merged = MergedLora(adapter.transformer, **kwargs) if kwargs is not None else None
                    _sync(device)
                    build_s = time.perf_counter() - t0
                    ctx = merged.applied if merged is not None else contextlib.nullcontext

                    def step():
                        with torch.no_grad(), _training_graph(adapter, compiled), ctx():
                            adapter.velocity(x, t, cond, s.height, s.width).detach()

                    times = _timed(step, device, 1 if dry else 4)
                    row = dict(compiled=compiled, mode=mode, build=build, build_s=build_s, first_s=times[0],
                               steady_s=min(times[1:]) if len(times) > 1 else times[0],
                               graph_breaks=sum(counters["graph_break"].values()),
                               unique_graphs=counters["stats"].get("unique_graphs", 0),
                               frames=counters["frames"].get("total", 0))
                    rows.append(row)
                    print(" | ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                          flush=True)
                    del merged
            bench.restore(adapter)
    (out / "flux_fp8_probe.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
