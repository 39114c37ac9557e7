"""perf/memory_estimate.py: the estimated peak against the peaks measured on H100 and H200 cards (the bench's JSON
records under benchmarks/runs/, summarized in benchmarks/LOG.md), and the refusal of a run that cannot fit."""

import json
from pathlib import Path

import pytest
import torch

from imagerl.config import load_config
from imagerl.perf.bench import GEOMETRY
from imagerl.perf.memory_estimate import (GIB, USABLE_FRACTION, ModelDims, check_memory, estimate_memory,
                                          settings_that_fit)

RUNS = Path(__file__).resolve().parent.parent / "benchmarks" / "runs"
TEXT_TOKENS = 48  # the bench's 43-token prompts, padded to a multiple of 8 under compile
H100_BYTES = int(79.18 * GIB)  # torch.cuda.mem_get_info's total on the H100 80GB HBM3 of runs AF-AI

FLOW = ["sample.guidance_scale=4.0"]
NFT = ["train.algorithm=diffusion_nft", "sample.guidance_scale=1.0"]
GC = ["model.gradient_checkpointing=true", "model.checkpoint_every=1"]
NO_GC = ["model.gradient_checkpointing=false"]
MERGED, UNMERGED = ["sample.merge_lora=true"], ["sample.merge_lora=false"]
TE_OFF = ["model.text_encoder_offload=true"]
# (run, row name in its JSON, blocks, recipe, the row's effective settings then): every setting that moves memory
# is spelled out, so a later change of a recipe does not change the row
MEASURED = [
    ("2026-12-03-I", "b8 merged", 60, "qwen_image_jpeg",
     FLOW + MERGED + GC + ["sample.batch_size=8", "train.batch_size=8"]),
    ("2026-12-03-I", "b16 t8 merged", 60, "qwen_image_jpeg",
     FLOW + MERGED + GC + ["sample.batch_size=16", "train.batch_size=8"]),
    ("2026-12-03-I", "b16 t8 merged ckpt2", 60, "qwen_image_jpeg",
     FLOW + MERGED + ["model.gradient_checkpointing=true", "model.checkpoint_every=2", "sample.batch_size=16",
                      "train.batch_size=8"]),
    ("2026-12-04-P", "recipe", 60, "qwen_image_jpeg",
     FLOW + MERGED + NO_GC + ["sample.batch_size=16", "train.batch_size=4"]),
    ("2026-12-04-S", "flow_grpo recipe", 60, "qwen_image_jpeg",
     FLOW + MERGED + NO_GC + ["sample.batch_size=16", "train.batch_size=4"]),
    ("2026-12-04-S", "diffusion_nft recipe (rollout batch 16)", 60, "qwen_image_nft_ocr",
     NFT + MERGED + NO_GC + ["sample.batch_size=16", "train.batch_size=4"]),
    ("2026-12-04-S", "diffusion_nft, train 8 checkpoint every 2", 60, "qwen_image_nft_ocr",
     NFT + MERGED + ["model.gradient_checkpointing=true", "model.checkpoint_every=2", "sample.batch_size=16",
                     "train.batch_size=8"]),
    ("2026-12-06-AE", "recipe", 30, "qwen_image_jpeg",
     FLOW + MERGED + NO_GC + ["sample.batch_size=16", "train.batch_size=4"]),
    ("2026-12-06-AE", "recipe, off-window FP8", 30, "qwen_image_jpeg",
     FLOW + MERGED + NO_GC + ["sample.off_window_fp8=true", "sample.batch_size=16", "train.batch_size=4"]),
    ("2026-12-06-AH", "80gb recipe (b8 unmerged, t4 ckpt)", 60, "qwen_image_jpeg",
     FLOW + UNMERGED + GC + ["sample.batch_size=8", "train.batch_size=4"]),
    ("2026-12-06-AI", "nft 80gb (b16 unmerged, t4 ckpt)", 60, "qwen_image_nft_ocr",
     NFT + UNMERGED + GC + ["sample.batch_size=16", "train.batch_size=4"]),
    ("2026-12-06-AK", "TE off, b16 merged FP8, t4 ckpt first 40", 60, "qwen_image_jpeg",
     FLOW + MERGED + GC + TE_OFF + ["sample.off_window_fp8=true", "sample.batch_size=16", "train.batch_size=4",
                                    "model.checkpoint_blocks=40"]),
    ("2026-12-06-AK", "TE off, b16 merged FP8, t4 ckpt all", 60, "qwen_image_jpeg",
     FLOW + MERGED + GC + TE_OFF + ["sample.off_window_fp8=true", "sample.batch_size=16", "train.batch_size=4",
                                    "model.checkpoint_blocks=0"]),
    ("2026-12-06-AL", "nft TE off, t8 ckpt first 45", 60, "qwen_image_nft_ocr",
     NFT + UNMERGED + GC + TE_OFF + ["sample.batch_size=16", "train.batch_size=8", "model.checkpoint_blocks=45"]),
    ("2026-12-06-AL", "nft TE off, t8 ckpt all", 60, "qwen_image_nft_ocr",
     NFT + UNMERGED + GC + TE_OFF + ["sample.batch_size=16", "train.batch_size=8", "model.checkpoint_blocks=0"]),
    # runs AN and AO: the rollout's VAE decode 2 images at a time (sample.decode_batch_size)
    ("2026-12-06-AN", "t8 first 52, decode 2", 60, "qwen_image_jpeg",
     FLOW + MERGED + GC + TE_OFF + ["sample.off_window_fp8=true", "sample.batch_size=16", "train.batch_size=8",
                                    "model.checkpoint_blocks=52", "sample.decode_batch_size=2"]),
    ("2026-12-06-AN", "t8 ckpt all, decode 2", 60, "qwen_image_jpeg",
     FLOW + MERGED + GC + TE_OFF + ["sample.off_window_fp8=true", "sample.batch_size=16", "train.batch_size=8",
                                    "model.checkpoint_blocks=0", "sample.decode_batch_size=2"]),
    ("2026-12-06-AN", "t8 first 50, decode 2", 60, "qwen_image_jpeg",
     FLOW + MERGED + GC + TE_OFF + ["sample.off_window_fp8=true", "sample.batch_size=16", "train.batch_size=8",
                                    "model.checkpoint_blocks=50", "sample.decode_batch_size=2"]),
    ("2026-12-06-AO", "nft merged FP8, decode 2, t8 first 45", 60, "qwen_image_nft_ocr",
     NFT + MERGED + GC + TE_OFF + ["sample.off_window_fp8=true", "sample.batch_size=16", "train.batch_size=8",
                                   "model.checkpoint_blocks=45", "sample.decode_batch_size=2"]),
]


@pytest.fixture(scope="module")
def released_dims():
    """ModelDims of the bench's released-size qwen_image (and of its 30-block depth_bench model), built on the meta
    device: the real architectures' parameter counts, no memory."""
    from imagerl.families.qwen_image import QwenImageFamily
    from imagerl.perf.real_size import build_qwen_image

    dims = {}
    for blocks in (None, 30):
        transformer, vae, text_encoder, _ = build_qwen_image(torch.device("meta"), ["a cat"], blocks=blocks)
        dims[blocks or 60] = ModelDims.from_modules(transformer, text_encoder, vae, 64,
                                                    QwenImageFamily.lora_target_modules, image_tokens=1024)
    return dims


def _measured_peak(run: str, row: str) -> float:
    path = next((RUNS / run).rglob("bench_qwen_image.json"))
    rows = {r["name"]: r for r in json.loads(path.read_text())["rows"]}
    return rows[row]["peak_gib"]


def _config(recipe: str, settings: list[str]):
    return load_config(recipe, GEOMETRY + settings)


def test_released_dims_are_the_released_model(released_dims):
    dims = released_dims[60]
    assert dims.transformer_bytes / 2 == pytest.approx(20.43e9, rel=0.01)  # 20.43 B bf16 parameters (LOG.md)
    assert dims.lora_params == pytest.approx(0.425e9, rel=0.01)  # r64 on the 12 targets
    assert dims.merge_target_params == pytest.approx(13.6e9, rel=0.01)  # the merged copies: 27 GB in bf16
    assert (dims.blocks, dims.hidden, dims.latent_values) == (60, 3072, 1024 * 64)


@pytest.mark.parametrize("run, row, blocks, recipe, settings", MEASURED, ids=[f"{m[0]}:{m[1]}" for m in MEASURED])
def test_estimate_is_within_10_percent_of_the_measured_peak(released_dims, run, row, blocks, recipe, settings):
    measured = _measured_peak(run, row)
    estimate = estimate_memory(_config(recipe, settings), released_dims[blocks], text_tokens=TEXT_TOKENS)
    print(f"{run} {row}: estimated {estimate.gib():.1f} GiB, measured {measured:.1f} GiB")
    assert estimate.gib() == pytest.approx(measured, rel=0.10)


def test_what_ran_out_of_memory_on_an_h100_is_refused_there_and_what_fit_is_not(released_dims):
    """Run AG: rollout batch 8 with the merged copies in FP8, training batch 4 with checkpointing: out of memory on
    the H100 (76.4 GiB allocated when it failed); run AH, the same unmerged: 67.3 GiB."""
    dims = released_dims[60]
    settings = FLOW + GC + ["sample.batch_size=8", "train.batch_size=4"]
    oom = estimate_memory(_config("qwen_image_jpeg", settings + MERGED + ["sample.off_window_fp8=true"]), dims,
                          text_tokens=TEXT_TOKENS)
    fit = estimate_memory(_config("qwen_image_jpeg", settings + UNMERGED), dims, text_tokens=TEXT_TOKENS)
    assert oom.peak > H100_BYTES * USABLE_FRACTION >= fit.peak


def test_run_aks_row_out_of_memory_is_refused_on_an_h100_and_the_recipes_rows_are_not(released_dims):
    """Run AK: with the encoder off the card, recomputing only the first 35 blocks went out of memory (74.5 GiB
    allocated, 3.6 GiB more reserved by the allocator, estimated 73.9); the first 40 fit (70.3 GiB)."""
    dims = released_dims[60]
    settings = FLOW + MERGED + GC + TE_OFF + ["sample.off_window_fp8=true", "sample.batch_size=16", "train.batch_size=4"]
    usable = H100_BYTES * USABLE_FRACTION
    for blocks, fits in ((35, False), (40, True)):
        estimate = estimate_memory(_config("qwen_image_jpeg", settings + [f"model.checkpoint_blocks={blocks}"]), dims,
                                   text_tokens=TEXT_TOKENS)
        assert (estimate.peak <= usable) == fits, blocks
    for recipe in ("qwen_image_jpeg_80gb", "qwen_image_nft_ocr_80gb", "qwen_image_awm_ocr_80gb",
                   "qwen_image_dppo_ocr_80gb"):  # their own geometry, the text at its cap
        assert estimate_memory(load_config(recipe, []), dims).peak <= usable, recipe


def test_the_text_encoder_off_the_gpu_makes_room_for_run_ags_merged_copies(released_dims):
    """model.text_encoder_offload: the encoder (14 GiB) leaves the static part; it is on the GPU only while prompts
    are encoded, before the rollout's merged copies exist. Run AG's configuration then fits an H100 and is the first
    setting suggested for it."""
    dims = released_dims[60]
    settings = FLOW + GC + MERGED + ["sample.off_window_fp8=true", "sample.batch_size=8", "train.batch_size=4"]
    on = estimate_memory(_config("qwen_image_jpeg", settings), dims, text_tokens=TEXT_TOKENS)
    off = estimate_memory(_config("qwen_image_jpeg", settings + ["model.text_encoder_offload=true"]), dims,
                          text_tokens=TEXT_TOKENS)
    assert on.static - off.static == dims.text_encoder_bytes == pytest.approx(14.19 * GIB, rel=0.01)
    assert on.rollout - off.rollout == dims.text_encoder_bytes
    assert off.host - on.host == dims.text_encoder_bytes  # the pinned host copy
    assert off.peak <= H100_BYTES * USABLE_FRACTION < on.peak
    fits = settings_that_fit(_config("qwen_image_jpeg", settings), dims, int(H100_BYTES * USABLE_FRACTION))
    assert fits[0][0] == ("model.text_encoder_offload=true",)


def test_settings_that_fit_an_80gb_card_fit_it(released_dims):
    cfg = _config("qwen_image_jpeg", [])  # the H200 recipe: 121 GiB
    assert estimate_memory(cfg, released_dims[60]).peak > H100_BYTES
    fits = settings_that_fit(cfg, released_dims[60], int(H100_BYTES * USABLE_FRACTION))
    assert fits and all(e.peak <= H100_BYTES * USABLE_FRACTION for _, e in fits)
    print([" ".join(o) for o, _ in fits])


def test_the_samples_kept_grow_with_the_group(released_dims):
    """What the rollout keeps per sample (noise, the window's latents, images) is in the estimate."""
    small = estimate_memory(_config("qwen_image_jpeg", ["sample.group_size=16"]), released_dims[60])
    large = estimate_memory(_config("qwen_image_jpeg", ["sample.group_size=32"]), released_dims[60])
    per_sample = (large.samples - small.samples) / 16  # the bench geometry: one prompt
    # initial noise + 2 window steps in and out (float32 latents) + 2 float32 log-probs
    assert per_sample == 1024 * 64 * 4 * (1 + 2 * 2) + 4 * 2
    assert large.host - small.host == 16 * 3 * 512 * 512 * 4  # the float32 images on the CPU


@pytest.fixture(scope="module")
def quickstart():
    from imagerl.components import load_adapter
    from imagerl.distributed.parallel import World

    world = World(0, 1, torch.device("cpu"))
    return load_adapter(load_config("quickstart", ["model.device=cpu"]), world), world


def test_a_group_too_large_for_this_machine_is_refused_before_it_allocates(quickstart):
    from imagerl.perf.memory_estimate import _host_available

    adapter, world = quickstart
    # 200000 (16 x 200000 images of 64 x 64 in float32: 146 GiB), or more on a machine with more memory
    group = max(200000, 2 * _host_available() // (16 * 3 * 64 * 64 * 4))
    cfg = load_config("quickstart", ["model.device=cpu", f"sample.group_size={group}"])
    with pytest.raises(ValueError, match=r"estimated peak [\d.]+ GiB .*device has [\d.]+ GiB.*settings that fit: "
                                         r"sample.group_size=(\d+)") as error:
        check_memory(cfg, adapter, world)
    # the suggestion fits: it passes the same check
    suggested = int(error.value.args[0].split("sample.group_size=")[1].split()[0])
    assert 2 <= suggested < group
    check_memory(load_config("quickstart", ["model.device=cpu", f"sample.group_size={suggested}"]), adapter, world)


def test_the_quickstart_fits(quickstart):
    adapter, world = quickstart
    check_memory(load_config("quickstart", ["model.device=cpu"]), adapter, world)


def test_flux_dims_count_the_frozen_token_linears_that_off_window_fp8_copies():
    """FLUX.1-dev (19 double-, 38 single-stream blocks, hidden 3072, MLP 12288) with DanceGRPO's attention-only LoRA
    (flux_ocr): the merged targets are the image stream's q/k/v/out and the single blocks' q/k/v; sample.off_window_fp8
    also copies the text stream's projections, both MLPs and the single blocks' proj_mlp / proj_out in e4m3."""
    from diffusers import FluxTransformer2DModel

    from imagerl.families.flux import FluxFamily
    from imagerl.perf.bench_flux import FLUX_DEV

    with torch.device("meta"):
        transformer = FluxTransformer2DModel(**FLUX_DEV)
    dims = ModelDims.from_modules(transformer, None, None, 128, ("to_k", "to_q", "to_v", "to_out.0"), 1024,
                                  true_cfg=False, token_linears=FluxFamily.token_linears)
    d, mlp = 3072, 12288
    assert dims.merge_target_params == 19 * 4 * d * d + 38 * 3 * d * d
    assert dims.frozen_token_params == 19 * (4 * d * d + 2 * 2 * d * mlp) + 38 * (d * mlp + (d + mlp) * d)
    assert dims.blocks == 57 and not dims.true_cfg


# (run, family, row name in its JSON): the sd3 and flux rows of `imagerl bench` at its geometry (perf/bench.py
# geometry(), the row's own overrides on top)
MEASURED_FAMILIES = [
    ("2026-12-07-AR", "sd3", "imagerl (sd3_5_ocr, compile, batch 8)"),
    ("2026-12-07-AR", "sd3", "imagerl, rollout 16, train 8"),
    ("2026-12-07-AX", "flux", "flux_ocr (compile, batch 4, every block checkpointed)"),
    ("2026-12-07-AX", "flux", "rollout 4 merged FP8 (every token linear)"),
    ("2026-12-07-AX", "flux", "rollout 16 merged FP8 (every token linear), first 30 of 57 checkpointed"),
]


@pytest.fixture(scope="module")
def family_dims():
    """ModelDims of the bench's released-size SD3.5-Medium and FLUX.1-dev (perf/bench_sd3.py, bench_flux.py) on the
    meta device, by family and LoRA targets."""
    from imagerl.families.registry import FAMILIES, _import_builtin
    from imagerl.perf.bench import family_module

    _import_builtin()
    cache = {}

    def dims(family: str, targets: tuple[str, ...], rank: int) -> ModelDims:
        if (family, targets, rank) not in cache:
            transformer, vae, encoders, _ = family_module(family).build(torch.device("meta"), ["a cat"])
            cls = FAMILIES[family]
            cache[family, targets, rank] = ModelDims.from_modules(
                transformer, torch.nn.ModuleList(encoders), vae, rank, targets, image_tokens=1024,
                true_cfg=cls.true_cfg, token_linears=cls.token_linears)
        return cache[family, targets, rank]

    return dims


@pytest.mark.parametrize("run, family, row", MEASURED_FAMILIES, ids=[f"{m[0]}:{m[2]}" for m in MEASURED_FAMILIES])
def test_sd3_and_flux_estimates_are_within_10_percent_of_the_measured_peak(family_dims, run, family, row):
    """Fitted on Qwen-Image alone, the coefficients put SD3.5-Medium's and FLUX.1-dev's bench peaks 4-7 % high
    (the conservative side): FLUX.1's text is its T5 padded to 512 tokens, SD3's its three encoders' rows."""
    from imagerl.families.registry import FAMILIES, _import_builtin
    from imagerl.perf.bench import geometry, variant_config

    _import_builtin()
    record = json.loads((RUNS / run / "bench" / f"bench_{family}.json").read_text())
    measured = next(r for r in record["rows"] if r["name"] == row)
    cfg = variant_config(family, geometry(family, False), measured["overrides"])
    targets = tuple(cfg.model.lora_target_modules or FAMILIES[family].lora_target_modules)
    estimate = estimate_memory(cfg, family_dims(family, targets, cfg.model.lora_rank),
                               text_tokens=measured["text_tokens"])
    print(f"{run} {row}: estimated {estimate.gib():.1f} GiB, measured {measured['peak_gib']:.1f} GiB")
    assert estimate.gib() == pytest.approx(measured["peak_gib"], rel=0.10)
    assert estimate.gib() >= measured["peak_gib"]
