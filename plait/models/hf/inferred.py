"""A tensor-parallel plan for a transformers model that declares none, read off its layer names.

Most causal LMs that declare no plan (StableLM, OPT, BioGPT, GPT-Neo...) are built from the
same pieces as those that do: an attention with separate q, k and v projections and one output
projection, an MLP with an up (and gate) projection and one down projection. Where a block's
child holds exactly such linears, and nothing else that is linear, plait writes the plan
transformers would have declared (transformers' words: "colwise", "rowwise"), the input
embedding split by vocabulary and the head gathered, and reads it as any declared plan. A
child laid out otherwise (a fused q|k|v, extra projections) stays whole. The probe then holds
the split to the one-process model like any other. An attention that views its heads by the
sizes it keeps (StableLM's `num_heads`, OPT's `embed_dim`) keeps its share of them once split
(`narrow_counts`); one that reads them from the config is refused by the probe, in one line.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1", "fc_in", "c_fc", "w1", "w3")
ROW = ("o_proj", "out_proj", "dense", "down_proj", "fc2", "fc_out", "c_proj", "w2")
ATTENTION = ("q_proj", "k_proj", "v_proj")  # all three, or the attention stays whole
# What an attention may keep of its sizes and view its heads by (StableLM's num_heads and
# hidden_size, OPT's and XGLM's embed_dim): under tp its share of them.
COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_heads", "embed_dim", "hidden_size")


def inferred_tp_plan(model: nn.Module, blocks: str | None) -> dict[str, str]:
    """{pattern: transformers style} for `model`'s blocks (the list named `blocks`), its input
    embedding and its head; {} where no block child is laid out as above."""
    if blocks is None:
        return {}
    layers = model.get_submodule(blocks)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        return {}
    plan: dict[str, str] = {}
    for child_name, child in layers[0].named_children():
        plan.update({f"{blocks}.*.{child_name}.{name}": style for name, style in _split_child(child).items()})
    if not plan:
        return {}
    names = {module: name for name, module in model.named_modules()}
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if isinstance(embedding, nn.Embedding) and embedding in names:
        plan[names[embedding]] = "embedding_rowwise"
    if type(head) is nn.Linear and head in names:
        plan[names[head]] = "colwise_gather_output"
    return plan


def _split_child(child: nn.Module) -> dict[str, str]:
    """{linear name: style} for a block's child holding only column and row linears (one row),
    an attention holding all of q, k and v; {} otherwise."""
    linears = {name: module for name, module in child.named_children() if type(module) is nn.Linear}
    columns = [name for name in linears if name in COLUMN]
    rows = [name for name in linears if name in ROW]
    if not columns or len(rows) != 1 or len(columns) + len(rows) != len(linears):
        return {}
    if any(name in ATTENTION for name in columns) and not all(name in columns for name in ATTENTION):
        return {}
    if any(True for _, sub in child.named_children() if sub not in linears.values()
           and any(True for _ in sub.parameters())):  # a norm inside (per-head q/k norms): left to the model
        return {}
    return {**dict.fromkeys(columns, "colwise"), rows[0]: "rowwise"}


def narrow_counts(model: nn.Module, plan: dict[str, str], tp: int) -> list[str]:
    """Once the split is made: each attention the inferred `plan` splits keeps its share of the
    sizes it holds (`COUNTS`), as a model that views its heads by them (StableLM, OPT, XGLM)
    needs; Llama's, which views them by `-1` and its head size, holds none. The names of the
    attributes narrowed; the probe then holds the split to the one-process model."""
    attentions = {key.rsplit(".", 1)[0] for key in plan if key.rsplit(".", 1)[-1] in ATTENTION}
    narrowed = []
    for name, module in model.named_modules():
        if not any(fnmatchcase(name, pattern) for pattern in attentions):
            continue
        for attr in COUNTS:
            value = vars(module).get(attr)
            if isinstance(value, int) and not isinstance(value, bool) and value % tp == 0:
                setattr(module, attr, value // tp)
                narrowed.append(f"{name}.{attr}")
    return narrowed
