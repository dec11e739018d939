"""How a split model's tensors compare with the whole model's (plait.parallel.probe).

A rank of a split model holds part of what the whole model computes: its cp chunks of the
sequence, its SP slice of those, its slice of a vocabulary split over tp. `RankView` turns a
whole-model tensor into what this rank should hold, so the two can be compared elementwise;
`relative_error` measures the difference against the whole tensor's scale, and `TOLERANCE`
says, by the model's dtype, what a split may change (the order of sums), never the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.parallel.context.chunks import shard_sequence
from plait.parallel.tensor.ops import all_gather_stacked
from plait.runtime import comm
from plait.runtime.comm import Axis

# Relative error allowed between the split and the whole model: a split changes the order of
# sums (1e-6 in fp32 here), never the model; a 16-bit model rounds each sum to its precision.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 3e-2, torch.float16: 5e-3}


class RankView:
    """How this rank should hold a whole-model tensor: its cp tokens, its SP slice of those,
    and (for a vocabulary split without a gather) its output gathered over tp."""

    def __init__(self, tokens: int, context: Any, tp: Axis, sp: bool, device: torch.device):
        self.tokens, self.context, self.tp, self.sp, self.device = tokens, context, tp, sp, device

    def local(self, whole: torch.Tensor | None, split: torch.Tensor) -> torch.Tensor | None:
        """`whole` as this rank holds it when that has `split`'s shape, else None (not comparable)."""
        for view in self._candidates(whole) if whole is not None else ():
            if view.shape == split.shape:
                return view
        return None

    def gathered(self, split: torch.Tensor | None, whole: torch.Tensor | None) -> torch.Tensor | None:
        """The model's final output gathered over tp where its last dimension is split (a
        vocabulary-parallel head that leaves the gather to the loss), cropped to the whole size."""
        if split is None or whole is None or self.tp.size == 1:
            return split
        if split.shape[-1] < whole.shape[-1] <= split.shape[-1] * self.tp.size:
            pieces = all_gather_stacked(split.contiguous(), self.tp, comm.SETUP)
            return torch.cat(list(pieces), dim=-1)[..., :whole.shape[-1]]
        return split

    def weights_for(self, weights: torch.Tensor | None, split: torch.Tensor | None) -> torch.Tensor | None:
        """The whole output's weights as this rank's output holds them: its tokens, and its
        slice of a vocabulary split over tp (padded with zeros to tp equal slices)."""
        if weights is None or split is None:
            return None
        if self.tp.size > 1 and split.shape[-1] < weights.shape[-1] <= split.shape[-1] * self.tp.size:
            padded = F.pad(weights, (0, split.shape[-1] * self.tp.size - weights.shape[-1]))
            weights = padded.chunk(self.tp.size, dim=-1)[self.tp.rank]
        return self.local(weights, split)

    def _candidates(self, whole: torch.Tensor) -> Iterator[torch.Tensor]:
        yield whole
        if whole.dim() < 2 or whole.shape[1] != self.tokens:
            return
        local = whole
        if self.context is not None:
            local = shard_sequence(whole, self.context.axis.rank, self.context.axis.size, dim=1)
            yield local
        if self.sp and self.tp.size > 1:
            yield local.chunk(self.tp.size, dim=1)[self.tp.rank]


def relative_error(split: torch.Tensor | None, whole: torch.Tensor | None, floor: float = 0.0) -> float:
    """max |split - whole| relative to the largest |whole| (or `floor`, when larger; absolute
    where both are 0); infinite when not comparable."""
    if split is None or whole is None or split.shape != whole.shape:
        return math.inf
    split, whole = split.float().cpu(), whole.float().cpu()
    scale = max(whole.abs().max().item(), floor) or 1.0
    return (split - whole).abs().max().item() / scale


def tolerance(dtype: torch.dtype) -> float:
    return TOLERANCE.get(dtype, 1e-4)


def dtype_of(model: nn.Module) -> torch.dtype:
    """The model's parameters' dtype (the least precise, when mixed)."""
    dtypes = {param.dtype for param in model.parameters() if param.is_floating_point()}
    return max(dtypes, key=lambda dtype: TOLERANCE.get(dtype, 1e-4), default=torch.float32)
