"""A mixture of experts' costs: the all-to-all's bytes, memory of experts / ep, active FLOPs.

Pure arithmetic. One dispatch (one MoE layer, one forward) from one rank of an ep group:

    counts   all-to-all of E int64 counts          (ep-1)/ep · 8E        (ring formula)
    rows     the rows it sends to other ranks      s · d · b
             the rows it returns to them           r · d · b
    backward the same rows' gradients, reversed    (s + r) · d · b

where s and r are the (token, choice) assignments this rank sends to experts held elsewhere
and receives from other ranks. On the routing that happened (the ledger's check, measured
by plait.parallel.expert.dispatch) s and r are counted; for a prediction, uniform routing
gives s = r = tokens · top_k · (ep-1)/ep. Experts that run on every token (Llama 4's) send
every expert's rows, s = r = tokens · E · (ep-1)/ep, and no counts. The formula lives in
plait/wire.py (dispatch_bytes).
"""

from __future__ import annotations

from typing import Any

from plait.wire import dispatch_bytes  # the formula's one home, shared with the ledger's check


def uniform_rows(tokens: int, top_k: int, ep: int) -> float:
    """Assignments a rank sends to (and, by symmetry, receives from) other ep ranks when the
    router spreads them evenly: all but the 1/ep that stay."""
    return tokens * top_k * (ep - 1) / ep


def layer_alltoall(config: Any, layout: Any) -> dict[str, float]:
    """One MoE block's dispatch bytes per rank and micro-batch under uniform routing:
    {"forward": counts + rows out and back, "backward": the rows' gradients}. Experts that run
    on every token (GPTConfig.tp_expert_rows, Llama 4's) send every expert's rows and no counts
    (plait.parallel.expert.dispatch.DenseExpertDispatch): exact, whatever the routing."""
    rows = uniform_rows(layout.tokens_per_micro_batch, routed_rows(config), layout.ep)
    row_bytes = config.d_model * layout.compute_bytes
    counts = 0 if config.tp_expert_rows else config.experts
    forward = dispatch_bytes(rows, rows, row_bytes, counts, layout.ep, backward=False)
    return {"forward": forward, "backward": 2 * rows * row_bytes}


ASSUMPTIONS = (
    "MoE: each ep rank holds experts / ep routed experts of every MoE block, synced over the "
    "dp / ep ranks holding the same ones (axis edp); FLOPs follow the active parameters (the "
    "router, top_k routed and the shared experts of each MoE block); activations count a token's "
    "top_k + shared experts' widths as its MLP, plus 2·k·h rows, 8E of router scores "
    "and 4kE of the balancing loss's choices",
    "ep all-to-all per MoE block and micro-batch, uniform routing: counts (ep−1)/ep·8E, then "
    "t·k·(ep−1)/ep rows of d values out and as many back, forward (again when recomputed); the "
    "rows' gradients both ways backward",
)


def summary(config: Any, layout: Any) -> dict[str, Any]:
    """What `plait estimate` says of the experts: the shape, and one MoE block's all-to-all."""
    per = layer_alltoall(config, layout) if layout.ep > 1 else {"forward": 0.0, "backward": 0.0}
    return {"experts": config.experts, "top_k": config.top_k, "shared": config.shared_experts,
            "moe_layers": config.moe_layers, "ep": layout.ep, "experts_per_rank": config.experts // layout.ep,
            "alltoall_forward": per["forward"], "alltoall_backward": per["backward"]}


def saved_bytes_per_token(config: Any, layout: Any) -> float:
    """What an MoE block saves per token beyond its experts' widths (routed_and_shared_widths),
    averaged over the blocks: each choice's input row as its expert read it (under ep, the row
    that arrived) and its output row back in token order, which the weighting keeps (2·k·h;
    nothing else holds a row: dispatch.Unsort and the all-to-alls keep none), the router's fp32
    scores and probabilities (8E) and the balancing loss's choices (4kE). A model that runs
    every expert on every token (`tp_expert_rows`, Llama 4's) makes E rows a token, not k."""
    if not config.is_moe:
        return 0.0
    k, h, e = routed_rows(config), config.d_model, layout.compute_bytes
    rows = 2 * k * h * e
    return config.moe_layers / config.n_layers * (rows + 8 * config.experts + 4 * k * config.experts)


def dense_width(config: Any) -> float:
    """The dense MLP's units a token computes per block, averaged over the blocks: a dense
    block's ffn_hidden, none in an MoE block (whose experts' widths are
    `routed_and_shared_widths`)."""
    return config.ffn_hidden * (1 - config.moe_layers / config.n_layers)


def routed_and_shared_widths(config: Any) -> tuple[float, float]:
    """(routed units, shared units) a token computes per block, averaged over the blocks: an
    MoE block's routed rows times an expert's width, and its shared experts' width."""
    moe = config.moe_layers / config.n_layers
    return routed_rows(config) * config.expert_width * moe, config.shared_width * moe


def expert_units_on_rank(config: Any, layout: Any) -> tuple[float, float]:
    """(units whole on every tp rank, units split by tp) of a token's experts, averaged over
    the blocks: the routed ones split only where the model's plan splits them and no ep keeps
    them whole (GPTConfig.routed_split_by_tp), the shared ones with them or beside whole routed
    ones (shared_split_by_tp: dots1's)."""
    routed, shared = routed_and_shared_widths(config)
    split_routed, split_shared = config.routed_split_by_tp(layout.ep), config.shared_split_by_tp(layout.ep)
    return (routed * (not split_routed) + shared * (not split_shared),
            routed * split_routed + shared * split_shared)


def routed_rows(config: Any) -> int:
    """The routed experts' rows a token makes: its top_k choices, or every expert where the
    model runs them all on every token (GPTConfig.tp_expert_rows)."""
    return config.tp_expert_rows or config.top_k
