"""A transformers mixture of experts, read from the expert-parallel plan its config declares.

transformers 5 stores an MoE layer's routed experts as one module whose weights are 3-D
(`gate_up_proj` (E, 2·hidden, d), `down_proj` (E, d, hidden)) and whose forward takes
(tokens, top_k_index, top_k_weights); the router is `mlp.gate`. The config says which modules
those are in `base_model_ep_plan`: "ep_dispatch_experts" for the experts module and
"grouped_gemm" for each parameter split by expert. plait's expert parallelism
(plait.parallel.expert) needs exactly that, so any class declaring it trains unchanged, and
one that declares something else is refused in one line naming what differs.

Routing statistics: a `RoutingStats` module added to each MoE block counts the tokens each
expert received (a forward hook on the router), for the closing report; with
`output_router_logits` set in the config it also adds plait's per-sequence balancing loss
(plait.models.gpt.moe.MoE's formula) with `router_aux_loss_coef`, since transformers' batch-level
loss is not the same sum when a layout splits the batch.
"""

from __future__ import annotations

import inspect
import logging
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import PlaitError
from plait.models.gpt.moe import RoutingCounts
from plait.parallel.expert.plan import takes_rows_only

log = logging.getLogger(__name__)

DISPATCH, SPLIT = "ep_dispatch_experts", "grouped_gemm"
TP_WORDS = ("colwise", "rowwise", "packed_colwise", "packed_rowwise")  # an ep plan's entries beside the experts
HINT = "plait splits experts declared as base_model_ep_plan {'...experts': 'ep_dispatch_experts', " \
       "'...experts.gate_up_proj' / 'down_proj': 'grouped_gemm'} (transformers 5's MoE layout); see docs/moe.md"


def declared_experts(model: nn.Module, plan: dict[str, Any], tp_plan: dict[str, Any] | None = None) -> list[nn.Module]:
    """The experts modules `plan` (the model's composed ep_plan) names, each checked; with no
    ep plan, those its tp plan names "moe_tp_experts" whose forward takes their rows alone,
    every expert on every token (Llama 4's: `dense_experts`)."""
    name = type(model).__name__
    if not plan:
        found = dense_experts(model, tp_plan or {})
        if found:
            return found
        raise PlaitError(f"expert parallelism needs {name}'s experts, and its config declares no base_model_ep_plan",
                         hint=HINT)
    # tp words beside the experts (Gemma 4's dense MLP, colwise and rowwise): transformers splits
    # those modules over the ep ranks too; plait's ep deals out the experts alone and keeps the
    # rest whole on each ep rank, its gradients synced as every other dense weight's (the probe
    # holds the result to the whole model)
    beside = sorted({style for style in plan.values() if style in TP_WORDS})
    if beside:
        log.info("%s's ep plan also splits modules beside its experts (%s): plait's ep keeps them whole",
                 name, ", ".join(beside))
    unknown = sorted({style for style in plan.values() if style not in (DISPATCH, SPLIT, *TP_WORDS)})
    if unknown:
        raise PlaitError(f"{name}'s ep plan uses {', '.join(map(repr, unknown))}, which plait does not split",
                         hint=HINT)
    if DISPATCH not in plan.values():
        raise PlaitError(f"{name}'s ep plan declares no experts module ({DISPATCH!r})", hint=HINT)
    modules = dict(model.named_modules())
    found = [(key, module) for pattern, style in plan.items() if style == DISPATCH
             for key, module in modules.items() if key and fnmatchcase(key, pattern)]
    if not found:
        raise PlaitError(f"{name}'s ep plan names no module this model has", hint=HINT)
    splits = [pattern for pattern, style in plan.items() if style == SPLIT]
    for key, module in found:
        _check_experts(name, key, module, splits)
    return [module for _, module in found]


def dense_experts(model: nn.Module, tp_plan: dict[str, Any]) -> list[nn.Module]:
    """The modules `tp_plan` marks "moe_tp_experts" that hold num_experts and weights with one
    slice per expert first, and whose forward takes one argument: rows (E·T, d), every expert
    given every token (the router's scores applied to the rows, zero for the experts not
    chosen). plait.parallel.expert.dispatch.DenseExpertDispatch keeps that layout exactly."""
    patterns = [pattern for pattern, style in tp_plan.items() if style == "moe_tp_experts"]
    found = []
    for key, module in model.named_modules():
        if not key or not any(fnmatchcase(key, pattern) for pattern in patterns):
            continue
        experts = getattr(module, "num_experts", None)
        sliced = [p for p in module.parameters(recurse=False) if p.ndim == 3 and p.shape[0] == experts]
        if isinstance(experts, int) and sliced and takes_rows_only(module):
            found.append(module)
    return found


def _check_experts(name: str, key: str, module: nn.Module, splits: list[str]) -> None:
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int):
        raise PlaitError(f"{name}.{key} ({type(module).__name__}) has no num_experts", hint=HINT)
    for param_name, param in module.named_parameters(recurse=False):
        if any(fnmatchcase(f"{key}.{param_name}", pattern) for pattern in splits) and param.shape[0] != experts:
            raise PlaitError(f"{name}.{key}.{param_name} has shape {tuple(param.shape)}, not {experts} experts first",
                             hint=HINT)
    if len(inspect.signature(module.forward).parameters) < 3:
        raise PlaitError(f"{name}.{key}.forward does not take (hidden_states, top_k_index, top_k_weights)", hint=HINT)


class RoutingStats(RoutingCounts):
    """Counts a transformers MoE block's routing (the tokens each expert received, this rank's,
    since the last `take_counts`), and adds the balancing loss when the config asks for it."""

    router = "softmax"
    bias_rate = 0.0

    def __init__(self, experts: int, top_k: int, aux_loss_coef: float):
        super().__init__(experts, top_k, aux_loss_coef)
        self.batch = 1

    def seen(self, logits: torch.Tensor, scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The router's output passes through: counted, and carrying the balancing loss."""
        self.count(index)
        if not self.training or self.aux_loss_coef <= 0:  # no probabilities to compute
            return scores
        probs = F.softmax(logits.float(), dim=-1).view(self.batch, -1, logits.shape[-1])
        return self.with_balance_loss(scores, index, probs)


def counted_blocks(model: nn.Module, experts_modules: list[nn.Module]) -> list[nn.Module]:
    """The MoE blocks whose routing plait counts: those holding one of `experts_modules`, each
    beside its router (`gate`); none unless every such block has one, so that the counts a step
    sums over the data ranks cover every MoE block, as the estimate prices them
    (GPTConfig.counts_routing). Mixtral's blocks have one; PhiMoE's and GPT-OSS's name theirs
    otherwise, and nothing of theirs is counted."""
    held = {id(module) for module in experts_modules}
    blocks = [block for block in model.modules() if id(getattr(block, "experts", None)) in held]
    return blocks if all(isinstance(getattr(block, "gate", None), nn.Module) for block in blocks) else []


def routed_experts(model: nn.Module, plan: dict[str, Any]) -> tuple[list[nn.Module], PlaitError | None]:
    """The experts modules the ep plan (`plan`, composed) names, or none and why plait cannot
    run the plan: what the task installs the routing counts on (refusing under --ep, the
    counts alone lost without) and what the estimate reads to price them, decided once."""
    if not plan:
        return [], None
    try:
        return declared_experts(model, plan), None
    except PlaitError as why:
        return [], why


def counts_routing(model: nn.Module, plan: dict[str, Any]) -> bool:
    """Whether training this model counts its routing (`install_routing_stats`, as the task
    installs it): its ep plan naming its experts, and a router beside each MoE block."""
    return bool(counted_blocks(model, routed_experts(model, plan)[0]))


def install_routing_stats(model: nn.Module, experts_modules: list[nn.Module]) -> int:
    """A RoutingStats on each block `counted_blocks` finds (its `gate` the router)."""
    config = getattr(model, "config", None)
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if getattr(
        config, "output_router_logits", False) else 0.0
    installed = 0
    for block in counted_blocks(model, experts_modules):
        experts, gate = block.experts, block.gate
        stats = RoutingStats(experts.num_experts, int(getattr(gate, "top_k", 1)), coef)
        block.add_module("plait_routing", stats)
        block.register_forward_pre_hook(lambda m, args, s=stats: setattr(s, "batch", args[0].shape[0]))
        gate.register_forward_hook(lambda m, args, out, s=stats: _counted(s, out))
        installed += 1
    return installed


def _counted(stats: RoutingStats, out: Any) -> Any:
    """A router's output, its choices counted: (logits, scores, index, ...), the scores handed
    on with the balancing loss; what follows them (Inkling's shared experts' gammas) as it is.
    An output of another form passes uncounted (its counts stay zero)."""
    if not isinstance(out, tuple) or len(out) < 3:
        return out
    return (out[0], stats.seen(*out[:3]), *out[2:])
