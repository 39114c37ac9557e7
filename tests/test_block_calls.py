"""The training forward calls every transformer block exactly as the rollout's forward_only_blocks does.

A regionally compiled block may compile a call by keywords (diffusers' branch without checkpointing) as another
graph than a call by position (its checkpoint branch, which forward_only_blocks takes), and two graphs' kernels
may round differently: the replay would not be exact any more. So prepare_adapter routes training through the
checkpoint branch whether or not it checkpoints (families/base.py enable_activation_checkpointing)."""

import pytest
import torch

from conftest import tiny_config
from imagerl.components import load_adapter  # (it calls prepare_adapter)
from imagerl.distributed.parallel import World
from imagerl.families.qwen_image21.tiny import make_tiny_qwen_image21


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    return {"qwen_image": tiny_checkpoint,
            "qwen_image21": make_tiny_qwen_image21(tmp_path_factory.mktemp("ckpt21") / "tiny-qwen-image-2.1")}


def _recorded_calls(adapter, run) -> list[tuple]:
    """(block index, positional count, keyword names) of each block call made by run()."""
    calls = []
    for i, block in enumerate(adapter.transformer_blocks()):
        def recorder(*args, _i=i, _forward=block.forward, **kwargs):
            calls.append((_i, len(args), tuple(sorted(kwargs))))
            return _forward(*args, **kwargs)
        block.forward = recorder
    try:
        run()
    finally:
        for block in adapter.transformer_blocks():
            del block.forward  # the class's forward again
    return calls


@pytest.mark.parametrize("family", ["qwen_image", "qwen_image21"])
@pytest.mark.parametrize("checkpointing", [["model.gradient_checkpointing=false"],
                                           ["model.gradient_checkpointing=true"],
                                           ["model.gradient_checkpointing=true", "model.checkpoint_every=2"]])
def test_training_calls_the_blocks_as_the_rollout_does(checkpoints, tmp_path, family, checkpointing):
    cfg = tiny_config(checkpoints[family], tmp_path, "sample.height=64", "sample.width=64", *checkpointing)
    adapter = load_adapter(cfg, World(0, 1, torch.device("cpu")))
    h, w = cfg.sample.height, cfg.sample.width
    cond = adapter.conditioning(adapter.encode_prompts(["a red cube"] * 2), adapter.encode_prompts([" "] * 2), 4.0)
    x = adapter.initial_noise([torch.Generator().manual_seed(i) for i in range(2)], h, w)
    t = torch.full((2,), 500.0)

    def rollout():
        adapter.transformer.train()
        with torch.enable_grad(), adapter.forward_only_blocks():
            adapter.velocity(x, t, cond, h, w)

    def training():
        adapter.transformer.train()
        with torch.enable_grad():
            adapter.velocity(x, t, cond, h, w).square().mean().backward()

    rollout_calls, training_calls = _recorded_calls(adapter, rollout), _recorded_calls(adapter, training)
    assert len(training_calls) >= len(adapter.transformer_blocks())  # (recompute may call checkpointed ones again)
    assert set(training_calls) == set(rollout_calls)
    assert all(not keywords for _, _, keywords in rollout_calls)
