"""Analytic FLOP counts of the Qwen-Image transformer (the basis of MFU), checked against
torch.utils.flop_counter on real modules (tests/test_flops.py).

One forward of QwenImageTransformer2DModel on one sample with I image tokens and L text tokens
(N = I + L; D = heads x head_dim; every Linear costs 2 x in x out FLOPs per row it is applied to):

  per block   2 x 12 D^2 x N      a token passes through its own stream's q, k, v, out (4 D^2) and MLP (8 D^2)
            + 4 x D x N^2         joint attention: Q K^T and A V over all N tokens (2 N^2 D each)
            + 2 x 2 x 6 D^2       img_mod and txt_mod (D -> 6D), once per sample
  outside     2 x C_in x D x I (img_in) + 2 x J x D x L (txt_in) + 2 x (256 D + D^2) (timestep MLP)
            + 2 x 2 D^2 (norm_out, per sample) + 2 x D x C_out x I (proj_out)

(counted from diffusers' transformer_qwenimage.py at the released config: 13.59 GFLOP x N + 0.737 MFLOP x N^2 + 22 MFLOP x L + small for
the 20B model). A LoRA of rank r on a Linear (in -> out) adds 2 x r x (in + out) per row. Elementwise work
(norms, RoPE, softmax, activations) is not counted, as in MFU conventions.
"""

from __future__ import annotations

from dataclasses import dataclass

# the per-token Linears of one block, by stream (PEFT target names as in the family adapters)
IMAGE_STREAM = ("to_q", "to_k", "to_v", "to_out.0", "img_mlp.net.0.proj", "img_mlp.net.2")
TEXT_STREAM = ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "txt_mlp.net.0.proj", "txt_mlp.net.2")
PER_SAMPLE = ("img_mod.1", "txt_mod.1")


@dataclass(frozen=True)
class QwenImageDims:
    num_layers: int
    dim: int  # heads x head_dim
    in_channels: int
    out_channels: int  # per packed token: patch_size^2 x latent channels
    joint_attention_dim: int

    @classmethod
    def from_config(cls, config) -> "QwenImageDims":
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
        p = get("patch_size")
        return cls(get("num_layers"), get("num_attention_heads") * get("attention_head_dim"), get("in_channels"),
                   p * p * get("out_channels"), get("joint_attention_dim"))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each Linear of one block, by its name inside the block."""
        d = self.dim
        shapes = {name: (d, d) for name in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj",
                                            "add_v_proj", "to_add_out")}
        shapes.update({"img_mlp.net.0.proj": (d, 4 * d), "img_mlp.net.2": (4 * d, d), "txt_mlp.net.0.proj": (d, 4 * d),
                       "txt_mlp.net.2": (4 * d, d), "img_mod.1": (d, 6 * d), "txt_mod.1": (d, 6 * d)})
        return shapes


def _rows(name: str, image_tokens: int, text_tokens: int) -> int:
    if name in IMAGE_STREAM:
        return image_tokens
    if name in TEXT_STREAM:
        return text_tokens
    return 1  # per-sample modulation


def qwen_image_forward_flops(dims: QwenImageDims, image_tokens: int, text_tokens: int, lora_rank: int = 0,
                             lora_targets: tuple[str, ...] = ()) -> int:
    """FLOPs of one transformer forward for one sample (multiply by the batch, and by 2 for true CFG)."""
    d, n = dims.dim, image_tokens + text_tokens
    block = 4 * d * n * n
    for name, (fan_in, fan_out) in dims.linear_shapes().items():
        rows = _rows(name, image_tokens, text_tokens)
        block += 2 * fan_in * fan_out * rows
        if lora_rank and any(name == t or name.endswith("." + t) or t.endswith(name) for t in lora_targets):
            block += 2 * lora_rank * (fan_in + fan_out) * rows
    outside = (2 * dims.in_channels * d * image_tokens + 2 * dims.joint_attention_dim * d * text_tokens
               + 2 * (256 * d + d * d) + 2 * d * 2 * d + 2 * d * dims.out_channels * image_tokens)
    return dims.num_layers * block + outside


@dataclass(frozen=True)
class QwenImage21Dims:
    """Qwen-Image 2.1: one stream (every token through every block weight), gated MLP of width mlp_ratio x D."""

    num_layers: int
    dim: int
    in_channels: int
    out_channels: int
    context_dim: int  # the text encoder's width (txt_in's input)
    mlp_ratio: int

    @classmethod
    def from_config(cls, config) -> "QwenImage21Dims":
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
        return cls(get("num_layers"), get("num_attention_heads") * get("attention_head_dim"), get("in_channels"),
                   get("out_channels"), get("context_in_dim"), get("mlp_ratio"))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        d, m = self.dim, self.mlp_ratio * self.dim
        return {"to_q": (d, d), "to_k": (d, d), "to_v": (d, d), "to_out.0": (d, d), "img_mlp.proj": (d, m),
                "img_mlp.gate_layer": (d, m), "img_mlp.out": (m, d)}


def qwen_image21_forward_flops(dims: QwenImage21Dims, image_tokens: int, text_tokens: int, lora_rank: int = 0,
                               lora_targets: tuple[str, ...] = (), cached: bool = False, batch: int = 1) -> int:
    """FLOPs of one Qwen-Image 2.1 forward of `batch` samples. Block-causal attention: text tokens attend to
    text (4 D L^2), image tokens to text and image (4 D T (T + L)). cached: a KV-cached rollout step (the text
    prefix's keys and values reused, so only the T image rows pass the blocks; txt_in still runs)."""
    d, t, l = dims.dim, image_tokens, text_tokens
    rows = t if cached else t + l
    block = 4 * d * t * (t + l) + (0 if cached else 4 * d * l * l)
    for name, (fan_in, fan_out) in dims.linear_shapes().items():
        block += 2 * fan_in * fan_out * rows
        if lora_rank and any(name == x or name.endswith("." + x) or x.endswith(name) for x in lora_targets):
            block += 2 * lora_rank * (fan_in + fan_out) * rows
    # per sample: img_in, txt_in (two Linears), proj_out (on every row passed). Timestep MLP, modulation and
    # norm_out run on batch + 1 conditioning rows (each sample's timestep and one shared text row; counted by
    # FlopCounterMode on diffusers' module, tests/test_flops.py)
    per_token = 2 * dims.in_channels * d * t + 2 * (dims.context_dim * d + d * d) * l + 2 * d * dims.out_channels * rows
    per_condition_row = 2 * (256 * d + d * d) + 2 * d * 4 * d + 2 * d * d
    return batch * (dims.num_layers * block + per_token) + (batch + 1) * per_condition_row


def training_flops(forward_flops: int, full_fine_tune: bool, recompute: bool | float) -> int:
    """FLOPs of forward + backward of one sample. Backward: activation gradients (1x forward) plus weight
    gradients (1x forward when every weight trains; LoRA's are in the LoRA term of the forward count, ~0
    of the base); recomputation (gradient checkpointing) repeats the forward: True for every block, or the
    fraction of blocks recomputed (model.checkpoint_every; the layers outside the blocks, < 1 % of a
    forward, are counted in the fraction too). MFU reported with this count counts recompute as work done
    (hardware FLOPs), stated where it is used."""
    backward = 2 * forward_flops if full_fine_tune else forward_flops
    return forward_flops + backward + round(forward_flops * float(recompute))


def flow_grpo_iteration_flops(dims: QwenImageDims, image_tokens: int, text_tokens: int, *, samples: int,
                              num_steps: int, num_sde_steps: int, true_cfg: bool, lora_rank: int = 0,
                              lora_targets: tuple[str, ...] = (), recompute: bool = True) -> dict[str, int]:
    """Model FLOPs of one Flow-GRPO iteration (qwen_image): the rollout runs every denoising step for every
    sample (x2 with true CFG: cond and uncond rows), training replays each SDE-window step with grad
    (forward + backward, + recompute with gradient checkpointing). Text encoder and VAE are not included."""
    cfg_rows = 2 if true_cfg else 1
    forward = qwen_image_forward_flops(dims, image_tokens, text_tokens, lora_rank, lora_targets) * cfg_rows
    rollout = samples * num_steps * forward
    train = samples * num_sde_steps * training_flops(forward, full_fine_tune=False, recompute=recompute)
    return {"rollout": rollout, "train": train, "total": rollout + train}


def mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak (use a matmul ceiling measured in the same run)."""
    if seconds <= 0 or peak_flops_per_s <= 0:
        raise ValueError(f"mfu needs positive seconds and peak, got {seconds} and {peak_flops_per_s}")
    return flops / seconds / peak_flops_per_s


def measure_matmul_flops_per_s(device, dtype, size: int = 8192, iterations: int = 20) -> float:
    """The dense matmul rate this device reaches (size x size @ size x size, best of `iterations` after a
    warm-up): the ceiling MFU is reported against, measured in the same run as the benchmark."""
    import time

    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    a @ b
    sync()
    best = float("inf")
    for _ in range(iterations):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best
