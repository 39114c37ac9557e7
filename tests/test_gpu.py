"""GPU checks (skipped without CUDA): bf16 autocast rollout replays bit for bit, training runs."""

import json

import pytest
import torch

from conftest import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_bf16_rollout_replays_exactly_on_gpu(tiny_checkpoint, tmp_path):
    from test_training import _rollout
    from imagerl.algorithms.flow_grpo import _step_log_prob

    cfg = tiny_config(tiny_checkpoint, tmp_path, "model.device=cuda", "model.dtype=bfloat16",
                      "model.gradient_checkpointing=true", "sample.height=128", "sample.width=128")
    adapter, rollout = _rollout(cfg)
    assert adapter.transformer.dtype == torch.bfloat16
    assert rollout.latents_BSNC.dtype == torch.float32 and rollout.latents_BSNC.is_cuda
    adapter.transformer.train()
    for batch in rollout.batches():
        cond = rollout.conditioning(adapter, batch, cfg.sample.guidance_scale)
        for j in range(rollout.latents_BSNC.shape[1]):
            out = _step_log_prob(adapter, rollout, batch, j, cond, cfg)
            out.log_prob.sum().backward()  # gradient checkpointing recomputes the same forward
            assert torch.equal(out.log_prob.detach(), rollout.log_probs_BS[batch, j])


@pytest.mark.parametrize("overrides", [[], ["model.group_text_lengths=true"], ["parallel.compile=true"],
                                       ["parallel.compile=true", "model.gradient_checkpointing=true"],
                                       ["parallel.compile=true", "model.gradient_checkpointing=true",
                                        "model.checkpoint_every=2"],
                                       ["train.timestep_staging=true"],
                                       ["model.gradient_checkpointing=true", "model.checkpoint_every=2"],
                                       ["sample.batch_size=4", "train.batch_size=2", "sample.merge_lora=true"],
                                       ["parallel.compile=true", "sample.batch_size=4", "train.batch_size=2",
                                        "sample.merge_lora=true", "model.gradient_checkpointing=true"],
                                       # the qwen_image recipe's shape: no checkpointing, the text capped
                                       ["parallel.compile=true", "sample.batch_size=4", "train.batch_size=2",
                                        "sample.merge_lora=true", "model.gradient_checkpointing=false",
                                        "sample.max_sequence_length=128"],
                                       ["parallel.compile=true", "sample.batch_size=4", "train.batch_size=2",
                                        "sample.merge_lora=true", "sample.off_window_fp8=true"],
                                       # the 80 GB recipes' shape: the text encoder off the GPU, some blocks
                                       # keeping their activations
                                       ["parallel.compile=true", "sample.batch_size=4", "train.batch_size=2",
                                        "sample.merge_lora=true", "sample.off_window_fp8=true",
                                        "model.text_encoder_offload=true", "model.gradient_checkpointing=true",
                                        "model.checkpoint_blocks=1"]])
def test_training_on_gpu_is_on_policy(tiny_checkpoint, tmp_path, overrides):
    from imagerl.train import train

    train(tiny_config(tiny_checkpoint, tmp_path, "model.device=cuda", "train.num_rollouts=3", "train.beta=0.01",
                      *overrides))
    records = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/log_prob_mean_abs_diff"] == 0.0 for r in records)
    assert all(r["memory/peak_allocated_gib"] > 0 for r in records)


def test_offloaded_text_encoder_frees_its_gpu_memory_and_encodes_the_same(tiny_checkpoint, tmp_path):
    """model.text_encoder_offload: the encoder's weights leave the GPU (pinned host copies), come back only while
    prompts the cache lacks are encoded, and the embeddings are bit for bit those of the encoder left on the GPU."""
    from imagerl.components import load_adapter
    from imagerl.distributed.parallel import World

    cfg = tiny_config(tiny_checkpoint, tmp_path, "model.device=cuda", "model.dtype=bfloat16")
    adapter = load_adapter(cfg, World(0, 1, torch.device("cuda")))
    prompts = ["a red cube on a blue sphere", "two cats", " "]
    plain = adapter.encode_prompts(prompts)
    tensors = [*adapter.text_encoder.parameters(), *adapter.text_encoder.buffers()]
    size = sum(t.numel() * t.element_size() for t in tensors)
    torch.cuda.synchronize()
    on_gpu = torch.cuda.memory_allocated()
    adapter.offload_text_encoder()
    assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors)
    assert torch.cuda.memory_allocated() <= on_gpu - size
    adapter.prompt_cache = type(adapter.prompt_cache)(16)  # a fresh cache: the prompts are encoded again
    inside = []
    encode = adapter._encode_uncached
    adapter._encode_uncached = lambda p: (inside.extend(t.device.type for t in tensors), encode(p))[1]
    offloaded = adapter.encode_prompts(prompts)
    assert set(inside) == {"cuda"} and all(t.device.type == "cpu" for t in tensors)
    assert all(a.is_cuda and torch.equal(a, b) for a, b in zip(offloaded, plain))
    adapter.reload_text_encoder()
    assert all(t.is_cuda for t in tensors)


def test_rope_tables_rebuilt_on_gpu_equal_a_gpu_build(tiny_checkpoint):
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    from imagerl.families.qwen_image import QwenImageFamily

    adapter = QwenImageFamily.from_pretrained(tiny_checkpoint, torch.device("cuda"), torch.bfloat16)
    rope = adapter.transformer.pos_embed
    with torch.device("cuda"):
        gpu_built = QwenEmbedRope(theta=rope.theta, axes_dim=list(rope.axes_dim), scale_rope=True)
    cpu_built = QwenEmbedRope(theta=rope.theta, axes_dim=list(rope.axes_dim), scale_rope=True)
    assert rope.pos_freqs.is_cuda
    assert torch.equal(rope.pos_freqs, gpu_built.pos_freqs) and torch.equal(rope.neg_freqs, gpu_built.neg_freqs)
    print("rope: GPU build differs from the CPU build:", not torch.equal(rope.pos_freqs.cpu(), cpu_built.pos_freqs))


def test_timestep_staging_keeps_the_trajectory_on_the_cpu(tiny_checkpoint, tmp_path):
    from test_training import _rollout
    from imagerl.algorithms.flow_grpo import _step_log_prob

    cfg = tiny_config(tiny_checkpoint, tmp_path, "model.device=cuda", "train.timestep_staging=true")
    adapter, rollout = _rollout(cfg)
    assert rollout.latents_BSNC.device.type == "cpu" and rollout.log_probs_BS.device.type == "cpu"
    for batch in rollout.batches():
        cond = rollout.conditioning(adapter, batch, cfg.sample.guidance_scale)
        out = _step_log_prob(adapter, rollout, batch, 0, cond, cfg)
        assert out.log_prob.is_cuda and torch.equal(out.log_prob.cpu(), rollout.log_probs_BS[batch, 0])


def test_fp8_linear_on_gpu_is_the_float64_product_of_its_quantized_factors():
    """The row-wise scaled FP8 GEMM (torch._scaled_mm) against float64 arithmetic on the layer's own e4m3 values
    and fp32 scales (the CPU twin is tests/test_fp8_linear.py). Two things differ from that product on Hopper:
    - the bf16 output rounding, at most 2^-8 of |y| (measured on an H100: 1.66e-3 rms, as one rounding gives);
    - the accumulation: Hopper's FP8 tensor-core MMAs sum their products with about 14 bits of precision before
      the fp32 accumulator takes them (DeepSeek-V3 technical report, arXiv:2412.19437, section 3.3.2), so the
      error is absolute, against the size of the products: bounded as a dot product's, c * sum_k |x_k w_k|
      (Higham, Accuracy and Stability of Numerical Algorithms, section 3.1), with c = 2^-12, 4x the largest seen
      on an H100 (4.0e-4 at sum 5.2: outputs near 0 mismatched at rtol 2^-7 alone, issue 40).
    The factors must be the layer's own: re-quantizing in float64 breaks exact e4m3 rounding ties of the bf16
    inputs the other way (issue 40: 1625 of 59136 outputs), and the GPU's scale is amax * fl32(1/448) (a tensor
    divided by a Python number is multiplied by its reciprocal on CUDA), which breaks other ties than the CPU's
    amax / 448: either neighbour is within half an e4m3 step, as checked below."""
    from test_fp8_linear import _e4m3_neighbours_at_ties, _factors_product
    from imagerl.families.layers.fp8_linear import Fp8Linear, quantize_rows

    torch.manual_seed(0)
    w, x = torch.randn(256, 512) * 0.02, torch.randn(7, 33, 512)  # M = 231 rows: not a multiple of 16
    layer = Fp8Linear(w.cuda().bfloat16(), None)
    x_gpu = x.cuda().bfloat16()
    y = layer(x_gpu).double().cpu().reshape(-1, 256)
    reference = _factors_product(layer, x_gpu)
    magnitude = _factors_product(layer, x_gpu, absolute=True)  # sum_k |x_k w_k| per output
    error = (y - reference).abs()
    assert (error <= reference.abs() * 2**-7 + magnitude * 2**-12).all(), (error / magnitude).max()
    assert ((y - reference).norm() / reference.norm()).item() < 2.5e-3  # one bf16 rounding: 1.65e-3 rms
    # the GPU's quantization: off the float64 definition only at exact ties, by one e4m3 step
    for t, values in [(w.bfloat16(), layer.weight_fp8), (x.bfloat16().reshape(-1, 512),
                                                          quantize_rows(x_gpu.reshape(-1, 512))[0])]:
        assert _e4m3_neighbours_at_ties(t, values)[1]


@pytest.mark.parametrize("overrides", [[], ["model.gradient_checkpointing=true"],
                                       # the rollout batch split into training batches, merged off the window
                                       ["sample.batch_size=4", "train.batch_size=2", "sample.merge_lora=true"],
                                       ["sample.batch_size=4", "train.batch_size=2", "sample.merge_lora=true",
                                        "model.gradient_checkpointing=true"],
                                       # the off-window steps KV-cached, the window steps full forwards
                                       ["sample.batch_size=4", "train.batch_size=2", "sample.merge_lora=true",
                                        "sample.kv_cache=true"],
                                       # both off-window options: the prefix cache filled by the FP8 weights
                                       ["sample.batch_size=4", "train.batch_size=2", "sample.merge_lora=true",
                                        "sample.kv_cache=true", "sample.off_window_fp8=true"]])
def test_compiled_qwen_image21_training_is_on_policy(tmp_path, overrides):
    """Compiled 2.1 blocks (RoPE as real pairs, attention without cuDNN: the family's prepare_compile) replay the
    rollout exactly and train on finite gradients (their values: tests/test_compile21_gradients.py)."""
    from imagerl.families.qwen_image21.tiny import make_tiny_qwen_image21
    from imagerl.train import train

    checkpoint = make_tiny_qwen_image21(tmp_path / "tiny21")
    train(tiny_config(checkpoint, tmp_path / "run", "model.device=cuda", "model.dtype=bfloat16",
                      "parallel.compile=true", "train.num_rollouts=3", "sample.guidance_scale=1.0", *overrides))
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["train/log_prob_mean_abs_diff"] == 0.0 for r in records)
    assert all(torch.isfinite(torch.tensor(r["train/grad_norm"])) for r in records if "train/grad_norm" in r)


@pytest.mark.parametrize("family_name", ["qwen_image", "qwen_image21", "sd3"])
def test_every_family_trains_on_policy_compiled_in_bf16_on_gpu(tmp_path, family_name):
    """The family contract's exact replay (tests/test_family_contract.py, CPU) on a GPU: regional compile, bf16,
    merged LoRA off the window, training batch smaller than the rollout's: lp diff exactly 0, finite gradients."""
    from imagerl.families.registry import FAMILIES, _import_builtin
    from imagerl.train import train

    _import_builtin()
    cls = FAMILIES[family_name]
    checkpoint = cls.build_tiny_checkpoint(tmp_path / f"tiny-{family_name}")
    guidance = "1.0" if family_name == "qwen_image21" else "4.0"  # 2.1 samples without CFG (its recipes)
    train(tiny_config(checkpoint, tmp_path / "run", "model.device=cuda", "model.dtype=bfloat16",
                      "parallel.compile=true", "train.num_rollouts=3", f"sample.guidance_scale={guidance}",
                      "sample.batch_size=4", "train.batch_size=2", "sample.merge_lora=true"))
    records = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and all(r["train/log_prob_mean_abs_diff"] == 0.0 for r in records)
    assert all(torch.isfinite(torch.tensor(r["train/grad_norm"])) for r in records if "train/grad_norm" in r)
