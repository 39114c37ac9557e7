"""exclude_cudnn_attention (families/layers/attention_backends.py): the compiled 2.1 blocks run their attention with the
cuDNN backend off (its compiled backward faulted on the GPU, LOG.md issue 22 run Y), in eager and inside
a fullgraph torch.compile, and backends turned off before (parallel.deterministic) stay off. That the 2.1
family applies it to every block before compiling: tests/test_qwen_image21_adapter.py."""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from imagerl.families.layers.attention_backends import backends_without_cudnn, exclude_cudnn_attention


class PlainAttention(torch.nn.Module):
    def forward(self, q):
        return F.scaled_dot_product_attention(q, q, q)


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, q):
        self.seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
        return F.scaled_dot_product_attention(q, q, q)


def test_cudnn_is_off_inside_the_block_and_restored_after():
    block = Attention()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert exclude_cudnn_attention([block]) == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                SDPBackend.MATH]
    q = torch.randn(1, 2, 5, 8)
    out = block(q)
    assert block.seen == [(False, True)]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # the process keeps its settings outside the block
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, q, q), rtol=0, atol=0)
    exclude_cudnn_attention([block])  # a second call wraps nothing twice
    assert block.forward.__wrapped__.__self__ is block


def test_the_wrapped_block_compiles_as_one_graph():
    import torch._dynamo

    torch._dynamo.reset()
    block = PlainAttention()
    exclude_cudnn_attention([block])
    q = torch.randn(1, 2, 5, 8)
    compiled = torch.compile(block, fullgraph=True, backend="eager")  # fullgraph: a graph break raises
    torch.testing.assert_close(compiled(q), F.scaled_dot_product_attention(q, q, q))


def test_backends_disabled_before_stay_disabled():
    flash, efficient = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    try:
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        assert backends_without_cudnn() == [SDPBackend.MATH]  # what parallel.deterministic leaves
        block = Attention()
        exclude_cudnn_attention([block])
        block(torch.randn(1, 2, 5, 8))
        assert block.seen == [(False, False)]
    finally:
        torch.backends.cuda.enable_flash_sdp(flash)
        torch.backends.cuda.enable_mem_efficient_sdp(efficient)



def test_except_unreplayed_keeps_the_backends_only_in_unreplayed_forwards():
    """flux: the merged off-window forwards (unreplayed_forwards, MergedLora.applied) keep the process's backends;
    every other forward, under grad or not, runs without cuDNN, so a replayed window step and the update's forward
    pick the same kernel (run AY: cuDNN in the eager rollout's no-grad window steps and flash in the update gave a
    log-prob difference of 2.7e-6)."""
    from imagerl.families.layers.attention_backends import unreplayed_forwards

    block = Attention()
    exclude_cudnn_attention([block], except_unreplayed=True)
    q = torch.randn(1, 2, 5, 8)
    block(q)
    with torch.no_grad():
        block(q)
    with unreplayed_forwards():
        block(q)
    block(q)
    cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    assert block.seen == [(False, True), (False, True), (cudnn, True), (False, True)]


def test_merged_lora_forwards_are_unreplayed():
    from imagerl.families.layers import attention_backends
    from imagerl.families.layers.merged_lora import MergedLora

    seen = []
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with MergedLora(model).applied():
        seen.append(attention_backends._UNREPLAYED)
    seen.append(attention_backends._UNREPLAYED)
    assert seen == [True, False]


def test_flux_compiles_without_inductors_coalescing_analysis(tmp_path, monkeypatch):
    """apply_parallelism calls the family's prepare_compile before compiling: FLUX.1's turns off the Inductor analysis
    that torch 2.11 asserted in on its blocks (GPU only, benchmarks/LOG.md run AZ); its forward still compiles here."""
    import torch._inductor.config as inductor_config

    from imagerl.config import load_config
    from imagerl.distributed.fsdp import apply_parallelism
    from imagerl.distributed.parallel import World
    from imagerl.families.flux import FluxFamily

    monkeypatch.setattr(inductor_config.triton, "coalesce_tiling_analysis", True)
    adapter = FluxFamily.from_pretrained(FluxFamily.build_tiny_checkpoint(tmp_path / "tiny-flux"), torch.device("cpu"),
                                         torch.float32)
    cfg = load_config("flux_ocr", ["parallel.compile=true", "model.device=cpu"])
    apply_parallelism(adapter, cfg, World(0, 1, torch.device("cpu")))
    assert inductor_config.triton.coalesce_tiling_analysis is False
    assert all(block._compiled_call_impl is not None for block in adapter.transformer_blocks())


class DoubleBlock(torch.nn.Module):  # two block classes, as FLUX.1's double- and single-stream blocks
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x, scale=None):
        q = self.proj(x)
        out = F.scaled_dot_product_attention(q, q, q)
        return out if scale is None else out * scale


class SingleBlock(DoubleBlock):
    def forward(self, x, scale=None):
        return super().forward(x, scale) + x


def test_each_block_class_compiles_into_its_own_cache():
    """Compiled, the wrapper is each block's first traced frame, and Dynamo keeps graphs and counts recompiles per
    code object: with one wrapper code for all classes, FLUX.1's two block classes shared one cache and took 7
    entries of it in a warm-up (benchmarks/LOG.md run BC), each further class or situation adding more. Here two
    classes, two blocks each, through the situations that recompiled there (grad mode, the input's requires_grad,
    an absent argument) and the unreplayed forwards: each class's wrapper has its own code and cache, holding only
    its own graphs, and blocks of one class share them."""
    import torch._dynamo
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from imagerl.families.layers.attention_backends import unreplayed_forwards

    torch._dynamo.reset()
    torch.manual_seed(0)
    blocks = [DoubleBlock(), DoubleBlock(), SingleBlock(), SingleBlock()]
    exclude_cudnn_attention(blocks, except_unreplayed=True)
    for block in blocks:
        block.compile(backend="eager", dynamic=True)  # as apply_parallelism, on Dynamo's graphs alone
    x = torch.randn(1, 2, 5, 8)

    def run(h, **kwargs):
        for block in blocks:
            h = block(h, **kwargs)
        return h

    with torch.no_grad():  # a rollout step
        run(x)
        run(x, scale=0.5)
        with unreplayed_forwards():
            run(x)
    run(x.clone().requires_grad_()).sum().backward()  # the update
    run(x)
    codes = {type(block): block.forward.__code__ for block in blocks}
    assert codes[DoubleBlock] is not codes[SingleBlock]
    assert all(block.forward.__code__ is codes[type(block)] for block in blocks)  # one cache per class
    entries = {cls.__name__: len(_debug_get_cache_entry_list(code)) for cls, code in codes.items()}
    # no grad, no grad with scale, unreplayed, grad with a requires_grad input, and the first block alone: grad
    # with a plain input (the next blocks get its output, which requires grad). One shared code held all 9.
    assert entries == {"DoubleBlock": 5, "SingleBlock": 4}
    torch._dynamo.reset()
