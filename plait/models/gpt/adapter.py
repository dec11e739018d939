"""What the strategies ask of plait's GPT (plait.parallel.seam), in its own module names.

`GPT.plait_adapter` points here, so `plait.parallel` finds it on the model class without
importing this package. Kept apart from gpt.py so that the model reads on its own.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.gpt.rope import rope_angles
from plait.parallel.probe import spread_ids
from plait.parallel.seam import Parts, StageView
from plait.parallel.tensor.loss import gather_vocab
from plait.runtime.comm import Axis

GPT_PLAN: dict[str, str] = {
    "embed": "vocab",
    "blocks.*.attn_norm": "sequence",
    "blocks.*.attn": "region",
    "blocks.*.attn.q_proj": "column",
    "blocks.*.attn.k_proj": "column",
    "blocks.*.attn.v_proj": "column",
    "blocks.*.attn.o_proj": "row",
    "blocks.*.mlp_norm": "sequence",
    "blocks.*.mlp": "region",
    "blocks.*.mlp.gate_proj": "column",
    "blocks.*.mlp.up_proj": "column",
    "blocks.*.mlp.down_proj": "row",
    "norm": "sequence",
    "lm_head": "vocab",
}


def moe_plan(config: Any) -> dict[str, str]:
    """GPT_PLAN with the MLP entries named block by block, the dense blocks' only: an MoE
    block stays whole on every tp rank (its router and experts replicated, its tokens the
    same on each: no region, so its input's gradient is not summed over tp)."""
    plan = {k: v for k, v in GPT_PLAN.items() if not k.startswith("blocks.*.mlp.") and k != "blocks.*.mlp"}
    for i in range(config.n_layers):
        if not config.moe_layer(i):
            plan.update({k.replace("blocks.*.", f"blocks.{i}."): v for k, v in GPT_PLAN.items()
                         if k.startswith("blocks.*.mlp.") or k == "blocks.*.mlp"})
    return plan


class GPTAdapter:
    """plait's GPT: embedding, blocks, final norm and head; rope tables every stage keeps."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.blocks)

    def parts(self, model: nn.Module) -> Parts:
        return Parts(blocks="blocks", first=("embed",), last=("norm", "lm_head"), shared=("rope_cos", "rope_sin"))

    takes_document_ids = True  # GPT.forward(ids, position_ids, document_ids): plait.parallel.packed

    def run_stage(self, stage: StageView, x: torch.Tensor) -> torch.Tensor:
        """Token ids or hidden states (batch, seq, d_model) in; hidden states or logits out."""
        embed = stage.held("embed")
        # Under sequence parallelism hidden states hold seq / tp positions; rope needs seq.
        seq = x.shape[1] * (1 if embed is not None else stage.seq_split)
        if embed is not None:
            x = embed(x)
        packed = stage.packed  # packed documents: their own positions, attention inside each
        # else, under context parallelism, this rank's two chunks of the sequence
        positions = packed.positions if packed is not None else stage.context_positions(seq, x.device)
        cos, sin = rope_angles(stage.held("rope_cos"), stage.held("rope_sin"), seq, positions)
        for block in stage.held_blocks():
            x = block(x, cos, sin) if packed is None else block(x, cos, sin, packed.documents)
        if stage.is_last:
            x = stage.held("lm_head")(stage.held("norm")(x))
        return x

    def probe_input(self, model: nn.Module, tokens: int) -> tuple[tuple, dict]:
        """The batch a split is checked on before training (plait.parallel.probe): ids spread
        over the vocabulary, so every tensor-parallel rank's rows are read."""
        return (spread_ids(model.config.vocab_size, tokens, model.embed.weight.device),), {}

    def tensor_plan(self, model: nn.Module, tp: int, sp: bool) -> dict[str, str]:
        model.config.check_split(tp, sp)  # one home: the shape's own check, shared with the estimator
        if not model.config.is_moe:
            return GPT_PLAN
        return moe_plan(model.config)

    def expert_modules(self, model: nn.Module) -> list[nn.Module]:
        """Every MoE block's routed experts (plait.models.gpt.moe.Experts), in forward order."""
        from plait.models.gpt.moe import Experts

        return [m for m in model.modules() if isinstance(m, Experts)]

    def context_attention(self, model: nn.Module, context: Any) -> None:
        """Context parallelism (plait.parallel.context): every block's attention core becomes
        `context.attend` while a training step has it engaged, the core it replaces otherwise."""
        for block in model.blocks:
            block.attn.attention_core = functools.partial(_context_core, block.attn.attention_core, context)

    def after_tensor_parallel(self, model: nn.Module, axis: Axis, sp: bool) -> None:
        """Sampling needs the whole vocabulary; under SP, any sequence length when not training."""
        model.gather_vocab = functools.partial(gather_vocab, axis=axis)
        if sp:
            _pad_to_tp(model, axis)


def _context_core(fallback: Any, context: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  documents: torch.Tensor | None = None) -> torch.Tensor:
    if context.active:
        return context.attend(q, k, v, documents=documents)
    return fallback(q, k, v) if documents is None else fallback(q, k, v, documents)


def _pad_to_tp(model: nn.Module, axis: Axis) -> None:
    """Pad ids to a multiple of tp and crop the logits back, for sampling under SP.

    Exact: causal attention never lets a token see the padding after it. Training keeps the
    error instead, so a wrong --seq-len is not silently padded.
    """
    lengths: list[int] = []

    def pad(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        ids = args[0]
        short = -ids.shape[1] % axis.size
        lengths.append(ids.shape[1] if short and not torch.is_grad_enabled() else -1)
        return (F.pad(ids, (0, short)), *args[1:]) if lengths[-1] >= 0 else None

    def crop(module: nn.Module, args: tuple[Any, ...], logits: torch.Tensor) -> torch.Tensor:
        length = lengths.pop()
        return logits if length < 0 else logits[:, :length]

    model.register_forward_pre_hook(pad)
    model.register_forward_hook(crop)
