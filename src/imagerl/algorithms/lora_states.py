"""Named copies of the trainable (LoRA) parameters beside the policy: DiffusionNFT's `old` sampling policy and
its evaluation EMA.

A state is a list of tensors laid out exactly as the trainable parameters (under FSDP2 each is a DTensor shard
like its parameter, so every operation here is local to the rank and a state costs 1/W of the LoRA per rank).
A state is used by copying it into the parameters for a block of code (`swapped_in`) and copying the policy
back afterwards: the parameters stay the same objects, so FSDP2's all-gathers (which read the sharded
parameters at each forward), compiled graphs (parameters are graph inputs) and the optimizer see no change.
Copies are exact (fp32 to fp32), so swapping in and out returns the policy bit for bit.

verl-omni keeps the old policy as a second PEFT adapter ("old", `set_adapter`); a swap keeps one adapter,
which under compile means one graph per block instead of one per active adapter.
"""

from __future__ import annotations

import contextlib

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's local tensor of a DTensor (FSDP2: a view of the storage its all-gathers read), else t."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t.detach()


class LoraStates:
    """States `names` initialised to the current parameters (the fresh LoRA: B = 0, the base model)."""

    def __init__(self, params: list[torch.nn.Parameter], names: tuple[str, ...]):
        self.params = params
        self._locals = [_local(p) for p in params]  # the foreach ops below run on plain local tensors
        with torch.no_grad():
            self.states = {name: [p.detach().clone() for p in params] for name in names}  # DTensors like params
            self._backup = [t.clone() for t in self._locals]
        self._active: str | None = None

    def _state_locals(self, name: str) -> list[torch.Tensor]:
        return [_local(t) for t in self.states[name]]

    @contextlib.contextmanager
    def swapped_in(self, name: str):
        """Within: the parameters hold state `name`; afterwards the policy again (exactly)."""
        if self._active is not None:
            raise RuntimeError(f"LoRA state {name!r} swapped in while {self._active!r} is")
        state = self._state_locals(name)
        with torch.no_grad():
            torch._foreach_copy_(self._backup, self._locals)
            torch._foreach_copy_(self._locals, state)
        self._active = name
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._locals, self._backup)
            self._active = None

    @torch.no_grad()
    def blend_toward_policy(self, name: str, decay: float) -> None:
        """state <- decay * state + (1 - decay) * policy, computed as state + (1 - decay) (policy - state)
        (lerp: equal in exact arithmetic; a state equal to the policy stays equal bit for bit, and decay 0 is an
        exact copy)."""
        if self._active is not None:
            raise RuntimeError("blend_toward_policy while a state is swapped in")
        state = self._state_locals(name)
        if decay == 0.0:
            torch._foreach_copy_(state, self._locals)
        else:
            torch._foreach_lerp_(state, self._locals, 1.0 - decay)

    # checkpoint.py stores these with the parameters and torch.distributed.checkpoint loads into them in place
    # (sharded, any world size)
    def state_dict(self, param_names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
        return {name: dict(zip(param_names, tensors)) for name, tensors in self.states.items()}
