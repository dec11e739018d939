"""Tensor parallelism (Megatron-style) and sequence parallelism, applied from a plan.

A plan maps module-name patterns (shell style, `*` matches any run of characters) to styles
(plait.parallel.tensor.styles holds the table): "column" and "row" split a linear layer's
outputs or inputs, "vocab" an embedding's (or a head's) vocabulary rows, "region" makes an
attention or MLP enter the region once for its column layers, "sequence" sums the gradients
of what runs on a chunk of the sequence under SP; "column_gather", "row_split", "grad_sum",
the "+share" entries and the "+whole" layers (the whole sequence under SP too) are the styles
transformers' declared plans need (docs/tensor.md).

`apply_tensor_parallel(model, axis, plan=..., sp=...)` swaps the layers in place. The full
model must already exist on every rank (built from the seed): each rank keeps its slice, so
the initial weights are those of the one-process model for any tp. Order in `parallelize`:
pipeline split, then this, then data parallelism.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.applied import applied, applied_of
from plait.parallel.seam import adapter_of, tensor_plan
from plait.parallel.tensor import regions
from plait.parallel.tensor.entry import SharedEntry
from plait.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                          enter_region, overrides_forward, shard_of, shard_param,
                                          split_embedding_in_place, split_head_in_place, sum_grad_over)
from plait.parallel.tensor.loss import lm_loss, vocab_parallel_cross_entropy
from plait.runtime import comm
from plait.runtime.comm import Axis
from plait.parallel.tensor.ops import all_gather_stacked, register_axis
from plait.parallel.tensor.experts import split_experts
from plait.parallel.tensor.styles import (COLUMNS, PARAMS, ROWS, SPLIT, STYLES, check_divisible, param_split_dim,
                                          parse_style, resolve_plan, shares_entry, whole_sequence)

__all__ = ["STYLES", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "apply_tensor_parallel", "gather_full_params", "lm_loss", "parse_style", "resolve_plan", "shard_of",
           "tensor_parallel_of", "tp_loss_fn", "vocab_parallel_cross_entropy"]

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class TensorParallel:
    """What `apply_tensor_parallel` did to a model: read by the loss, clipping and gathering."""

    axis: Axis
    sp: bool
    regather: bool
    styles: dict[str, str]


def tensor_parallel_of(model: nn.Module) -> TensorParallel | None:
    return applied_of(model).tensor


# -- applying it ------------------------------------------------------------------------------
def apply_tensor_parallel(model: nn.Module, axis: Axis, *, plan: dict[str, str] | None = None,
                          sp: bool = False, regather: bool = True, adapter: Any = None) -> nn.Module:
    """Split `model` over `axis` in place following `plan`, by default the one its adapter
    gives (plait.parallel.seam: `tensor_plan`), then let the adapter fix its family up.

    `sp` turns on sequence parallelism outside the regions. `regather` (SP only) saves each
    region's input as this rank's sequence chunk and all-gathers it again in backward, as
    Megatron-LM does: every activation is then split by tp, for one more all-gather per
    region in backward. False saves the gathered input instead (torch's SequenceParallel):
    exactly the traffic of TP without SP, but the region inputs stay whole.
    """
    if tensor_parallel_of(model) is not None:
        raise PlaitError("tensor parallelism is already applied to this model",
                         hint="call apply_tensor_parallel once, on the whole model")
    adapter = adapter_of(model, adapter)
    if plan is None:
        plan = tensor_plan(model, adapter, axis.size, sp)
    styles = resolve_plan(model, plan)
    sp = sp and axis.size > 1
    applied(model).tensor = TensorParallel(axis, sp, regather, styles)
    register_axis(axis)  # the collectives' custom ops find it by name (ops.py)
    if axis.size == 1:
        return model
    check_divisible(model, styles, axis.size)
    # the slices come from one model; a meta model's are filled later, from one source on every rank
    comm.broadcast_many([tensor.data for tensor in [*model.parameters(), *model.buffers()] if not tensor.is_meta],
                        axis, purpose=comm.SETUP)
    _swap_layers(model, styles, axis, sp, regather)
    fix_up = getattr(adapter, "after_tensor_parallel", None)
    if callable(fix_up):
        fix_up(model, axis, sp)
    split = sum(parse_style(style)[0] in (*SPLIT, *PARAMS) for style in styles.values())
    log.info("tensor parallel over %d ranks%s: %d layers and parameters split", axis.size,
             " with sequence parallelism" if sp else "", split)
    return model


def _swap_layers(model: nn.Module, styles: dict[str, str], axis: Axis, sp: bool, regather: bool) -> None:
    regions = [name for name, style in styles.items() if parse_style(style)[0] == "region"]
    whole = [name for name, style in styles.items() if style == "gathered"  # run as without SP inside
             or (name in regions and whole_sequence(style))]
    memo: dict[int, nn.Parameter] = {}
    entry = SharedEntry()  # the "+share" column layers' one entry per input (tensor/entry.py)
    for name, value in styles.items():
        style, fused = parse_style(value)
        enters = not any(name.startswith(region + ".") for region in regions)
        if style in PARAMS:
            owner, _, attribute = name.rpartition(".")
            module = model.get_submodule(owner)
            param = getattr(module, attribute)
            setattr(module, attribute, shard_param(param, param_split_dim(param, value), axis, memo, fused))
            continue
        module = model.get_submodule(name)
        # a "+whole" layer, or one inside a "region+whole", enters and leaves as without SP
        split_sp = sp and not whole_sequence(value) and not any(name.startswith(w + ".") for w in whole)
        if style == "experts":
            split_experts(module, name, axis, enters=enters, sp=sp)
        elif style == "region" and sp and whole_sequence(value):
            WholeRegion(module, axis).install()
        elif style == "enter_tail" and enters:  # inside a region the tail has entered with the rest
            module.register_forward_hook(functools.partial(_enter_tail, axis=axis, features=fused, name=name))
        elif style == "gathered" and sp:
            WholeRegion(module, axis, replicated=True).install()
        elif style == "region":
            hook = functools.partial(_enter_hook, axis=axis, sp=sp, regather=regather, name=first_input_name(module))
            module.register_forward_pre_hook(hook, with_kwargs=True)
        elif style == "divided":
            module.register_forward_pre_hook(functools.partial(_divided, tp=axis.size, name=first_input_name(module)),
                                             with_kwargs=True)
        elif style == "grad_sum" or (style == "sequence" and sp):
            for param in module.parameters():
                sum_grad_over(param, axis)
        elif style in ROWS:
            _replace(model, name, RowParallelLinear.from_dense(module, axis, memo, sequence_parallel=split_sp,
                                                               split_input=style == "row_split", entry=entry))
        elif style == "vocab" and overrides_forward(module, nn.Linear):  # a head's own arithmetic (Dory's scale)
            split_head_in_place(module, axis, memo)
            if enters:
                module.register_forward_pre_hook(functools.partial(_enter_hook, axis=axis, sp=split_sp,
                                                                   regather=regather, name=first_input_name(module)),
                                                 with_kwargs=True)
        elif style == "vocab" and overrides_forward(module, nn.Embedding):  # keep its own arithmetic
            split_embedding_in_place(module, axis, memo, sequence_parallel=split_sp,
                                     input_name=first_input_name(module))
        elif style == "vocab" and isinstance(module, nn.Embedding):
            _replace(model, name, VocabParallelEmbedding.from_dense(module, axis, memo, sequence_parallel=split_sp))
        elif style in (*COLUMNS, "vocab"):
            _replace(model, name, ColumnParallelLinear.from_dense(
                module, axis, memo, sequence_parallel=split_sp, enters=enters, regather=regather, fused=fused,
                gather_output=style == "column_gather", entry=entry if shares_entry(value) else None))


def _divided(module: nn.Module, args: tuple, kwargs: dict, tp: int, name: str | None) -> tuple[tuple, dict]:
    """A "divided" module's first input (`name`, when passed by keyword) over tp (its gradient
    too: each rank's share of the sum)."""
    if args:
        return (args[0] / tp, *args[1:]), kwargs
    return args, {**kwargs, name: kwargs[name] / tp}


def first_input_name(module: nn.Module) -> str | None:
    """The name of the first parameter of `module.forward`: a region's input, however it is
    passed (transformers calls `self_attn(hidden_states=...)`, plait's GPT `attn(x, ...)`)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return named[0].name if named else None


def _enter_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, axis: Axis, sp: bool,
                regather: bool, name: str | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The region's input enters it once, passed by position or by keyword."""
    if args:
        return (enter_region(args[0], axis, sp, regather), *args[1:]), kwargs
    if name is not None and isinstance(kwargs.get(name), torch.Tensor):
        return args, {**kwargs, name: enter_region(kwargs[name], axis, sp, regather)}
    raise PlaitError(f"tensor-parallel region {type(module).__name__} was called without its input "
                     f"{name or '(first argument)'}",
                     hint="a region enters through the first argument of its forward; mark the module "
                          "that receives the hidden states as \"region\"")


def _enter_tail(module: nn.Module, args: tuple, out: Any, *, axis: Axis, features: int, name: str) -> torch.Tensor:
    """A whole layer's last `features` outputs enter the region, the rest pass as they are:
    MLA's key projection feeds its compressed part to a column layer (which enters on its own)
    and its rotary part straight to every rank's heads, whose gradients are partial sums."""
    if not isinstance(out, torch.Tensor) or out.shape[-1] <= features:
        raise PlaitError(f"{name} ({type(module).__name__}) does not return more than {features} features, so "
                         "its last ones cannot enter the region alone", hint="leave it out of the tp plan")
    head, tail = out.split([out.shape[-1] - features, features], dim=-1)
    return torch.cat([head, regions.copy_to_region(tail, axis)], dim=-1)


class WholeRegion:
    """A "region+whole" under SP: a module that reshapes its tokens (Llama 4's MoE flattens
    them to (batch·seq, hidden)) cannot be left by a reduce-scatter along the sequence, so it
    runs on the whole sequence as without SP: it enters by gathering the sequence, the row
    layers inside it sum their outputs whole, and it leaves keeping this rank's chunk of
    its first output (its tokens in (batch, seq) order). The forward sends an all-reduce where
    SP sends a reduce-scatter; the backward's collectives are SP's.

    `replicated` ("gathered"): a module the plan leaves whole that mixes tokens (an attention
    transformers declares no split for) reads the whole sequence the same way, but every rank
    then computes all of it: its input gradient is whole on every rank, so entering keeps this
    rank's chunk of it (regions.gather_to_replicated) rather than summing the ranks'. Its other
    inputs on the same sequence slice are gathered alike (MPT's MLP adds the residual it is
    given), and leaving, each output that holds the whole sequence keeps this rank's chunk
    (DBRX's attention hands on its residual beside its output)."""

    def __init__(self, module: nn.Module, axis: Axis, replicated: bool = False):
        self.module, self.axis, self.name = module, axis, first_input_name(module)
        self.replicated = replicated  # "gathered": nothing inside is split, each rank computes it all
        self.shapes: list[torch.Size] = []  # the (batch, seq chunk) entering each forward in flight

    def install(self) -> None:
        self.module.register_forward_pre_hook(self.enter, with_kwargs=True)
        self.module.register_forward_hook(self.leave)

    def enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = args[0] if args else kwargs.get(self.name or "")
        if not isinstance(x, torch.Tensor) or x.dim() < 3:
            raise PlaitError(f"tensor-parallel region {type(module).__name__} was called without its "
                             "(batch, seq, hidden) input", hint="drop --sp")
        self.shapes.append(x.shape[:2])
        entered = regions.gather_to_replicated(x, self.axis) if self.replicated else \
            enter_region(x, self.axis, True, regather=False)
        args, kwargs = ((entered, *args[1:]), kwargs) if args else (args, {**kwargs, self.name: entered})
        if self.replicated:  # its other inputs on this rank's slice too (MPT's MLP adds the residual it is given)
            args, kwargs = self._gathered_rest(x, args, kwargs)
        return args, kwargs

    def _gathered_rest(self, x: torch.Tensor, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The inputs after the first that hold the same (batch, seq chunk) as it, gathered
        whole: inside, everything runs as without SP, so each is whole and alike on every rank,
        and so is its gradient, of which entering keeps this rank's chunk."""
        def whole(value: Any) -> Any:
            return regions.gather_to_replicated(value, self.axis) if on_the_same_slice(value, x) else value
        first = 1 if args else 0
        return ((*args[:first], *map(whole, args[first:])),
                {key: value if key == self.name else whole(value) for key, value in kwargs.items()})

    def leave(self, module: nn.Module, args: tuple, out: Any) -> Any:
        batch, chunk = self.shapes.pop()
        first = out[0] if isinstance(out, tuple) else out
        mine = regions.scatter_to_sequence(first.reshape(batch, chunk * self.axis.size, -1), self.axis)
        mine = mine.reshape(batch, chunk, *first.shape[2:]) if first.dim() == 3 else mine.reshape(-1, *first.shape[1:])
        if not isinstance(out, tuple):
            return mine
        whole = (batch, chunk * self.axis.size)  # DBRX's attention also hands on its residual
        rest = [regions.scatter_to_sequence(value, self.axis) if holds_the_sequence(value, whole) else value
                for value in out[1:]]
        return (mine, *rest)


def on_the_same_slice(value: Any, x: torch.Tensor) -> bool:
    """Whether a replicated region gathers `value`, an input beside its first, `x`: a tensor of
    the same (batch, seq chunk) (MPT's MLP's residual). The shape reader counts these gathers by
    the same test (models/hf/load._read_whole_passes)."""
    return isinstance(value, torch.Tensor) and value is not x and value.dim() >= 3 and value.shape[:2] == x.shape[:2]


def holds_the_sequence(value: Any, whole: tuple[int, ...]) -> bool:
    """Whether a replicated region keeps this rank's chunk of `value`, an output beside its first:
    a (batch, seq, hidden) tensor over the whole sequence (DBRX's attention's residual), whose
    gradient is then gathered back."""
    return isinstance(value, torch.Tensor) and value.dim() == 3 and tuple(value.shape[:2]) == tuple(whole)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, new)


# -- what the trainer calls instead of the dense versions -------------------------------------
def tp_loss_fn(model: nn.Module) -> Callable[..., torch.Tensor]:
    """`lm_loss` bound to the model's TP axis: loss_fn(logits, targets, reduction="mean")."""
    info = tensor_parallel_of(model)
    return functools.partial(lm_loss, axis=info.axis if info else None)


def gather_full_params(model: nn.Module, purpose: str = "checkpoint") -> dict[str, torch.Tensor]:
    """{name: full tensor} of every parameter, with split ones gathered over tp (no autograd)."""
    info = tensor_parallel_of(model)
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        shard = shard_of(param)
        if shard is None or info is None:
            out[name] = param.detach().clone()
            continue
        out[name] = shard.join(all_gather_stacked(param.detach(), info.axis, purpose))
    return out
