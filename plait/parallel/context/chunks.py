"""Which positions of the sequence a context-parallel rank holds: the head-tail split.

The sequence is cut into 2·cp equal chunks and rank i holds chunks i and 2·cp−1−i, in that
order. Under causal attention a query attends to every key before it, so a rank holding only
early chunks would have little to do and one holding late chunks a lot; pairing an early
chunk with its mirror from the end gives every rank the same number of (query, key) pairs
(Megatron-Core's and torchtitan's load balancing). Pure index arithmetic, shared by the data
split, the positions the model is given and both attention kinds.
"""

from __future__ import annotations

import torch


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk numbers rank `rank` of `cp` holds, the early one first."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, rank: int, cp: int) -> torch.Tensor:
    """The global positions (0..seq_len-1) of this rank's tokens, in the order it holds them."""
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(rank, cp)])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's tokens of `x` (whole sequences along `dim`), contiguous."""
    index = local_positions(x.shape[dim], rank, cp).to(x.device)
    return x.index_select(dim, index)


def rank_order(seq_len: int, cp: int) -> torch.Tensor:
    """Positions in the order the ranks hold them, rank 0's first: where a gather of every
    rank's tokens puts each position. Its inverse (`natural_order`) sorts them back."""
    return torch.cat([local_positions(seq_len, r, cp) for r in range(cp)])


def natural_order(seq_len: int, cp: int) -> torch.Tensor:
    """The index that turns rank-ordered tokens back into sequence order."""
    return torch.argsort(rank_order(seq_len, cp))
