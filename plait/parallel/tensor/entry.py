"""One entry into the tensor-parallel region for column layers that read the same tensor.

A hand-written plan marks a whole attention or MLP as a "region", so q, k and v enter it
once: one all-reduce of the input gradient in backward (under SP, one all-gather in forward
and one reduce-scatter in backward), not three. A plan read from a model's declarations
(transformers' `tp_plan`) has no such marks, and guessing which module's first argument is
"the" input would be wrong for a layer whose k reads another tensor than its q. So column
layers of a "+share" style ask a `SharedEntry` instead, one per split model (per tp axis):

- the first column layer to read a tensor x enters the region with it as usual, and the
  slot keeps (x, weakly; its version; the grad mode; the entered tensor);
- a later column layer given the very same x (same object, still alive, not changed in
  place since, same grad mode) reads the entered tensor it left there.

Why this is exact: entering is the identity in forward (or an all-gather of the sequence),
and its backward all-reduces (reduce-scatters) the sum of the gradients that reach the
entered tensor. Each column layer's input gradient is this rank's partial sum, so adding the
layers' partials before one collective equals one collective each. The other readers of x
(the residual stream) never see the entered tensor: their gradient stays the original,
un-reduced one.

The slot holds the entered tensor strongly (k and v need it after q has run, and under SP
nothing else keeps the gathered input alive) until a row layer on the axis leaves the region
or another input enters: at most one entered tensor outlives its readers.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch


class SharedEntry:
    """A one-slot cache: the last input that entered the region, and what it became."""

    def __init__(self) -> None:
        self._slot: tuple[weakref.ref, int, bool, torch.Tensor] | None = None

    def enter(self, x: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """`make(x)`, or what it gave for this very `x` earlier in the same forward."""
        grad = torch.is_grad_enabled()
        slot = self._slot
        if slot is not None and slot[0]() is x and slot[1] == x._version and slot[2] == grad:
            return slot[3]
        entered = make(x)
        self._slot = (weakref.ref(x), x._version, grad, entered)
        return entered

    def clear(self) -> None:
        """The region was left: no later column layer reads the same entry."""
        self._slot = None

    def __deepcopy__(self, memo: dict[int, Any]) -> "SharedEntry":
        """A copied layer (the pipeline's copy of a tied head) starts with its own empty slot."""
        return SharedEntry()
