"""Several gloo ranks on CPU (FSDP2, parallel.strategy=auto) compute what one process computes: same
groups, images, rewards, advantages and losses (to float rounding), and a LoRA within 1e-6 after two
rollouts; checkpoints written by 2 ranks resume in 1 process and the reverse, continuing as the
uninterrupted run.

Why lr=1e-4 and adam_eps=1e-6: gradients are sums over batches and ranks, summed in another order by one
process than by FSDP's reduce-scatter, so they agree to float32 rounding, not bit for bit. Adam divides
each gradient by its own RMS, so an element whose gradient is a near-cancelling sum can move by up to ~lr
in a direction the rounding decides; the tolerance must therefore be judged against lr. With lr=1e-4 the
LoRA moves > 5e-5 (asserted), 50x the 1e-6 tolerance, and eps=1e-6 keeps near-zero gradients from being
amplified to full lr-sized steps. Measured: 1.5e-8 for 2 and 4 ranks. The reward is a smooth test reward
(JPEG size counts bytes, so a rounding-level pixel change can flip a reward by a whole byte).
"""

import json
import os
import socket

import pytest
import torch

from conftest import tiny_config
from spawn_ranks import spawn_and_join
from imagerl.rewards.registry import REWARDS, register_reward


class SmoothReward:
    """Mean red minus mean blue: continuous in the pixels (JPEG size counts bytes, so the tiny weight
    differences between world sizes would flip rewards by whole bytes and change the advantages)."""

    def __init__(self, cfg=None, device=None):
        pass

    def __call__(self, images_B3HW, prompts, metadata):
        return (images_B3HW[:, 0] - images_B3HW[:, 2]).double().mean(dim=(1, 2)).cpu()


if "test_smooth" not in REWARDS:  # spawned ranks import this module too
    register_reward("test_smooth")(SmoothReward)

COMMON = ["sample.prompts_per_rollout=4", "sample.group_size=2", "sample.batch_size=2", "sample.height=64",
          "sample.width=64", "train.num_optimizer_steps=1", "train.num_rollouts=2", "run.checkpoint_every=1",
          "run.keep_checkpoints=2", "train.lr=1e-4", "train.adam_eps=1e-6", "model.gradient_checkpointing=true",
          "reward.weights={test_smooth: 1.0}"]
EQUAL_KEYS = ["rollout/reward/raw_mean", "rollout/reward/raw_std", "rollout/zero_std_ratio",
              "rollout/advantage_abs_mean"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, checkpoint, run_dir, cache, overrides, resume, no_pickles):
    import torch.distributed as dist

    if world_size == 1:
        os.environ.pop("RANK", None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), IMAGERL_CACHE=cache)
    torch.set_num_threads(1)
    from imagerl.train import train

    if no_pickles:  # after spawn has unpickled this function's arguments: the run itself must unpickle nothing
        import no_unpickling

        no_unpickling.install()

    train(tiny_config(checkpoint, run_dir, *COMMON, *overrides), resume=resume)
    if dist.is_initialized():
        dist.barrier()  # rank 0 may still be writing: tear the group down together
        dist.destroy_process_group()


def _run(world_size: int, checkpoint, run_dir, *overrides, resume=None, no_pickles=False):
    """Every run in fresh processes with one thread each (the kernels' summation order depends on the thread
    count), a single process included."""
    spawn_and_join(_rank_main, (world_size, _free_port(), checkpoint, run_dir, os.environ["IMAGERL_CACHE"],
                                list(overrides), resume, no_pickles), world_size, timeout_s=600)


def _records(run_dir):
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _lora(run_dir, step):
    from safetensors.torch import load_file

    return load_file(run_dir / "checkpoints" / f"step_{step:06d}" / "lora" / "adapter_model.safetensors")


def _max_diff(a, b) -> float:
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape for k in a)  # full tensors: a plain PEFT adapter, not shards
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _assert_same_records(r1, r2, exact_first: bool = True):
    """Rollout 1 runs the same weights everywhere, yet a rank's forwards see other batch compositions than one
    process (e.g. a rank encodes fewer prompts per text-encoder batch), so images and rewards agree to float
    rounding (~1e-8 relative measured), not bit for bit. Later rollouts also run LoRAs that differ by rounding."""
    assert [r["step"] for r in r1] == [r["step"] for r in r2]
    for i, (a, b) in enumerate(zip(r1, r2)):
        for key in EQUAL_KEYS:
            assert a[key] == pytest.approx(b[key], rel=1e-6 if i == 0 and exact_first else 1e-5, abs=1e-9), key
        assert b["train/log_prob_mean_abs_diff"] == 0.0  # the replay under FSDP is exact
        for key in ["rollout/reward/test_smooth_mean", "train/loss", "train/policy_loss",
                    "train/grad_norm", "train/clipfrac"]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-9), key


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_one_two_and_four_ranks_agree_and_resume_across_world_sizes(tiny_checkpoint, tmp_path):
    runs = {n: tmp_path / f"w{n}" for n in (1, 2, 4)}
    _run(1, tiny_checkpoint, runs[1])
    # the 2-rank run also shards the (tiny) text encoder and runs in deterministic mode
    _run(2, tiny_checkpoint, runs[2], "parallel.text_encoder=shard", "parallel.deterministic=true")
    _run(4, tiny_checkpoint, runs[4])
    ref = _lora(runs[1], 2)
    assert _max_diff(ref, _lora(runs[1], 1)) > 1e-4 / 2  # the LoRA moved by far more than the tolerance
    for n in (2, 4):
        _assert_same_records(_records(runs[1]), _records(runs[n]))
        assert _max_diff(ref, _lora(runs[n], 1)) < 1e-6 or _max_diff(_lora(runs[1], 1), _lora(runs[n], 1)) < 1e-6
        diff = _max_diff(ref, _lora(runs[n], 2))
        print(f"max |LoRA(1 process) - LoRA({n} processes)| after 2 rollouts: {diff:.3g}")
        assert diff < 1e-6
        state = json.loads((runs[n] / "checkpoints" / "step_000002" / "state.json").read_text())
        assert state["world_size"] == n and state["step"] == 2

    # 2 -> 1: the 2-rank checkpoint after rollout 1, continued in one process
    two_to_one = tmp_path / "2to1"
    _run(1, tiny_checkpoint, two_to_one, resume=str(runs[2] / "checkpoints" / "step_000001"))
    # 1 -> 2: the 1-process checkpoint after rollout 1, continued on two ranks
    one_to_two = tmp_path / "1to2"
    _run(2, tiny_checkpoint, one_to_two, resume=str(runs[1] / "checkpoints" / "step_000001"))
    for resumed in (two_to_one, one_to_two):
        _assert_same_records(_records(runs[1])[1:], _records(resumed), exact_first=False)
        diff = _max_diff(ref, _lora(resumed, 2))
        print(f"max |LoRA(1 process) - LoRA(resumed {resumed.name})| after 2 rollouts: {diff:.3g}")
        assert diff < 1e-6


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_diffusion_nft_on_two_ranks_equals_one_process(tiny_checkpoint, tmp_path):
    """DiffusionNFT under FSDP2: the old-policy and EMA states are sharded like the LoRA and swapped in per rank;
    2 ranks give one process's rewards, losses and exported (EMA) LoRA, and resume its checkpoint on 1 rank and on
    2 ranks, the latter with every unpickling path made to raise (tests/no_unpickling.py)."""
    nft = ["train.algorithm=diffusion_nft", "nft.solver=dpm2", "nft.old_decay_rate=0.3", "nft.ref_weight=0.01"]
    one, two, two_to_one, two_to_two = tmp_path / "w1", tmp_path / "w2", tmp_path / "2to1", tmp_path / "2to2"
    _run(1, tiny_checkpoint, one, *nft)
    _run(2, tiny_checkpoint, two, *nft)
    _run(1, tiny_checkpoint, two_to_one, *nft, resume=str(two / "checkpoints" / "step_000001"))
    _run(2, tiny_checkpoint, two_to_two, *nft, resume=str(two / "checkpoints" / "step_000001"), no_pickles=True)
    r1 = _records(one)
    assert [r["step"] for r in r1] == [1, 2] and r1[-1]["train/old_deviation"] > 0
    for other in (two, two_to_one, two_to_two):
        records = _records(other)
        for a, b in zip(r1[-len(records):], records):
            for key in [*EQUAL_KEYS, "train/loss", "train/policy_loss", "train/ref_loss", "train/old_deviation",
                        "train/grad_norm"]:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-9), key
        assert _max_diff(_lora(one, 2), _lora(other, 2)) < 1e-6
    assert _max_diff(_lora(one, 2), _lora(one, 1)) > 1e-5  # the exported EMA moved by far more than the tolerance


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_diffusion_nft_shuffled_over_two_optimizer_steps_is_the_same_on_two_ranks(tiny_checkpoint, tmp_path):
    """nft.shuffle (two optimizer steps a rollout): each step trains the same samples on 1 and on 2 ranks, so the
    losses and the LoRA agree as without the shuffle."""
    nft = ["train.algorithm=diffusion_nft", "nft.solver=euler", "nft.old_decay_rate=0.3", "train.num_optimizer_steps=2"]
    one, two = tmp_path / "w1", tmp_path / "w2"
    _run(1, tiny_checkpoint, one, *nft)
    _run(2, tiny_checkpoint, two, *nft)
    for a, b in zip(_records(one), _records(two)):
        for key in [*EQUAL_KEYS, "train/loss", "train/policy_loss", "train/old_deviation", "train/grad_norm"]:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-9), key
    assert _max_diff(_lora(one, 2), _lora(two, 2)) < 1e-6


def _exit_rank_main(rank: int, world_size: int, port: int, out) -> None:
    """torchrun's environment, init_world, one collective, then a return without destroying the group."""
    import atexit

    import torch.distributed as dist

    from imagerl.distributed.parallel import init_world

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    # atexit runs last-registered first: this hook, registered before init_world's, sees the state after it
    atexit.register(lambda: (out / f"rank{rank}.txt").write_text(str(dist.is_initialized())))
    world = init_world("cpu")
    total = world.all_reduce_mean_(torch.tensor([float(rank)]))
    assert world.size == world_size and total.item() == 0.5


@pytest.mark.timeout(180)
def test_a_group_that_init_world_created_is_destroyed_at_exit(tmp_path):
    # a group left to the interpreter's teardown can abort a gloo rank (pytorch/pytorch#190489)
    spawn_and_join(_exit_rank_main, (2, _free_port(), tmp_path), 2, timeout_s=120)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["False", "False"]


@pytest.mark.timeout(900)
def test_every_rank_scores_through_one_reward_server_as_in_process(tiny_checkpoint, tmp_path):
    """Two ranks against one real `imagerl reward-server`: each rank sends its own images (the rollout's samples are
    split over the ranks), and the run's rewards, advantages and losses equal the same two ranks scoring in process
    bit for bit (the JPEG reward rounds pixels to uint8 itself: the uint8 wire is exact for it)."""
    from reward_server_util import ServerProcess

    jpeg = ["reward.weights={jpeg_compressibility: 1.0}"]
    from test_reward_server import images_scored

    server = ServerProcess("--reward", "jpeg_compressibility")
    try:
        _run(2, tiny_checkpoint, tmp_path / "remote", *jpeg, f"reward.remote={{jpeg_compressibility: {server.url}}}")
        assert images_scored(server.url) == {"jpeg_compressibility": 2 * 8}  # both ranks' images, both rollouts
    finally:
        server.stop()
    _run(2, tiny_checkpoint, tmp_path / "local", *jpeg)
    local, remote = _records(tmp_path / "local"), _records(tmp_path / "remote")
    assert [r["step"] for r in local] == [r["step"] for r in remote] == [1, 2]
    for a, b in zip(local, remote):
        for key in [*EQUAL_KEYS, "rollout/reward/jpeg_compressibility_mean", "train/loss", "train/grad_norm"]:
            assert a[key] == b[key], key
