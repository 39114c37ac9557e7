"""The LoRA folded into a copy of the base weights, for forwards that need neither gradients nor exactness.

A rollout's steps outside the SDE window are deterministic ODE steps: they are never replayed and give no
log-prob, so they may run on W' = W + scaling * B @ A (one GEMM per adapted layer, the LoRA matmuls,
dtype casts and adds gone) instead of W x + scaling * B(A x). The function is the same; only the rounding
differs (W' is rounded to the model dtype once, from the factors in the model dtype that the forward multiplies).
The window steps and the training forwards keep the unmerged weights, so the replay stays exact
(sample.merge_lora, rollout.py).

The merged copies live as long as the MergedLora object (qwen_image, r64 on the 12 targets: 13.6 B weights,
27 GB in bf16, 13.6 GB in FP8); the caller drops it after the rollout, before training allocates its activations.
With fp8=True (sample.off_window_fp8) each merged weight is quantized to e4m3 and its layer runs an FP8 GEMM
(families/layers/fp8_linear.py): not the same function up to rounding any more, but still never replayed. So do
the frozen Linear layers named in token_linears (the family's per-token GEMMs that are not LoRA targets: with
DanceGRPO's attention-only LoRA, 76 % of FLUX.1-dev's linear FLOPs); their e4m3 copies are rebuilt with the merged
ones, so no copy outlives the rollout.
"""

from __future__ import annotations

import contextlib

import torch

from imagerl.families.layers.attention_backends import unreplayed_forwards
from imagerl.families.layers.fp8_linear import Fp8Linear, check_fp8_device, fp8_alignable


def _merged(module, names: list[str], weight: torch.Tensor) -> torch.Tensor:
    """W + sum_n scaling_n * B_n @ A_n in W's dtype. The factors are cast to W's dtype first, as the bf16 autocast
    forward casts them (adapter.autocast), and the GEMM adds the product to W in fp32 and rounds once (cuBLAS'
    fp32 compute type for bf16 addmm). One bf16 GEMM with K = r that reads W and writes W' (4 bytes moved per
    weight) instead of an fp32 product (no TF32), a scaled copy, an fp32 W and their sum (about 44 bytes per
    weight); qwen_image r64 has 13.6 B adapted weights."""
    assert not module.fan_in_fan_out and not getattr(module, "lora_variant", {}), "plain LoRA on nn.Linear only"
    out = weight
    for n in names:
        a, b = module.lora_A[n].weight, module.lora_B[n].weight
        out = torch.addmm(out, b.to(weight.dtype), a.to(weight.dtype), alpha=module.scaling[n])
    return out


def frozen_token_linears(transformer: torch.nn.Module, token_linears: tuple[str, ...]) -> list:
    """(name, layer) of each plain nn.Linear whose name ends with one of token_linears after a '.' (inside a block:
    the top-level proj_out is not one). A LoRA target under PEFT is a peft layer, not an nn.Linear, and its
    base_layer / lora_A / lora_B names end otherwise; without PEFT (a meta-device estimate) targets are included."""
    suffixes = tuple("." + name for name in token_linears)
    return [(name, layer) for name, layer in transformer.named_modules()
            if type(layer) is torch.nn.Linear and name.endswith(suffixes)]


def _frozen_fp8_swaps(transformer: torch.nn.Module, token_linears: tuple[str, ...]) -> list:
    """(parent, name, layer, Fp8Linear of its weight) for each frozen_token_linears layer whose dims the FP8 GEMM
    takes."""
    swaps = []
    with torch.no_grad():
        for full, layer in frozen_token_linears(transformer, token_linears):
            if fp8_alignable(layer.weight):
                parent, name = full.rsplit(".", 1)
                swaps.append((transformer.get_submodule(parent), name, layer, Fp8Linear(layer.weight, layer.bias)))
    return swaps


class MergedLora:
    """Built from the current LoRA weights; `applied()` swaps the merged weights in for a block of code."""

    def __init__(self, transformer: torch.nn.Module, fp8: bool = False, token_linears: tuple[str, ...] = ()):
        from peft.tuners.lora import LoraLayer
        from torch.distributed.tensor import DTensor

        # (peft layer, its base nn.Linear, the original weight, the merged weight) for a bf16/fp32 swap
        self.swaps: list[tuple[torch.nn.Module, torch.nn.Module, torch.nn.Parameter, torch.nn.Parameter]] = []
        # (peft layer, its base nn.Linear, the Fp8Linear that stands in for it) under fp8
        self.fp8_swaps: list[tuple[torch.nn.Module, torch.nn.Module, Fp8Linear]] = []
        # (parent module, attribute name, frozen nn.Linear, its Fp8Linear) under fp8 for token_linears
        self.frozen_fp8_swaps: list[tuple[torch.nn.Module, str, torch.nn.Module, Fp8Linear]] = []
        if fp8:
            check_fp8_device(next(transformer.parameters()).device)
            self.frozen_fp8_swaps = _frozen_fp8_swaps(transformer, token_linears)
        with torch.no_grad():
            for module in transformer.modules():
                if not isinstance(module, LoraLayer):
                    continue
                names = [n for n in module.active_adapters if n in module.lora_A]
                base = module.get_base_layer()
                weight = base.weight
                if isinstance(weight, DTensor):
                    raise ValueError("sample.merge_lora needs unsharded weights (one process, or "
                                     "parallel.strategy=replicate); under FSDP set sample.merge_lora=false")
                if module.merged or module.disable_adapters or not names:  # its forward is the base layer already
                    continue
                merged = _merged(module, names, weight)
                if fp8 and fp8_alignable(weight):  # a misaligned layer (dims not multiples of 16) keeps bf16 merged
                    self.fp8_swaps.append((module, base, Fp8Linear(merged, base.bias)))
                else:
                    self.swaps.append((module, base, weight, torch.nn.Parameter(merged, requires_grad=False)))

    @contextlib.contextmanager
    def applied(self):
        """Within: no grad, each adapted layer runs its merged base weight only (the adapter is skipped)."""
        layers = [module for module, *_ in self.swaps] + [module for module, *_ in self.fp8_swaps]
        disabled = [module._disable_adapters for module in layers]
        for module, base, _, merged in self.swaps:
            base._parameters["weight"] = merged
        for module, _, fp8 in self.fp8_swaps:
            module._modules["base_layer"] = fp8  # what peft's forward calls with the adapters off
        for parent, name, _, fp8 in self.frozen_fp8_swaps:
            parent._modules[name] = fp8
        for module in layers:
            module._disable_adapters = True  # the flag peft's forward reads; no requires_grad changes (cheap)
        try:  # nothing replays these forwards: the blocks may attend with any backend (attention_backends.py)
            with torch.no_grad(), unreplayed_forwards():
                yield
        finally:
            for module, base, original, _ in self.swaps:
                base._parameters["weight"] = original
            for module, base, _ in self.fp8_swaps:
                module._modules["base_layer"] = base
            for parent, name, linear, _ in self.frozen_fp8_swaps:
                parent._modules[name] = linear
            for module, was in zip(layers, disabled):
                module._disable_adapters = was
