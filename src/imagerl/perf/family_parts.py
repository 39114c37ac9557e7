"""Which bench parts a family has, and its analytic forward FLOPs: shared by `imagerl bench` (bench.py) and the
profiler (profile.py), so that neither imports the other."""

from __future__ import annotations

# families whose bench parts (released-size build, adapter, baseline, FLOPs, geometry) live in perf/bench_<family>.py
MODULE_FAMILIES = ("sd3", "flux")


def family_module(family: str):
    """perf/bench_<family>.py for the families in MODULE_FAMILIES, else None (Qwen-Image's parts are in bench.py)."""
    import importlib

    return importlib.import_module(f"imagerl.perf.bench_{family}") if family in MODULE_FAMILIES else None


def _forward_flops(family: str, transformer, image_tokens: int, text_tokens: list[int], lora_rank: int, targets,
                   cached: bool = False) -> int:
    """Analytic FLOPs of one guided velocity for one sample: one forward per row (cond, and uncond with CFG);
    cached: a KV-cached qwen_image21 rollout step."""
    from imagerl.perf import flops

    module = family_module(family)
    if module:
        return module.forward_flops(transformer, image_tokens, text_tokens, lora_rank, targets, cached=cached)
    if family == "qwen_image":
        dims = flops.QwenImageDims.from_config(transformer.config)
        return sum(flops.qwen_image_forward_flops(dims, image_tokens, length, lora_rank, tuple(targets))
                   for length in text_tokens)
    dims = flops.QwenImage21Dims.from_config(transformer.config)
    return sum(flops.qwen_image21_forward_flops(dims, image_tokens, length, lora_rank, tuple(targets), cached=cached)
               for length in text_tokens)
