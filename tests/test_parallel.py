"""Group-complete sampling over many (world size, prompts per rollout, group size, batch) combinations,
parallel.* validation, deterministic-mode checks and interrupted checkpoints (all single-process, fast)."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch

from imagerl.config import Config
from imagerl.data.prompts import GroupSampler, PromptSet
from imagerl.distributed.parallel import validate_parallel
from imagerl.validation import validate

PROMPTS = PromptSet([f"prompt {i}" for i in range(7)], [{} for _ in range(7)])


def _config(world: int, p: int, k: int, batch: int, opt_steps: int = 1) -> Config:
    cfg = Config()
    cfg.sample.prompts_per_rollout, cfg.sample.group_size, cfg.sample.batch_size = p, k, batch
    cfg.train.num_optimizer_steps = opt_steps
    return cfg


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_each_prompts_k_samples_exist_exactly_once_across_ranks(world):
    checked = rejected = 0
    for p, k, batch in itertools.product([1, 2, 3, 4, 6, 8, 12], [2, 3, 4], [1, 2, 4]):
        cfg = _config(world, p, k, batch)
        try:
            plan = validate(cfg, world)
        except ValueError as e:
            rejected += 1
            # the message names the setting to change and the numbers involved
            assert ("sample.prompts_per_rollout" in str(e) and f"{world} ranks" in str(e)) or "sample.batch_size" in str(e)
            if p % world:
                with pytest.raises(ValueError, match="divisible by world_size"):
                    GroupSampler(PROMPTS, p, 0, 0, world)
            continue
        checked += 1
        samplers = [GroupSampler(PROMPTS, p, seed=3, rank=r, world_size=world) for r in range(world)]
        single = GroupSampler(PROMPTS, p, seed=3)
        for step in range(3):
            per_rank = [s.groups_for(step) for s in samplers]
            # the rollout's sample ids (rollout.generate): group g's K samples are g*K .. g*K+K-1
            sample_ids = [g * k + j for groups in per_rank for g in groups.group_ids_G for j in range(k)]
            assert sorted(sample_ids) == list(range(p * k))  # every sample of every group exactly once
            assert all(len(groups.group_ids_G) == plan.prompts_per_rank for groups in per_rank)
            assert all(len(groups.group_ids_G) * k == plan.samples_per_rank for groups in per_rank)
            # all ranks agree on the prompt order: together they hold the one-process rollout, in rank order
            whole = single.groups_for(step)
            assert [q for groups in per_rank for q in groups.prompts_G] == whole.prompts_G
            assert [g for groups in per_rank for g in groups.group_ids_G] == whole.group_ids_G
    assert checked and (rejected or world == 1)


def test_invalid_world_size_combinations_are_rejected_clearly():
    with pytest.raises(ValueError, match=r"sample.prompts_per_rollout=3 must be divisible by the 2 ranks"):
        validate(_config(2, 3, 4, 4), 2)
    with pytest.raises(ValueError, match=r"not a multiple of sample.batch_size=2"):
        validate(_config(4, 4, 3, 2), 4)  # 3 samples per rank in batches of 2
    cfg = _config(4, 4, 2, 4)  # a batch above a rank's 2 samples is a ceiling: lowered to them
    assert validate(cfg, 4).samples_per_rank == 2 and cfg.sample.batch_size == 2
    with pytest.raises(ValueError, match=r"train.num_optimizer_steps=2"):
        validate(_config(2, 2, 3, 3, opt_steps=2), 2)


@pytest.mark.parametrize("key, value", [("strategy", "ddp"), ("reduce_dtype", "float16"), ("text_encoder", "yes")])
def test_parallel_settings_are_validated(key, value):
    cfg = Config()
    setattr(cfg.parallel, key, value)
    with pytest.raises(ValueError, match=f"parallel.{key} must be one of"):
        validate_parallel(cfg, 2)


def test_parallel_strategy_resolution():
    cfg = Config()
    assert validate_parallel(cfg, 1) == "none"
    assert validate_parallel(cfg, 2) == "fsdp"
    cfg.parallel.strategy = "replicate"
    assert validate_parallel(cfg, 2) == "replicate"
    cfg.parallel.text_encoder = "shard"
    with pytest.raises(ValueError, match="parallel.text_encoder=shard needs parallel.strategy=fsdp"):
        validate_parallel(cfg, 2)


def test_deterministic_mode_is_checked_at_startup():
    from imagerl.distributed.fsdp import check_deterministic

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        with pytest.raises(ValueError, match="parallel.deterministic=true but torch.use_deterministic_algorithms is off"):
            check_deterministic(torch.device("cpu"))
    finally:
        torch.use_deterministic_algorithms(before)


def test_interrupted_checkpoint_is_never_picked_up(tiny_checkpoint, tmp_path, monkeypatch):
    import imagerl.run.checkpoint_tensors as checkpoint_tensors
    from conftest import tiny_config
    from imagerl.run.checkpoint import latest_checkpoint, resolve_resume
    from imagerl.train import train

    run = tmp_path / "run"
    overrides = ["train.num_rollouts=2", "run.checkpoint_every=1", "train.num_optimizer_steps=1"]
    real_save, calls = checkpoint_tensors.save_file, []

    def crash_on_second(tensors, file, **kwargs):  # the second checkpoint dies half-way through writing its tensors
        calls.append(1)
        if len(calls) == 2:
            Path(file).write_bytes(b"\0" * 100)
            raise KeyboardInterrupt("killed while writing")
        return real_save(tensors, file, **kwargs)

    monkeypatch.setattr(checkpoint_tensors, "save_file", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(tiny_checkpoint, run, *overrides))
    assert (run / "checkpoints" / "step_000002.tmp").is_dir()
    assert latest_checkpoint(run).name == "step_000001"
    assert resolve_resume("latest", run).name == "step_000001"
    # a final-named directory without state.json (e.g. copied half-way) is not a checkpoint either
    shutil.copytree(run / "checkpoints" / "step_000002.tmp", run / "checkpoints" / "step_000003")
    assert latest_checkpoint(run).name == "step_000001"
    with pytest.raises(ValueError, match="no checkpoint found"):
        resolve_resume(str(run / "checkpoints" / "step_000003"), run)
    shutil.rmtree(run / "checkpoints" / "step_000003")

    monkeypatch.setattr(checkpoint_tensors, "save_file", real_save)
    train(tiny_config(tiny_checkpoint, run, *overrides), resume="latest")  # continues after rollout 1
    assert latest_checkpoint(run).name == "step_000002"
    assert not (run / "checkpoints" / "step_000002.tmp").exists()
    assert sorted(p.name for p in (run / "checkpoints" / "step_000002").iterdir()) == ["lora", "rng", "state.json",
                                                                                      "trainer"]
