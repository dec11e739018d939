"""ZeRO's runtime: the hooks that reduce-scatter gradients in backward and, at stage 3,
gather each unit's weights just before it runs and free them after.

`ZeroSync` is what `apply_zero` (stages.py) attaches to a model; autograd and the module
hooks call it. The shards it moves are shard.py's flat groups, each over its own axis (the
one its parameters' placement replicates them over: dp, or edp for experts). At stage 3 a
unit holding both kinds is two groups, the expert one the other's companion: the unit's
hooks gather, show and free both; each group's gradient is reduced on its own, as soon as
autograd has accumulated it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from plait.parallel.zero.shard import FlatGroup
from plait.runtime import comm
from plait.runtime.comm import Axis

IN_FLIGHT = 1  # reductions left running while backward goes on: one bucket filling, one reducing


class GatherForBackward(torch.autograd.Function):
    """Forward: a unit's outputs, unchanged. Backward: gather the unit's parameters first.

    Each output comes back as a detached alias, not as itself: autograd takes an input returned
    as-is for a view this function made, and forbids changing it in place, where the model
    alone may (Gemma 3n scales its per-layer projection's output in place: `*=`). The alias
    shares the output's storage and version counter, so an in-place change of a tensor its
    producer saved for backward is still caught, as it would be without ZeRO."""

    @staticmethod
    def forward(ctx: Any, sync: "ZeroSync", group: FlatGroup, *outputs: torch.Tensor) -> Any:
        ctx.sync, ctx.group = sync, group
        ctx.set_materialize_grads(False)
        return tuple(output.detach() for output in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        ctx.sync.pre_backward(ctx.group)
        return (None, None, *grads)


class ZeroSync:
    """The ZeRO machinery attached to one model: when to reduce, gather and free, and in what order."""

    def __init__(self, axis: Axis, stage: int, groups: list[FlatGroup], root: FlatGroup | None = None,
                 offload: bool = False):
        self.axis, self.stage, self.groups, self.root, self.offload = axis, stage, groups, root, offload
        companions = {id(g.companion) for g in groups if g.companion is not None}
        self.units = [g for g in groups if id(g) not in companions]  # stage 3: what the hooks name
        self._leads = {g.index for g in self.units if g is not root}  # units counted as gathered
        self.enabled = True  # what no_sync switches off (stage 1 only: see the module docstring)
        self.names: dict[nn.Parameter, str] = {}  # each parameter's name in the unsharded model
        self.replicas: set[nn.Parameter] = set()  # a pipeline's copy of a tied weight: not written, not normed
        self.tied: list[nn.Parameter] = []  # this rank's copies of a tied weight (each alone in a group)
        self.chunk: dict[int, int] = {}  # group index -> pipeline chunk (all 0 for a whole model)
        self._touched: set[int] = set()  # chunks that produced gradients in this backward
        self.events: deque[tuple[str, int]] = deque(maxlen=4096)  # (what, group index): tests read it
        self._slot = {p: (g, i) for g in groups for i, p in enumerate(g.params)}
        self._callback_queued = False
        self._in_flight: list[FlatGroup] = []
        self._launched: set[int] = set()  # groups reduced in this backward
        self._order: list[FlatGroup] = []  # stage 3: units in the order this forward ran them
        self._last_orders: dict[int, list[FlatGroup]] = {}  # ... and the last forward of each pipeline chunk
        self._forward_chunk = 0  # the chunk this forward runs (read at its first unit)
        self._cursor: int | None = None  # where this forward is in its chunk's last order; None: off it
        self._kept: set[int] = set()  # stage 3: units left gathered after forward (kept, or unannounced)
        self._placeholders: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # a freed unit's attributes
        self._held: dict[int, int] = {}  # stage 3: bytes of each unit gathered right now
        self.peak_gathered_bytes = 0  # the most held at once since the meter last read it
        self.peak_gathered_units = 0  # the most units (the root aside) held at once: tests read it
        self.prefetch = 1  # stage 3: units gathered ahead of the one running
        self.reshard_after_forward = True  # stage 3: free a unit after its forward (else after its backward)
        self.reduce_dtype: torch.dtype | None = None  # gradients cross dp in this dtype (None: their own)

    @property
    def params(self) -> list[nn.Parameter]:
        """The model's trainable parameters as they were before sharding (shapes intact)."""
        return [p for g in self.groups for p in g.params]

    # -- gradients ----------------------------------------------------------------------------------
    def on_grad_ready(self, param: nn.Parameter) -> None:
        """Stages 1-2: a parameter's gradient for this micro-batch is fully accumulated."""
        group, i = self._slot[param]
        self._queue_backward_end()
        self._touched.add(self.chunk.get(group.index, 0))
        if group.grad is None:  # made at its first gradient of the step (stage 2: of the micro-batch)
            group.alloc_grad()
        view = group.grad_views[i]
        if param.grad is not view:
            view.copy_(param.grad)
            param.grad = view
        if self._reducing():
            group.ready += 1
            if group.ready == len(group.params):
                self._launch(group)

    def on_unit_grad(self, group: FlatGroup) -> None:
        """Stage 3: autograd has accumulated the whole unit's gradient: free it, reduce the gradient."""
        self._queue_backward_end()
        self._touched.add(self.chunk.get(group.index, 0))
        self._free(group)
        group.grad = group.flat.grad
        self._launch(group)

    def _queue_backward_end(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.on_backward_end)

    def _reducing(self) -> bool:
        return self.enabled or self.stage >= 2

    def _launch(self, group: FlatGroup) -> None:
        group.launch_reduce(self.reduce_dtype)
        self._launched.add(group.index)
        self.events.append(("reduce_scatter" if self._callback_queued else "reduce_scatter_late", group.index))
        self._in_flight.append(group)
        if len(self._in_flight) > IN_FLIGHT:  # bound the whole gradients alive at once
            self._in_flight.pop(0).finish_reduce(self.stage)

    def on_backward_end(self) -> None:
        """Reduce what got no gradient this backward, wait for every reduction, free the rest.

        "What got no gradient" is limited to the pipeline chunks this backward went through:
        a pipeline runs one backward per chunk and micro-batch, and the other chunks' groups
        wait for their own.
        """
        self._callback_queued = False
        if self._reducing():
            for group in self.groups:
                if group.index not in self._launched and self.chunk.get(group.index, 0) in self._touched:
                    self._fill_missing(group)
                    self._launch(group)
            self._finish_reductions()
        self._launched.clear()
        self._touched.clear()
        for group in self.groups:
            group.ready = 0
            self._free(group)
        self.events.append(("backward_end", -1))

    def _fill_missing(self, group: FlatGroup) -> None:
        """Unused parameters contribute zeros, so that every rank runs the same collectives."""
        if self.stage == 3:
            group.grad = group.flat.grad if group.flat.grad is not None else torch.zeros_like(group.flat.detach())
            return
        if group.grad is None:
            group.alloc_grad()
        for param, view in zip(group.params, group.grad_views):
            if param.grad is None:
                view.zero_()
                param.grad = view

    def sync_now(self) -> None:
        """Reduce-scatter now what no_sync held back (stage 1), for callers that ran every
        backward under no_sync: the pipeline executor. Stages 2-3 reduced each backward already."""
        if self.stage != 1:
            return
        for group in self.groups:
            self._fill_missing(group)
            self._launch(group)
        self._finish_reductions()
        self._launched.clear()

    def _finish_reductions(self) -> None:
        while self._in_flight:
            self._in_flight.pop(0).finish_reduce(self.stage)

    def zero_grad(self) -> None:
        for group in self.groups:
            group.zero_grad(self.stage)

    def owned_grads(self) -> list[torch.Tensor]:
        """This rank's reduced gradient shards, padding excluded: what clipping and the optimizer see."""
        return [g for g in (group.owned_grad() for group in self.groups) if g is not None]

    def gathered_storages(self) -> set[int]:
        """Storages of stage 3's gathered weights now (parameters, not activations, while a
        unit runs); each gather allocates afresh, so ask when a tensor is saved."""
        return {group.flat.untyped_storage().data_ptr() for group in self.groups} if self.stage == 3 else set()

    def group_of(self, param: nn.Parameter) -> FlatGroup:
        """The flat group holding `param`."""
        return self._slot[param][0]

    def owned_grad_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its part of this rank's gradient shard): the norm needs to know whose."""
        out = []
        for group in self.groups:
            grad = group.owned_grad()
            if grad is None:
                continue
            lo, pieces = group.owned_layout()
            out += [(group.params[i], grad[start - lo:stop - lo]) for i, start, stop in pieces]
        return out

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every gradient buffer this machinery holds right now (for the memory meter)."""
        held = [g.grad for g in self.groups] + [g.grad_shard for g in self.groups]
        return [t for t in held if t is not None]

    def gather_params(self) -> None:
        """Stages 1-2, after the optimizer step: all-gather the updated shards in place."""
        if self.stage < 3:
            handles = [comm.all_gather(g.flat, g.shard, g.axis, async_op=True) for g in self.groups]
            for handle in handles:
                handle.wait()

    # -- stage 3: gather before use, free after, prefetch the next --------------------------------
    def _gather(self, group: FlatGroup, wait: bool = True, purpose: str = comm.TRAIN) -> None:
        """Gather a unit: `group` and its companion, both started before either is waited on."""
        for one in group.together():
            if one.gather(False, purpose):
                self.events.append(("all_gather", one.index))
                self._held[one.index] = one.flat.untyped_storage().nbytes()
        for one in group.together():
            one.gather(wait, purpose)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes)
        self.peak_gathered_units = max(self.peak_gathered_units, len(self._leads & self._held.keys()))

    def _free(self, group: FlatGroup) -> None:
        """Free one group (its gradient is in: its companion may still be needed)."""
        if self.stage == 3:
            key = (group.flat.dtype, group.flat.device)  # its dtype: code may read `head.weight.dtype`
            group.free(self._placeholders.setdefault(key, torch.empty(0, dtype=key[0], device=key[1])))
            self._held.pop(group.index, None)

    def _free_unit(self, group: FlatGroup) -> None:
        for one in group.together():
            self._free(one)

    @property
    def gathered_bytes(self) -> int:
        """Stage 3: bytes of whole unit weights held right now (the shards are counted apart)."""
        return sum(self._held.values())

    def pre_forward(self, group: FlatGroup | None, is_root: bool) -> None:
        if is_root:
            self._order, self._kept, self._cursor = [], set(), -1
        if group is None:
            return
        if is_root:  # the root prefetches its chunk's first units
            self._forward_chunk = self._chunk_of(group)
        self._gather(group)
        for one in group.together():
            one.show()
        if group is not self.root:
            self._order.append(group)
            self._follow(group)
        if self._cursor is not None:
            self._prefetch_after(self._cursor, group)

    def _follow(self, group: FlatGroup) -> None:
        """Move this forward's place in the last forward's order to `group`, or leave that order
        for the rest of this forward where `group` is not the unit it ran next.

        The prefetch gathers what the last forward ran next, and a unit gathered ahead stays
        whole until it runs. Before the first forward the order is a guess (the modules'
        registration, shard.with_edges): Gemma 3n registers its per-layer embedding after its
        blocks and runs it before them, and prefetching on past the first miss held one more
        unit (an AltUp projection, gathered ahead for the end of the forward) beside the two
        blocks the prefetch window holds. A place kept by position, not by a unit's first
        appearance, follows a forward that runs a block twice (a looped model)."""
        if self._cursor is None:
            return
        if self._cursor < 0:  # this forward's first unit: a pipeline chunk starts where it starts
            self._forward_chunk = self._chunk_of(group)
            last = self._last_order(self._forward_chunk)
            self._cursor = next((i for i, g in enumerate(last) if g is group), None)
            return
        last = self._last_order(self._forward_chunk)
        if self._cursor + 1 < len(last) and last[self._cursor + 1] is group:
            self._cursor += 1
        else:
            self._cursor = None

    def _last_order(self, chunk: int) -> list[FlatGroup]:
        """The units of pipeline chunk `chunk` in the order its last forward ran them; before
        its first, as registered. One order a chunk: an interleaved schedule runs another
        chunk's forward between two of one chunk, and a single order, the last forward's
        whatever its chunk, left each forward (and each backward) no order to prefetch on."""
        if chunk not in self._last_orders:
            self._last_orders[chunk] = [g for g in self.units if g is not self.root and self._chunk_of(g) == chunk]
        return self._last_orders[chunk]

    def _chunk_of(self, group: FlatGroup) -> int:
        return self.chunk.get(group.index, 0)

    def post_forward(self, group: FlatGroup | None, output: Any, is_root: bool) -> Any:
        if group is not None:
            wrapped = True
            if torch.is_grad_enabled():
                output, wrapped = _wrap_outputs(output, self, group)
            # Kept (for its backward, which frees it once its gradient is in) when told so and a
            # backward will come; kept too when its backward cannot be announced (until backward ends).
            if wrapped and (self.reshard_after_forward or not torch.is_grad_enabled()):
                self._free_unit(group)
            else:
                self._kept.update(one.index for one in group.together())
        if is_root:  # the whole forward is done: free what was prefetched but never ran
            if self._order:
                self._last_orders[self._chunk_of(self._order[0])] = self._order
            for other in self.groups:
                if other.index not in self._kept:
                    self._free(other)
        return output

    def pre_backward(self, group: FlatGroup) -> None:
        """Called by GatherForBackward: gather this unit, prefetch the one backward needs next."""
        self._queue_backward_end()
        self._gather(group)
        with torch.enable_grad():  # backward runs without grad mode; these views must reach `flat`
            for one in group.together():  # a block that recomputes its forward in backward reads
                one.show()  # its weights again
        self._prefetch(([self.root] if self.root else []) + self._last_order(self._chunk_of(group))[::-1], group)

    def _prefetch(self, sequence: list[FlatGroup], group: FlatGroup) -> None:
        """Start gathering the `prefetch` units that follow `group` in `sequence` (same chunk)."""
        position = sequence.index(group) if group in sequence else len(sequence)
        self._gather_ahead(sequence[position + 1:position + 1 + self.prefetch], group)

    def _prefetch_after(self, cursor: int, group: FlatGroup) -> None:
        """Start gathering the `prefetch` units the last forward ran after its `cursor`-th (after
        none: its first ones, for the root)."""
        self._gather_ahead(self._last_order(self._forward_chunk)[cursor + 1:cursor + 1 + self.prefetch], group)

    def _gather_ahead(self, ahead: list[FlatGroup], group: FlatGroup) -> None:
        """Start gathering `ahead`, stopping at the first outside `group`'s pipeline chunk."""
        for one in ahead:
            if not self._same_chunk(one, group):
                break
            self._gather(one, wait=False)

    def _same_chunk(self, one: FlatGroup, other: FlatGroup) -> bool:
        """Prefetch stays inside a pipeline chunk: the next chunk runs after other work."""
        return self._chunk_of(one) == self._chunk_of(other)


def _wrap_outputs(output: Any, sync: ZeroSync, group: FlatGroup) -> tuple[Any, bool]:
    """Route the unit's tensor outputs through GatherForBackward; False if their shape is unknown.

    A mapping's tensor values are routed in place: a transformers model returns a ModelOutput
    (logits, loss, and non-tensor entries such as its cache), and its root unit is then freed
    after forward and gathered again for backward like any other, not held in between."""
    if isinstance(output, torch.Tensor):
        return (GatherForBackward.apply(sync, group, output)[0] if output.requires_grad else output), True
    if isinstance(output, Mapping):
        if any(isinstance(v, (tuple, list, Mapping)) for v in output.values()):  # nested: its tensors unknown
            return output, False
        keys = [k for k, v in output.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        for key, tensor in zip(keys, GatherForBackward.apply(sync, group, *(output[k] for k in keys)) if keys else ()):
            output[key] = tensor
        return output, True
    if not isinstance(output, (tuple, list)) or not all(isinstance(o, torch.Tensor) or o is None for o in output):
        return output, False
    slots = [i for i, o in enumerate(output) if o is not None and o.requires_grad]
    items = list(output)
    for i, tensor in zip(slots, GatherForBackward.apply(sync, group, *(output[i] for i in slots)) if slots else ()):
        items[i] = tensor
    return (tuple(items) if isinstance(output, tuple) else items), True


# -- setting up --------------------------------------------------------------------------------------
