"""Real-size check on one GPU: full-size random transformers, recipe geometry, frozen weights.

For each family: the transformer at its released size with random bf16 weights (no download), the
real VAE architecture (random, fp32), and a text-encoder stand-in of the real hidden size (the real
class with 1 decoder layer and the tiny tokenizer), wrapped in the same adapter class that loads real
checkpoints. Then one rollout (1 prompt x group of 16, batch 4, 512 px, 10 steps, SDE window {3, 4})
and one training step over it with lr = 0 (frozen weights): the training forward must replay the
rollout's log-probs exactly (train/log_prob_mean_abs_diff == 0 in bf16).

    python benchmarks/real_size_check.py [qwen_image] [qwen_image21]   # writes $OUT/real_size.json if OUT is set
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from imagerl.algorithms.flow_grpo import flow_grpo_update
from imagerl.components import make_optimizer, resolve_family_defaults
from imagerl.config import load_config
from imagerl.data.prompts import PromptGroups
from imagerl.distributed.parallel import World
from imagerl.rollout import generate
from imagerl.sampling import sde_window
from imagerl.validation import validate

# Dry run of this script's code path on a CPU: DRY=1 builds 1-layer transformers at 64 px.
DRY = os.environ.get("DRY") == "1"
LAYERS = {"num_layers": 1} if DRY else {}
PROMPT = 'A close-up photograph of an engraved silver ring with the inscription "Forever Yours"'


def build_qwen_image(device):
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from imagerl.families.qwen_image import QwenImageFamily
    from imagerl.families.qwen_image.tiny import QWEN_IMAGE_SCHEDULER_CONFIG, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        transformer = QwenImageTransformer2DModel(**LAYERS)  # released config == class defaults (20.4 B params)
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=3584, intermediate_size=18944, num_hidden_layers=1,
                             num_attention_heads=28, num_key_value_heads=4,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
                             bos_token_id=None, eos_token_id=None),
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2, out_hidden_size=3584,
                               fullatt_block_indexes=[0])))
        torch.set_default_dtype(torch.float32)
        vae = AutoencoderKLQwenImage()
    adapter = QwenImageFamily(transformer, vae, text_encoder, tokenizer, QWEN_IMAGE_SCHEDULER_CONFIG, device,
                              torch.bfloat16)
    return adapter, "quickstart"


def build_qwen_image21(device):
    from diffusers import AutoencoderKLQwenImage21, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from imagerl.families.qwen_image21 import QwenImage21Family
    from imagerl.families.qwen_image.tiny import QWEN_IMAGE_SCHEDULER_CONFIG
    from imagerl.families.qwen_image21.tiny import build_tiny_processor

    processor = build_tiny_processor()
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        transformer = QwenImage21Transformer2DModel(**LAYERS)  # class defaults (7.1 B params)
        text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config=dict(vocab_size=len(processor.tokenizer), hidden_size=4096, intermediate_size=12288,
                             num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                             rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [24, 20, 20],
                                              "mrope_interleaved": True}),
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2, out_hidden_size=4096,
                               deepstack_visual_indexes=[])))
        torch.set_default_dtype(torch.float32)
        vae = AutoencoderKLQwenImage21()
    adapter = QwenImage21Family(transformer, vae, text_encoder, processor, QWEN_IMAGE_SCHEDULER_CONFIG, device,
                                torch.bfloat16)
    return adapter, "quickstart"


def check(family: str) -> dict:
    device = torch.device("cpu" if DRY else "cuda")
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    peak = (lambda: torch.cuda.max_memory_allocated() / 2**30) if device.type == "cuda" else (lambda: float("nan"))
    reset = torch.cuda.reset_peak_memory_stats if device.type == "cuda" else (lambda: None)
    reset()
    t0 = time.perf_counter()
    adapter, recipe = {"qwen_image": build_qwen_image, "qwen_image21": build_qwen_image21}[family](device)
    build_s = time.perf_counter() - t0
    guidance = "4.0" if family == "qwen_image" else "1.0"
    cfg = load_config(recipe, [
        f"sample.height={64 if DRY else 512}", f"sample.width={64 if DRY else 512}", "sample.num_steps=10", f"sample.guidance_scale={guidance}",
        "sample.prompts_per_rollout=1", "sample.group_size=16", "sample.batch_size=4", "train.num_optimizer_steps=1",
        "train.lr=0", "model.lora_rank=64", "model.lora_alpha=128", "sample.noise_level=1.2"])
    validate(cfg)
    resolve_family_defaults(cfg, adapter)
    torch.manual_seed(0)
    adapter.add_lora(64, 128, "gaussian")
    adapter.transformer.enable_gradient_checkpointing()
    adapter.transformer.eval()
    optimizer = make_optimizer(adapter.trainable_parameters(), cfg)
    world = World(0, 1, device)
    window = sde_window(2, (0, 5), 3, seed=42, rollout_step=0)
    params = sum(p.numel() for p in adapter.transformer.parameters())
    lora = sum(p.numel() for p in adapter.trainable_parameters())

    sync()
    t0 = time.perf_counter()
    rollout = generate(adapter, PromptGroups([PROMPT], [{}], [0]), cfg, 0, window)
    sync()
    rollout_s = time.perf_counter() - t0
    rollout_peak = peak()
    reset()
    t0 = time.perf_counter()
    stats = flow_grpo_update(adapter, rollout, torch.randn(16), optimizer, cfg, world)
    sync()
    train_s = time.perf_counter() - t0
    return {
        "family": family, "transformer_params_B": params / 1e9, "lora_params_M": lora / 1e6, "build_s": build_s,
        "rollout_s": rollout_s, "rollout_images_per_s": 16 / rollout_s, "train_step_s": train_s,
        "peak_mem_rollout_gib": rollout_peak, "peak_mem_train_gib": peak(),
        "log_prob_mean_abs_diff": stats.log_prob_mean_abs_diff, "ratio_abs_minus_1": stats.ratio_abs_minus_1,
        "old_log_prob_finite": bool(torch.isfinite(rollout.log_probs_BS).all()),
        "images_finite": bool(torch.isfinite(rollout.images_B3HW).all()),
    }


def main(families: list[str]) -> None:
    results = []
    for family in families:
        results.append(check(family))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(json.dumps(results[-1]), flush=True)
    keys = ["family", "transformer_params_B", "rollout_s", "train_step_s", "peak_mem_rollout_gib", "peak_mem_train_gib",
            "log_prob_mean_abs_diff"]
    print(" | ".join(keys))
    for r in results:
        print(" | ".join(f"{r[k]:.4g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "real_size.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if not DRY else "cpu (dry run)", "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen_image", "qwen_image21"])
