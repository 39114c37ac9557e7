"""How far 2 processes (gloo, FSDP2) end from 1 process, at the quickstart's settings and around them.

    python benchmarks/cross_process_bound.py [--rollouts 2] [--out DIR]

Each run: the quickstart recipe (DiffusionNFT, the shipped model) for N rollouts, no evaluation, every process with
one thread. Prints, per (train.lr, train.adam_eps), the largest |policy LoRA(1 process) - policy LoRA(2 processes)|
after N rollouts, and the largest LoRA change over the run for scale. The gradients of 1 and 2 processes agree to
float32 rounding (summed in another order); Adam divides each by its own running RMS + eps, so an element whose
gradient is tiny against eps moves by ~lr * g / eps, and one whose gradient is a near-cancelling sum moves by up to
~lr in a direction the rounding decides: the gap grows with lr and shrinks as eps grows.
"""

from __future__ import annotations

import argparse
import os
import socket
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

GRID = [(1e-3, 1e-8), (1e-4, 1e-8), (1e-3, 1e-6), (1e-4, 1e-6)]  # (lr, eps); the first is the quickstart's


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, size: int, port: int, run_dir: str, overrides: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank))
    if size == 1:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(key)
    torch.set_num_threads(1)
    import torch.distributed as dist

    from imagerl.config import load_config
    from imagerl.train import train

    train(load_config("quickstart", [f"run.output_dir={run_dir}", "eval.interval=0", "eval.before_training=false",
                                     "run.tensorboard=false", "run.image_grid_every=0", *overrides]))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _policy(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    from imagerl.run.checkpoint_tensors import read_trainer_state

    return read_trainer_state(run_dir / "checkpoints" / f"step_{step:06d}" / "trainer")["model"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="cross_process_"))
    n = args.rollouts
    print(f"quickstart, {n} rollouts, 1 vs 2 processes (gloo), one thread each; policy LoRA after rollout {n}")
    print(f"{'lr':>8} {'adam_eps':>9} {'max |1p - 2p|':>14} {'max |change|':>13}")
    for lr, eps in GRID:
        overrides = [f"train.num_rollouts={n}", f"run.checkpoint_every={n}", f"train.lr={lr}", f"train.adam_eps={eps}"]
        runs = {}
        for size in (1, 2):
            runs[size] = out / f"lr{lr:g}_eps{eps:g}_w{size}"
            mp.start_processes(_rank, args=(size, _port(), str(runs[size]), overrides), nprocs=size, join=True,
                               start_method="spawn")
        one, two = _policy(runs[1], n), _policy(runs[2], n)
        gap = max((one[k] - two[k]).abs().max().item() for k in one)
        moved = max(one[k].abs().max().item() for k in one if "lora_B" in k)  # lora_B starts at 0
        print(f"{lr:8.0e} {eps:9.0e} {gap:14.2e} {moved:13.2e}", flush=True)


if __name__ == "__main__":
    main()
