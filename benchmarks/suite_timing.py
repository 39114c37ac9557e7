"""Time `imagerl eval --suite ocr` on the released-size Qwen-Image (random weights: the images are noise, so only the
time means anything), the path the CLI runs: suites.run.expand + evaluation.generate_and_score with the suite's
OCR scorer, 512x512 px, 10 steps, CFG 4 (Qwen-Image's default, negative prompt " "), batch 16.

    python3 benchmarks/suite_timing.py OUT [--prompts N] [--batch-size B]

Prints one table (sampling with scoring in a background thread, the GPU default; the same images scored in line;
RapidOCR alone on images of rendered text, the cost it has on legible images) and writes OUT/suite_timing.json.
The whole suite's time is extrapolated from N prompts (1018 in the suite) and said to be so.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from imagerl.distributed.parallel import World
from imagerl.evaluation.held_out import EvalSettings, generate_and_score
from imagerl.evaluation.suites import build_suite
from imagerl.evaluation.suites.run import expand


def rendered_text_images(texts: list[str], size: int = 512) -> torch.Tensor:
    """(B, 3, size, size) black text on white, one line per image (PIL's default font at size 48)."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=48)
    out = []
    for text in texts:
        image = Image.new("RGB", (size, size), "white")
        ImageDraw.Draw(image).text((16, size // 2 - 24), text[:18], fill="black", font=font)
        out.append(torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).reshape(size, size, 3))
    return torch.stack(out).permute(0, 3, 1, 2).float() / 255


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")

    from imagerl.config import RewardConfig
    from imagerl.families.qwen_image import QwenImageFamily
    from imagerl.families.qwen_image.tiny import QWEN_IMAGE_SCHEDULER_CONFIG
    from imagerl.perf.real_size import build_qwen_image

    suite = build_suite("ocr", reward_cfg=RewardConfig(), device=device)
    n, prompts, metadata, _ = expand(suite, 1, args.prompts)
    t0 = time.perf_counter()
    transformer, vae, text_encoder, tokenizer = build_qwen_image(device, suite.prompt_set.prompts)
    adapter = QwenImageFamily(transformer, vae, text_encoder, tokenizer, QWEN_IMAGE_SCHEDULER_CONFIG, device,
                              torch.bfloat16)
    build_s = time.perf_counter() - t0
    settings = EvalSettings(10, QwenImageFamily.default_guidance_scale, 512, 512, 0, args.batch_size, " ", n)
    world = World(0, 1, device)

    score_s = []

    def timed_score(images, batch_prompts, batch_metadata):
        start = time.perf_counter()
        rows = suite.score(images, batch_prompts, batch_metadata)
        score_s.append(time.perf_counter() - start)
        return rows

    # warm-up: one batch (kernels, the OCR engine's sessions), not timed
    generate_and_score(adapter, prompts[: args.batch_size], metadata[: args.batch_size], settings, world, timed_score,
                       len(suite.measures), progress=False)
    rows = {}
    for name, overlap in (("sampled, OCR in a background thread (default on a GPU)", True),
                          ("sampled, OCR in line", False)):
        score_s.clear()
        torch.cuda.synchronize()
        start = time.perf_counter()
        generate_and_score(adapter, prompts, metadata, settings, world, timed_score, len(suite.measures),
                           progress=False, overlap=overlap)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows[name] = {"seconds": seconds, "images_per_s": n / seconds, "ocr_s": sum(score_s),
                      "suite_1018_minutes": seconds / n * 1018 / 60}
    legible = rendered_text_images([p.split('"')[1] if '"' in p else p for p in prompts])
    score_s.clear()
    for i in range(0, n, args.batch_size):
        timed_score(legible[i : i + args.batch_size], prompts[i : i + args.batch_size], metadata[i : i + args.batch_size])
    rows["RapidOCR alone on rendered text (legible images)"] = {
        "seconds": sum(score_s), "images_per_s": n / sum(score_s), "ocr_s": sum(score_s),
        "suite_1018_minutes": sum(score_s) / n * 1018 / 60}

    print(f"{torch.cuda.get_device_name()}: ocr suite, {n} of 1018 prompts, 512x512, 10 steps, CFG 4, batch "
          f"{args.batch_size}; build {build_s:.0f} s; peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print("| phase | seconds | images/s | OCR s | 1018 prompts (min, extrapolated) |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['seconds']:.1f} | {r['images_per_s']:.2f} | {r['ocr_s']:.1f} | "
              f"{r['suite_1018_minutes']:.1f} |")
    (out / "suite_timing.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "prompts": n, "batch_size": args.batch_size, "build_s": build_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
