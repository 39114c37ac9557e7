"""Seed policy: every random stream is derived from (run seed, purpose, step, [rank]).

No stream depends on how many draws happened before it, so a resumed run reproduces an uninterrupted
one exactly, and streams that must agree across ranks (prompt order, SDE window) leave out the rank
while streams that must differ (initial noise, SDE noise) include it.
"""

from __future__ import annotations

import hashlib

import torch


def derive_seed(seed: int, purpose: str, *keys: int) -> int:
    """A 63-bit seed from the run seed, a purpose name and integer keys (step, rank, ...)."""
    text = ":".join([str(int(seed)), purpose, *(str(int(k)) for k in keys)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def make_generator(seed: int, purpose: str, *keys: int, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(derive_seed(seed, purpose, *keys))
