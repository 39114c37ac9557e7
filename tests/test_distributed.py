"""Two gloo ranks on CPU compute what one rank computes: same groups, images, rewards and (up to
float summation order in the gradient all-reduce) the same LoRA update."""

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conftest import tiny_config

COMMON = ["sample.prompts_per_rollout=2", "sample.group_size=2", "sample.batch_size=2",
          "train.num_optimizer_steps=1", "train.num_rollouts=2", "run.checkpoint_every=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, checkpoint, run_dir, cache):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), IMAGERL_CACHE=cache)
    torch.set_num_threads(1)
    from imagerl.train import train

    train(tiny_config(checkpoint, run_dir, *COMMON, "model.device=cpu"))
    dist.destroy_process_group()


def _records(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _lora(run_dir, step):
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "lora" / "adapter_model.safetensors")


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_rank(tiny_checkpoint, tmp_path):
    from imagerl.train import train

    one, two = tmp_path / "one", tmp_path / "two"
    train(tiny_config(tiny_checkpoint, one, *COMMON))
    mp.start_processes(_rank_main, args=(2, _free_port(), tiny_checkpoint, two, os.environ["IMAGERL_CACHE"]),
                       nprocs=2, join=True, start_method="spawn")
    r1, r2 = _records(one), _records(two)
    assert len(r1) == len(r2) == 2
    for a, b in zip(r1, r2):
        # same prompts and the same per-image noise, so the same images and rewards, bit for bit
        for key in ["rollout/reward/raw_mean", "rollout/reward/raw_std", "rollout/zero_std_ratio",
                    "rollout/advantage_abs_mean"]:
            assert a[key] == b[key], key
        assert b["train/log_prob_mean_abs_diff"] == 0.0
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
    w1, w2 = _lora(one, 2), _lora(two, 2)
    # Adam divides each gradient element by its own RMS, so elements with near-zero gradients take
    # updates whose size depends on the summation order of the all-reduce: allow 1% of one lr=1e-2 step.
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4
    assert any(not torch.equal(w1[k], _lora(one, 1)[k]) for k in w1)  # the second update did change the LoRA
