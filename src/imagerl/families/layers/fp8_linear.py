"""FP8 (e4m3) linear layers for forwards that are never replayed: the rollout's steps outside the SDE window
(sample.off_window_fp8, built by MergedLora from the merged weights).

Weights are scaled per output channel and activations per row (token), both to the e4m3 range:
  s_w[n] = max_k |W[n, k]| / 448,  W_q = e4m3(W / s_w)        once, when the merged weights are built
  s_x[m] = max_k |x[m, k]| / 448,  x_q = e4m3(x / s_x)        at every call
  y = (x_q @ W_q^T) * s_x * s_w^T + b                          torch._scaled_mm: fp32 accumulator, bf16 out
(On Hopper the FP8 tensor-core MMAs add their products with about 14 bits before the fp32 accumulator takes
them, DeepSeek-V3 technical report arXiv:2412.19437 section 3.3.2: an error of about 2^-14 of sum_k |x_k w_k|,
far under the quantization's; tests/test_gpu.py bounds it.)
448 is e4m3fn's largest finite value. e4m3 keeps 3 mantissa bits: in a binade [2^e, 2^(e+1)) the rounding error
is uniform within half an ulp, 2^(e-4), so rms 2^(e-4) / sqrt(3); relative to values spread evenly over the
binade (E[1/v^2] = 1/2 in units of 2^e) that is 2^-4 / sqrt(3) x sqrt(1/2) = 2.55 % rms. A product of two rounded
factors: sqrt(2) x 2.55 = 3.6 %, and a K-term sum of independently rounded products keeps that 3.6 % relative to
|y| (tests/test_fp8_linear.py measures 3.7 % on random data). Not exact: only for forwards that are not replayed.
The GEMM runs at twice the bf16 rate on Hopper (989 -> 1979 dense TFLOP/s, H100 SXM datasheet).
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448.0
# cuBLASLt's FP8 GEMMs need both matrix dims of the weight to be multiples of 16 (leading dims 16-byte aligned)
FP8_ALIGNMENT = 16
# a row of zeros gets this scale instead of 0 (x / s would be 0 / 0): its quantized values are 0 either way
_MIN_AMAX = 1e-12


def fp8_supported(device: torch.device) -> bool:
    """FP8 matmuls: CUDA compute capability 8.9 (Ada) or 9.0+ (Hopper); the CPU runs torch._scaled_mm too."""
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9))


def check_fp8_device(device: torch.device) -> None:
    """sample.off_window_fp8 on a device without FP8 matmuls: say so before any model loads."""
    if not fp8_supported(device):
        raise ValueError(f"sample.off_window_fp8 needs FP8 matmuls (CUDA compute capability 8.9+: Ada, Hopper or "
                         f"newer); {torch.cuda.get_device_name(device)} has none: set sample.off_window_fp8=false")


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scale per row of shape (rows, 1)) with t ~= values * scale, for a 2-D t.

    The quotient t / scale is taken in fp32 with the fp32 scale that the GEMM multiplies back: a value whose exact
    quotient t * 448 / amax lies on a midpoint between two e4m3 values (frequent for bf16 inputs, whose mantissas
    have 8 bits) rounds by the fp32 quotient, not by ties-to-even on the exact one; either neighbour is within half
    an e4m3 step, and values * scale is exactly what the GEMM computes with (tests/test_fp8_linear.py)."""
    scale = t.abs().amax(dim=1, keepdim=True).float().clamp(min=_MIN_AMAX) / E4M3_MAX
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_alignable(weight: torch.Tensor) -> bool:
    """Both dims of an (out, in) weight multiples of FP8_ALIGNMENT."""
    return all(size % FP8_ALIGNMENT == 0 for size in weight.shape)


class Fp8Linear(torch.nn.Module):
    """y = x W^T + b in FP8 with per-channel weight and per-token activation scales; the output in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        out_features, in_features = weight.shape
        if not fp8_alignable(weight):
            raise ValueError(f"FP8 GEMMs need weight dims divisible by {FP8_ALIGNMENT}, got {tuple(weight.shape)}")
        values, scale = quantize_rows(weight.detach())
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_fp8", values)  # (N, K) row-major: .t() is the column-major mat2 _scaled_mm wants
        self.register_buffer("weight_scale", scale.reshape(1, out_features).contiguous())  # (1, N) fp32
        self.register_buffer("bias", None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        values, scale = quantize_rows(rows)
        # the output dtype nn.Linear would give: under autocast its dtype (bf16), whatever x's is. The families'
        # norms hand fp32 activations to the projections under bf16 autocast; an fp32 output here would carry the
        # rest of the block (MLP activations, q/k norms, residual adds) in fp32, off the bf16 function's dtypes
        device = x.device.type
        out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        # bf16 out: the one output dtype cuBLASLt offers with row-wise scales (torch 2.5+); fp32 models cast back
        y = torch._scaled_mm(values, self.weight_fp8.t(), scale_a=scale, scale_b=self.weight_scale,
                             out_dtype=torch.bfloat16).to(out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(out_dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 row-wise scales"
