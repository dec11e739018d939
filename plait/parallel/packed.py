"""Packed documents: a batch's token ids with each token's position in its own document.

A row of a batch may hold several documents end to end (plait's packing, `--doc-mask`).
Attention must then stay inside each document and positions restart at each one, or a token
would see the end of another text and a document's position would depend on where it was
packed. `Packed` carries that through every layout as one record:

- `positions` (batch, seq): each token's position in its document, 0 where one begins. This
  is transformers' own convention: given `position_ids` and no mask, its models find the
  documents where the positions do not run on by one, and mask attention to each;
- `documents` (batch, seq): each token's document number along its row, derived from the
  positions once, on the whole row. Context parallelism shards the ids and the positions but
  keeps this whole, so a rank knows the document of every key its ring or all-to-all brings
  in without sending a word more.

The loss side needs nothing here: a target that carries no loss is `IGNORE` (-100, torch's
and transformers' ignore index), and the losses skip it.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from plait.parallel.applied import applied_of
from plait.rules import doc_mask_on

IGNORE = -100  # a target that carries no loss: F.cross_entropy's ignore_index, transformers' label


def document_numbers(positions: torch.Tensor) -> torch.Tensor:
    """(batch, seq) positions -> each token's document number along its row: a new document
    begins wherever a position does not follow the one before by one."""
    step = torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


@dataclass(frozen=True)
class Packed:
    """Token ids of packed documents (see the module docstring)."""

    ids: torch.Tensor
    positions: torch.Tensor
    documents: torch.Tensor

    @classmethod
    def of(cls, ids: torch.Tensor, positions: torch.Tensor) -> "Packed":
        return cls(ids, positions, document_numbers(positions))

    @property
    def shape(self) -> torch.Size:
        return self.ids.shape

    def to(self, device: Any) -> "Packed":
        return Packed(self.ids.to(device), self.positions.to(device), self.documents.to(device))


def takes_documents(model: Any) -> bool:
    """Whether the model's forward takes `document_ids` (plait's GPT); otherwise its own
    forward finds the documents in `position_ids` (transformers')."""
    from plait.parallel.seam import adapter_of

    return bool(getattr(adapter_of(model), "takes_document_ids", False))


def run_model(model: Any, inputs: Any) -> Any:
    """`model(inputs)`, or for packed documents their ids with the positions (and, where the
    model takes them, the documents): every forward the executor runs goes through here.

    A transformers model finds the documents in the positions only when it keeps no cache
    (a cache means generation, where positions run on), so it is told `use_cache=False`.
    Under context parallelism its rank holds two chunks of each row, whose positions cannot
    say where documents begin: it is given the whole rows' documents too, which context
    parallelism's hook takes off the call for its attention (plait.parallel.context.plan)."""
    if not isinstance(inputs, Packed):
        return model(inputs)
    if takes_documents(model):
        return model(inputs.ids, position_ids=inputs.positions, document_ids=inputs.documents)
    extra: dict[str, Any] = {"use_cache": False} if _takes(model, "use_cache") else {}
    if applied_of(model).context is not None:
        extra["document_ids"] = inputs.documents
    return model(inputs.ids, position_ids=inputs.positions, **extra)


@functools.lru_cache(maxsize=None)
def forward_parameters(cls: type) -> tuple[str, ...]:
    """The names a module class's forward takes, in order (`self` first)."""
    return tuple(inspect.signature(cls.forward).parameters)


def _takes(model: Any, name: str) -> bool:
    return name in forward_parameters(type(model))


def loss_tokens(targets: torch.Tensor) -> torch.Tensor:
    """How many of `targets` carry the loss (not IGNORE), as a float64 scalar."""
    return (targets != IGNORE).sum().to(torch.float64)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor,
                       scale: float | None = None) -> torch.Tensor:
    """Causal attention inside each packed document, over whole sequences (batch, heads, seq,
    head_dim), K/V heads as many as q's or a divisor of them (each shared by its group of query
    heads): on a GPU, FlexAttention with a block mask (blocks no document spans are skipped, no
    seq × seq mask is made), compiled once; elsewhere SDPA with the block-causal mask, made once
    a forward (`dense_mask`; the CPU has no FlexAttention backward)."""
    grouped = k.shape[1] != q.shape[1]
    if doc_mask_on(q.device.type) == "blocks":
        return _flex()(q, k, v, block_mask=flex_block_mask(documents, q.shape[-2]), scale=scale, enable_gqa=grouped)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask(documents, q.dtype),
                                                            scale=scale, enable_gqa=grouped)


def dense_mask(documents: torch.Tensor, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """SDPA's additive mask of `documents` (batch, seq): (batch, 1, seq, seq), 0 where a query
    sees a key of its own document at or before it (and, with `window`, at most window − 1
    before it: Ulysses' sliding layers), -inf elsewhere.

    Why additive, and why shared: SDPA turns a boolean mask into this very tensor of the
    query's dtype and keeps it for backward, a fresh b·s² copy at every layer, where one it is
    given is kept as it is. So the mask is made once and every layer of a forward reads it:
    the documents tensor remembers it weakly (`remembered`), so it lives exactly as long as some
    layer's backward keeps it. Under recomputation nothing keeps it, and each layer makes its
    own and drops it (plait.estimate.activations.document_mask_bytes)."""
    def made_afresh() -> torch.Tensor:
        allowed = block_causal(documents, documents, True)
        if window is not None:
            allowed = allowed & sliding_band(documents.shape[1], window, documents.device)
        return additive(allowed, dtype)

    if torch.compiler.is_compiling():  # a compiled block's graph makes its own; what it keeps is Inductor's choice
        return made_afresh()
    made = getattr(documents, "_plait_dense_masks", None)
    if made is None:
        made = {}
        documents._plait_dense_masks = made  # type: ignore[attr-defined]
    return remembered(made, dtype if window is None else (dtype, window), made_afresh)


def remembered(made: dict[Any, Any], key: Any, make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`made[key]` while something (a layer's backward) keeps it alive, else `make()`, remembered
    weakly under `key`: one mask for every layer of a forward, none kept past its last user."""
    mask = made[key]() if key in made else None
    if mask is None:
        mask = make()
        made[key] = weakref.ref(mask)
    return mask


def sliding_band(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """(1, 1, seq, seq) booleans: a query may see a key at or before it and at most window − 1
    before it (transformers' sliding window)."""
    positions = torch.arange(seq, device=device)
    behind = positions.unsqueeze(-1) - positions.unsqueeze(0)
    return ((behind >= 0) & (behind < window))[None, None]


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA adds it to the scores: 0 where allowed, -inf elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


_MASKS: list[tuple[torch.Tensor, Any]] = []  # the last documents and their block mask: one per forward's layers


def flex_block_mask(documents: torch.Tensor, seq: int) -> Any:
    """FlexAttention's block mask of `documents` (batch, seq): a query sees the keys of its own
    document at or before it. Made once for all the layers of a forward (the last one kept)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if _MASKS and _MASKS[0][0].shape == documents.shape and torch.equal(_MASKS[0][0], documents):
        return _MASKS[0][1]

    def same_document(batch: Any, head: Any, query: Any, key: Any) -> Any:
        return (documents[batch, query] == documents[batch, key]) & (key <= query)

    mask = create_block_mask(same_document, documents.shape[0], None, seq, seq, device=documents.device)
    _MASKS[:] = [(documents.clone(), mask)]
    return mask


@functools.lru_cache(maxsize=1)
def _flex() -> Any:
    """flex_attention, compiled (its eager form materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def block_causal(documents_q: torch.Tensor, documents_k: torch.Tensor, causal_diagonal: bool) -> torch.Tensor:
    """(batch, 1, q, k) booleans: a query may see a key of its own document (and, with
    `causal_diagonal`, only a key at or before it: q and k are the same run of positions)."""
    allowed = documents_q.unsqueeze(-1) == documents_k.unsqueeze(-2)
    if causal_diagonal:
        allowed = allowed & torch.ones(allowed.shape[-2:], dtype=torch.bool, device=allowed.device).tril()
    return allowed.unsqueeze(1)
