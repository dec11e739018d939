"""Rotary positions for plait's GPT: the tables, the rotation, and the rows a batch reads.

Kept apart from model.py so that the adapter's pipeline stages (adapter.py) read the same
rows without importing the model they describe.
"""

from __future__ import annotations

import torch


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every (position, frequency) pair, shape (max_seq_len, head_dim // 2)."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), freqs)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of x's last dimension by its position's angle.

    x is (batch, heads, seq, head_dim), a view of the projection's (batch, seq, heads,
    head_dim); cos and sin are (…, seq, head_dim // 2), as `rope_angles` gives them. The
    result has x's shape but is stored seq-major, as the projection wrote it: SDPA then writes
    its output in that order too, so that o_proj reads it back as a view, not a copy (h
    elements a token a layer fewer kept for backward).
    """
    rows = x.transpose(1, 2)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over the heads, seq-major
    even, odd = rows[..., 0::2], rows[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).transpose(1, 2)


def rope_angles(cos: torch.Tensor, sin: torch.Tensor, seq: int,
                position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rope tables' rows for positions 0..seq-1, or for `position_ids` (1 or batch, seq):
    (…, seq, head_dim / 2), which `apply_rope` broadcasts over the heads."""
    if position_ids is None:
        return cos[:seq], sin[:seq]
    return cos[position_ids], sin[position_ids]
