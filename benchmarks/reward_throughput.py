"""Reward throughput: PickScore (CLIP ViT-H/14 size, random weights) in fp32 and bf16, and OCR (RapidOCR, CPU).

PickScore: a random CLIPModel of PickScore_v1's size (vision ViT-H/14: hidden 1280, 32 layers, 16 heads,
MLP 5120, patch 14, 224 px; text: hidden 1024, 24 layers, 16 heads, MLP 4096; projection 1024) saved in
the Hub layout with a CLIP image processor (resize 224 bicubic + center crop 224) and the character-level
test tokenizer, loaded by the real `pickscore` reward and called on batches of 32 512x512 images with 2
prompts x 16 (a rollout's group structure). images/s include the preprocessing (uint8 -> PIL -> processor,
CPU, up to 8 threads) and the copy of the scores back; the preprocessing alone is timed too. The tokenizer is one token per
character, so prompts reach the 77-token limit: text cost is an upper bound.
OCR: the `ocr` reward on 512x512 renders of flow_grpo OCR targets (black text on white), one image at a
time, onnxruntime on all CPU cores; also its mean reward on them.

    python benchmarks/reward_throughput.py            # GPU; writes $OUT/reward_throughput.json if OUT is set
    DRY=1 python benchmarks/reward_throughput.py      # CPU, tiny CLIP, a few images: checks the code path
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from imagerl.config import RewardConfig
from imagerl.rewards.clip_common import clip_pixels
from imagerl.rewards.ocr import OcrReward, ocr_reward, ocr_target, to_uint8_bgr
from imagerl.rewards.pickscore import PickScore
from imagerl.rewards.tiny_clip import save_random_clip

DRY = os.environ.get("DRY") == "1"
DEVICE = torch.device("cuda" if torch.cuda.is_available() and not DRY else "cpu")
BATCH = 4 if DRY else 32
RES = 64 if DRY else 512
REPEATS = 1 if DRY else 5
OCR_IMAGES = 3 if DRY else 64
VIT_H = dict(
    vision=dict(hidden_size=1280, num_hidden_layers=32, num_attention_heads=16, intermediate_size=5120,
                patch_size=14, hidden_act="gelu"),
    text=dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
              hidden_act="gelu"),
    projection_dim=1024, image_size=224,
)
TINY = dict(vision=dict(hidden_size=32, patch_size=8), text=dict(hidden_size=32), projection_dim=32, image_size=32)
PROMPT_FILE = Path(__file__).resolve().parents[1] / ".." / "shared" / "datasets" / "ocr" / "prompts.txt"
FALLBACK_PROMPTS = ['A close-up photograph of an engraved silver ring with the inscription "Forever Yours"',
                    'A realistic photograph of a fast food drive-thru menu board that reads "Try Our New Burger"']


def prompts() -> list[str]:
    if PROMPT_FILE.is_file():
        return PROMPT_FILE.read_text().split("\n")
    from imagerl.data.prompts import bundled_prompt_file

    bundled = bundled_prompt_file()
    return bundled.read_text().splitlines() if bundled.is_file() else FALLBACK_PROMPTS


def sync():
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def render(text: str, size: int = 512) -> torch.Tensor:
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    font_size = 48
    while True:
        font = ImageFont.load_default(size=font_size)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        if right - left <= size - 32 or font_size <= 12:
            break
        font_size -= 2
    draw.text(((size - (right - left)) / 2 - left, (size - (bottom - top)) / 2 - top), text, fill="black", font=font)
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255


def bench_pickscore(path: Path, all_prompts: list[str]) -> dict:
    gen = torch.Generator().manual_seed(0)
    # smooth random images (upsampled noise), as decoded images are, at the rollout resolution
    images = torch.nn.functional.interpolate(torch.rand(BATCH, 3, 16, 16, generator=gen), size=(RES, RES),
                                             mode="bilinear").clamp(0, 1)
    batch_prompts = [p for p in all_prompts[:2] for _ in range(BATCH // 2)]
    results, scores = {}, {}
    for dtype in ("float32", "bfloat16"):
        t0 = time.perf_counter()
        reward = PickScore(RewardConfig(pickscore_model=str(path), dtype=dtype), DEVICE)
        sync()
        load_s = time.perf_counter() - t0
        results["params_b"] = sum(p.numel() for p in reward.model.parameters()) / 1e9
        scores[dtype] = reward(images, batch_prompts, [{}] * BATCH)  # warm-up (kernels, allocator)
        sync()
        t0 = time.perf_counter()
        for _ in range(REPEATS):
            reward(images, batch_prompts, [{}] * BATCH)
        sync()
        total = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(REPEATS):
            clip_pixels(reward.processor.image_processor, images)
        pre = time.perf_counter() - t0
        results[dtype] = dict(images_per_s=BATCH * REPEATS / total, s_per_batch=total / REPEATS,
                              preprocess_s_per_batch=pre / REPEATS, load_s=load_s,
                              peak_gpu_gib=torch.cuda.max_memory_allocated() / 2**30 if DEVICE.type == "cuda" else 0)
        del reward
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    diff = (scores["bfloat16"] - scores["float32"]).abs()
    results["bf16_vs_fp32"] = dict(max_abs_diff=float(diff.max()), mean_abs_diff=float(diff.mean()),
                                   fp32_score_range=[float(scores["float32"].min()), float(scores["float32"].max())])
    return results


def bench_ocr(all_prompts: list[str]) -> dict:
    chosen = all_prompts[:: max(1, len(all_prompts) // OCR_IMAGES)][:OCR_IMAGES]
    images = torch.stack([render(ocr_target(p), RES) for p in chosen])
    t0 = time.perf_counter()
    reward = OcrReward(RewardConfig(), DEVICE)
    init_s = time.perf_counter() - t0
    reward.recognize(to_uint8_bgr(images[:1])[0])  # warm-up
    t0 = time.perf_counter()
    texts = [reward.recognize(a) for a in to_uint8_bgr(images)]
    total = time.perf_counter() - t0
    values = [ocr_reward(t, p) for t, p in zip(texts, chosen)]
    return dict(images_per_s=len(chosen) / total, s_per_image=total / len(chosen), init_s=init_s, n=len(chosen),
                mean_reward=float(np.mean(values)), exact=float(np.mean([v == 1.0 for v in values])),
                cpu_threads=os.cpu_count())


def main() -> None:
    all_prompts = prompts()
    sizes = TINY if DRY else VIT_H
    out: dict = dict(device=torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu", dry=DRY,
                     batch=BATCH, resolution=RES, torch=torch.__version__)
    import transformers

    out["transformers"] = transformers.__version__
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        path = save_random_clip(Path(tmp) / "pickscore", text=sizes["text"], vision=sizes["vision"],
                                projection_dim=sizes["projection_dim"], image_size=sizes["image_size"],
                                init_device=DEVICE.type)
        out["build_s"] = time.perf_counter() - t0
        out["pickscore"] = bench_pickscore(path, all_prompts)
    out["ocr"] = bench_ocr(all_prompts)

    p = out["pickscore"]
    print(f"device {out['device']}, batch {BATCH} x {RES}x{RES} px, torch {out['torch']}, "
          f"transformers {out['transformers']}")
    print(f"pickscore model: {p['params_b']:.3f} B parameters")
    print(f"{'reward':<18}{'images/s':>10}{'s/batch':>10}{'preproc s':>11}{'peak GiB':>10}")
    for dtype in ("float32", "bfloat16"):
        r = p[dtype]
        print(f"{'pickscore ' + dtype:<18}{r['images_per_s']:>10.1f}{r['s_per_batch']:>10.3f}"
              f"{r['preprocess_s_per_batch']:>11.3f}{r['peak_gpu_gib']:>10.2f}")
    o = out["ocr"]
    print(f"{'ocr (cpu)':<18}{o['images_per_s']:>10.2f}{o['s_per_image']:>10.3f}{'':>11}{'':>10}")
    print(f"pickscore bf16 vs fp32: max |diff| {p['bf16_vs_fp32']['max_abs_diff']:.2e} "
          f"(fp32 scores in {p['bf16_vs_fp32']['fp32_score_range']})")
    print(f"ocr on {o['n']} rendered targets: mean reward {o['mean_reward']:.4f}, exact {o['exact']:.3f}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "reward_throughput.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
