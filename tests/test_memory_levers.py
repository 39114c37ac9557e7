"""The memory settings of the 80 GB recipes (issue 40): model.text_encoder_offload (the text encoder's weights in CPU
memory, copied to the device only to encode prompts the cache lacks) and model.checkpoint_blocks (only the first n
blocks recompute their activations). Neither changes a number: the same embeddings, the same training."""

import json

import pytest
import torch

from conftest import tiny_config
from imagerl.components import load_adapter
from imagerl.distributed.parallel import World
from imagerl.families.qwen_image21.tiny import make_tiny_qwen_image21


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    return {"qwen_image": tiny_checkpoint,
            "qwen_image21": make_tiny_qwen_image21(tmp_path_factory.mktemp("ckpt21") / "tiny-qwen-image-2.1")}


def _adapter(checkpoint, tmp_path, *overrides):
    return load_adapter(tiny_config(checkpoint, tmp_path, *overrides), World(0, 1, torch.device("cpu")))


def _encoder_tensors(adapter) -> list[torch.Tensor]:
    return [*adapter.text_encoder.parameters(), *adapter.text_encoder.buffers()]


@pytest.mark.parametrize("family", ["qwen_image", "qwen_image21"])
def test_offloaded_text_encoder_gives_the_same_embeddings(checkpoints, tmp_path, family):
    prompts = ["a red cube on a blue sphere", "two cats", " "]
    plain = _adapter(checkpoints[family], tmp_path).encode_prompts(prompts)
    adapter = _adapter(checkpoints[family], tmp_path, "model.text_encoder_offload=true")
    assert adapter.text_encoder_offloaded
    offloaded = adapter.encode_prompts(prompts)
    assert all(torch.equal(a, b) for a, b in zip(plain, offloaded))


def test_the_encoder_returns_to_its_host_copies_after_an_encode(checkpoints, tmp_path, monkeypatch):
    """After an encode, also one that raises, the encoder's tensors are its host copies again (the same storage:
    nothing is copied back), and reload_text_encoder undoes the offload. The copy to a GPU and the memory it frees:
    tests/test_gpu.py."""
    adapter = _adapter(checkpoints["qwen_image"], tmp_path)
    before = [t.detach().clone() for t in _encoder_tensors(adapter)]
    adapter.offload_text_encoder()
    host = [t.data for t in _encoder_tensors(adapter)]
    seen = []

    def encode(prompts):
        seen.extend(t.device for t in _encoder_tensors(adapter))
        raise RuntimeError("the encode failed")

    monkeypatch.setattr(adapter, "_encode_uncached", encode)
    with pytest.raises(RuntimeError, match="the encode failed"):
        adapter.encode_prompts(["a cat"])
    assert seen and set(seen) == {adapter.device}
    after = _encoder_tensors(adapter)
    assert all(t.device.type == "cpu" and t.data_ptr() == h.data_ptr() for t, h in zip(after, host))
    assert all(torch.equal(t, b) for t, b in zip(after, before))
    adapter.reload_text_encoder()  # imagerl bench between variants: the encoder stays on the device again
    assert not adapter.text_encoder_offloaded and all(torch.equal(t, b) for t, b in zip(_encoder_tensors(adapter), before))


def _training_calls(adapter, h: int, w: int) -> int:
    from test_block_calls import _recorded_calls

    cond = adapter.conditioning(adapter.encode_prompts(["a red cube"] * 2), adapter.encode_prompts([" "] * 2), 4.0)
    x = adapter.initial_noise([torch.Generator().manual_seed(i) for i in range(2)], h, w)

    def training():
        adapter.transformer.train()
        with torch.enable_grad():
            adapter.velocity(x, torch.full((2,), 500.0), cond, h, w).square().mean().backward()

    return len(_recorded_calls(adapter, training))


@pytest.mark.parametrize("settings, recomputed", [(["model.checkpoint_blocks=0"], "all"),
                                                  (["model.checkpoint_blocks=1"], 1),
                                                  (["model.checkpoint_blocks=1000"], "all"),
                                                  (["model.checkpoint_every=2", "model.checkpoint_blocks=1"], 1)])
def test_checkpoint_blocks_recomputes_that_many_blocks(checkpoints, tmp_path, settings, recomputed):
    from imagerl.perf.memory_estimate import checkpointed_blocks

    cfg = tiny_config(checkpoints["qwen_image"], tmp_path, "model.gradient_checkpointing=true", *settings)
    adapter = load_adapter(cfg, World(0, 1, torch.device("cpu")))
    blocks = len(adapter.transformer_blocks())
    assert blocks >= 2
    expected = blocks if recomputed == "all" else recomputed
    assert _training_calls(adapter, 64, 64) == blocks + expected  # each checkpointed block runs again in the backward
    assert checkpointed_blocks(cfg.model, blocks) == expected


def test_checkpoint_blocks_must_not_be_negative(tiny_checkpoint, tmp_path):
    from imagerl.validation import validate

    with pytest.raises(ValueError, match="model.checkpoint_blocks must be >= 0"):
        validate(tiny_config(tiny_checkpoint, tmp_path, "model.checkpoint_blocks=-1"))


def test_training_with_both_levers_is_the_same_run(tiny_checkpoint, tmp_path):
    """Two rollouts and updates with the text encoder offloaded and one block checkpointed: the very metrics of the
    run that keeps the encoder on the device and checkpoints every block (on-policy, lp diff 0)."""
    from imagerl.train import train

    def run(name, *overrides):
        train(tiny_config(tiny_checkpoint, tmp_path / name, "model.gradient_checkpointing=true", *overrides))
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        keys = [k for k in records[0] if k.startswith(("train/", "reward/"))]
        return [{k: r[k] for k in keys} for r in records]

    plain = run("plain")
    levers = run("levers", "model.text_encoder_offload=true", "model.checkpoint_blocks=1")
    assert levers == plain
    assert all(r["train/log_prob_mean_abs_diff"] == 0.0 for r in levers)


def test_decode_batch_size_decodes_in_chunks_and_changes_nothing_else(tiny_checkpoint, tmp_path, monkeypatch):
    """sample.decode_batch_size=1: the VAE sees one image at a time (tiny_config: training batches of 2). The images
    are those of decoding a training batch at once up to the convolutions' rounding per batch size, so the JPEG
    rewards agree to a byte's worth (1e-4) and the replay stays exact; negative sizes are refused."""
    from imagerl.families.qwen_image import QwenImageFamily
    from imagerl.train import train
    from imagerl.validation import validate

    sizes = []
    real = QwenImageFamily.decode
    monkeypatch.setattr(QwenImageFamily, "decode", lambda self, x, h, w: sizes.append(x.shape[0]) or real(self, x, h, w))

    def run(name, *overrides):
        sizes.clear()
        train(tiny_config(tiny_checkpoint, tmp_path / name, *overrides))
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k.startswith(("train/", "rollout/reward/"))} for r in records], list(sizes)

    plain, plain_sizes = run("plain")
    chunked, chunked_sizes = run("chunked", "sample.decode_batch_size=1")
    # the first decode is the CPU time estimate's (cpu_estimate.py: one rollout batch), then the two rollouts' 8 images
    assert plain_sizes[1:] == [2] * 4 and chunked_sizes[1:] == [1] * 8
    assert [r["rollout/reward/raw_mean"] for r in chunked] == pytest.approx(
        [r["rollout/reward/raw_mean"] for r in plain], abs=1e-4)
    assert all(r["train/log_prob_mean_abs_diff"] == 0.0 for r in chunked)
    with pytest.raises(ValueError, match="sample.decode_batch_size must be >= 0"):
        validate(tiny_config(tiny_checkpoint, tmp_path, "sample.decode_batch_size=-1"))
