"""The FP8 GEMM of families/layers/fp8_linear.py on a CUDA GPU against float64 arithmetic (issue 40): the layer's own
factors vs factors re-quantized in float64 from the definition, and torch._scaled_mm with and without
use_fast_accum. Prints one line per comparison (mismatches at rtol 2^-7, atol 1e-5; max abs difference).

    PYTHONPATH=src:tests python3 benchmarks/fp8_gemm_check.py
"""

import torch

from imagerl.families.layers.fp8_linear import Fp8Linear, quantize_rows
from test_fp8_linear import _dequantized, _e4m3_neighbours_at_ties, _factors_product


def _compare(name: str, y: torch.Tensor, reference: torch.Tensor) -> None:
    y, reference = y.float().cpu().reshape(reference.shape), reference.float()
    bad = ~torch.isclose(y, reference, rtol=2**-7, atol=1e-5)
    rel = ((y.double() - reference.double()).norm() / reference.double().norm()).item()
    print(f"{name:58s} mismatched {int(bad.sum()):5d} / {bad.numel()}  max abs {(y - reference).abs().max():.3g}"
          f"  rms rel {rel:.2e}")


def main() -> None:
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    w, x = torch.randn(256, 512) * 0.02, torch.randn(7, 33, 512)  # tests/test_gpu.py's data
    layer = Fp8Linear(w.cuda().bfloat16(), None)
    x_gpu = x.cuda().bfloat16()
    y = layer(x_gpu)
    definition = _dequantized(x.bfloat16().float().reshape(-1, 512)) @ _dequantized(w.bfloat16().float()).T
    _compare("layer vs float64 re-quantized (the old test)", y, definition)
    _compare("layer vs float64 of its own factors (the test now)", y, _factors_product(layer, x_gpu))
    values, scale = quantize_rows(x_gpu.reshape(-1, 512))
    for fast in (False, True):
        out = torch._scaled_mm(values, layer.weight_fp8.t(), scale_a=scale, scale_b=layer.weight_scale,
                               out_dtype=torch.bfloat16, use_fast_accum=fast)
        _compare(f"_scaled_mm use_fast_accum={fast} vs own factors", out, _factors_product(layer, x_gpu))
    for name, t, v in [("weight", w.bfloat16(), layer.weight_fp8), ("activations", x.bfloat16().reshape(-1, 512), values)]:
        differ, at_ties = _e4m3_neighbours_at_ties(t, v)
        same_as_cpu = torch.equal(v.cpu().float(), quantize_rows(t)[0].float())
        print(f"{name}: {differ} e4m3 values differ from the float64 definition, all at exact ties: {at_ties}; "
              f"GPU quantization == CPU: {same_as_cpu}")


if __name__ == "__main__":
    main()
