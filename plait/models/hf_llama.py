"""What the strategies ask of the transformers Llama family: Llama, Mistral, Qwen2.

Their `*ForCausalLM` classes share one layout, so one adapter serves them all:

    model.embed_tokens -> model.layers[i] (input_layernorm, self_attn.{q,k,v,o}_proj,
    post_attention_layernorm, mlp.{gate,up,down}_proj) -> model.norm -> lm_head
    model.rotary_emb: cos and sin for any positions (no trainable parameters)

(Qwen2 adds biases to q, k and v: column layers split them with their rows.)

Tensor parallelism splits the attention heads and the MLP columns; each attention and each
MLP is a region, so its input gradient is all-reduced once in backward however transformers
calls it (`self_attn(hidden_states=...)`). The embedding and the head are split by
vocabulary (tied or not: one shard serves both), and the head's logits are gathered again,
so `model(input_ids=...)` returns whole logits and `labels=` the same loss as before.
With sequence parallelism the embedding and the head stay whole instead (the model computes
positions and masks from the embedding's output, which must then hold the whole sequence),
and the decoder layers run on a slice of the sequence: the first
layer keeps this rank's slice of its input and the last gathers its output again, so the
model's own code around them (positions, masks, final norm, head) sees the whole sequence.

A pipeline stage does what `LlamaModel.forward` does for its own layers: positions 0..s-1,
the rotary angles from the shared `model.rotary_emb`, and the causal mask (sliding-window
where the config asks for it), made inside the stage, so a stage needs only hidden states.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from plait.models.hf_hooks import check_splits, gather_logits, hidden_in
from plait.parallel.seam import Parts, StageView
from plait.parallel.tensor.layers import shard_of
from plait.parallel.tensor import regions
from plait.runtime.comm import Axis

LAYER = "model.layers.*"
PLAN: dict[str, str] = {
    f"{LAYER}.input_layernorm": "sequence",
    f"{LAYER}.self_attn": "region",
    f"{LAYER}.self_attn.q_proj": "column",
    f"{LAYER}.self_attn.k_proj": "column",
    f"{LAYER}.self_attn.v_proj": "column",
    f"{LAYER}.self_attn.o_proj": "row",
    f"{LAYER}.post_attention_layernorm": "sequence",
    f"{LAYER}.mlp": "region",
    f"{LAYER}.mlp.gate_proj": "column",
    f"{LAYER}.mlp.up_proj": "column",
    f"{LAYER}.mlp.down_proj": "row",
}
VOCAB_PLAN = {"model.embed_tokens": "vocab", "lm_head": "vocab"}  # without SP (see the docstring)


class LlamaAdapter:
    """Llama, Mistral and Qwen2 causal LMs from transformers, as they are."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return list(model.model.layers)

    def parts(self, model: nn.Module) -> Parts:
        return Parts(blocks="model.layers", first=("model.embed_tokens",), last=("model.norm", "lm_head"),
                     shared=("model.rotary_emb",))

    def run_stage(self, stage: StageView, x: torch.Tensor) -> torch.Tensor:
        """Ids or hidden states (batch, seq, hidden) in; hidden states or logits out."""
        embed = stage.held("model.embed_tokens")
        # Under sequence parallelism hidden states between stages hold seq / tp positions.
        seq = x.shape[1] * (1 if embed is not None else stage.seq_split)
        if embed is not None:
            x = embed(x)
        rotary = stage.held("model.rotary_emb")
        positions = torch.arange(seq, device=x.device).unsqueeze(0)
        whole = x[:, :1].expand(x.shape[0], seq, x.shape[-1])  # the shape the masks are made for
        angles = rotary(whole, position_ids=positions)
        masks = _masks(rotary.config, whole, positions)
        for i, block in enumerate(stage.held_blocks(), start=stage.first_layer):
            out = block(x, attention_mask=masks[_kind(rotary.config, i)], position_ids=positions,
                        position_embeddings=angles, use_cache=False)
            x = out[0] if isinstance(out, tuple) else out
        if stage.is_last:
            x = stage.held("lm_head")(stage.held("model.norm")(x))
        return x

    def tensor_plan(self, model: nn.Module, tp: int, sp: bool) -> dict[str, str]:
        """The layers' plan; each rank must hold whole heads, whole KV heads, 1/tp of the MLP."""
        config = model.config
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        sizes = [("num_attention_heads", heads), ("num_key_value_heads", kv),
                 ("intermediate_size", config.intermediate_size)] + ([] if sp else [("vocab_size", config.vocab_size)])
        check_splits(model, tp, sizes)
        return PLAN if sp else {**PLAN, **VOCAB_PLAN}

    def after_tensor_parallel(self, model: nn.Module, axis: Axis, sp: bool) -> None:
        """Without SP, the split head's logits are gathered whole (the user's code and `labels=`
        read them); with SP, the layers run on sequence slices: split before the first,
        gather after the last."""
        if not sp:
            if shard_of(model.lm_head.weight) is not None:  # split by this plan (a user's may keep it whole)
                model.lm_head.register_forward_hook(lambda module, args, out: gather_logits(out, axis))
            return
        layers = model.model.layers
        split = hidden_in(lambda x: regions.scatter_to_sequence(x, axis))
        layers[0].register_forward_pre_hook(split, with_kwargs=True)
        layers[-1].register_forward_hook(lambda module, args, out: _map_hidden(
            out, lambda x: regions.gather_to_replicated(x, axis)))


def _kind(config: Any, layer: int) -> str:
    """The attention a layer runs: Qwen2 names it per layer; Mistral slides a window everywhere."""
    types = getattr(config, "layer_types", None)
    if types:
        return types[layer]
    return "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"


def _masks(config: Any, whole: torch.Tensor, positions: torch.Tensor) -> dict[str, Any]:
    """The masks the family's model makes (None when attention can be told `is_causal`)."""
    kinds = {_kind(config, i) for i in range(config.num_hidden_layers)}
    make = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    return {kind: make[kind](config=config, inputs_embeds=whole, attention_mask=None, past_key_values=None,
                             position_ids=positions) for kind in kinds}


def _map_hidden(out: Any, change: Any) -> Any:
    return (change(out[0]), *out[1:]) if isinstance(out, tuple) else change(out)
