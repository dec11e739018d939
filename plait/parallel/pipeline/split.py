"""Cut a GPT into pipeline stages: embedding on the first, blocks in between, head on the last.

The full model is built once from the seed on every rank and then cut, so every layout starts
from the same weights; a rank keeps only its own stages and the rest is garbage collected.

Where the cuts go: with one stage per rank, the blocks are split into contiguous runs that
minimise the largest stage's parameter count (the embedding counted on the first stage, the
final norm and head on the last), or follow an explicit `balance` list of block counts.
With `virtual_stages = v > 1` there are v·pp stages of equal size, placed round robin
(stage = chunk·pp + rank, as in `schedule.py`), so each rank holds v non-adjacent chunks.

Tied embeddings: the first stage reads `embed.weight` and the last stage's head multiplies
by it. When those stages live on different ranks (pp > 1) the head gets its own copy of the
weight, made here from the same values; the runner then adds the two gradients on both
ranks after every step (`sum_tied_grads`), so the copies see the same gradient, take the
same optimizer step and stay bitwise equal — the single-process model, held twice.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence

import torch
from torch import nn

from plait.errors import PlaitError
from plait.estimate.layout import balanced_counts
from plait.models.gpt import GPT


class GPTStage(nn.Module):
    """One pipeline stage of a GPT: a run of blocks, plus the embedding and/or the head.

    Input is token ids on the first stage and hidden states (batch, seq, d_model) on the
    others; output is logits on the last stage and hidden states elsewhere.
    """

    def __init__(self, model: GPT, index: int, num_stages: int, first_layer: int, layers: int,
                 untie_head: bool, seq_split: int = 1):
        super().__init__()
        self.index, self.num_stages, self.first_layer = index, num_stages, first_layer
        # Under sequence parallelism hidden states hold seq / tp positions; rope needs seq.
        self.seq_split = seq_split
        self.embed = model.embed if index == 0 else None
        self.blocks = nn.ModuleList(model.blocks[first_layer:first_layer + layers])
        last = index == num_stages - 1
        self.norm = model.norm if last else None
        tied = model.lm_head.weight is model.embed.weight
        # deepcopy gives the head its own Parameter with the same values, without drawing
        # from the random generator (a fresh nn.Linear would).
        self.lm_head = (_own_copy(model.lm_head) if untie_head and tied else model.lm_head) if last else None
        # True on the first and the last stage when each holds a copy of the tied weight.
        self.shares_tied_weight = untie_head and tied and (index == 0 or last)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1] * (1 if self.embed is not None else self.seq_split)
        if self.embed is not None:
            x = self.embed(x)
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for block in self.blocks:
            x = block(x, cos, sin)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x

    def global_name(self, name: str) -> str:
        """The full model's name for this stage's parameter `name` ("blocks.0.x" -> "blocks.4.x")."""
        return re.sub(r"^blocks\.(\d+)\.", lambda m: f"blocks.{int(m.group(1)) + self.first_layer}.", name)


def split_stages(model: GPT, pp: int, *, virtual_stages: int = 1,
                 balance: Sequence[int] | None = None, seq_split: int = 1) -> list[GPTStage]:
    """All pp·v stages of `model`, in stage order (rank r holds stages r, r + pp, ...).

    `balance`, when given, is the number of blocks in each of the pp·v stages. `model` may
    already be split by tensor parallelism (the default balance counts whole parameters,
    so every tp degree cuts at the same layers); `seq_split` is tp under sequence
    parallelism, where stage boundaries carry seq / tp positions.
    """
    v = virtual_stages
    check_split(len(model.blocks), pp, virtual_stages=v, balance=balance)
    counts = list(balance) if balance is not None else default_balance(model, pp, v)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [GPTStage(model, i, pp * v, starts[i], counts[i], untie_head=pp > 1, seq_split=seq_split)
            for i in range(pp * v)]


def _own_copy(head: nn.Module) -> nn.Module:
    """The head with its own Parameter of the same values (and tensor-parallel placement).

    deepcopy draws nothing from the random generator, as a fresh nn.Linear would; it keeps
    the process-group handles (`Axis` copies to itself) but not a Parameter's attributes.
    """
    copied = copy.deepcopy(head)
    for name, param in head.named_parameters():
        vars(copied.get_parameter(name)).update(vars(param))
    return copied


def is_pipeline(model: nn.Module) -> bool:
    """Whether `model` is a rank's pipeline stages (what `apply_pipeline` returns)."""
    return isinstance(model, nn.ModuleList) and len(model) > 0 and all(isinstance(m, GPTStage) for m in model)


def tied_copies(model: nn.Module) -> list[nn.Parameter]:
    """This rank's copies of a tied weight split across pipeline ranks (the embedding on the
    first stage, the head's copy on the last): their gradients are summed between ranks."""
    if not is_pipeline(model):
        return []
    return [stage.embed.weight if stage.is_first else stage.lm_head.weight
            for stage in model if stage.shares_tied_weight]


def logical_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter, bool]]:
    """(full-model name, parameter, is-a-replica) for each parameter this rank holds.

    Pipeline stages name their parameters as the whole model does ("blocks.4.x", not
    "0.blocks.0.x"); the last stage's copy of a tied embedding is a replica of
    "embed.weight" (its gradient and Adam state equal the first stage's): loaded, not
    written, and counted once in the gradient norm.
    """
    if not is_pipeline(model):
        return [(name, param, False) for name, param in model.named_parameters()]
    out = []
    for stage in model:
        for name, param in stage.named_parameters():
            if name == "lm_head.weight" and stage.shares_tied_weight and stage.is_last:
                out.append(("embed.weight", param, True))
            else:
                out.append((stage.global_name(name), param, False))
    return out


def check_split(n_layers: int, pp: int, *, virtual_stages: int = 1, balance: Sequence[int] | None = None) -> None:
    """Raise PlaitError unless `n_layers` blocks can be cut into pp·v stages (no model needed,
    so a config can be checked before any process starts)."""
    v, stages = virtual_stages, pp * virtual_stages
    if pp < 1 or v < 1:
        raise PlaitError(f"pp and virtual stages must be at least 1; got pp={pp}, v={v}")
    if balance is not None:
        _check_counts(list(balance), stages, n_layers)
        return
    if stages > n_layers:
        what = f"pp={pp}" if v == 1 else f"pp={pp} × virtual stages {v} = {stages} stages"
        raise PlaitError(f"{what} is more than the model's {n_layers} layers: every stage needs a layer",
                         hint=f"use pp·v <= {n_layers}, or a model with more layers")
    if v > 1 and n_layers % stages:
        raise PlaitError(f"interleaving cuts the {n_layers} layers into v·pp = {v}·{pp} = {stages} equal "
                         f"chunks, and {n_layers} is not divisible by {stages}",
                         hint="choose pp and --virtual-stages whose product divides the layer count")


def rank_stages(stages: Sequence[nn.Module], rank: int, pp: int) -> nn.ModuleList:
    """The stages pipeline rank `rank` holds, chunk by chunk: stages rank, rank + pp, ..."""
    return nn.ModuleList(stages[chunk * pp + rank] for chunk in range(len(stages) // pp))


def default_balance(model: GPT, pp: int, v: int = 1) -> list[int]:
    """Blocks per stage: equal chunks when interleaved, else balanced by parameter count."""
    n, stages = len(model.blocks), pp * v
    if v > 1:
        return [n // stages] * stages
    return balanced_counts([_numel(b) for b in model.blocks], pp,
                           first_extra=_numel(model.embed),
                           last_extra=_numel(model.norm) + _numel(model.lm_head))


def _numel(module: nn.Module) -> int:
    """Parameters of `module` before any tensor-parallel split: every tp degree cuts alike."""
    from plait.parallel.tensor.layers import shard_of

    return sum(math.prod(shard_of(p).full_shape) if shard_of(p) else p.numel() for p in module.parameters())


def _check_counts(counts: list[int], stages: int, n: int) -> None:
    if len(counts) != stages:
        raise PlaitError(f"balance gives {len(counts)} block counts but the layout has {stages} stages",
                         hint="give one block count per stage (pp × virtual stages numbers)")
    if sum(counts) != n or min(counts) < 1:
        raise PlaitError(f"balance {counts} must give every stage at least one block and sum to "
                         f"the model's {n} layers", hint=f"e.g. {_even(n, stages)}")


def _even(n: int, stages: int) -> list[int]:
    return [n // stages + (i < n % stages) for i in range(stages)]
