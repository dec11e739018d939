"""A transformers model's declared tensor-parallel plan, in plait's styles.

transformers declares how each layer of a family splits (`model.tp_plan`, e.g. Qwen3's
{"model.layers.*.self_attn.q_proj": "colwise", ..., "lm_head": "colwise_gather_output"}),
for its own DTensor-based tensor parallelism. plait reads the same words and splits with its
own layers (plait.parallel.tensor):

| transformers                     | plait                 | why                                           |
|----------------------------------|-----------------------|-----------------------------------------------|
| colwise                          | column+share          | output features split; readers of one input   |
|                                  |                       | enter the region once (tensor/entry.py)       |
| colwise_gather_output, colwise_rep | column_gather+share | the same, output all-gathered whole (the head)|
| rowwise                          | row                   | input features split, output summed           |
| rowwise_split_input, rowwise_rep | row_split             | whole input, each rank keeps its slice        |
| embedding_rowwise                | vocab                 | the embedding split by vocabulary rows        |
| replicated_with_grad_allreduce   | grad_sum              | kept whole, gradients summed (per-head norms) |
| packed_colwise (a 2-D nn.Linear) | column:2+share        | gate|up packed in one output: each rank gets  |
|                                  |                       | its slice of both halves                      |
| sequence_parallel                | sequence              | gradients summed under SP                     |
| mla_kv_a_proj                    | enter_tail:r          | kept whole, its last r = qk_rope_head_dim     |
|                                  |                       | outputs (the rotary key) enter the region     |
| moe_tp_experts, all_reduce       | experts               | every expert's hidden units split (its        |
|                                  |                       | parameters' entries): inputs enter, the output|
|                                  |                       | is summed (parallel/tensor/experts.py)        |
| moe_identity_expert              | divided               | inside the experts: its input over tp, as its |
|                                  |                       | whole output joins every rank's partial sum   |
| local_params, replicate          | (nothing)             | plait's slices are plain tensors already; a   |
|                                  |                       | module no entry names stays whole             |
| colwise, rowwise on a parameter  | param_column, param_row | dimension -2 (a 1-D parameter's only one),  |
| packed_colwise, packed_rowwise   | param_column:2, param_row:2 | or the last; packed: gate|up cut alike  |

A mixture of experts whose config also declares an ep plan keeps its experts whole under tp
(their entries are left out: expert parallelism splits them). Anything else (local_*,
embedding_colwise, a parameter entry in another style...) is refused in one line naming
the pattern and the style: a split plait cannot honour is never skipped silently.

Under sequence parallelism only the blocks run on sequence slices (hf_hooks.split_sequence_around:
split entering the first, gathered leaving the last): the model computes positions and masks
from the embedding's output, which must then hold the whole sequence, and runs its final norm
and head on what the last block returns. The embedding and the head keep their split by
vocabulary and read the whole sequence ("+whole": the embedding's output all-reduced, the
head's input gradient too, as without SP), so no rank holds the whole vocabulary's weights or
logits. The attention and
the MLP then read their input's shape on a slice, so each child of a block holding column
layers becomes a "region", entered (all-gathered) from its first input; one probe forward
checks that every column layer in it reads exactly that input (else SP is refused), and
finds the parameters of the blocks that run outside the regions, on a sequence slice (the
layer norms): they are marked "sequence". Those inside a region (a per-head q_norm) see the
whole sequence. A region whose column layers read its input reshaped (Llama 4's MoE
flattens its tokens) runs whole ("region+whole": its row layers sum whole, and it keeps this
rank's chunk leaving). A region whose column layers read anything else, or that does not
leave through a row layer (Qwen3-Next's linear attention gathers its projections whole), and
a child the plan leaves whole that mixes tokens (an attention no entry splits: its forward
takes a mask or positions) read the whole sequence ("gathered"), their layers split as
without SP. An MoE block holding experts kept whole for ep beside split shared experts has
nothing split under SP (plans.whole_beside_experts).
"""

from __future__ import annotations

import functools
import inspect
import logging
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.models.hf.hooks import check_splits
from plait.parallel.probe import quiet, spread_ids
from plait.parallel.tensor.plan import first_input_name
from plait.parallel.tensor.styles import COLUMNS, PARAMS, ROWS, SPLIT, WHOLE, parse_style

log = logging.getLogger(__name__)

DECLARED: dict[str, str] = {  # transformers' style -> plait's
    "colwise": "column+share",
    "colwise_gather_output": "column_gather+share",
    "colwise_rep": "column_gather+share",
    "rowwise": "row",
    "rowwise_split_input": "row_split",
    "rowwise_rep": "row_split",
    "embedding_rowwise": "vocab",
    "replicated_with_grad_allreduce": "grad_sum",
    "packed_colwise": "column:2+share",
    "sequence_parallel": "sequence",
    "moe_tp_experts": "experts",
    "all_reduce": "experts",  # a module over split parameters (Inkling's shared experts): its output summed
    "moe_identity_expert": "divided",  # inside the experts: its whole output joins each rank's partial sum
}
# Styles that only say how transformers' DTensors run a module (its forward with its own
# shards as plain tensors: the owner of a split attention sink): plait's slices are plain
# tensors already, so they ask for nothing.
LOCAL_ONLY = ("local_params", "replicate")  # "replicate": every rank keeps it whole, as plait does unasked
PARAM_DECLARED: dict[str, str] = {  # transformers' style on a parameter -> plait's (the dimension it cuts)
    "colwise": "param_column",
    "rowwise": "param_row",
    "packed_colwise": "param_column:2",
    "packed_rowwise": "param_row:2",
}


def refuse(model: nn.Module, pattern: str, style: str, why: str = "") -> PlaitError:
    """The one line a declared split plait cannot honour gets."""
    name = type(model).__name__
    return PlaitError(f"{name} declares tp_plan[{pattern!r}] = {style!r}{why}: plait cannot split it that way",
                      hint=f"plait reads the styles {', '.join(DECLARED)}; train {name} with tp 1 (dp, ZeRO "
                           "and pp need no tp plan), or pass ParallelConfig(tp_plan=...) in plait's styles "
                           "(docs/tensor.md)")


def plait_plan(model: nn.Module, declared: dict[str, str]) -> dict[str, str]:
    """{pattern: plait style} for a declared {pattern: transformers style} (a pattern naming
    parameters gets a parameter style); PlaitError if any entry cannot be honoured. Patterns
    that match nothing in this model (a layer its config leaves out) split nothing and are
    dropped."""
    modules = dict(model.named_modules())
    plan: dict[str, str] = {}
    for pattern, style in declared.items():
        if style in LOCAL_ONLY:
            continue
        hits = [module for name, module in modules.items() if name and fnmatchcase(name, pattern)]
        if not hits:
            if any(fnmatchcase(name, pattern) for name, _ in model.named_parameters()):
                if style not in PARAM_DECLARED:
                    raise refuse(model, pattern, style, " (a parameter)")
                plan[pattern] = PARAM_DECLARED[style]
            continue
        mapped = DECLARED.get(style) or (_mla_tail(model) if style == "mla_kv_a_proj" else None)
        if mapped is None or (style == "packed_colwise" and not all(isinstance(m, nn.Linear) for m in hits)):
            raise refuse(model, pattern, style)
        plan[pattern] = mapped
    _check_experts_split(model, plan, declared)
    return plan


def text_config(model: nn.Module) -> Any:
    """The config of the model's text part (a multimodal config keeps it inside), or its own."""
    config = getattr(model, "config", None)
    return config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config


def _mla_tail(model: nn.Module) -> str | None:
    """MLA's kv_a_proj: kept whole, its last qk_rope_head_dim outputs (the rotary key every
    head reads) entering the region; None when the config does not say how many."""
    rope = getattr(text_config(model), "qk_rope_head_dim", None)
    return f"enter_tail:{rope}" if isinstance(rope, int) and rope > 0 else None


def _check_experts_split(model: nn.Module, plan: dict[str, str], declared: dict[str, str]) -> None:
    """An "experts" module sums its ranks' outputs: each must hold a split of its parameters
    (a parameter entry under it), else every rank's whole output would be added tp times; a
    "divided" module only inside one, whose sum counts its output once."""
    experts = [pattern for pattern, style in plan.items() if style == "experts"]
    for pattern, style in plan.items():
        if style == "divided" and not any(pattern.startswith(f"{e}.") for e in experts):
            raise refuse(model, pattern, declared.get(pattern, style), " outside an experts module whose output is summed")
    params = [name for name, _ in model.named_parameters()]
    split = [name for pattern, style in plan.items() if parse_style(style)[0] in PARAMS
             for name in params if fnmatchcase(name, pattern)]
    for pattern, style in plan.items():
        if style != "experts":
            continue
        for name, _ in model.named_modules():
            if name and fnmatchcase(name, pattern) and not any(p.startswith(f"{name}.") for p in split):
                raise refuse(model, pattern, declared.get(pattern, style), f" with no parameter of {name} split")
        inside = [key for key, inner in plan.items() if parse_style(inner)[0] not in (*PARAMS, "divided")
                  and key != pattern and key.startswith(f"{pattern}.")]
        if inside:  # a row layer inside would sum its output, and the module sum it again
            raise refuse(model, pattern, declared.get(pattern, style), f" around layers split as modules ({inside[0]})")


def check_config(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    """One error naming the config value tp does not divide: each rank must hold whole heads,
    whole KV heads, 1/tp of the MLP and (when split) of the vocabulary."""
    config = getattr(model, "config", None)
    styles = {parse_style(style)[0] for style in plan.values()}
    wanted: list[str] = []
    if "column" in styles and splits_attention(model, plan):  # split outputs are read as this rank's heads
        wanted += ["num_attention_heads", "num_key_value_heads"]
    if styles & {*COLUMNS, *ROWS}:
        wanted.append("intermediate_size")
    if "vocab" in styles:
        wanted.append("vocab_size")
    sizes = [(what, getattr(config, what, None)) for what in wanted]
    check_splits(model, tp, [(what, size) for what, size in sizes if isinstance(size, int)])


# an attention's query, key and value layers by name (fused ones too); with its output's, its projections
QKV_NAMES = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query", "key", "value", "query_key_value", "c_attn", "Wqkv")
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # the plain ones, as a plan names them


def splits_attention(model: nn.Module, plan: dict[str, str]) -> bool:
    """Whether a column entry splits an attention's projection: one named as a query, key or
    value, or any inside a module that mixes tokens. Only then must tp divide the heads: a
    plan that splits an MLP alone (DeepSeek-V4's shared experts, as transformers 5.25 declares
    it) leaves its one KV head whole on every rank."""
    columns = [pattern for pattern, style in plan.items() if parse_style(style)[0] == "column"]
    named = dict(model.named_modules())
    for name in named:
        if not any(fnmatchcase(name, pattern) for pattern in columns):
            continue
        parent, _, leaf = name.rpartition(".")
        if leaf in QKV_NAMES or mixes_tokens(named.get(parent, model)):
            return True
    return False


def for_sequence_parallel(model: nn.Module, plan: dict[str, str], blocks: str) -> dict[str, str]:
    """The plan under SP (see the module docstring): what lies outside the blocks keeps its
    split and reads the whole sequence (the embedding and the head: "+whole");
    each child of a block holding column layers (the attention, the MLP) is a region, entered
    once from its first input, so the module reads the whole sequence's shape; the blocks'
    parameters that run outside those regions (the norms) get their gradients summed."""
    inside = {pattern: style for pattern, style in plan.items() if pattern.startswith(f"{blocks}.")}
    styles = {name: parse_style(style)[0] for pattern, style in inside.items()
              for name, _ in model.named_modules() if fnmatchcase(name, pattern)}
    regions = _regions(model, styles, blocks)
    gathered = _unsplit_attention(model, styles, blocks)
    outside, reshaped, other = _probe_regions(model, styles, regions + gathered, blocks)
    other = {name: why for name, why in other.items() if name not in gathered}
    if other:
        log.info("sequence parallelism: %s read whole, split as without SP inside (%s)",
                 ", ".join(sorted(other)), next(iter(other.values())))
    return {**_around_blocks(plan, blocks), **inside,
            **{name: "region" + (WHOLE if name in reshaped else "") for name in regions if name not in other},
            **{name: "gathered" for name in [*gathered, *other]},
            **{name: "sequence" for name in outside}}


MIXES_TOKENS = ("attention_mask", "position_embeddings", "position_ids")  # a forward taking one reads the sequence


def mixes_tokens(module: nn.Module) -> bool:
    """A module with weights whose forward takes a mask or positions (MIXES_TOKENS), as an
    attention's does: under SP it reads the whole sequence where the plan leaves it whole."""
    try:
        takes = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    return any(True for _ in module.parameters()) and any(word in takes for word in MIXES_TOKENS)


def _unsplit_attention(model: nn.Module, styles: dict[str, str], blocks: str) -> list[str]:
    """The children of the blocks that the plan leaves whole (no style at or under them) and
    that mix tokens, as an attention does (their forward takes a mask or positions): under SP
    they read the whole sequence, gathered ("gathered"), where a norm runs on its slice."""
    depth = blocks.count(".") + 2
    found = []
    for name, module in model.named_modules():
        if not name.startswith(f"{blocks}.") or name.count(".") != depth:
            continue
        if any(key == name or key.startswith(f"{name}.") for key in styles):
            continue
        if mixes_tokens(module):
            found.append(name)
    return found


def _around_blocks(plan: dict[str, str], blocks: str) -> dict[str, str]:
    """The plan's entries outside the blocks, which run on the whole sequence: a split layer
    (the embedding, the head) enters and leaves as without SP ("+whole"); a "sequence" mark
    has nothing to sum there, and is dropped."""
    around = {pattern: style for pattern, style in plan.items() if not pattern.startswith(f"{blocks}.")}
    return {pattern: style + WHOLE if parse_style(style)[0] in SPLIT else style
            for pattern, style in around.items() if parse_style(style)[0] != "sequence"}


def _regions(model: nn.Module, styles: dict[str, str], blocks: str) -> list[str]:
    """The children of the blocks that hold column layers; a column layer that is itself a
    child of its block has no module around it to enter, and is refused."""
    depth = blocks.count(".") + 2  # "model.layers" -> "model.layers.0.self_attn" has 3 dots
    regions = set()
    for name, style in styles.items():
        if style in COLUMNS and name.startswith(f"{blocks}."):
            if name.count(".") < depth + 1:
                raise _sp_refusal(model, f"{name} sits in its block with no module around it to enter")
            regions.add(".".join(name.split(".")[:depth + 1]))
    return sorted(regions)


def _probe_regions(model: nn.Module, styles: dict[str, str], regions: list[str],
                   blocks: str) -> tuple[list[str], set[str], dict[str, str]]:
    """One probe forward: every column layer of a region must read the region's own input,
    that input reshaped (Llama 4's MoE flattens its tokens: the region then runs whole,
    "region+whole"), or what a module inside the region made from it (MLA's q_b_proj reads
    q_a_proj's normed output: the whole layers between compute on the entered input, their
    gradients partial, summed as the probe finds them), by any torch operations
    (`_computed_inside`: AXK2's q_gate_proj reads two latents concatenated). A region where
    one reads anything else (Qwen3-Next's linear attention gathers its projections whole) is
    read whole instead ("gathered"), its layers entering one by one as without SP. Returns the
    blocks' modules with parameters, not split nor summed by the plan, that ran outside every
    region (on a sequence slice), the regions whose input is read reshaped, and {region read
    whole: why}."""
    active: list[tuple[str, Any]] = []
    outside: set[str] = set()
    reshaped: set[str] = set()
    other: dict[str, str] = {}
    made: list[torch.Tensor] = []  # the outputs of the modules inside the active region
    entered: list[int] = []  # the autograd node number each active region was entered at
    rows: list[torch.Tensor] = []  # those of its row layers, which leave the region

    def inside(module: nn.Module, args: tuple, out: Any, row: bool) -> None:
        first = _first_tensor(out)
        if active and first is not None:
            made.append(first)
            if row:
                rows.append(first)

    def enter(module: nn.Module, args: tuple, kwargs: dict, name: str) -> None:
        active.append((name, args[0] if args else kwargs.get(first_input_name(module) or "")))
        entered.append(_next_node_number())

    def leave(module: nn.Module, args: tuple, out: Any, name: str) -> None:  # returns None: out stays
        first = _first_tensor(out)
        if name not in reshaped and not any(first is row or _reshaped(first, row) for row in rows):
            other.setdefault(name, "its output is not what a row layer inside it returned")
        active.pop()
        entered.pop()
        if not active:
            made.clear()
            rows.clear()

    def column(module: nn.Module, args: tuple, name: str) -> None:
        if not active or not args or args[0] is active[-1][1]:
            return
        if _reshaped(args[0], active[-1][1]):
            reshaped.add(active[-1][0])
        elif not any(args[0] is tensor or _reshaped(args[0], tensor) for tensor in made) \
                and not _computed_inside(args[0], [active[-1][1], *made], entered[-1]):
            other.setdefault(active[-1][0], f"{name} reads another tensor than its input or what is made from it")

    handles = [module.register_forward_hook(functools.partial(inside, row=styles.get(name) in ROWS))
               for name, module in model.named_modules() if any(name.startswith(f"{region}.") for region in regions)]
    for name, module in model.named_modules():
        if name in regions:
            handles.append(module.register_forward_pre_hook(functools.partial(enter, name=name), with_kwargs=True))
            handles.append(module.register_forward_hook(functools.partial(leave, name=name)))
        elif styles.get(name) in COLUMNS:
            handles.append(module.register_forward_pre_hook(functools.partial(column, name=name)))
        elif name.startswith(f"{blocks}.") and name not in styles and any(True for _ in module.parameters(False)):
            handles.append(module.register_forward_pre_hook(
                lambda *_, name=name: None if active else outside.add(name)))
    try:
        with quiet(model, grad=True):  # the graph tells what a column layer's input was computed from
            # two rows: a module that flattens (seq, batch) rather than (batch, seq) copies, and is read whole
            model(input_ids=probe_ids(model, 4).repeat(2, 1), **no_cache(model))
    finally:
        for handle in handles:
            handle.remove()
    return sorted(outside), reshaped, other


def _next_node_number() -> int:
    """The sequence number autograd gives the next node it makes (they rise as the forward runs)."""
    return (torch.ones((), device="meta", requires_grad=True) * 1).grad_fn._sequence_nr() + 1


def _computed_inside(x: torch.Tensor, sources: list[Any], since: int) -> bool:
    """Whether `x` was computed, by any torch operations, from `sources` (a region's input and
    what its modules made), parameters and constants alone: every path of its graph back ends
    at one of them before it reaches a node made before the region was entered (numbered below
    `since`; a parameter's partial gradient is found and summed by parallelize's probe). Its gradient then reaches the region's entry, summed
    there (AXK2's q_gate_proj reads cat(q_a_layernorm's output, q_a_proj's); dots3 scales its
    latents before reading them); a tensor from outside the region would keep a partial one."""
    stops = {id(source.grad_fn) for source in sources if isinstance(source, torch.Tensor) and source.grad_fn}
    if x.grad_fn is None:
        return False
    pending, seen = [x.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or id(node) in stops or id(node) in seen or type(node).__name__ == "AccumulateGrad":
            continue
        if node._sequence_nr() < since:
            return False
        seen.add(id(node))
        pending.extend(next_node for next_node, _ in node.next_functions)
    return True


def _first_tensor(out: Any) -> torch.Tensor | None:
    """A module's output, or the first of the tuple it returns (an attention's (output, weights))."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    return first if isinstance(first, torch.Tensor) else None


def _reshaped(x: Any, source: Any) -> bool:
    """Whether `x` is `source` reshaped: the same elements of the same storage."""
    return isinstance(x, torch.Tensor) and isinstance(source, torch.Tensor) and x.numel() == source.numel() \
        and x.data_ptr() == source.data_ptr() and x.is_contiguous() and source.is_contiguous()


def _sp_refusal(model: nn.Module, why: str) -> PlaitError:
    return PlaitError(f"sequence parallelism: in {type(model).__name__}, {why}",
                      hint="drop --sp (tensor parallelism alone splits it as it declares)")


def no_cache(model: nn.Module) -> dict[str, bool]:
    """{"use_cache": False} where the forward takes it: a probe, as training, keeps no key/value
    cache (whose update would hand the attention new tensors in place of what it made)."""
    try:
        takes = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in takes else {}


def probe_ids(model: nn.Module, length: int) -> torch.Tensor:
    """(1, length) token ids for a probe forward, on the model's device, spread over the
    vocabulary (every tensor-parallel rank's rows are read), and below every table the ids
    index: Gemma 3n's and Gemma 4's per-layer embedding may hold fewer rows than the vocabulary
    (a probe past them failed with torch's IndexError before any check of plait's)."""
    config = getattr(model, "config", None)
    tables = [getattr(config, name, None) for name in ("vocab_size", "vocab_size_per_layer_input")]
    vocab = min((rows for rows in tables if isinstance(rows, int) and rows > 0), default=2)
    return spread_ids(vocab, length, next(model.parameters()).device)


def probe_input(model: nn.Module, length: int) -> tuple[tuple, dict]:
    """The (args, kwargs) of a transformers causal LM's probe forward (plait.parallel.probe)."""
    return (), {"input_ids": probe_ids(model, length)}
