"""Context parallelism for transformers models, through their attention-function seam.

transformers looks each layer's attention function up by the name in
`config._attn_implementation` (`AttentionInterface`), and the mask builder likewise
(`AttentionMaskInterface`). plait registers one name per model whose attention function
runs `context.attend` (ring or Ulysses, plait.parallel.context) while a training step has
context parallelism engaged, and the model's own implementation otherwise; its mask
function builds no mask while engaged (the ring applies the causal mask itself, and the
head-tail positions would otherwise look like packed documents) and the model's own mask
otherwise. No layer is copied or replaced, so any family that calls the seam works.

A sliding window the layer hands its attention function (`sliding_window`) is honoured: the
ring masks each block by position, Ulysses masks the whole sequence. What neither can honour
is refused with one line, never dropped: attention dropout, logit soft-capping, attention
sinks, a window the layer declares but does not hand over, and masks other than causal or a
window (chunked, linear layers...).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.models.hf.config import ATTENTION_DROPOUT, attention_dropout

UNSUPPORTED = {"softcap": "logit soft-capping", "s_aux": "attention sinks"}


def context_attention(model: nn.Module, context: Any) -> None:
    """Register `model`'s context-parallel attention and mask functions and select them."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        raise PlaitError("context parallelism reaches a transformers model through its AttentionInterface and "
                         "AttentionMaskInterface, which this transformers version lacks",
                         hint="pip install -U 'transformers>=4.56'") from None
    config = model.config
    check_layer_kinds(model)
    own = config._attn_implementation or "sdpa"
    if own not in ALL_ATTENTION_FUNCTIONS or own not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise PlaitError(f"context parallelism replaces {type(model).__name__}'s attention through transformers' "
                         f"AttentionInterface, and its implementation {own!r} is not registered there",
                         hint="build the model with attn_implementation='sdpa'")
    check_dropout(model)
    own_attention, own_mask = ALL_ATTENTION_FUNCTIONS[own], ALL_MASK_ATTENTION_FUNCTIONS[own]

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        if not context.active:
            return own_attention(module, query, key, value, attention_mask, *args, **kwargs)
        return context_forward(context, module, query, key, value, **kwargs)

    def mask(*args: Any, **kwargs: Any) -> Any:
        return None if context.active else own_mask(*args, **kwargs)

    name = f"plait_context_{id(model):x}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)
    config._attn_implementation = name


def context_forward(context: Any, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                    sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q (batch, heads, local, d), k and v
    (batch, kv_heads, local, d) in; (batch, local, heads, d) and no weights out."""
    seq = query.shape[2] * context.axis.size
    if dropout:
        raise PlaitError(f"attention dropout ({dropout}) is not built under context parallelism",
                         hint="set the model's attention dropout to 0, or drop --cp")
    declared = declared_window(module)
    if sliding_window is None and 0 < declared < seq:
        raise PlaitError(f"{type(module).__name__} declares a sliding window of {declared} tokens it does not hand "
                         "its attention function: cp cannot mask by it", hint=f"use --seq-len {declared} or less, "
                                                                            "or drop --cp")
    for key_name, what in UNSUPPORTED.items():
        if kwargs.get(key_name) is not None:
            raise PlaitError(f"{type(module).__name__} uses {what}, which context parallelism does not build",
                             hint="drop --cp")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = context.attend(query, key, value, causal=causal, scale=scaling, documents=context.documents,
                         window=sliding_window or None)
    return out.transpose(1, 2).contiguous(), None


def declared_window(module: nn.Module) -> int:
    """The sliding window a layer's attention module declares, 0 for none: its `sliding_window`,
    unless it says it does not slide (EXAONE MoE's and Kolibri's full-attention layers hold the
    config's window beside `is_sliding` false, and rightly hand their attention none)."""
    declared = getattr(module, "sliding_window", None)
    if getattr(module, "is_sliding", True) is False or getattr(module, "layer_type", None) == "full_attention":
        return 0
    return declared if isinstance(declared, int) and not isinstance(declared, bool) else 0


def check_layer_kinds(model: nn.Module) -> None:
    """Layers whose mask is neither causal nor a sliding window (chunked attention...): cp
    builds those two only, so they are refused rather than made causal."""
    config = model.config
    kinds = getattr(config, "layer_types", None) or []
    other = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    if other or getattr(config, "attention_chunk_size", None):
        what = other[0] if other else "chunked_attention"
        raise PlaitError(f"{type(model).__name__} has {what} layers, whose mask context parallelism does not build "
                         "(it builds the causal mask and a sliding window's)",
                         hint="drop --cp")


def check_dropout(model: nn.Module) -> None:
    """Attention dropout in the config (Llama's attention_dropout, GPT-2's attn_pdrop)."""
    dropout = attention_dropout({field: getattr(model.config, field, None) for field in ATTENTION_DROPOUT})
    if dropout:
        field, rate = dropout
        raise PlaitError(f"{type(model).__name__}: {field} = {rate}; attention dropout is not built under "
                         "context parallelism", hint=f"set {field} to 0 in the model's config, or drop --cp")
