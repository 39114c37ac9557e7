"""The exported LoRA (imagerl.run.checkpoint.save_lora) means the same thing to diffusers and to imagerl.

rank 4, alpha 8: the LoRA update is (alpha / r) B A = 2 B A. A loader that ignored alpha would apply
B A and the outputs below would differ.
"""

import json

import pytest
import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from safetensors.torch import load_file

from imagerl.run.checkpoint import PEFT_PREFIX, save_lora
from imagerl.families.qwen_image import QwenImageFamily

RANK, ALPHA = 4, 8
TARGETS = {"to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
           "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    """The session's tiny checkpoint (conftest.py)."""
    return tiny_checkpoint


def new_adapter(tiny):
    return QwenImageFamily.from_pretrained(tiny, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def trained(tiny, tmp_path_factory):
    """An adapter with a LoRA that has an effect (B != 0), saved to a directory."""
    adapter = new_adapter(tiny)
    torch.manual_seed(0)
    adapter.add_lora(rank=RANK, alpha=ALPHA, init="gaussian")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    adapter.transformer.eval()
    directory = tmp_path_factory.mktemp("export") / "lora"
    save_lora(adapter, directory)
    return adapter, directory


@pytest.fixture(scope="module")
def inputs():
    """Transformer inputs for 2 images of 64x64 px: 8x8 latents -> 4x4 = 16 packed tokens of 4 x 4 channels."""
    gen = torch.Generator().manual_seed(2)
    return dict(hidden_states=torch.randn(2, 16, 16, generator=gen),
                encoder_hidden_states=torch.randn(2, 7, 32, generator=gen),
                timestep=torch.tensor([0.7, 0.3]), img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)


@torch.no_grad()
def forward(transformer, inputs):
    return transformer(**inputs)[0]


def test_input_shapes_follow_the_tiny_config(trained, inputs):
    config = trained[0].transformer.config
    assert inputs["hidden_states"].shape[-1] == config.in_channels == 16
    assert inputs["encoder_hidden_states"].shape[-1] == config.joint_attention_dim == 32


def test_lora_has_an_effect_and_the_export_lists_every_layer(trained, inputs):
    adapter, directory = trained
    with adapter.lora_disabled():
        base = forward(adapter.transformer, inputs)
    assert (forward(adapter.transformer, inputs) - base).abs().max() > 1e-2
    state = adapter.lora_state_dict()
    num_layers = adapter.transformer.config.num_layers
    assert len(state) == 2 * len(TARGETS) * num_layers  # lora_A and lora_B of each target in each block
    for key in ("adapter_model.safetensors", "pytorch_lora_weights.safetensors"):
        assert len(load_file(directory / key)) == len(state)


def test_diffusers_pipeline_loads_the_export_with_alpha_scaling(tiny, trained, inputs):
    adapter, directory = trained
    pipe = QwenImagePipeline.from_pretrained(tiny)
    base = forward(pipe.transformer, inputs)
    pipe.load_lora_weights(directory)
    theirs = forward(pipe.transformer, inputs)
    ours = forward(adapter.transformer, inputs)
    assert (theirs - base).abs().max() > 1e-2  # the LoRA was applied at all
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)


def test_export_equals_merging_two_b_a_into_the_base_weights(tiny, trained, inputs):
    """Independent of PEFT and diffusers: W' = W + (alpha / r) B A in every target Linear."""
    adapter, directory = trained
    merged = QwenImageTransformer2DModel.from_pretrained(tiny, subfolder="transformer", torch_dtype=torch.float32)
    state = load_file(directory / "pytorch_lora_weights.safetensors")
    modules = dict(merged.named_modules())
    seen = 0
    with torch.no_grad():
        for key, a in state.items():
            if ".lora_A." not in key:
                continue
            name = key.removeprefix("transformer.").removesuffix(".lora_A.weight")
            b = state[key.replace(".lora_A.", ".lora_B.")]
            assert a.shape[0] == b.shape[1] == RANK
            modules[name].weight += (ALPHA / RANK) * (b @ a)
            seen += 1
    assert seen == len(TARGETS) * merged.config.num_layers
    torch.testing.assert_close(forward(merged, inputs), forward(adapter.transformer, inputs), rtol=0, atol=1e-5)


def test_peft_copy_loads_back_into_a_fresh_adapter(tiny, trained, inputs):
    adapter, directory = trained
    fresh = new_adapter(tiny)
    torch.manual_seed(123)  # a different random A than the trained adapter's
    fresh.add_lora(rank=RANK, alpha=ALPHA, init="gaussian")
    fresh.transformer.eval()
    before = forward(fresh.transformer, inputs)
    assert not torch.allclose(before, forward(adapter.transformer, inputs), atol=1e-3)
    state = load_file(directory / "adapter_model.safetensors")
    assert all(k.startswith(PEFT_PREFIX) for k in state)
    fresh.load_lora_state_dict({k.removeprefix(PEFT_PREFIX): v for k, v in state.items()})
    assert torch.equal(forward(fresh.transformer, inputs), forward(adapter.transformer, inputs))
    for k, v in adapter.lora_state_dict().items():
        assert torch.equal(fresh.lora_state_dict()[k], v), k


def test_loading_a_state_for_another_model_is_an_error(tiny, trained):
    adapter, _ = trained
    state = adapter.lora_state_dict()
    state["transformer_blocks.7.attn.to_q.lora_A.weight"] = torch.zeros(RANK, 32)
    with pytest.raises(ValueError, match=r"LoRA state has keys this model does not"):
        adapter.load_lora_state_dict(state)


def test_adapter_config_records_rank_alpha_and_targets(trained):
    _, directory = trained
    config = json.loads((directory / "adapter_config.json").read_text())
    assert config["r"] == RANK
    assert config["lora_alpha"] == ALPHA
    assert set(config["target_modules"]) == TARGETS and len(config["target_modules"]) == 12
    assert config["peft_type"] == "LORA"
    assert not config["use_rslora"] and not config["use_dora"]  # scaling is alpha / r, nothing else
