"""apply_context_parallel: the model's attention over the cp ranks, its positions the global ones.

Each cp rank holds 2 of the sequence's 2·cp chunks (plait.parallel.context.chunks), for
every layer: embeddings, MLPs, norms and the loss see local tokens only, so their
activations shrink by cp. Attention alone needs the whole sequence; the model's adapter
(plait.parallel.seam) routes it through `ContextParallel.attend` (ring or Ulysses), and a
forward pre-hook on the model gives it the global positions of its tokens, which RoPE and
learned position tables read.

Context parallelism is *engaged* around a training step's forward and backward (the
trainer does it, `context_engaged(model)`); outside it, evaluation and sampling run whole sequences
through the model's own attention, unchanged. Within it the model refuses what the split
cannot honour rather than dropping it: an attention mask (padding, documents) or position
ids of the caller's own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.context.chunks import local_positions, shard_sequence
from plait.parallel.context.ring import ring_attention
from plait.parallel.context.ulysses import ulysses_attention
from plait.parallel.hooks import StepHooks
from plait.parallel.packed import Packed, takes_documents
from plait.parallel.applied import applied, applied_of
from plait.rules import CP_KINDS, check_choice
from plait.runtime.comm import Axis



class ContextParallel:
    """What a model under context parallelism holds: the cp axis, the attention kind, and
    whether a training step has engaged it."""

    def __init__(self, axis: Axis, kind: str):
        check_choice("cp-kind", kind, CP_KINDS)
        self.axis, self.kind, self.active = axis, kind, False
        self.sharded: int | None = None  # tokens per sequence shard_batch last gave this rank
        # The running forward's packed documents (batch, whole seq), for a model whose forward
        # does not take them (transformers'): its attention function reads them here.
        self.documents: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
               scale: float | None = None, documents: torch.Tensor | None = None,
               window: int | None = None) -> torch.Tensor:
        """Attention of this rank's queries (batch, heads, local, head_dim) to the whole
        sequence's keys and values (batch, kv_heads, local, head_dim), by the chosen kind.
        `documents` (batch, whole seq): packed documents' numbers; a query sees its own only.
        `window`: a sliding window, in positions (a key at most window − 1 before its query)."""
        if window is not None and window >= q.shape[2] * self.axis.size:
            window = None  # the whole causal past is within it
        if self.kind == "ulysses":
            if q.shape[1] % self.axis.size:
                raise PlaitError(f"--cp-kind ulysses splits attention heads over cp: {q.shape[1]} heads (per tp "
                                 f"rank) are not divisible by cp={self.axis.size}",
                                 hint="use --cp-kind ring, or a cp that divides the heads")
            return ulysses_attention(q, k, v, self.axis, causal, scale, documents, window)
        return ring_attention(q, k, v, self.axis, causal, scale, documents, window)

    def positions(self, local: int, device: torch.device) -> torch.Tensor:
        """(1, local): the global positions of this rank's `local` tokens."""
        seq = local * self.axis.size
        return local_positions(seq, self.axis.rank, self.axis.size).to(device).unsqueeze(0)


def apply_context_parallel(model: nn.Module, axis: Axis, kind: str = "ring", adapter: Any = None) -> nn.Module:
    """Route `model`'s attention through context parallelism over `axis` (in place).

    The adapter's `context_attention(model, context)` replaces the attention; a model whose
    adapter has none is refused with one line rather than trained wrong."""
    if axis.size == 1:
        return model
    setup = getattr(adapter, "context_attention", None)
    if not callable(setup):
        raise PlaitError(f"cp {axis.size} needs to know where {type(model).__name__}'s attention is, and its "
                         f"adapter {type(adapter).__name__} does not say",
                         hint="context parallelism trains plait's GPT and transformers' causal LMs; drop --cp")
    context = ContextParallel(axis, kind)
    setup(model, context)
    model.register_forward_pre_hook(_global_positions(context), with_kwargs=True)
    applied(model).context = context
    return model


def context_of(model: nn.Module) -> ContextParallel | None:
    return applied_of(model).context


@contextlib.contextmanager
def context_engaged(model: nn.Module) -> Iterator[None]:
    """Context parallelism on for what runs inside: forward, backward and any recomputation."""
    context = context_of(model)
    if context is None:
        yield
        return
    context.active = True
    try:
        yield
    finally:
        context.active, context.sharded, context.documents = False, None, None


def shard_batch(model: nn.Module, *tensors: Any) -> tuple[Any, ...]:
    """This cp rank's tokens of each (batch, seq, ...) tensor: inputs and targets alike. Packed
    documents (plait.parallel.packed) keep their document numbers whole: the attention reads
    the documents of keys other ranks hold."""
    context = context_of(model)
    if context is None:
        return tensors
    seq = tensors[0].shape[1]
    if seq % (2 * context.axis.size):
        raise PlaitError(f"cp {context.axis.size} cuts each sequence into {2 * context.axis.size} chunks: "
                         f"a sequence of {seq} tokens does not divide",
                         hint=f"give a --seq-len divisible by {2 * context.axis.size}")
    context.sharded = seq // context.axis.size

    def mine(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, context.axis.rank, context.axis.size, dim=1)

    return tuple(Packed(mine(t.ids), mine(t.positions), t.documents) if isinstance(t, Packed) else mine(t)
                 for t in tensors)


def _global_positions(context: ContextParallel) -> Any:
    """The model's forward pre-hook: while engaged, position_ids = this rank's global positions."""

    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if not context.active and not takes_documents(module) and "document_ids" in kwargs:
            # whole sequences (evaluation): the model finds the documents in the positions
            return args, {k: v for k, v in kwargs.items() if k != "document_ids"}
        if not context.active:
            if context.sharded is not None:
                raise PlaitError("shard_batch gave this rank its chunks of each sequence, and the model runs "
                                 "without context parallelism engaged: its attention would see those chunks only",
                                 hint="run the forward and backward inside plait.context_engaged(model)")
            return None
        if ids is None:
            raise PlaitError(f"{type(module).__name__} was called without input_ids or inputs_embeds under context "
                             "parallelism, so its tokens' positions are unknown", hint="pass the token ids")
        if context.sharded is not None and ids.shape[1] != context.sharded:
            raise PlaitError(f"under context parallelism each rank runs its {context.sharded} tokens of every "
                             f"sequence (shard_batch), and the model got {ids.shape[1]}",
                             hint="pass the model what plait.shard_batch returns")
        if kwargs.get("document_ids") is not None:  # packed documents, sharded by shard_batch
            if takes_documents(module):
                return None  # their positions are the caller's; the model hands its attention the documents
            context.documents = kwargs["document_ids"]  # for the attention function (plait.models.hf.context)
            return args, {k: v for k, v in kwargs.items() if k != "document_ids"}
        context.documents = None
        for name in ("attention_mask", "position_ids"):
            if kwargs.get(name) is not None:
                raise PlaitError(f"the caller's {name} (padding, packed documents) cannot be honoured across "
                                 "cp ranks: context parallelism makes the positions and the causal mask itself",
                                 hint="give packed documents as plait's Packed batches (--doc-mask), train whole, "
                                      "unpadded sequences under cp, or drop --cp")
        return args, {**kwargs, "position_ids": context.positions(ids.shape[1], ids.device)}

    return hook


class ContextHooks(StepHooks):
    """Context parallelism's part in each step: this cp rank's tokens of every batch, and
    the attention routed through the cp group while a step's forwards and backwards run."""

    def __init__(self, model: nn.Module):
        self.model = model

    def batch(self, inputs: Any, targets: torch.Tensor) -> tuple[Any, torch.Tensor]:
        return shard_batch(self.model, inputs, targets)  # type: ignore[return-value]

    def engaged(self) -> contextlib.AbstractContextManager[None]:
        return context_engaged(self.model)
