"""GPT-2 from `transformers` (GPT2LMHeadModel): what the strategies ask of it.

GPT-2 differs from a Llama where the strategies look:

- its linears are `Conv1D`, which store the weight transposed, (in, out): the column and row
  styles take them as they are (parallel/tensor/layers.py);
- attention's q, k and v come from one fused `c_attn` whose output is q|k|v: its style is
  "column:3", so each rank gets its slice of each of q, k and v, i.e. its own heads;
- after the split, attention must cut the local output of `c_attn` into three local parts,
  so its `split_size` becomes n_embd / tp (the head count is inferred from head_dim);
- `lm_head` is tied to `wte`, and the positions come from a second embedding, `wpe`.

The embedding and head stay whole under tp, so `model(input_ids=...)` returns whole logits
and `labels=` gives the one-process loss. Sequence parallelism is refused: transformers
builds the positions and the causal mask from the length of the sequence it is given, so
a rank holding a chunk would place its tokens at the wrong positions.

This module imports neither transformers nor plait's strategies: it only names modules.
"""

from __future__ import annotations

from torch import nn

from plait.errors import PlaitError

BLOCKS = "transformer.h"
LAYER = f"{BLOCKS}.*"
QKV = 3  # c_attn's output: q | k | v, equal parts

GPT2_PLAN: dict[str, str] = {
    f"{LAYER}.attn": "region",            # one all-reduce of the input gradient per attention
    f"{LAYER}.attn.c_attn": f"column:{QKV}",
    f"{LAYER}.attn.c_proj": "row",
    f"{LAYER}.mlp": "region",             # and one per MLP
    f"{LAYER}.mlp.c_fc": "column",
    f"{LAYER}.mlp.c_proj": "row",
}


def is_gpt2(model: nn.Module) -> bool:
    """A transformers GPT-2 language model (by class name: transformers is not imported here)."""
    return type(model).__name__ == "GPT2LMHeadModel" and hasattr(model, "transformer")


class GPT2Adapter:
    """What the strategies ask of a transformers GPT2LMHeadModel (plait.parallel.seam)."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The decoder blocks: ZeRO-3's units, what recomputation reruns, what the pipeline cuts."""
        return list(model.transformer.h)

    def tensor_plan(self, model: nn.Module, sp: bool = False) -> dict[str, str]:
        """The tp plan in GPT-2's module names; sequence parallelism is refused (module docstring)."""
        if sp:
            raise PlaitError("sequence parallelism is not supported for GPT-2: transformers computes "
                             "its positions and causal mask from the sequence length a rank is given",
                             hint="drop sp (--sp); tensor parallelism alone splits GPT-2")
        return dict(GPT2_PLAN)

    def after_tensor_parallel(self, model: nn.Module, tp: int) -> None:
        """Attention splits c_attn's (now local) output by `split_size`: make it the local width.

        Set from the config, not from the current value, so calling it twice is harmless.
        """
        config = model.config
        for block in self.blocks(model):
            block.attn.split_size = config.n_embd // tp
            block.attn.num_heads = config.n_head // tp
            block.attn.embed_dim = config.n_embd // tp

    def embedding(self, model: nn.Module) -> list[nn.Module]:
        """What runs before the first block: token and position embeddings."""
        return [model.transformer.wte, model.transformer.wpe]

    def final_norm(self, model: nn.Module) -> nn.Module:
        return model.transformer.ln_f

    def head(self, model: nn.Module) -> nn.Module:
        """The output head, whose weight is `wte`'s (tied)."""
        return model.lm_head

    def tied(self, model: nn.Module) -> list[tuple[str, str]]:
        """Parameters shared by two modules: the head reads the token embedding's table."""
        if model.lm_head.weight is model.transformer.wte.weight:
            return [("lm_head.weight", "transformer.wte.weight")]
        return []
