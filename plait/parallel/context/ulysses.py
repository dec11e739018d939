"""Ulysses: trade sequence shards for head shards, attend to the whole sequence, trade back.

Each cp rank holds its head-tail slice of the sequence for every head. One all-to-all per
tensor gives it the whole sequence for heads/cp of them (DeepSpeed-Ulysses); it runs plain
SDPA there, then one all-to-all takes the output back to sequence shards. The sequence
arrives in the ranks' order (rank 0's two chunks, rank 1's, ...) and is put back in
position order before attention, so the causal mask is the ordinary one.

A sliding window (or one inside packed documents) is one additive mask over the whole
sequence, made once a forward and shared by its layers (`window_mask`).

It needs heads divisible by cp. K/V heads that cp does not divide are repeated up to the
query heads first (GQA): more bytes, the same result. Each all-to-all is an autograd function
whose backward is the reverse all-to-all; every one goes through plait.runtime.comm.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from plait.parallel.context.chunks import natural_order, rank_order
from plait.parallel.packed import additive, dense_mask, document_attention, remembered, sliding_band
from plait.runtime import comm
from plait.runtime.comm import Axis


def _to_heads(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(b, h, local, d) sequence shard -> (b, h/cp, cp·local, d), the sequence in rank order."""
    b, h, n, d = x.shape
    parts = x.reshape(b, axis.size, h // axis.size, n, d).transpose(0, 1).contiguous()
    out = torch.empty_like(parts)
    comm.all_to_all(out, parts, axis)
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // axis.size, axis.size * n, d)


def _to_sequence(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """(b, h/cp, cp·local, d) in rank order -> (b, h, local, d): this rank's tokens, every head."""
    b, h, total, d = x.shape
    n = total // axis.size
    parts = x.reshape(b, h, axis.size, n, d).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty_like(parts)
    comm.all_to_all(out, parts, axis)
    return out.transpose(0, 1).reshape(b, axis.size * h, n, d)


class Trade(torch.autograd.Function):
    """One all-to-all (`there`) whose backward is the reverse one (`back`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, axis: Axis, there: Any, back: Any) -> torch.Tensor:
        ctx.axis, ctx.back = axis, back
        return there(x, axis)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return ctx.back(grad.contiguous(), ctx.axis), None, None, None


def to_heads(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Sequence shards -> head shards (backward: head shards -> sequence shards)."""
    return Trade.apply(x, axis, _to_heads, _to_sequence)


def to_sequence(x: torch.Tensor, axis: Axis) -> torch.Tensor:
    """Head shards -> sequence shards (backward: sequence shards -> head shards)."""
    return Trade.apply(x, axis, _to_sequence, _to_heads)


_WINDOW_MASKS: dict[tuple[Any, ...], Any] = {}  # (seq, window, dtype, device) -> the mask, weakly


def window_mask(seq: int, window: int, documents: torch.Tensor | None, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """SDPA's additive mask of a sliding window over the whole sequence: (1, 1, seq, seq), or
    (batch, 1, seq, seq) inside packed `documents` (packed.dense_mask); 0 where a query sees a
    key (at or before it, at most window − 1 before, in its own document), −inf elsewhere.

    Made once and shared, for packed.dense_mask's reasons (SDPA keeps the mask it is given for
    backward, and makes a fresh copy of any other at every layer): remembered weakly, it lives
    as long as some layer's backward keeps it."""
    if documents is not None:
        return dense_mask(documents, dtype, window)
    if torch.compiler.is_compiling():
        return additive(sliding_band(seq, window, device), dtype)
    return remembered(_WINDOW_MASKS, (seq, window, dtype, device),
                      lambda: additive(sliding_band(seq, window, device), dtype))


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, axis: Axis, causal: bool = True,
                      scale: float | None = None, documents: torch.Tensor | None = None,
                      window: int | None = None) -> torch.Tensor:
    """Attention of this rank's tokens to the whole sequence, by head shards. Shapes as
    plait.parallel.context.ring.ring_attention's; `documents` (batch, whole seq, in sequence
    order): packed documents' numbers, whose block-causal mask the whole sequence takes;
    `window`: a sliding window, in positions."""
    if (documents is not None or window is not None) and not causal:
        raise ValueError("packed documents' masks and sliding windows are causal")
    heads, kv_heads, cp = q.shape[1], k.shape[1], axis.size
    if kv_heads % cp:  # repeat K/V heads up to the query heads, which cp divides
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    seq = q.shape[2] * cp
    order, back = natural_order(seq, cp).to(q.device), rank_order(seq, cp).to(q.device)
    q, k, v = (to_heads(t, axis).index_select(2, order) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    grouped = k.shape[1] != q.shape[1]  # grouped K/V heads stay so: each shared by its group of query heads
    if window is not None and window < seq:
        mask = window_mask(seq, window, documents, q.dtype, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=grouped)
    elif documents is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=grouped)
    else:
        out = document_attention(q, k, v, documents, scale)
    return to_sequence(out.index_select(2, back).contiguous(), axis)
