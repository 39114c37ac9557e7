"""A still image's causal 3D VAE convolutions as the 2D convolutions they amount to (qwen_image decode/encode).

diffusers' AutoencoderKLQwenImage is Wan 2.1's video VAE. Its QwenImageCausalConv3d pads the time axis with
kt - 1 zero frames in front (causal) and runs a 3D convolution. A still image is one frame with no cached frames
before it, so the one output frame is the kernel's last temporal slice applied to that frame plus the other slices
times zeros: the 3 x 3 x 3 convolutions do 3x the multiply-adds of the 3 x 3 one with the same sum, and conv3d
kernels are slower per multiply-add than conv2d ones. Inside `single_frame_convs(vae)` exactly that case (one
frame in, no cache, full causal time padding, so one frame out) runs F.conv2d with weight[:, :, -1]; anything else
(videos, cached chunks) runs diffusers' forward. The same math: only the order in which the kernel sums may
differ (float64: equal to ~1e-15, float32: ~1e-6; tests/test_vae_single_frame.py). On the H200 the fp32 decode of
4 images at 512 px took 118 ms per call as 3D convolutions (run O, benchmarks/LOG.md).
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn.functional as F


def _forward(conv, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    pad_w, pad_w_end, pad_h, pad_h_end, pad_t, pad_t_end = conv._padding
    kt = conv.kernel_size[0]
    if (cache_x is None and x.shape[2] == 1 and pad_t == conv.dilation[0] * (kt - 1) and pad_t_end == 0
            and pad_w == pad_w_end and pad_h == pad_h_end):
        out = F.conv2d(x[:, :, 0], conv.weight[:, :, -1], conv.bias, conv.stride[1:], (pad_h, pad_w),
                       conv.dilation[1:], conv.groups)
        return out.unsqueeze(2)
    return type(conv).forward(conv, x, cache_x)


@contextlib.contextmanager
def single_frame_convs(vae: torch.nn.Module):
    """Within: the VAE's causal convolutions take the 2D path for one-frame inputs; restored on exit."""
    from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageCausalConv3d

    convs = [m for m in vae.modules() if isinstance(m, QwenImageCausalConv3d)]
    for conv in convs:
        conv.forward = types.MethodType(_forward, conv)
    try:
        yield
    finally:
        for conv in convs:
            del conv.forward
