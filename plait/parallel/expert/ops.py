"""Custom ops that keep a compiled MoE block one graph: torch.compile calls a custom op as it
is, without tracing into it, so what it does with host values stays out of the graph.

- `grouped_mm_loop(a, b, offs)`: what `torch.nn.functional.grouped_mm` computes for a 2-D `a`
  whose rows are sorted by group and a 3-D `b` of one matrix per group (out[s:e] = a[s:e] @
  b[g], the run of group g ending at offs[g]), as one product per group. It serves where torch's
  grouped kernel does not: a GPU before Hopper, a dtype that kernel, or the shape function
  torch.compile checks it with (bf16 only in torch 2.13), refuses. Reading `offs` on the host
  is a sync on a GPU, but inside the op, so the graph does not break there.
- `add_unless_recomputing(total, amount)`: total += amount, except in a forward rerun by
  recomputation inside backward. Which it is is known when the op runs, not when the block is
  traced, so the op asks then.
"""

from __future__ import annotations

from typing import Any

import torch


def recomputing() -> bool:
    """Whether this forward runs inside a backward (activation recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _runs(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


@torch.library.custom_op("plait::grouped_mm_loop", mutates_args=())
def grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a (n, k) with rows sorted by group, b (groups, k, m), offs (groups,) the runs' ends -> (n, m).
    Every group has its product, an empty one too; autocast is off inside, so the result has
    the inputs' dtype, as the shape function below says."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.cat([a[s:e] @ b[g] for g, (s, e) in enumerate(_runs(offs))])


@grouped_mm_loop.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[-1]))


@torch.library.custom_op("plait::grouped_mm_loop_weight_grad", mutates_args=())
def grouped_mm_loop_weight_grad(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The gradient of grouped_mm_loop's `b`: a[s:e]ᵀ @ grad[s:e] per group (zeros for an empty one)."""
    with torch.autocast(a.device.type, enabled=False):
        return torch.stack([a[s:e].t() @ grad[s:e] for s, e in _runs(offs)])


@grouped_mm_loop_weight_grad.register_fake
def _(a: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty((offs.shape[0], a.shape[1], grad.shape[1]))


def _save(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    a, b, offs = ctx.saved_tensors
    grad_a = grouped_mm_loop(grad, b.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm_loop_weight_grad(a, grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm_loop.register_autograd(_backward, setup_context=_save)


@torch.library.custom_op("plait::add_unless_recomputing", mutates_args=("total",))
def add_unless_recomputing(total: torch.Tensor, amount: torch.Tensor) -> None:
    """total += amount, unless this runs inside a backward (recomputation's second forward)."""
    if not recomputing():
        total.add_(amount)


@add_unless_recomputing.register_fake
def _(total: torch.Tensor, amount: torch.Tensor) -> None:
    return None
