"""Ranks and collectives in one place. Single process: every collective is the identity.

Launch several ranks with torchrun (`torchrun --nproc_per_node N -m imagerl train ...`); the group uses
NCCL on CUDA and gloo on CPU. Each rank holds complete prompt groups (data.GroupSampler), so only
rewards (for global-std advantages and logging), scalar metrics and LoRA gradients cross ranks; with
parallel.strategy=fsdp also the sharded weights (distributed/fsdp.py applies the sharding).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class World:
    rank: int
    size: int
    device: torch.device
    strategy: str = "none"
    """"none" (one process), "replicate" (all_reduce_grads averages LoRA grads) or "fsdp" (set by
    fsdp.apply_parallelism: FSDP2 reduce-scatters the grads in backward, params are DTensor shards)."""

    @property
    def fsdp(self) -> bool:
        return self.strategy == "fsdp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors from all ranks in rank order (dim 0)."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def all_reduce_mean_(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            tensor.div_(self.size)
        return tensor

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Average LoRA gradients over ranks (one flat buffer, one collective); FSDP already did."""
        if self.size == 1 or self.fsdp:
            return
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.all_reduce_mean_(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError as e:
        raise ValueError(f"model.device={spec!r} is not a device; use auto, cpu, cuda or cuda:N") from e
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={spec!r} but CUDA is not available; use model.device=cpu")
    return device


def init_world(device_spec: str = "auto") -> World:
    """From torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), or a single process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device_spec)
    if size == 1:
        return World(0, 1, device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        atexit.register(_destroy_process_group)
    return World(dist.get_rank(), dist.get_world_size(), device)


def _destroy_process_group() -> None:
    """At exit, while the interpreter is still whole: a process group left to the interpreter's teardown
    can abort the rank (gloo's worker threads still hold work; "terminate called without an active
    exception", pytorch/pytorch#190489) and NCCL warns that it was not destroyed."""
    if dist.is_initialized():
        dist.destroy_process_group()


def validate_parallel(cfg, world_size: int) -> str:
    """Check the parallel.* section; return the effective strategy: "fsdp", "replicate" or "none" (one process)."""
    p = cfg.parallel
    choices = {"parallel.strategy": (p.strategy, ("auto", "fsdp", "replicate")),
               "parallel.reduce_dtype": (p.reduce_dtype, ("float32", "bfloat16")),
               "parallel.text_encoder": (p.text_encoder, ("auto", "shard", "replicate"))}
    for key, (value, allowed) in choices.items():
        if value not in allowed:
            raise ValueError(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
    if p.text_encoder_shard_min_params < 0:
        raise ValueError(f"parallel.text_encoder_shard_min_params must be >= 0, got {p.text_encoder_shard_min_params}")
    if world_size == 1:
        return "none"
    strategy = "fsdp" if p.strategy == "auto" else p.strategy
    if p.text_encoder == "shard" and strategy != "fsdp":
        raise ValueError("parallel.text_encoder=shard needs parallel.strategy=fsdp (or auto with several ranks)")
    return strategy
