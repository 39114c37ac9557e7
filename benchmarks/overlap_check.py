"""How much a rollout's wall time grows from scoring, with and without overlap (one GPU).

Qwen-Image 2.1 at full size (random bf16 weights, real_size_check.py's stand-ins), 1 prompt x 16
images at 512 px in batches of 4, 10 steps; rewards PickScore (real-size CLIP-H, random weights,
fp32, same GPU) + OCR (RapidOCR on the CPU). For reward.async_scoring on and off: generation seconds,
the seconds the loop then waits for rewards, and wait / (generation + wait) = what scoring adds.

    python benchmarks/overlap_check.py          # writes $OUT/overlap.json if OUT is set
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_size_check import PROMPT, build_qwen_image21  # noqa: E402
from reward_throughput import VIT_H  # noqa: E402

from imagerl.config import RewardConfig, load_config  # noqa: E402
from imagerl.data.prompts import PromptGroups  # noqa: E402
from imagerl.rewards import Scorer  # noqa: E402
from imagerl.rewards.tiny_clip import save_random_clip  # noqa: E402
from imagerl.rollout import generate  # noqa: E402
from imagerl.sampling import sde_window  # noqa: E402
from imagerl.rewards.scoring import AsyncScorer  # noqa: E402


def main() -> None:
    device = torch.device("cuda")
    adapter, _ = build_qwen_image21(device)
    clip_dir = Path(tempfile.mkdtemp()) / "pickscore"
    save_random_clip(clip_dir, **VIT_H, init_device="cuda")
    scorer = Scorer(RewardConfig(weights={"pickscore": 1.0, "ocr": 0.5}, pickscore_model=str(clip_dir)), device)
    cfg = load_config("quickstart", ["sample.height=512", "sample.width=512", "sample.guidance_scale=1.0",
                                     "sample.prompts_per_rollout=1", "sample.group_size=16", "sample.batch_size=4"])
    window = sde_window(2, (0, 5), 3, seed=42, rollout_step=0)
    groups = PromptGroups([PROMPT], [{}], [0])
    generate(adapter, groups, cfg, 0, window)  # warm-up
    rows = []
    for enabled in (False, True, False, True):
        scoring = AsyncScorer(scorer, enabled=enabled)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate(adapter, groups, cfg, 0, window, on_batch=scoring.submit)
        torch.cuda.synchronize()
        gen_s = time.perf_counter() - t0
        scored = scoring.collect()
        scoring.close()
        rows.append(dict(async_scoring=enabled, generation_s=gen_s, reward_wait_s=scored.wait_s,
                         reward_compute_s=scored.compute_s, added_fraction=scored.wait_s / (gen_s + scored.wait_s)))
        print(json.dumps(rows[-1]), flush=True)
    print("async | generation_s | reward_wait_s | reward_compute_s | scoring adds")
    for r in rows[2:]:
        print(f"{r['async_scoring']} | {r['generation_s']:.2f} | {r['reward_wait_s']:.2f} | {r['reward_compute_s']:.2f} | "
              f"{100 * r['added_fraction']:.1f} %")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "overlap.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
