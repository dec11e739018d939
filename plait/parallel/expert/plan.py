"""apply_expert_parallel: each ep rank keeps experts / ep of every experts module, and its
forward becomes the all-to-all dispatch (plait.parallel.expert.dispatch).

What an MoE model must offer, found by duck typing so that plait's GPT and transformers'
MoE classes (Mixtral, Qwen2-MoE: the same layout) take the same path:

- an **experts module**: a module with `num_experts`, whose parameters with a first
  dimension of num_experts hold one slice per expert (`gate_up_proj`, `down_proj`, their
  biases), and whose forward is (tokens (n, d), expert indices (n, k), weights (n, k)) ->
  (n, d), or (rows (E·n, d), every expert's rows for every token, expert-major) -> (E·n, d)
  (Llama 4's, dispatched densely: dispatch.DenseExpertDispatch);
- optionally, **MoE blocks** with `take_counts()` (the tokens each expert received since the
  last call), `aux_weight`/`aux_loss_coef` (the balancing loss's weight in backward), and
  `after_routing(counts)`, the block's own rule on the step's routing (the sigmoid
  router's bias): `set_aux_scale` and `after_step` use them, whatever the layout.

ep folds into dp (plait.runtime.mesh: the ep and edp axes). Expert parameters are averaged
over edp, the dp ranks holding the same experts, and divided by dp, not dp / ep: each
expert's gradient already sums what the tokens of all ep ranks sent it.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.expert.dispatch import DenseExpertDispatch, ExpertDispatch, take_formula
from plait.parallel.expert.shard import expert_placement
from plait.parallel.applied import applied, applied_of
from plait.parallel.hooks import StepHooks
from plait.parallel.placement import place, placement_of
from plait.parallel.tensor.layers import carry_grad_sum
from plait.rules import check_experts_split
from plait.runtime import comm
from plait.runtime.comm import Axis
from plait.runtime.mesh import EXPERT, SYNC, Mesh


def experts_modules(model: nn.Module, adapter: Any = None) -> list[nn.Module]:
    """The model's experts modules: the adapter's answer (`expert_modules`: plait's GPT, a
    transformers model's declared ep plan), else any module with num_experts and 3-D
    parameters with num_experts first (see the module docstring)."""
    named = getattr(adapter, "expert_modules", None)
    if callable(named):
        return named(model)
    return [m for m in model.modules() if isinstance(getattr(m, "num_experts", None), int)
            and any(p.ndim >= 3 and p.shape[0] == m.num_experts for p in m.parameters(recurse=False))]


def takes_rows_only(module: nn.Module) -> bool:
    """Whether an experts module's forward takes its rows alone (every expert on every token),
    not (tokens, indices, weights)."""
    try:
        return len(inspect.signature(module.forward).parameters) == 1
    except (TypeError, ValueError):
        return False


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules that route and count (plait's MoE), in forward order."""
    return [m for m in model.modules() if callable(getattr(m, "take_counts", None))]


def apply_expert_parallel(model: nn.Module, axis: Axis, adapter: Any = None) -> int:
    """Keep this ep rank's experts of every experts module and dispatch their tokens over
    `axis`; returns how many experts modules were split. Call it on the whole model, every
    rank built from the same seed, before the pipeline cut and data parallelism (which
    must know the marks)."""
    found = experts_modules(model, adapter)
    if not found:
        raise PlaitError(f"ep {axis.size} needs experts, and {type(model).__name__} has no experts module",
                         hint="an experts module has num_experts and (experts, ...) parameters; see docs/moe.md")
    for module in found:
        experts = module.num_experts
        check_experts_split(experts, axis.size)
        if any(placement_of(p).split("tp") is not None for p in module.parameters(recurse=False)):
            raise PlaitError(f"{type(module).__name__}'s experts are split by tp already, and ep would split "
                             "them again", hint="train it with tp or with ep, not both")
        local = experts // axis.size
        start = axis.rank * local
        for name, param in list(module.named_parameters(recurse=False)):
            if param.ndim >= 1 and param.shape[0] == experts:
                kept = nn.Parameter(param.detach()[start:start + local].clone(), requires_grad=param.requires_grad)
                carry_grad_sum(param, kept)  # under tp + SP each tp rank's expert gradient is partial
                place(kept, expert_placement(axis.rank, axis.size, tuple(param.shape)))
                setattr(module, name, kept)
        module.num_experts = local  # what it holds now (transformers' grouped kernels size by it)
        dispatch = DenseExpertDispatch if takes_rows_only(module) else ExpertDispatch
        module.forward = dispatch(module.forward, axis, experts)
    applied(model).experts = axis
    return len(found)


def expert_axis(model: nn.Module) -> Axis | None:
    """The ep axis of a model (or of the stage list cut from it) split by apply_expert_parallel."""
    return applied_of(model).experts


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """The balancing loss's gradient weight for the next backward: its coefficient × `scale`
    (1 / micro-batches per step, × the fp16 loss scale), as the main loss is scaled."""
    for block in moe_blocks(model):
        block.aux_weight = block.aux_loss_coef * scale


def begin_step(model: nn.Module) -> None:
    """Start a step's count of the all-to-all formula (what ran before it, evaluation say, is dropped)."""
    take_formula(model)


@torch.no_grad()
def after_step(model: nn.Module, sync: Axis) -> dict[str, Any]:
    """After each optimizer step: the tokens each expert received this step, summed over the
    micro-batches and over `sync` (the ranks holding other samples), so every rank sees the
    whole batch's routing; a block that balances itself by them (the sigmoid router's bias:
    `after_routing`, the model's own rule) moves the same way on every rank, once per step
    whatever the accumulation. Returns what the step's record shows: tokens per expert per
    MoE layer, the balancing loss, dropped assignments."""
    blocks = moe_blocks(model)
    if not blocks:
        return {}
    counts = torch.stack([block.take_counts() for block in blocks])
    dropped = torch.stack([block.dropped for block in blocks])
    both = torch.cat([counts, dropped[:, None]], dim=1)
    comm.all_reduce(both, sync)
    counts, dropped = both[:, :-1], both[:, -1]
    for block, seen in zip(blocks, counts):
        block.dropped.zero_()
        if hasattr(block, "after_routing"):
            block.after_routing(seen)
    aux = [float(block.last_aux) for block in blocks if getattr(block, "aux_loss_coef", 0) > 0
           and getattr(block, "router", "") == "softmax"]
    return {"tokens_per_expert": counts.tolist(), "dropped": float(dropped.sum()),
            "aux_loss": sum(aux) / len(aux) if aux else None, "alltoall_formula": take_formula(model)}


class ExpertHooks(StepHooks):
    """A mixture of experts' part in each step (at any ep, 1 included): the balancing loss's
    gradient scaled as the main loss's is, the step's routing counted over the data ranks into
    its record beside the ep bytes the ledger measured, and the run's routing summed up."""

    def __init__(self, model: nn.Module, mesh: Mesh):
        self.model, self.sync = model, mesh.axis(SYNC)

    def begin_step(self, loss_scale: float, micro_batches: int) -> None:
        begin_step(self.model)  # the formula of this step's routing starts with the ledger's snapshot
        set_aux_scale(self.model, loss_scale / micro_batches)

    def end_step(self, step_comm: dict[str, Any]) -> dict[str, Any]:
        routing = after_step(self.model, self.sync)
        # This rank's ep bytes beside the formula on its routing (the world's comm is a max).
        return {"moe": {**routing, "alltoall_measured": step_comm.get(EXPERT, {}).get("all_to_all", 0.0)}}

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        return {"experts": expert_summary(history)} if any("moe" in r for r in history) else {}


def expert_summary(history: list[dict[str, Any]]) -> dict[str, Any]:
    """A mixture of experts' routing over the run (the steps' "moe" records, every rank's
    tokens summed): tokens per expert per MoE layer (this rank's layers), min / mean / max
    per layer, the balancing loss first and last, dropped assignments, and the last step's
    ep all-to-all bytes measured beside the formula on that step's routing (rank 0's both)."""
    steps = [r["moe"] for r in history if "moe" in r]
    totals = [list(map(sum, zip(*layer))) for layer in zip(*(s["tokens_per_expert"] for s in steps))]
    aux = [s["aux_loss"] for s in steps if s.get("aux_loss") is not None]
    return {"tokens_per_expert": totals,
            "per_layer": [{"min": min(t), "mean": sum(t) / len(t), "max": max(t)} for t in totals],
            "aux_loss_first": aux[0] if aux else None, "aux_loss_last": aux[-1] if aux else None,
            "dropped": sum(s["dropped"] for s in steps),
            "alltoall_measured": steps[-1].get("alltoall_measured", 0.0),
            "alltoall_formula": steps[-1].get("alltoall_formula", 0.0)}
