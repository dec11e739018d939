"""The model seam: what a strategy may ask of a model, without knowing which model it is.

Strategies live in `plait/parallel/` and import nothing from the model families. A family
answers their questions through a small adapter kept beside the model, in the model's own
module names. It is found, in this order: passed to `parallelize(..., adapter=...)` (the
top-level `plait.parallelize` passes one for a transformers model, read from the tensor- and
pipeline-parallel plans the model declares); declared on the model class as `plait_adapter`
(plait's own models); else `GenericAdapter`, which answers from the module tree alone, so any
`nn.Module` keeps data parallelism and ZeRO, and an `nn.Sequential` is also cut.

What is asked, and by whom:

- `blocks(model)`: the repeated blocks, in forward order. ZeRO-3 gathers and frees one
  block at a time (its units); recomputation reruns a block in backward.
- `parts(model)`: where the pipeline cuts (`Parts`): the block list, what runs before it on
  the first stage (the embedding), after it on the last (final norm, head), and the
  parameter-free pieces every stage keeps (rotary tables). Tied weights need no answer of
  their own: a parameter held by both a first and a last piece (an embedding tied to the
  head) is found there, and split across pipeline ranks as two copies whose gradients are
  summed (plait.parallel.pipeline.split).
- `run_stage(stage, x)`: how one stage runs: ids -> hidden states on the first stage,
  hidden -> hidden in between, hidden -> logits on the last (`StageView` says what it reads).
  Whatever the blocks need besides the hidden states (positions, rotary angles, the causal
  mask) is made here, inside the stage, from the shared pieces.
- `tensor_plan(model, tp, sp)`: the tensor-parallel plan in the model's own module names
  ({pattern: style}, styles in plait.parallel.tensor.styles), with one region entry per
  attention and MLP (a "region" mark, or column layers that share their entry) so each does
  one all-reduce in backward; it may refuse a tp the model's shapes cannot take (heads not
  divisible...).
- `after_tensor_parallel(model, axis, sp)`: the family's fix-up once the layers are
  swapped (e.g. sampling that gathers the vocabulary, a forward that keeps its contract).
- `context_attention(model, context)`: route the model's attention through
  `context.attend(q, k, v, causal, scale)` while `context.active` (a training step under
  context parallelism, plait.parallel.context.plan), its own attention otherwise. The
  model's forward must take `position_ids` (the tokens' global positions).

The protocol is structural: an adapter need not import this module, and may answer only
some questions (a missing method means "I don't know": the strategy that needed it says
so in one PlaitError). Subclassing `GenericAdapter` gives the generic answers for the rest.
What a sample is, the loss and the metrics are the training task's (plait.train.loop.task), not
the strategies'.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.zero.shard import find_units
from plait.runtime.comm import Axis

@dataclass(frozen=True)
class Parts:
    """Where a pipeline cuts a model, by the model's own module (or buffer) names.

    `blocks` names the ModuleList (or Sequential) of repeated blocks; "" means the model
    itself is the Sequential to cut. `first` run before the blocks, on the first stage only;
    `last` after them, on the last stage only; `shared` hold no trainable parameters and
    every stage keeps them (rotary tables, a rotary module).
    """

    blocks: str
    first: tuple[str, ...] = ()
    last: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()


class StageView(Protocol):
    """What `ModelAdapter.run_stage` may read of a pipeline stage."""

    index: int  # this stage's place in the pipeline, 0 .. num_stages - 1
    num_stages: int
    first_layer: int  # the full model's index of this stage's first block
    seq_split: int  # tp under sequence parallelism: hidden states between stages hold seq / seq_split positions

    @property
    def is_first(self) -> bool: ...

    @property
    def is_last(self) -> bool: ...

    def held(self, name: str) -> Any:
        """The piece (module or buffer) of `Parts` named `name`, or None where another stage holds it."""
        ...

    def context_positions(self, seq: int, device: torch.device) -> torch.Tensor | None:
        """(1, seq) global positions under engaged context parallelism, else None."""
        ...

    def held_blocks(self) -> list[nn.Module]:
        """This stage's blocks, in forward order."""
        ...

    # The micro-batch's packed documents (plait.parallel.packed.Packed: positions restarting at
    # each document, document numbers), which every stage's attention and positions read; None
    # for plain sequences.
    packed: Any
    # The micro-batch's token ids (every pipeline rank holds them), for a stage that runs its
    # model's own forward on them; None outside a pipeline step.
    token_ids: Any


@runtime_checkable
class ModelAdapter(Protocol):
    """What one model family tells the strategies (see the module docstring)."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The repeated blocks of `model`, in the order its forward runs them."""
        ...


class GenericAdapter:
    """For a model plait knows nothing about: the children of its module lists and
    Sequentials are its blocks; an nn.Sequential is cut between its children."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return find_units(model)

    def parts(self, model: nn.Module) -> Parts | None:
        """An nn.Sequential is cut between its children; of anything else, nothing is known."""
        return Parts(blocks="") if isinstance(model, nn.Sequential) else None

    def run_stage(self, stage: StageView, x: torch.Tensor) -> torch.Tensor:
        for block in stage.held_blocks():
            x = block(x)
        return x

    def after_tensor_parallel(self, model: nn.Module, axis: Axis, sp: bool) -> None:
        return None


def adapter_of(model: nn.Module, adapter: Any = None) -> Any:
    """`adapter` when given, else the one the model's class declares, else the generic one."""
    if adapter is not None:
        return adapter
    declared = getattr(type(model), "plait_adapter", None)
    return declared if declared is not None else GenericAdapter()


def pipeline_parts(model: nn.Module, adapter: Any, pp: int) -> Parts:
    """The adapter's `Parts` of `model`; one PlaitError naming what is missing otherwise."""
    name = type(model).__name__
    hint = ("give parallelize an adapter (plait.parallel.seam.ModelAdapter: parts and run_stage), "
            "or use nn.Sequential")
    for method in ("parts", "run_stage"):
        if not callable(getattr(adapter, method, None)):
            raise PlaitError(f"pp {pp} needs to know how to cut {name}: its adapter "
                             f"{type(adapter).__name__} has no {method}()", hint=hint)
    parts = adapter.parts(model)
    if parts is None:
        raise PlaitError(f"pp {pp} needs to know the blocks of {name}", hint=hint)
    return parts


def tensor_plan(model: nn.Module, adapter: Any, tp: int, sp: bool, split_logits: bool = False) -> dict[str, str]:
    """The adapter's tensor-parallel plan for `model`; one PlaitError when it has none.
    `split_logits`: the loss reads logits split by vocabulary (plait's own), so a head the plan
    gathers whole stays split where the adapter can say so (`split_head`)."""
    plan = getattr(adapter, "tensor_plan", None)
    if not callable(plan):
        raise PlaitError(f"tensor parallelism needs a plan for a {type(model).__name__}",
                         hint='pass ParallelConfig(tp_plan={"layer.name": "column" | "row" | "vocab" | '
                              '"region", ...}) or an adapter with tensor_plan(); see docs/tensor.md')
    made = plan(model, tp, sp)
    split_head = getattr(adapter, "split_head", None)
    return split_head(model, made) if split_logits and callable(split_head) else made


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor, or an object with `.logits` (transformers)."""
    return getattr(outputs, "logits", outputs)
