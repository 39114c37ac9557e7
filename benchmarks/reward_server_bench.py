"""Reward server overhead on this machine: the shapes and JPEG rewards in process vs through `imagerl reward-server`
on localhost.

1. Scoring alone: 128 shapes-world images (64x64, what a quickstart rollout scores) by the shapes reward, in process
   and through the server in each encoding (requests of reward.batch_size=32, 2 in flight), median of 7; the overhead
   per image is (server - in process) / 128.
2. Several ranks, one server: 1, 2 and 4 client processes at once, each scoring 8 x 128 images of the JPEG reward
   (uint8) through one server; images/s over all clients.
3. End to end: the quickstart (128 images per rollout) for 5 rollouts, in process and against the server (float32:
   the same numbers), alternating A B A B in this process; seconds per rollout over rollouts 2-5 (time/total_s),
   and whether the rewards matched.

    python benchmarks/reward_server_bench.py [--out DIR]      # about 6 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reward_server_util import ServerProcess  # noqa: E402 - the tests' real server process

from imagerl.config import RewardConfig  # noqa: E402
from imagerl.rewards.registry import Scorer  # noqa: E402

N = 128


def shapes_images(work: Path):
    from imagerl.data.synthetic import generate_dataset

    out = generate_dataset(work / "data", N, seed=0, size=64)
    records = [json.loads(line) for line in (out / "captions.jsonl").read_text().splitlines()]
    images = torch.stack([torch.from_numpy(np.asarray(Image.open(out / r["image"]).convert("RGB"))).permute(2, 0, 1)
                          for r in records]).float() / 255
    return images, [r["prompt"] for r in records]


def timed(fn, repeats=7):
    fn()  # warm
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _client(url, seconds_out, start_event):
    cfg = RewardConfig(weights={"jpeg_compressibility": 1.0}, remote={"jpeg_compressibility": url})
    scorer = Scorer(cfg)
    images = torch.rand(N, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    start_event.wait()
    start = time.perf_counter()
    for _ in range(8):
        scorer.score(images, ["p"] * N, [{}] * N)
    seconds_out.put(time.perf_counter() - start)


def several_clients(url, k):
    ctx = mp.get_context("spawn")
    out, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_client, args=(url, out, go)) for _ in range(k)]
    for p in procs:
        p.start()
    time.sleep(15)  # every client imported torch and asked the server's health
    start = time.perf_counter()
    go.set()
    for p in procs:
        p.join()
    wall = time.perf_counter() - start
    return k * 8 * N / wall


def quickstart(out_dir: Path, remote: str | None):
    from imagerl.cli import main

    extra = [f"reward.remote={{shapes: {remote}}}", "reward.remote_encoding=float32"] if remote else []
    args = ["train", "--output-dir", str(out_dir), "train.num_rollouts=5", "eval.before_training=false",
            "eval.interval=0", "eval.suites=[]", "data.test_prompts=", "run.image_grid_every=0", "run.tensorboard=false",
            "run.checkpoint_every=5", *extra]
    assert main(args) == 0
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return records


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="reward_server_bench_"))
    server = ServerProcess("--reward", "shapes", "--reward", "jpeg_compressibility")
    result = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        images, prompts = shapes_images(work)
        meta = [{}] * N
        local = Scorer(RewardConfig(weights={"shapes": 1.0}))
        rows = [("in process", timed(lambda: local.score(images, prompts, meta)))]
        for encoding in ("uint8", "png", "float32"):
            remote = Scorer(RewardConfig(weights={"shapes": 1.0}, remote={"shapes": server.url},
                                         remote_encoding=encoding))
            rows.append((f"server, {encoding}", timed(lambda: remote.score(images, prompts, meta))))
        print(f"scoring {N} shapes-world images (64x64) by the shapes reward, median of 7:")
        for name, seconds in rows:
            print(f"  {name:18s} {seconds * 1000:8.1f} ms  overhead {(seconds - rows[0][1]) / N * 1000:+.3f} ms/image")
        result["scoring"] = {name: seconds for name, seconds in rows}
        print(f"JPEG reward through one server, 8 x {N} images per client:")
        result["clients"] = {}
        for k in (1, 2, 4):
            rate = several_clients(server.url, k)
            result["clients"][k] = rate
            print(f"  {k} client process(es): {rate:7.1f} images/s in all")
        runs = {}
        for i, mode in enumerate(["in process", "server", "in process", "server"]):
            records = quickstart(work / f"qs{i}", server.url if mode == "server" else None)
            runs.setdefault(mode, []).append(records)
        per_rollout = {mode: statistics.mean(r["time/total_s"] for records in rs for r in records[1:])
                       for mode, rs in runs.items()}
        same = all(a["rollout/reward/shapes_mean"] == b["rollout/reward/shapes_mean"]
                   for ra, rb in zip(runs["in process"], runs["server"]) for a, b in zip(ra, rb))
        print(f"quickstart, {N} images per rollout, s per rollout (rollouts 2-5, 2 runs each):")
        for mode, seconds in per_rollout.items():
            print(f"  {mode:18s} {seconds:7.3f} s")
        overhead = per_rollout["server"] - per_rollout["in process"]
        print(f"  overhead {overhead:+.3f} s per rollout = {overhead / N * 1000:+.2f} ms per image; rewards identical: "
              f"{same}")
        result["quickstart_s_per_rollout"], result["rewards_identical"] = per_rollout, same
    finally:
        server.stop()
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "reward_server_bench.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
