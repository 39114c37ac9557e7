"""FSDP2 sharding, activation checkpointing, regional compile and deterministic mode, applied in one place.

Order (torchtitan's): activation checkpointing (diffusers gradient checkpointing, enabled by
components.load_adapter) -> regional compile of each transformer block -> fully_shard of each block,
then of the transformer root. It runs after the LoRA is added (so the fp32 LoRA params are sharded
with their blocks) and before the optimizer is built (so it holds the sharded DTensor params, and
AdamW's state is sharded too).

Mixed precision: params are kept sharded in their stored dtype (fp32 LoRA master weights, frozen base
weights in the model dtype); all-gathered weights are cast to the model dtype (bf16 on GPU, fp32 on CPU)
for compute, gradients are reduce-scattered in parallel.reduce_dtype (float32 by default) and land in
the fp32 sharded LoRA grads, so AdamW runs on fp32 master params and fp32 state.

Text encoder: replicated when small; with parallel.text_encoder=shard (or auto and more than
parallel.text_encoder_shard_min_params) its decoder layers and then its root are sharded, and each
encode_prompts call gathers the whole encoder once (every rank makes the same number of calls: one per
rollout / eval batch, prompt-cache hits included) and frees it afterwards. With model.text_encoder_offload it
is never sharded: each rank keeps it in CPU memory and copies it in for the prompts its cache lacks. VAE and reward models are
replicated (reward.device can put rewards on another GPU).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch

from imagerl.config import Config
from imagerl.distributed.parallel import World
from imagerl.distributed.parallel import validate_parallel


def apply_parallelism(adapter, cfg: Config, world: World) -> str:
    """Compile and shard the adapter's models as cfg.parallel says; set and return world.strategy."""
    strategy = validate_parallel(cfg, world.size)
    p = cfg.parallel
    if p.compile:
        # dynamic=True: text lengths (and with model.group_text_lengths the rows per forward) vary from batch to
        # batch; one symbolic-shape graph per block instead of a recompile per length (verl-omni's choice, A6).
        # Duck sizing off: otherwise a text length that happens to equal the row count is traced as "the same
        # symbol" and the next length recompiles (seen with TORCH_LOGS=recompiles: encoder_hidden_states.size()[1]
        # == temb.size()[0])
        import torch.fx.experimental._config as fx_config

        fx_config.use_duck_shape = False
        # one block code object serves several graphs: train/eval mode, grad on/off, adapters on/off/merged, with and
        # without a text mask (DiffusionNFT alone uses four); past Dynamo's default limit of 8 it falls back to eager
        # (seen on the H200, benchmarks/LOG.md run Q)
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
        adapter.prepare_compile()
        for block in adapter.transformer_blocks():
            block.compile(dynamic=True)
    world.strategy = strategy
    if strategy != "fsdp":
        return strategy
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    reduce_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[p.reduce_dtype]
    # cast_forward_inputs=False: inputs keep their dtype (fp32 latents), adapter.autocast decides the compute
    # dtype, exactly as in one process
    mp = MixedPrecisionPolicy(param_dtype=adapter.dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    for block in adapter.transformer_blocks():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=p.reshard_after_forward)
    fully_shard(adapter.transformer, mesh=mesh, mp_policy=mp, reshard_after_forward=p.reshard_after_forward)
    if _shard_text_encoder(adapter, cfg):
        _shard_text_encoder_modules(adapter, mesh)
    return strategy


def _shard_text_encoder(adapter, cfg: Config) -> bool:
    module = adapter.text_encoder_module()
    if module is None or cfg.parallel.text_encoder == "replicate":
        return False
    if adapter.text_encoder_offloaded:  # model.text_encoder_offload: each rank copies its host weights in whole
        if cfg.parallel.text_encoder == "shard":
            raise ValueError("model.text_encoder_offload=true keeps the whole text encoder in each rank's CPU memory; "
                             "it cannot be sharded too: set parallel.text_encoder=auto or replicate")
        return False
    if cfg.parallel.text_encoder == "shard":
        if not adapter.text_encoder_layers():
            raise ValueError(f"parallel.text_encoder=shard: the {adapter.name} text encoder has no `layers` to shard")
        return True
    size = sum(t.numel() for t in module.parameters())
    return size > cfg.parallel.text_encoder_shard_min_params and bool(adapter.text_encoder_layers())


def _shard_text_encoder_modules(adapter, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    modules = [fully_shard(layer, mesh=mesh, reshard_after_forward=False) for layer in adapter.text_encoder_layers()]
    modules.append(fully_shard(adapter.text_encoder_module(), mesh=mesh, reshard_after_forward=False))
    encode = adapter.encode_prompts

    def encode_prompts(*args, **kwargs):
        for m in modules:  # one all-gather per module and call, on every rank alike
            m.unshard()
        try:
            return encode(*args, **kwargs)
        finally:
            for m in modules:
                m.reshard()

    adapter.encode_prompts = encode_prompts


def set_deterministic(seed: int, device: torch.device) -> None:
    """parallel.deterministic: deterministic kernels everywhere, or a clear error if that cannot be had."""
    if device.type == "cuda":
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
            if torch.cuda.is_initialized():
                raise ValueError("parallel.deterministic=true needs CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts; "
                                 "export CUBLAS_WORKSPACE_CONFIG=:4096:8 before launching")
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_math_sdp(True)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    check_deterministic(device)


def check_deterministic(device: torch.device) -> None:
    """Startup check that deterministic mode is really on (something may have turned it off)."""
    problems = []
    if not torch.are_deterministic_algorithms_enabled():
        problems.append("torch.use_deterministic_algorithms is off")
    if torch.backends.cudnn.benchmark or not torch.backends.cudnn.deterministic:
        problems.append("cudnn benchmark is on or cudnn.deterministic is off")
    if device.type == "cuda":
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in (":4096:8", ":16:8"):
            problems.append("CUBLAS_WORKSPACE_CONFIG is not :4096:8")
        if (torch.backends.cuda.flash_sdp_enabled() or torch.backends.cuda.mem_efficient_sdp_enabled()
                or torch.backends.cuda.cudnn_sdp_enabled()):
            problems.append("a non-deterministic SDPA backend (flash / memory-efficient / cudnn) is enabled")
    if problems:
        raise ValueError("parallel.deterministic=true but " + "; ".join(problems))
