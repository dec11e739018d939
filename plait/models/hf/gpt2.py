"""What the strategies ask of GPT-2 from `transformers` (GPT2LMHeadModel), in its module names.

    transformer.wte, transformer.wpe (+ transformer.drop) -> transformer.h[i] (ln_1,
    attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj) -> transformer.ln_f -> lm_head

GPT-2 differs from a Llama where the strategies look:

- its linears are `Conv1D`, which store the weight transposed, (in, out): the column and row
  styles take them as they are (parallel/tensor/layers.py);
- attention's q, k and v come from one fused `c_attn` whose output is q|k|v: its style is
  "column:3", so each rank gets its slice of each of q, k and v, i.e. its own heads;
- after the split, attention must cut the local output of `c_attn` into three local parts,
  so its `split_size` becomes n_embd / tp (the head count in forward follows from head_dim);
- `lm_head` is tied to `wte`, and the positions come from a second embedding, `wpe`.

The embedding and head stay whole under tp, so `model(input_ids=...)` returns whole logits
and `labels=` gives the one-process loss. With sequence parallelism the blocks run on a
slice of the sequence: the first block keeps this rank's slice of its input and the last
gathers its output again, so the model's own code around them (positions, the causal mask,
ln_f, the head) sees the whole sequence; ln_1 and ln_2 then see a slice, so their gradients
are summed over tp.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from plait.models.hf import context as hf_context
from plait.models.hf.hooks import check_splits, split_sequence_around
from plait.models.hf.stages import causal_masks, stage_positions
from plait.models.hf.styles import probe_input
from plait.parallel.seam import Parts
from plait.runtime.comm import Axis

BLOCKS = "transformer.h"
LAYER = f"{BLOCKS}.*"
QKV = 3  # c_attn's output: q | k | v, equal parts
FIXED = "_plait_gpt2_tp"  # set on the model once its attention sizes are local

GPT2_PLAN: dict[str, str] = {
    f"{LAYER}.attn": "region",            # one all-reduce of the input gradient per attention
    f"{LAYER}.attn.c_attn": f"column:{QKV}",
    f"{LAYER}.attn.c_proj": "row",
    f"{LAYER}.mlp": "region",             # and one per MLP
    f"{LAYER}.mlp.c_fc": "column",
    f"{LAYER}.mlp.c_proj": "row",
}
SEQUENCE_NORMS: dict[str, str] = {f"{LAYER}.ln_1": "sequence", f"{LAYER}.ln_2": "sequence"}


class GPT2Adapter:
    """GPT2LMHeadModel from transformers, as it is (see the module docstring)."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The decoder blocks: ZeRO-3's units, what recomputation reruns, what the pipeline cuts."""
        return list(model.transformer.h)

    def parts(self, model: nn.Module) -> Any:
        """The pipeline cut: embeddings first, ln_f and the head (tied to wte) last."""
        return Parts(blocks=BLOCKS, first=("transformer.wte", "transformer.wpe", "transformer.drop"),
                     last=("transformer.ln_f", "lm_head"))

    def run_stage(self, stage: Any, x: torch.Tensor) -> torch.Tensor:
        """Ids or hidden states (batch, seq, n_embd) in; hidden states or logits out.

        As GPT2Model.forward does for its own blocks: positions 0..s-1 and the causal mask,
        made here from the stage's first block's config.
        """
        wte = stage.held("transformer.wte")
        seq = x.shape[1] * (1 if wte is not None else stage.seq_split)
        positions = stage_positions(stage, seq, x.device)
        if wte is not None:
            x = stage.held("transformer.drop")(wte(x) + stage.held("transformer.wpe")(positions))
        blocks = stage.held_blocks()
        whole = x[:, :1].expand(x.shape[0], seq, x.shape[-1])  # the shape the mask is made for
        mask = _causal_mask(blocks[0].attn.config, whole, positions) if blocks else None
        for block in blocks:
            out = block(x, attention_mask=mask, use_cache=False)
            x = out[0] if isinstance(out, tuple) else out
        if stage.is_last:
            x = stage.held("lm_head")(stage.held("transformer.ln_f")(x))
        return x

    def probe_input(self, model: nn.Module, tokens: int) -> tuple[tuple, dict]:
        """The batch a split is checked on before training (plait.parallel.probe)."""
        return probe_input(model, tokens)

    def tensor_plan(self, model: nn.Module, tp: int, sp: bool) -> dict[str, str]:
        """The tp plan in GPT-2's names; each rank must hold whole heads and MLP columns."""
        config = model.config
        inner = config.n_inner or 4 * config.n_embd
        check_splits(model, tp, [("n_head", config.n_head), ("n_inner", inner)])
        return {**GPT2_PLAN, **SEQUENCE_NORMS} if sp else dict(GPT2_PLAN)

    def context_attention(self, model: nn.Module, context: Any) -> None:
        """Context parallelism through transformers' attention-function seam (models/hf/context.py);
        the learned position table reads the global positions the model is given."""
        hf_context.context_attention(model, context)

    def after_tensor_parallel(self, model: nn.Module, axis: Axis, sp: bool) -> None:
        """Attention cuts c_attn's (now local) output by `split_size`: make it the local width.
        With SP, the blocks run on sequence slices: split before the first, gather after the last.

        Done once per model (a second call changes nothing), from the config, not the current sizes.
        """
        if getattr(model, FIXED, False):
            return
        setattr(model, FIXED, True)
        config, tp = model.config, axis.size
        for block in self.blocks(model):
            block.attn.split_size = block.attn.embed_dim = config.n_embd // tp
            block.attn.num_heads = config.n_head // tp
        if sp and tp > 1:
            split_sequence_around(self.blocks(model), axis)


def _causal_mask(config: Any, whole: torch.Tensor, positions: torch.Tensor) -> Any:
    """The mask GPT2Model makes (None where attention can be told `is_causal`)."""
    return causal_masks(config, whole, positions, {"full_attention"})["full_attention"]
