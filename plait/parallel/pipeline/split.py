"""Cut a model into pipeline stages: embedding on the first, blocks in between, head on the last.

What the pieces are and how a stage runs is the model's adapter's answer (plait.parallel.seam:
`Parts`, `run_stage`); this module knows no model. The full model is built once from the seed
on every rank and then cut, so every layout starts from the same weights; a rank keeps only
its own stages and the rest is garbage collected.

A stage holds its pieces under the model's own names ("model.embed_tokens", "lm_head"), its
blocks in a list at the blocks' name, renumbered from 0 (`global_name` maps them back):
checkpoints and gradients are named as the whole model names them.

Where the cuts go: with one stage per rank, the blocks are split into contiguous runs that
minimise the largest stage's parameter count (the first pieces counted on the first stage,
the last ones on the last), or follow an explicit `balance` list of block counts
(--stage-layers), where the first and the last stage may hold none. With
`virtual_stages = v > 1` there are v·pp stages, of equal size unless `balance` says (or v·pp does not
divide the blocks: then balanced as above, over the v·pp stages), placed round robin
(stage = chunk·pp + rank, as in plait/schedule/build.py), so each rank holds v non-adjacent chunks.

Tied embeddings: a parameter held by both a first piece and a last one (the embedding that
the head multiplies by). When those stages live on different ranks (pp > 1) the last stage
gets its own copy of the piece, made here from the same values; the runner then adds the two
gradients on both ranks after every step (`sum_tied_grads`), so the copies see the same
gradient, take the same optimizer step and stay bitwise equal — the single-process model,
held twice.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from plait.balance import balanced_counts
from plait.errors import PlaitError
from plait.parallel.applied import applied_of
from plait.parallel.packed import Packed
from plait.parallel.seam import Parts, adapter_of, pipeline_parts
from plait.rules import check_pipeline_cut

BLOCKS = "blocks"  # where a stage keeps the blocks of a model that is itself a Sequential


class PipelineStage(nn.Module):
    """One pipeline stage of any model: a run of blocks, plus the first and/or the last pieces.

    Input is what the model takes (token ids) on the first stage and hidden states elsewhere;
    output is the model's output (logits) on the last stage and hidden states elsewhere.
    The forward is the adapter's `run_stage` (plait.parallel.seam.StageView says what it reads).
    """

    def __init__(self, model: nn.Module, parts: Parts, adapter: Any, index: int, num_stages: int,
                 first_layer: int, layers: int, untie: bool, seq_split: int = 1):
        super().__init__()
        self.index, self.num_stages, self.first_layer = index, num_stages, first_layer
        # Under sequence parallelism hidden states hold seq / tp positions; rope needs seq.
        self.seq_split = seq_split
        self.parts, self._adapter = parts, adapter
        # Context parallelism (plait.parallel.context), applied to the whole model before the cut.
        self.context = applied_of(model).context
        self.packed: Packed | None = None  # the running micro-batch's documents (set by the step's run)
        self.token_ids: torch.Tensor | None = None  # the running micro-batch's token ids (set alike)
        self._blocks_at = parts.blocks or BLOCKS
        first, last = self.is_first, self.is_last
        tied = _tied(model, parts)  # {id of a tied weight: the full model's name of it}
        # True on the first and the last stage when each holds a copy of the tied weight.
        self.shares_tied_weight = untie and bool(tied) and (first or last)
        for name in parts.first:
            _place(self, name, model.get_submodule(name) if first else None)
        blocks = _blocks_of(model, parts)
        _place(self, self._blocks_at, nn.ModuleList(blocks[first_layer:first_layer + layers]))
        # Local name of this stage's copy of a tied weight -> the full model's name of it,
        # in the same order on the first and the last stage (their gradients are added pairwise).
        self.tied_names: dict[str, str] = {}
        for name in parts.last:
            piece = model.get_submodule(name) if last else None
            if piece is not None and self.shares_tied_weight:
                self.tied_names.update({f"{name}.{local}": tied[id(p)] for local, p in piece.named_parameters()
                                        if id(p) in tied})
                piece = _own_copy(piece) if any(id(p) in tied for p in piece.parameters()) else piece
            _place(self, name, piece)
        if first and self.shares_tied_weight:
            self.tied_names = {name: name for name in tied.values()}
        self.tied_names = dict(sorted(self.tied_names.items(), key=lambda item: item[1]))
        for name in parts.shared:
            _place(self, name, _get(model, name))

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1

    def held(self, name: str) -> Any:
        """The piece named `name` (a module or buffer of `Parts`), or None if another stage has it."""
        return _get(self, name)

    def held_blocks(self) -> list[nn.Module]:
        """This stage's blocks, in forward order."""
        return list(_get(self, self._blocks_at))

    def context_positions(self, seq: int, device: torch.device) -> torch.Tensor | None:
        """(1, seq): the global positions of this rank's `seq` tokens while context parallelism
        is engaged; None otherwise (the positions are 0..seq-1)."""
        if self.context is None or not self.context.active:
            return None
        return self.context.positions(seq, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._adapter.run_stage(self, x)

    def global_name(self, name: str) -> str:
        """The full model's name for this stage's parameter `name` ("blocks.0.x" -> "blocks.4.x")."""
        prefix = re.escape(self._blocks_at)
        full = f"{self.parts.blocks}." if self.parts.blocks else ""
        return re.sub(rf"^{prefix}\.(\d+)\.", lambda m: f"{full}{int(m.group(1)) + self.first_layer}.", name)

    def tied_weights(self) -> list[nn.Parameter]:
        """This stage's copies of weights tied across the cut, in the full model's name order."""
        return [self.get_parameter(name) for name in self.tied_names]

    @property
    def replica_of(self) -> dict[str, str]:
        """On the last stage: its copies of tied weights, by local name -> the original's name."""
        return self.tied_names if self.shares_tied_weight and self.is_last else {}


def _tied(model: nn.Module, parts: Parts) -> dict[int, str]:
    """{id: name} of parameters held by both a first and a last piece (an embedding tied to the head)."""
    first = {id(p): f"{name}.{local}" for name in parts.first
             for local, p in model.get_submodule(name).named_parameters()}
    return {id(p): first[id(p)] for name in parts.last for p in model.get_submodule(name).parameters()
            if id(p) in first}


def _get(root: nn.Module, name: str) -> Any:
    """The module or buffer at dotted `name` under `root`, or None when a step of it is None."""
    node: Any = root
    for step in name.split("."):
        node = getattr(node, step, None)
        if node is None:
            return None
    return node


def _place(root: nn.Module, name: str, piece: Any) -> None:
    """Put `piece` at dotted `name` under `root`, making empty containers on the way."""
    *path, leaf = name.split(".")
    node = root
    for step in path:
        if getattr(node, step, None) is None:
            node.add_module(step, nn.Module())
        node = getattr(node, step)
    if isinstance(piece, torch.Tensor) and not isinstance(piece, nn.Parameter):
        node.register_buffer(leaf, piece, persistent=False)
    else:
        node.add_module(leaf, piece)


def _blocks_of(model: nn.Module, parts: Parts) -> list[nn.Module]:
    return list(model.get_submodule(parts.blocks) if parts.blocks else model)


def split_stages(model: nn.Module, pp: int, *, virtual_stages: int = 1, balance: Sequence[int] | None = None,
                 seq_split: int = 1, adapter: Any = None) -> list[PipelineStage]:
    """All pp·v stages of `model`, in stage order (rank r holds stages r, r + pp, ...).

    `balance`, when given, is the number of blocks in each of the pp·v stages. `model` may
    already be split by tensor parallelism (the default balance counts whole parameters,
    so every tp degree cuts at the same layers); `seq_split` is tp under sequence
    parallelism, where stage boundaries carry seq / tp positions. `adapter` says where to
    cut and how a stage runs (default: the model class's, or an nn.Sequential's children).
    """
    v = virtual_stages
    adapter = adapter_of(model, adapter)
    parts = pipeline_parts(model, adapter, pp)
    blocks = _blocks_of(model, parts)
    check_split(len(blocks), pp, virtual_stages=v, balance=balance)
    if balance and ((balance[0] == 0 and not parts.first) or (balance[-1] == 0 and not parts.last)):
        raise PlaitError(f"--stage-layers {','.join(map(str, balance))} leaves an end stage with no block, and "
                         "this model has no embedding or head to put there",
                         hint="give the first and the last stage at least one block each")
    counts = list(balance) if balance else default_balance(model, pp, v, parts)
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [PipelineStage(model, parts, adapter, i, pp * v, starts[i], counts[i], untie=pp > 1, seq_split=seq_split)
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
    return isinstance(model, nn.ModuleList) and len(model) > 0 and all(isinstance(m, PipelineStage) for m in model)


def tied_copies(model: nn.Module) -> list[nn.Parameter]:
    """This rank's copies of a tied weight split across pipeline ranks (the embedding on the
    first stage, the head's copy on the last): their gradients are summed between ranks."""
    if not is_pipeline(model):
        return []
    return [weight for stage in model for weight in stage.tied_weights()]


def logical_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter, bool]]:
    """(full-model name, parameter, is-a-replica) for each parameter this rank holds.

    Pipeline stages name their parameters as the whole model does ("blocks.4.x", not
    "0.blocks.0.x"); the last stage's copy of a tied embedding is a replica of the
    embedding's weight (its gradient and Adam state equal the first stage's): loaded, not
    written, and counted once in the gradient norm.
    """
    if not is_pipeline(model):
        return [(name, param, False) for name, param in model.named_parameters()]
    out = []
    for stage in model:
        for name, param in stage.named_parameters():
            if name in stage.replica_of:
                out.append((stage.replica_of[name], param, True))
            else:
                out.append((stage.global_name(name), param, False))
    return out


def check_split(n_layers: int, pp: int, *, virtual_stages: int = 1, balance: Sequence[int] | None = None) -> None:
    """Raise PlaitError unless `n_layers` blocks can be cut into pp·v stages (no model needed,
    so a config can be checked before any process starts); the rules are plait.rules'
    (`balance` is --stage-layers: the first and the last stage may hold no block)."""
    check_pipeline_cut(n_layers, pp, virtual_stages, tuple(balance or ()))


def rank_stages(stages: Sequence[nn.Module], rank: int, pp: int) -> nn.ModuleList:
    """The stages pipeline rank `rank` holds, chunk by chunk: stages rank, rank + pp, ..."""
    return nn.ModuleList(stages[chunk * pp + rank] for chunk in range(len(stages) // pp))


def default_balance(model: nn.Module, pp: int, v: int = 1, parts: Parts | None = None) -> list[int]:
    """Blocks per stage: equal chunks when interleaved and pp·v divides the blocks (Megatron's
    cut), else balanced by parameter count over the pp·v stages, the embedding's on the
    first and the head's on the last (plait.estimate.layout.balanced_stages prices the same)."""
    parts = parts or pipeline_parts(model, adapter_of(model), pp)
    blocks = _blocks_of(model, parts)
    n, stages = len(blocks), pp * v
    if v > 1 and n % stages == 0:
        return [n // stages] * stages
    return balanced_counts([_numel(b) for b in blocks], stages,
                           first_extra=sum(_numel(model.get_submodule(name)) for name in parts.first),
                           last_extra=sum(_numel(model.get_submodule(name)) for name in parts.last))


def _numel(module: nn.Module) -> int:
    """Parameters of `module` before any tensor-parallel split: every tp degree cuts alike."""
    from plait.parallel.tensor.layers import shard_of

    return sum(math.prod(shard_of(p).full_shape) if shard_of(p) else p.numel() for p in module.parameters())
