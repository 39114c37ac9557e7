"""`imagerl bench` on the CPU (--dry-run: the same code path with 1-layer models at 64 px): the baseline and
imagerl rows, their exact on-policy replay, the JSON record, the profile and the CLI's argument errors.
The real measurements need the H200 (benchmarks/LOG.md)."""

import json

import pytest
import torch

from imagerl.cli import main
from imagerl.perf.bench import run_bench


@pytest.fixture(scope="module")
def dry_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    lines = []
    variants = {"imagerl grouped": ["model.group_text_lengths=true"],
                "imagerl merged, train b1": ["sample.merge_lora=true", "train.batch_size=1"]}
    rows = run_bench("qwen_image", variants, warmup=0, iterations=1,
                     dry=True, out=out, profiles=[[]], echo=lines.append)
    return rows, out, "\n".join(lines)


def test_dry_bench_runs_baseline_and_imagerl_on_policy(dry_bench):
    rows, out, printed = dry_bench
    assert [r.name for r in rows] == ["baseline (diffusers+peft)", "imagerl grouped", "imagerl merged, train b1"]
    for r in rows:
        assert r.images_per_s > 0 and r.rollout_images_per_s > r.images_per_s and r.train_pairs_per_s > 0
        assert r.rollout_s + r.train_s <= r.total_s + 1e-6
        assert r.log_prob_mean_abs_diff == 0.0  # frozen weights at the first optimizer step: exact replay
        assert r.rollout_mfu > 0 and r.train_mfu > 0 and r.text_tokens > 0
        # garbage-collection pauses within each measured iteration, the baseline's too
        assert all(0 <= t["gc_pause_s"] < t["total_s"] and t["gc_full_collections"] >= 0 for t in r.per_iteration)
    for r in rows[1:]:  # imagerl rows, warmup 0: the first iteration's collection before gc.freeze() is in its total
        first = r.per_iteration[0]
        assert first["total_s"] > first["rollout_s"] + first["reward_s"] + first["train_s"]
        assert first["gc_full_collections"] >= 1
    record = json.loads((out / "bench_qwen_image.json").read_text())
    assert [r["name"] for r in record["rows"]] == [r.name for r in rows]
    assert record["matmul_ceiling_flops"] > 0 and record["vae_bf16"]["pixel_abs_diff_max"] > 0
    assert "x baseline" in printed and "imagerl grouped" in (out / "bench_qwen_image.md").read_text()


def test_dry_bench_profile_lists_operators(dry_bench):
    _, out, printed = dry_bench
    profile = (out / "profile_qwen_image.txt").read_text()
    assert "rollout forward (defaults; batch 2)" in profile and "training forward+backward" in profile
    assert "aten::" in profile and profile in printed


def test_the_shared_transformer_is_returned_to_its_plain_state(tmp_path):
    """Variants share one transformer: after each, no LoRA, no checkpointing, no compile wrapper, fp32 VAE."""
    from imagerl.perf.bench import Bench

    bench = Bench("qwen_image", torch.device("cpu"), True, tmp_path, warmup=0, iterations=1)
    bench.run_imagerl("bf16 vae", ["model.vae_dtype=bfloat16", "train.lr=0"], ceiling=1e12)
    t = bench.transformer
    assert not any("lora" in name for name, _ in t.named_parameters())
    assert not t.is_gradient_checkpointing and bench.vae.dtype == torch.float32
    assert all(block._compiled_call_impl is None for block in t.transformer_blocks)


@pytest.mark.parametrize("argv, message", [
    (["bench", "--dry-run", "--variant", ":model.vae_dtype=bfloat16"], "must look like 'name:section.key=value"),
    (["bench", "--dry-run", "--variant", "recipe (compile: batch 8):"], "a name cannot contain ':'"),
    (["bench", "--dry-run", "--family", "sdxl"], "unknown family 'sdxl'"),
    # checked before any model is built: a bad variant after good ones must not cost the good ones' GPU time
    (["bench", "--dry-run", "--variant", "ok:", "--variant", "b16:sample.batch_size=4,train.num_optimizer_steps=8"],
     "variant 'b16': 1 training batches per rank (of 4 samples) cannot be split evenly"),
])
def test_bench_cli_rejects_bad_arguments(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bench_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU .*--dry-run"):
        run_bench("qwen_image", {}, baseline=False)


def test_dry_bench_qwen_image21_counts_flops_with_and_without_kv_cache(tmp_path):
    # the recipe's off-window steps run merged (no LoRA FLOPs there) and KV-cached, and it trains without
    # checkpointing; unmerged, uncached and checkpointed, its FLOPs are the baseline's
    rows = run_bench("qwen_image21", {"imagerl": ["sample.merge_lora=false", "sample.kv_cache=false",
                                                  "model.gradient_checkpointing=true"],
                                      "kv cache": ["sample.kv_cache=true"]},
                     warmup=0, iterations=1,
                     dry=True, out=tmp_path, echo=lambda *_: None)
    # the baseline: the 2.1 diffusers + peft loop (perf/baseline21.py) on QwenImage21Pipeline around the shared modules
    assert [r.name for r in rows] == ["baseline (diffusers+peft)", "imagerl", "kv cache"]
    for r in rows:
        assert r.images_per_s > 0 and r.train_pairs_per_s > 0
        assert r.rollout_mfu > 0 and r.train_mfu > 0 and r.log_prob_mean_abs_diff == 0.0
    # the pipeline's encode_prompt and imagerl's encoder give the same text length (the same prompt, no padding)
    assert rows[0].text_tokens == rows[1].text_tokens > 0
    # and the baseline's FLOPs are the recipe row's (no CFG row, every block checkpointed, no KV cache, LoRA unmerged)
    flops = [(r.rollout_mfu * r.rollout_s, r.train_mfu * r.train_s) for r in rows[:2]]
    assert flops[0] == pytest.approx(flops[1], rel=1e-9)


def test_phase_probe_dry_run_times_each_kind_of_rollout_call(tmp_path):
    """benchmarks/phase_probe.py (the H200 runs N-P of benchmarks/LOG.md) on the CPU: host-clock events."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "phase_probe.py"
    done = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--iterations", "1", "--dry-run"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "probe.json").read_text())
    assert len(record["rollout"]) == 2  # the warm-up and the measured iteration
    kinds = record["rollout"][-1]["by_kind"]
    for kind in ("velocity merged", "velocity window", "decode", "encode", "merge build"):
        assert any(k.startswith(kind) and v["ms"] >= 0 and v["calls"] >= 1 for k, v in kinds.items()), kind
    assert record["merge_build_ms"][0][0] == "previous formula" and record["merge_build_ms"][0][1] > 0
    assert len(record["train"]) >= 1 and all(ms > 0 for ms in record["train"][-1]["gpu_ms"])
    assert "training phase" in done.stdout and "rollout |" in done.stdout


def test_dry_bench_diffusion_nft_rows_beside_the_flow_grpo_recipe(tmp_path):
    """--algorithm diffusion_nft: the NFT recipe with and without timestep staging beside the family's Flow-GRPO
    recipe (each variant's recipe=NAME), with the NFT FLOP count (10 ODE steps per image; per trained timestep the
    policy's forward + backward and the old policy's and reference's forwards)."""
    from imagerl.perf.bench import NFT_VARIANTS

    rows = run_bench("qwen_image", None, baseline=False, warmup=0, iterations=1, dry=True, out=tmp_path,
                     echo=lambda *_: None, algorithm="diffusion_nft")
    assert [r.name for r in rows] == list(NFT_VARIANTS["qwen_image"])
    grpo, nft, staged = rows
    assert grpo.log_prob_mean_abs_diff == 0.0 and nft.log_prob_mean_abs_diff != nft.log_prob_mean_abs_diff  # nan
    for r in (nft, staged):
        assert r.images_per_s > 0 and r.rollout_mfu > 0 and r.train_mfu > 0
    assert nft.train_pairs_per_s > 0  # pairs: samples x trained timesteps (10 of the dry run's 6-step grid: 6)
    with pytest.raises(ValueError, match="unknown algorithm 'ppo'"):
        run_bench("qwen_image", None, dry=True, algorithm="ppo")


def test_bench_builder_with_blocks_keeps_the_released_block_dims():
    """`blocks` (benchmarks/depth_bench.py: the qwen_image recipe on an 80 GB card; the 2.1 compile probes): that
    many blocks of the released width instead of the whole released model, the text encoder shrunk to as many
    layers."""
    from imagerl.perf.real_size import build_qwen_image

    transformer, _, text_encoder, _ = build_qwen_image("meta", ["a prompt"], blocks=1)
    assert len(transformer.transformer_blocks) == 1
    assert transformer.config.num_attention_heads == 24 and transformer.config.attention_head_dim == 128  # released
    assert text_encoder.config.text_config.num_hidden_layers == 1


def test_dry_bench_sd3_runs_flow_grpos_sd3_loop_beside_imagerl(tmp_path):
    """`imagerl bench --family sd3` on the CPU: the baseline is flow_grpo's train_sd3.py loop on
    StableDiffusion3Pipeline (perf/bench_sd3.py); both replay exactly and, with the same settings (every SDE step
    unmerged, no checkpointing), count the same FLOPs; the text length is CLIP's 77 + T5's cap."""
    rows = run_bench("sd3", {"imagerl": [], "merged": ["sample.merge_lora=true"]}, warmup=0, iterations=1, dry=True,
                     out=tmp_path, echo=lambda *_: None)
    assert [r.name for r in rows] == ["baseline (diffusers+peft)", "imagerl", "merged"]
    for r in rows:
        assert r.images_per_s > 0 and r.train_pairs_per_s > 0 and r.rollout_mfu > 0 and r.train_mfu > 0
        assert r.log_prob_mean_abs_diff == 0.0
    assert rows[0].text_tokens == rows[1].text_tokens == 77 + 128
    flops = [(r.rollout_mfu * r.rollout_s, r.train_mfu * r.train_s) for r in rows[:2]]
    assert flops[0] == pytest.approx(flops[1], rel=1e-9)
    assert rows[2].rollout_mfu * rows[2].rollout_s < flops[1][0]  # the merged ODE step runs no LoRA matmuls


def test_counted_flops_of_sd3_match_the_mmdit_formula():
    """perf/counted_flops.py on SD3.5-Medium's released config (meta device): per block of an image of I tokens and
    L text tokens, 2 x 12 D^2 per token (q, k, v, out, 4x MLP) + 4 D (I + L)^2 joint attention, + 8 D^2 I + 4 D I^2
    for the 13 dual-attention blocks' second attention; the last block has no text output or MLP; the LoRA on the
    8 attention projections 2 r (D + D) per row each (the last block's to_add_out has no text output)."""
    from diffusers import SD3Transformer2DModel

    from imagerl.perf.bench_sd3 import SD35_MEDIUM, _meta_inputs
    from imagerl.perf.counted_flops import counted_forward_flops

    config = SD35_MEDIUM
    d, layers, image, text, r = 1536, 24, 1024, 205, 32
    counted = counted_forward_flops(SD3Transformer2DModel, config, _meta_inputs, (64, text))
    blocks = (layers * (24 * d * d * image + 4 * d * (image + text) ** 2)  # image stream + joint attention
              + (layers - 1) * 24 * d * d * text + 2 * 3 * d * d * text  # text stream (the last: q, k, v only)
              + 13 * (8 * d * d * image + 4 * d * image * image))  # dual attention: q, k, v, out and attention
    assert counted == pytest.approx(blocks, rel=0.005)  # the rest (0.2 %): embedders, modulation, projections
    lora = counted_forward_flops(SD3Transformer2DModel, config, _meta_inputs, (64, text), r,
                                 ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                                  "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")) - counted
    per_row = 2 * r * 2 * d
    assert lora == 4 * per_row * image * layers + 3 * per_row * text * layers + per_row * text * (layers - 1)


def test_dry_bench_flux_runs_a_dancegrpo_style_loop_beside_imagerl(tmp_path):
    """`imagerl bench --family flux` on the CPU: one row per sample (the distilled guidance is an input, no negative
    prompt), T5 at the geometry's cap; the baseline (perf/bench_flux.py on FluxPipeline) and imagerl with every
    block checkpointed and the LoRA unmerged count the same FLOPs, and both replay exactly."""
    rows = run_bench("flux", {"imagerl": ["model.checkpoint_blocks=0"]}, warmup=0, iterations=1, dry=True,
                     out=tmp_path, echo=lambda *_: None, profiles=[[]])
    assert [r.name for r in rows] == ["baseline (diffusers+peft)", "imagerl"]
    assert "rollout forward (defaults; batch 2)" in (tmp_path / "profile_flux.txt").read_text()
    for r in rows:
        assert r.images_per_s > 0 and r.train_pairs_per_s > 0 and r.rollout_mfu > 0 and r.train_mfu > 0
        assert r.log_prob_mean_abs_diff == 0.0
    assert rows[0].text_tokens == rows[1].text_tokens == 64  # the dry geometry's T5 cap; no pooled row counted
    flops = [(r.rollout_mfu * r.rollout_s, r.train_mfu * r.train_s) for r in rows]
    assert flops[0] == pytest.approx(flops[1], rel=1e-9)


def test_a_compile_failure_is_a_row_not_the_end_of_the_bench(tmp_path, monkeypatch):
    """A profile or variant whose graphs the compiler rejects (torch 2.11's Inductor tiling assertion on FLUX.1's
    blocks ended a whole device call, benchmarks/LOG.md run AZ) is reported in one line; the other variants run."""
    import torch._dynamo.exc

    import imagerl.perf.bench as bench_module

    def rejected(*args, **kwargs):
        raise torch._dynamo.exc.TorchDynamoException("AssertionError: \n\nSet TORCH_LOGS=+dynamo for more")

    run_imagerl = bench_module.Bench.run_imagerl

    def run_or_reject(self, name, overrides, ceiling):
        return rejected() if name == "rejected" else run_imagerl(self, name, overrides, ceiling)

    monkeypatch.setattr("imagerl.perf.profile.profile_step", rejected)
    monkeypatch.setattr(bench_module.Bench, "run_imagerl", run_or_reject)
    lines = []
    rows = run_bench("qwen_image", {"rejected": [], "imagerl": []}, baseline=False, warmup=0, iterations=1,
                     dry=True, out=tmp_path, profiles=[["parallel.compile=true"]], echo=lines.append)
    printed = "\n".join(lines)
    assert "profile parallel.compile=true: compile failed: TorchDynamoException: AssertionError:" in printed
    assert [r.name for r in rows] == ["rejected", "imagerl"]
    assert rows[0].note.startswith("compile failed") and rows[0].images_per_s != rows[0].images_per_s  # nan
    assert rows[1].images_per_s > 0 and rows[1].log_prob_mean_abs_diff == 0.0
    record = json.loads((tmp_path / "bench_qwen_image.json").read_text())
    assert record["rows"][0]["note"].startswith("compile failed")


def test_the_profile_counts_each_gpu_kernel_once():
    """Inductor's "## Call CompiledFxGraph ##" ranges carry the device time of the kernels they launched: counted
    with those kernels, a compiled step's kernel time exceeded its wall time (benchmarks/LOG.md run BA)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from imagerl.perf.profile import device_kernels

    def event(key, device_type=DeviceType.CUDA, us=100.0):
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=us)

    averages = [event("## Call CompiledFxGraph fabc ##", us=300.0), event("triton_poi_fused_add_0"),
                event("nvjet_sm90_tst_192x192"), event("aten::mm", DeviceType.CPU), event("idle kernel", us=0.0)]
    assert [e.key for e in device_kernels(averages)] == ["triton_poi_fused_add_0", "nvjet_sm90_tst_192x192"]


def test_the_profile_counts_only_scalar_reads_of_cuda_tensors_as_host_syncs():
    """A scalar read (aten::item) waits for the GPU only on a CUDA tensor: the copy to the host and the
    cudaStreamSynchronize under it. The compiled FLUX.1 forward's 709 aten::item read CPU scalars (no CUDA sync was
    reported there, benchmarks/LOG.md run BC), which the profile counted as host syncs."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from imagerl.perf.profile import host_syncs

    events = []

    def event(name, *children, device_type=DeviceType.CPU, kernels=()):
        e = SimpleNamespace(name=name, device_type=device_type, cpu_children=list(children), cpu_parent=None,
                            kernels=list(kernels))
        for child in children:
            child.cpu_parent = e
        events.append(e)
        return e

    event("aten::item", event("aten::_local_scalar_dense", event("cudaMemcpyAsync"), event("cudaStreamSynchronize"),
                              kernels=["Memcpy DtoH (Device -> Pageable)"]))  # a CUDA tensor's
    for _ in range(3):  # CPU scalars'
        event("aten::item", event("aten::_local_scalar_dense"))
    event("aten::_local_scalar_dense")
    event("aten::copy_", event("cudaMemcpyAsync", kernels=["Memcpy HtoD"]))  # an asynchronous copy: no sync
    event("cudaDeviceSynchronize")
    event("cudaStreamSynchronize_ptsz")
    event("Memcpy DtoH (Device -> Pageable)", device_type=DeviceType.CUDA)
    assert host_syncs(events) == ({"aten::item (CUDA tensor)": 1, "cudaDeviceSynchronize": 1,
                                   "cudaStreamSynchronize_ptsz": 1}, 4)
