"""The family contract: every registered family passes these checks on a tiny random checkpoint it builds itself in
the hub's diffusers layout (Family.build_tiny_checkpoint). docs/adding_a_family.md says what a family implements.

1. its checkpoint is in the layout its diffusers pipeline saves and loads, and resolves to the family;
2. its ODE sampler equals its diffusers pipeline from the same noise (fp32, <= 1e-5), with and without CFG;
3. Flow-GRPO's replay is exact (train/log_prob_mean_abs_diff 0) in fp32 and in bf16;
4. a DiffusionNFT update runs and moves the LoRA;
5. the LoRA export loads with the pipeline's load_lora_weights and samples the images imagerl samples;
6. a resumed run equals the uninterrupted one bit for bit;
7. regional compile (torch.compile of each block) runs on a CPU and keeps the replay exact;
8. 2 gloo ranks give what 1 process gives;
9. sample.off_window_fp8 runs every one of its token_linears as an FP8 GEMM (merged LoRA targets and frozen layers).
"""

import json

import pytest
import torch

from conftest import tiny_config
from imagerl.families.registry import FAMILIES, _import_builtin, resolve_family, tiny_families

_import_builtin()
NAMES = sorted(FAMILIES)
PROMPTS = ["a red circle above a blue square", "a photo of a cat"]
H = W = 64


@pytest.fixture(scope="module", params=NAMES)
def family(request, tmp_path_factory):
    """(family class, its tiny checkpoint)."""
    cls = FAMILIES[request.param]
    return cls, cls.build_tiny_checkpoint(tmp_path_factory.mktemp(request.param) / f"tiny-{request.param}")


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _lora(run, step):
    from safetensors.torch import load_file

    return load_file(run / "checkpoints" / f"step_{step:06d}" / "lora" / "adapter_model.safetensors")


def test_the_checkpoint_is_in_the_hub_layout_and_names_its_family(family):
    from imagerl.components import TINY_CHECKPOINTS

    cls, path = family
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == cls.pipeline_class_name and resolve_family(path) == cls.name
    for component, (library, _) in ((k, v) for k, v in index.items() if isinstance(v, list) and v[0] is not None):
        assert (path / component).is_dir(), component
        assert library in ("diffusers", "transformers")
    assert tiny_families()[cls.tiny_name] is cls and cls.tiny_name in TINY_CHECKPOINTS
    cls.load_pipeline(path)  # the pipeline loads what the family wrote


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_the_sampler_equals_the_diffusers_pipeline(family, guidance):
    from imagerl.rollout import ode_sample

    cls, path = family
    adapter = cls.from_pretrained(path, torch.device("cpu"), torch.float32)
    noise = torch.cat([adapter.initial_noise([torch.Generator().manual_seed(i)], H, W) for i in range(len(PROMPTS))])
    ours = ode_sample(adapter, PROMPTS, num_steps=4, guidance_scale=guidance, height=H, width=W,
                      initial_noise_BNC=noise.clone(), negative_prompt=" ", batch_size=len(PROMPTS))
    pipe = cls.load_pipeline(path)
    theirs = torch.cat([adapter.from_pipeline_latents(pipe(
        prompt=[p], height=H, width=W, num_inference_steps=4, output_type="latent", **cls.pipeline_call_kwargs(guidance, " "),
        latents=adapter.to_pipeline_latents(noise[i : i + 1].clone(), H, W)).images, H, W) for i, p in enumerate(PROMPTS)])
    assert ours.shape == theirs.shape
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flow_grpo_replays_its_rollout_exactly(family, tmp_path, dtype):
    from imagerl.train import train

    _, path = family
    train(tiny_config(path, tmp_path, "train.num_rollouts=2", f"model.dtype={dtype}"))
    records = _records(tmp_path)
    assert [r["train/log_prob_mean_abs_diff"] for r in records] == [0.0, 0.0]
    assert all(r["train/grad_norm"] > 0 for r in records)


def test_a_diffusion_nft_update_moves_the_lora(family, tmp_path):
    """One DiffusionNFT rollout and update: a finite loss and gradient, and a LoRA other than the same run's at lr 0
    (the same seed: the same initial LoRA and images)."""
    from imagerl.train import train

    _, path = family
    nft = ["train.algorithm=diffusion_nft", "train.num_rollouts=1", "run.checkpoint_every=1", "nft.ema=false"]
    train(tiny_config(path, tmp_path / "lr0", *nft, "train.lr=0"))
    train(tiny_config(path, tmp_path / "nft", *nft))
    initial, moved = _lora(tmp_path / "lr0", 1), _lora(tmp_path / "nft", 1)
    record = _records(tmp_path / "nft")[0]
    assert torch.isfinite(torch.tensor(record["train/loss"])) and record["train/grad_norm"] > 0
    assert _records(tmp_path / "lr0")[0]["rollout/reward/raw_mean"] == record["rollout/reward/raw_mean"]
    assert any(not torch.equal(moved[k], initial[k]) for k in moved)


def test_the_lora_export_loads_into_the_pipeline_and_samples_the_same_images(family, tmp_path):
    from imagerl.run.checkpoint import load_lora
    from imagerl.rollout import ode_sample
    from imagerl.train import train

    cls, path = family
    train(tiny_config(path, tmp_path, "train.num_rollouts=1", "train.lr=0.05"))
    lora = tmp_path / "checkpoints" / "step_000001" / "lora"
    adapter = cls.from_pretrained(path, torch.device("cpu"), torch.float32)
    load_lora(adapter, lora)
    noise = adapter.initial_noise([torch.Generator().manual_seed(3)], H, W)
    ours = ode_sample(adapter, PROMPTS[:1], num_steps=3, guidance_scale=1.0, height=H, width=W,
                      initial_noise_BNC=noise.clone(), negative_prompt=" ", batch_size=1)
    pipe = cls.load_pipeline(path)
    call = dict(prompt=PROMPTS[:1], height=H, width=W, num_inference_steps=3, output_type="latent",
                **cls.pipeline_call_kwargs(1.0, " "))
    base = adapter.from_pipeline_latents(pipe(**call, latents=adapter.to_pipeline_latents(noise.clone(), H, W)).images,
                                         H, W)
    pipe.load_lora_weights(str(lora))
    theirs = adapter.from_pipeline_latents(pipe(**call, latents=adapter.to_pipeline_latents(noise.clone(), H, W)).images,
                                           H, W)
    assert (theirs - base).abs().max() > 1e-4  # the LoRA changes the images ...
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()  # ... as imagerl's do


def test_a_resumed_run_equals_the_uninterrupted_one(family, tmp_path):
    from imagerl.train import train

    _, path = family
    common = ["train.num_rollouts=3", "run.checkpoint_every=1"]
    train(tiny_config(path, tmp_path / "straight", *common))
    train(tiny_config(path, tmp_path / "resumed", *common, "train.num_rollouts=2"))
    train(tiny_config(path, tmp_path / "resumed", *common), resume="latest")
    a, b = _lora(tmp_path / "straight", 3), _lora(tmp_path / "resumed", 3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    keys = lambda r: {k: v for k, v in r.items() if k.startswith(("rollout/", "train/"))}  # noqa: E731
    assert [keys(r) for r in _records(tmp_path / "straight")] == [keys(r) for r in _records(tmp_path / "resumed")]


def test_each_prompt_is_encoded_once_per_text_length(family, monkeypatch):
    """encode_prompts caches at the default text length and at a recipe's (sd3_5_ocr: T5 at 128): a prompt asked for
    again is not encoded again and gets the same embedding."""
    cls, path = family
    adapter = cls.from_pretrained(path, torch.device("cpu"), torch.float32)
    calls = []
    encode = adapter._encode_uncached
    monkeypatch.setattr(adapter, "_encode_uncached", lambda prompts, *args: calls.append(len(prompts)) or
                        encode(prompts, *args))
    for length in (512, 32):
        first = adapter.encode_prompts(PROMPTS, length)
        again = adapter.encode_prompts(PROMPTS[::-1], length)
        assert all(torch.equal(a, b) for a, b in zip(first, again[::-1]))
        assert all(torch.equal(a, b) for a, b in zip(first, adapter.encode_prompts(PROMPTS, length)))
    assert sum(calls) <= 2 * len(PROMPTS)  # once per prompt and length (the Qwen families cache one full length)


def test_the_prompt_cache_holds_no_more_than_its_bytes(family, monkeypatch):
    """model.prompt_cache_gib: past the byte cap the least recently used prompts are dropped (and encoded again when
    asked for), at every text length the family caches; a call's own prompts are kept even above the cap."""
    cls, path = family
    adapter = cls.from_pretrained(path, torch.device("cpu"), torch.float32)
    one = adapter.encode_prompts(PROMPTS[:1], 32)[0]
    per_prompt = one.numel() * one.element_size()
    adapter = cls.from_pretrained(path, torch.device("cpu"), torch.float32)
    adapter.prompt_cache.max_bytes = 2 * per_prompt  # room for two prompts' embeddings
    calls = []
    encode = adapter._encode_uncached
    monkeypatch.setattr(adapter, "_encode_uncached", lambda prompts, *args: calls.append(list(prompts)) or
                        encode(prompts, *args))
    many = [f"prompt number {i}" for i in range(3)]
    assert len(adapter.encode_prompts(many, 32)) == 3  # all three kept for the call itself
    calls.clear()
    adapter.encode_prompts(["another prompt"], 32)  # evicts the two least recent: prompts 0 and 1
    adapter.encode_prompts(many[2:], 32)
    assert calls == [["another prompt"]]  # prompt 2 was still cached
    adapter.encode_prompts(many[:1], 32)
    assert calls[-1] == many[:1]  # prompt 0 was dropped and is encoded again


def test_the_text_encoder_fsdp_shards_is_a_module_with_its_layers(family):
    """parallel.text_encoder shards text_encoder_module() by text_encoder_layers() (distributed/fsdp.py):
    fully_shard needs a module with a forward (not the ModuleList that holds sd3's or flux's encoders), and the
    layers must be inside it."""
    cls, path = family
    adapter = cls.from_pretrained(path, torch.device("cpu"), torch.float32)
    module = adapter.text_encoder_module()
    assert isinstance(module, torch.nn.Module) and not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict))
    assert type(module).forward is not torch.nn.Module.forward
    inside = {id(m) for m in module.modules()}
    layers = adapter.text_encoder_layers()
    assert layers and all(id(layer) in inside for layer in layers)


@pytest.mark.slow
def test_regional_compile_runs_on_a_cpu_and_replays_exactly(family, tmp_path):
    from imagerl.train import train

    _, path = family
    train(tiny_config(path, tmp_path, "train.num_rollouts=1", "parallel.compile=true"))
    assert _records(tmp_path)[0]["train/log_prob_mean_abs_diff"] == 0.0


@pytest.mark.slow
def test_two_gloo_ranks_give_what_one_process_gives(family, tmp_path):
    from test_distributed import _max_diff, _run

    _, path = family
    _run(1, path, tmp_path / "one", "train.num_rollouts=1")
    _run(2, path, tmp_path / "two", "train.num_rollouts=1")
    assert _max_diff(_lora(tmp_path / "one", 1), _lora(tmp_path / "two", 1)) < 1e-6
    one, two = _records(tmp_path / "one")[0], _records(tmp_path / "two")[0]
    assert two["train/log_prob_mean_abs_diff"] == 0.0
    assert two["rollout/reward/raw_mean"] == pytest.approx(one["rollout/reward/raw_mean"], rel=1e-5)


def test_off_window_fp8_runs_every_token_linear_of_the_blocks_in_fp8(family, tmp_path):
    """sample.off_window_fp8 (families/layers/merged_lora.py): each of the family's token_linears names a Linear of
    its blocks (a misspelt one would stay bf16 unnoticed); in the merged off-window forward every one of them runs
    FP8, merged where it is a LoRA target (to_q here) and frozen otherwise; the velocity moves by FP8 rounding
    only, and afterwards the module tree and the unmerged velocity are as before."""
    from peft.tuners.lora import LoraLayer

    from imagerl.components import load_adapter, resolve_family_defaults
    from imagerl.distributed.parallel import World
    from imagerl.families.layers.fp8_linear import Fp8Linear
    from imagerl.families.layers.merged_lora import MergedLora
    from imagerl.rollout import batch_conditioning

    cls, path = family
    cfg = tiny_config(path, tmp_path, "model.lora_target_modules=[to_q]")
    adapter = load_adapter(cfg, World(0, 1, torch.device("cpu")))
    resolve_family_defaults(cfg, adapter)
    torch.manual_seed(0)
    with torch.no_grad():  # a trained-looking LoRA (B != 0)
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)
    suffixes = tuple("." + name for name in cls.token_linears)
    token = {n: m for n, m in adapter.transformer.named_modules() if n.endswith(suffixes)}
    assert {s for s in suffixes if any(n.endswith(s) for n in token)} == set(suffixes)
    assert any(isinstance(m, LoraLayer) for m in token.values()) and any(type(m) is torch.nn.Linear for m in token.values())

    guidance = cls.default_guidance_scale
    negative = adapter.encode_negative(" ", guidance, 512)
    cond = batch_conditioning(adapter, adapter.encode_prompts(PROMPTS), negative, guidance)
    x = adapter.initial_noise([torch.Generator().manual_seed(i) for i in range(len(PROMPTS))], H, W)
    t = torch.full((len(PROMPTS),), 600.0)
    modules = dict(adapter.transformer.named_modules())
    with torch.no_grad():
        exact = adapter.velocity(x, t, cond, H, W)
        with MergedLora(adapter.transformer, fp8=True, token_linears=cls.token_linears).applied():
            running = {n: m for n, m in adapter.transformer.named_modules() if n.endswith(suffixes)}
            assert all(isinstance(m.base_layer if isinstance(m, LoraLayer) else m, Fp8Linear) for m in running.values())
            fp8 = adapter.velocity(x, t, cond, H, W)
        error = ((fp8 - exact).norm() / exact.norm()).item()
        assert 0 < error < 0.1, error  # e4m3 rounding of weights and activations: a few percent
        assert dict(adapter.transformer.named_modules()) == modules
        assert torch.equal(adapter.velocity(x, t, cond, H, W), exact)
