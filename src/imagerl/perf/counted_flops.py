"""FLOPs of one transformer forward counted by torch.utils.flop_counter on the meta device, for families without a
hand-derived formula (sd3, flux; Qwen-Image's is perf/flops.py, checked against the same counter in
tests/test_flops.py).

`counted_forward_flops(config_class, config, make_inputs, lora_rank, lora_targets)` builds the transformer from its
config on the meta device (no memory, no weights), runs one forward on meta inputs of one sample under
FlopCounterMode (matmuls, convolutions and scaled-dot-product attention; elementwise work not counted, as in MFU
conventions) and adds the LoRA's 2 x r x (in + out) per row of every targeted Linear (PEFT's suffix match), the rows
read off each Linear's input during the same forward. Results are cached per (class, config, inputs, rank, targets).
"""

from __future__ import annotations

import functools
import json

import torch


def _targeted(name: str, targets: tuple[str, ...]) -> bool:
    return any(name == t or name.endswith("." + t) for t in targets)


@functools.lru_cache(maxsize=64)
def _count(config_class, config_json: str, make_inputs, inputs_key: tuple, lora_rank: int,
           lora_targets: tuple[str, ...]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    from imagerl.perf.real_size import _default_dtype

    with torch.device("meta"), _default_dtype(torch.bfloat16):
        model = config_class.from_config(json.loads(config_json))
    lora = [0]

    def add_lora(module, args):
        rows = args[0].numel() // module.in_features
        lora[0] += 2 * lora_rank * (module.in_features + module.out_features) * rows

    hooks = [m.register_forward_pre_hook(add_lora) for n, m in model.named_modules()
             if lora_rank and isinstance(m, torch.nn.Linear) and _targeted(n, lora_targets)]
    counter = FlopCounterMode(display=False)
    try:
        with torch.no_grad(), counter:
            model(**make_inputs(model.config, *inputs_key))
    finally:
        for h in hooks:
            h.remove()
    return counter.get_total_flops() + lora[0]


def counted_forward_flops(config_class, config, make_inputs, inputs_key: tuple, lora_rank: int = 0,
                          lora_targets: tuple[str, ...] = ()) -> int:
    """FLOPs of one forward of one sample (module docstring). make_inputs(config, *inputs_key) returns the forward's
    keyword arguments as meta tensors of batch 1; inputs_key: hashable sizes (image tokens, text tokens, ...)."""
    plain = {k: v for k, v in dict(config).items() if not k.startswith("_")}
    return _count(config_class, json.dumps(plain, sort_keys=True, default=list), make_inputs, tuple(inputs_key),
                  int(lora_rank), tuple(lora_targets))
