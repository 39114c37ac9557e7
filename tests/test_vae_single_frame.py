"""families/layers/vae_single_frame.py: a still image's causal 3D convolutions as 2D ones, against diffusers' own."""

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLQwenImage

from imagerl.families.layers.vae_single_frame import single_frame_convs


@pytest.fixture(scope="module")
def vae(tiny_checkpoint):
    return AutoencoderKLQwenImage.from_pretrained(tiny_checkpoint, subfolder="vae").eval()


def _count_conv3d(monkeypatch) -> list:
    calls = []
    original = F.conv3d

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(F, "conv3d", counting)
    return calls


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_one_frame_decode_and_encode_equal_diffusers_without_a_3d_convolution(vae, monkeypatch, dtype, tol):
    vae = vae.to(dtype)
    torch.manual_seed(0)
    z = torch.randn(2, vae.config.z_dim, 1, 8, 6, dtype=dtype)
    images = torch.rand(2, 3, 1, 64, 48, dtype=dtype) * 2 - 1
    with torch.no_grad():
        theirs = vae.decode(z, return_dict=False)[0], vae.encode(images).latent_dist.mode()
        calls = _count_conv3d(monkeypatch)
        with single_frame_convs(vae):
            ours = vae.decode(z, return_dict=False)[0], vae.encode(images).latent_dist.mode()
    assert not calls  # every causal conv ran as a 2D one
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    vae.to(torch.float32)


def test_videos_and_the_module_outside_the_context_are_diffusers_own(vae, monkeypatch):
    torch.manual_seed(1)
    z = torch.randn(1, vae.config.z_dim, 3, 8, 6)  # three latent frames: cached chunks after the first
    with torch.no_grad():
        theirs = vae.decode(z, return_dict=False)[0]
        calls = _count_conv3d(monkeypatch)
        with single_frame_convs(vae):
            ours = vae.decode(z, return_dict=False)[0]
        assert calls  # the cached chunks ran diffusers' 3D convolutions
        calls.clear()
        again = vae.decode(z, return_dict=False)[0]
    assert calls and torch.equal(again, theirs)  # restored: diffusers' forward again
    torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=2e-5)
    assert not any("forward" in vars(m) for m in vae.modules())
