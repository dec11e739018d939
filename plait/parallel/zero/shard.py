"""ZeRO's shards: how parameters are packed into flat buffers and cut between ranks.

Every group of parameters (a bucket at stages 1-2, a unit at stage 3) is one flat buffer,
padded at its end to a multiple of n, cut into n equal contiguous shards; rank r owns shard
r. Each group knows its axis, the n ranks that share it: the ranks its parameters' placement
replicates them over (plait/parallel/placement.py): the dp (× cp) ranks, or the edp ranks
for expert-parallel parameters, which hold the same experts. A group holds parameters of one
replicate axis only; stage 3 chains a unit's groups as companions, gathered and freed together.
The padding exists only so that reduce-scatter and all-gather see equal sizes: it is zero,
its gradient is zero, and the optimizer never sees it (its pieces stop at the last real
element), so it cannot leak into results.

The optimizer that steps a shard is in optim.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.placement import placement_of
from plait.runtime import comm
from plait.runtime.comm import Axis, Handle
from plait.runtime.mesh import EXPERT_SYNC, SYNC

Location = tuple[nn.Module, str, int]  # (module, attribute, index into FlatGroup.params)


def shard_size(numel: int, n: int) -> int:
    """Elements per rank once `numel` is padded up to a multiple of `n`."""
    return -(-numel // n)


def owned_range(numel: int, n: int, rank: int) -> tuple[int, int]:
    """The real (non-padding) elements [lo, hi) of a flat buffer that `rank` owns."""
    size = shard_size(numel, n)
    return min(rank * size, numel), min((rank + 1) * size, numel)


def owned_pieces(sizes: Sequence[int], n: int, rank: int) -> list[tuple[int, int, int]]:
    """(parameter index, start, stop), in flat coordinates, of each parameter's part of the shard."""
    lo, hi = owned_range(sum(sizes), n, rank)
    pieces, offset = [], 0
    for index, size in enumerate(sizes):
        start, stop = max(offset, lo), min(offset + size, hi)
        if start < stop:
            pieces.append((index, start, stop))
        offset += size
    return pieces


def pack(params: Sequence[nn.Parameter], n: int) -> torch.Tensor:
    """The parameters' values in one flat buffer, zero-padded to a multiple of `n`."""
    numel = sum(p.numel() for p in params)
    flat = torch.zeros(shard_size(numel, n) * n, dtype=params[0].dtype, device=params[0].device)
    flat[:numel].copy_(torch.cat([p.detach().reshape(-1) for p in params]))
    return flat


def filled_shard(params: Sequence[nn.Parameter], n: int, rank: int,
                 whole: Callable[[nn.Parameter], torch.Tensor]) -> torch.Tensor:
    """Rank `rank`'s shard of what `pack(params, n)` would hold, without the buffer: each
    parameter that reaches into the shard is asked of `whole` (its values, whole) in turn and
    its part copied in, so one parameter is whole at a time. The padding is zero, as pack's."""
    sizes = [p.numel() for p in params]
    size = shard_size(sum(sizes), n)
    shard = torch.zeros(size, dtype=params[0].dtype, device=params[0].device)
    starts = list(itertools.accumulate([0, *sizes]))
    for index, start, stop in owned_pieces(sizes, n, rank):
        values = whole(params[index]).reshape(-1)
        shard[start - rank * size:stop - rank * size].copy_(values[start - starts[index]:stop - starts[index]])
    return shard


@dataclass
class FlatGroup:
    """Parameters packed into one flat buffer of n equal shards (a bucket, or a stage-3 unit)."""

    index: int
    params: list[nn.Parameter]  # the model's parameters, in flat order (shapes kept at stage 3)
    axis: Axis  # the n ranks sharing this group's shards: dp (× cp), or edp for experts
    flat: torch.Tensor  # all n shards: the whole parameters (stages 1-2) or the gathered unit (3)
    shard: torch.Tensor  # this rank's shard: a view of `flat` (1-2), a registered Parameter (3)
    module: nn.Module | None = None  # stage 3: where `shard` is registered
    shard_name: str = ""  # stage 3: ... and under which name
    divisor: int = 0  # what the gradient sum is divided by, when not n (every group's: the whole dp × cp)
    replicate: Axis | None = None  # --dp-shard: the ranks holding the same shard, whose gradients it sums
    companion: "FlatGroup | None" = None  # stage 3: the same unit's next group (another axis), gathered with it
    _owned_layout: tuple[int, list[tuple[int, int, int]]] | None = field(default=None, repr=False)
    _sizes: list[int] | None = field(default=None, repr=False)
    locations: list[Location] = field(default_factory=list)  # stage 3: where the params are read
    gathered: bool = True
    gathering: Handle | None = None
    grad: torch.Tensor | None = None  # the whole flat gradient, while one exists
    grad_views: list[torch.Tensor] = field(default_factory=list)
    grad_shard: torch.Tensor | None = None  # this rank's averaged gradient
    ready: int = 0
    pending: tuple[torch.Tensor, Handle] | None = None  # a reduce-scatter in flight

    @property
    def n(self) -> int:
        return self.axis.size

    @property
    def rank(self) -> int:
        return self.axis.rank

    def together(self) -> list["FlatGroup"]:
        """This group and its companions: what stage 3 gathers, shows and frees as one unit."""
        return [self] if self.companion is None else [self, *self.companion.together()]

    @property
    def sizes(self) -> list[int]:
        """Each parameter's element count (fixed for the group's life: counted once)."""
        if self._sizes is None:
            self._sizes = [p.numel() for p in self.params]
        return self._sizes

    @property
    def size(self) -> int:
        return shard_size(sum(self.sizes), self.n)

    def owned(self) -> tuple[int, int]:
        return owned_range(sum(self.sizes), self.n, self.rank)

    def owned_layout(self) -> tuple[int, list[tuple[int, int, int]]]:
        """(the owned range's start, `owned_pieces`), worked out once: the parameters, their
        sizes and the axis are fixed for the group's life, and the step's clip reads this for
        every piece of every group (host time the GPU waits on)."""
        if self._owned_layout is None:
            self._owned_layout = (self.owned()[0], owned_pieces(self.sizes, self.n, self.rank))
        return self._owned_layout

    def owned_param(self) -> torch.Tensor:
        lo, hi = self.owned()
        return self.shard.detach()[: hi - lo]

    def owned_grad(self) -> torch.Tensor | None:
        lo, hi = self.owned()
        return None if self.grad_shard is None else self.grad_shard[: hi - lo]

    def split(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """`tensor` (a flat buffer of this group) as one view per parameter, in its shape."""
        sizes = self.sizes
        parts = torch.split(tensor, [*sizes, tensor.numel() - sum(sizes)])
        return [part.view(p.shape) for part, p in zip(parts, self.params)]

    def alloc_grad(self) -> None:
        """Make the whole flat gradient (stages 1-2, at the first gradient that needs it) and
        each parameter's .grad its view, taking in a gradient autograd already made: the
        group's other gradients then accumulate in place."""
        self.grad = torch.zeros(self.flat.shape, dtype=self.flat.dtype, device=self.flat.device)
        self.grad_views = self.split(self.grad)
        for param, view in zip(self.params, self.grad_views):
            if param.grad is not None:
                view.copy_(param.grad)
            param.grad = view

    # -- gradients ------------------------------------------------------------------------------
    def launch_reduce(self, dtype: torch.dtype | None = None) -> None:
        """Reduce-scatter `grad`, pre-divided so the sum is the mean (as DDP), asynchronously;
        in `dtype` on the wire when given (--reduce-dtype), rounded back once it arrives.
        An expert group sums over edp but divides by dp: each expert's gradient already
        holds what every ep rank's tokens sent it."""
        assert self.grad is not None
        wire = self.grad if dtype in (None, self.grad.dtype) else self.grad.to(dtype)
        wire.div_(self.divisor or self.n)
        out = torch.empty(self.size, dtype=wire.dtype, device=wire.device)
        self.pending = (out, comm.reduce_scatter(out, wire, self.axis, async_op=True))

    def finish_reduce(self, stage: int) -> None:
        """Keep this rank's reduced shard; from stage 2 on, drop the whole gradient."""
        assert self.pending is not None and self.grad is not None
        out, handle = self.pending
        handle.wait()
        self.pending = None
        if self.replicate is not None and self.replicate.size > 1:  # the other shard groups' samples
            comm.all_reduce(out, self.replicate)
        out = out.to(self.grad.dtype)
        if stage == 1:  # the whole buffer stays (the paper's 4Ψ): its owned slice holds the mean
            own = self.grad[self.rank * self.size:(self.rank + 1) * self.size]
            self.grad_shard = own.copy_(out)
            return
        self.grad_shard = out if self.grad_shard is None else self.grad_shard.add_(out)
        if stage == 2:
            for param in self.params:
                param.grad = None
        else:
            self.flat.grad = None
            self.shard.grad = self.grad_shard
        self.grad, self.grad_views = None, []

    def zero_grad(self, stage: int) -> None:
        self.grad_shard = None  # a step without a new backward then skips, as torch's does
        if stage == 1:  # the whole gradient too: the next backward makes it again (alloc_grad)
            for param in self.params:
                param.grad = None
            self.grad, self.grad_views = None, []
        elif stage == 3:
            self.shard.grad = None

    # -- stage 3: the gathered parameters -----------------------------------------------------
    def gather(self, wait: bool = True, purpose: str = comm.TRAIN) -> bool:
        """All-gather the shards into `flat` (in the background unless `wait`); True if it started one."""
        started = not self.gathered
        if started:
            self.flat.untyped_storage().resize_(self.size * self.n * self.flat.element_size())
            # Through .data, an alias with its own version counter: the views autograd saved in
            # forward stay valid for backward although their memory was refilled.
            self.gathering = comm.all_gather(self.flat.data, self.shard.data, self.axis, async_op=True,
                                             purpose=purpose)
            self.gathered = True
        if wait and self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
        return started

    def show(self) -> None:
        """Point the unit's module attributes at views of the gathered buffer (autograd sees them)."""
        views = self.split(self.flat)
        for module, name, i in self.locations:
            module.__dict__[name] = views[i]
        for param, view in zip(self.params, views):  # e.g. sequence parallelism's sum over tp
            hook = getattr(param, "plait_sums_grad", None)
            if hook is not None and view.requires_grad:
                view.register_hook(hook)

    def free(self, placeholder: torch.Tensor) -> None:
        """Release the gathered memory; module attributes become an empty placeholder."""
        if self.gathering is not None:
            self.gathering.wait()
            self.gathering = None
        if self.gathered:
            self.flat.untyped_storage().resize_(0)
            self.gathered = False
            for module, name, _ in self.locations:
                module.__dict__[name] = placeholder


# -- which parameters go together -----------------------------------------------------------------
@dataclass(frozen=True)
class ShardAxes:
    """The ranks that share each parameter's shards: those its placement replicates it over.

    Most parameters are replicated over the data axis, and their groups are cut over `dense`
    (the dp × cp ranks, or one --dp-shard group of them); an expert-parallel parameter's
    placement replicates it over edp only, so its groups are cut over those ranks. Every group
    divides its gradient sum by all the dp × cp ranks: an expert's gradient already sums what
    the tokens of every ep rank sent it, so its mean too is over every sample. Parameters
    replicated over different axes never share a group, each group having one axis.
    """

    over: dict[str, Axis]  # each replicate axis present -> the ranks its groups are cut over; SYNC first
    replicated: dict[int, str]  # id(parameter) -> its placement's replicate axis
    replicate: Axis | None = None  # --dp-shard: dense's copies, which sum its shards' gradients

    @classmethod
    def of_model(cls, model: nn.Module, dense: Axis, experts: Axis | None,
                 replicate: Axis | None = None) -> "ShardAxes":
        """`dense` cuts the data axis's parameters, `experts` the edp axis's (when any)."""
        replicated = {id(p): placement_of(p).replicate for p in model.parameters()}
        given = {SYNC: dense, EXPERT_SYNC: experts}
        names = [SYNC, *dict.fromkeys(name for name in replicated.values() if name != SYNC)]
        missing = [name for name in names if given.get(name) is None]
        if missing:
            raise PlaitError(f"ZeRO needs the {missing[0]} axis for the parameters replicated over it",
                             hint="pass expert_axis=mesh.axis('edp') to apply_zero (parallelize does)")
        hybrid = replicate if replicate is not None and replicate.size > 1 else None
        if hybrid is not None and len(names) > 1:
            raise PlaitError(f"hybrid sharding does not group parameters replicated over {names[1]} "
                             "(expert-parallel ones)", hint="drop replicate_axis (--dp-shard), or expert parallelism")
        return cls({name: given[name] for name in names}, replicated, hybrid)

    @property
    def dense(self) -> Axis:
        return self.over[SYNC]

    @property
    def mean_over(self) -> int:
        """What every gradient sum is divided by: all the dp × cp ranks (--dp-shard: the shard
        group's ranks times its replicas)."""
        return self.dense.size * (self.replicate.size if self.replicate is not None else 1)

    def replicated_over(self, tensor: torch.Tensor) -> str:
        """`tensor`'s replicate axis (a buffer's: the data axis)."""
        return self.replicated.get(id(tensor), SYNC)

    def replicate_of(self, tensor: torch.Tensor) -> Axis | None:
        """The ranks that hold `tensor`'s shards again (--dp-shard, for the data axis's groups)."""
        return self.replicate if self.replicated_over(tensor) == SYNC else None

    def axis(self, tensor: torch.Tensor) -> Axis:
        """Where `tensor` is sharded, and broadcast from at setup."""
        return self.over[self.replicated_over(tensor)]

    def kinds(self, params: Sequence[nn.Parameter]) -> list[list[nn.Parameter]]:
        """`params` split by replicate axis (the data axis's first), order kept, empty ones left out."""
        split = [[p for p in params if self.replicated_over(p) == name] for name in self.over]
        return [kind for kind in split if kind]


def bucket_params(params: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Stages 1-2: parameters in backward order (reverse of registration), in buckets of one dtype."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for param in reversed(params):
        nbytes = param.numel() * param.element_size()
        same = buckets and buckets[-1][0].dtype == param.dtype and buckets[-1][0].device == param.device
        if not same or size + nbytes > bucket_bytes and size > 0:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += nbytes
    return buckets


def find_units(model: nn.Module) -> list[nn.Module]:
    """Stage 3's units: the children (with trainable parameters) of every ModuleList or Sequential.

    A transformer's blocks, or the layers of a plain nn.Sequential. Parameters outside any
    unit form the root unit, which is gathered for the whole forward and the whole backward.
    """
    units: list[nn.Module] = []

    def visit(module: nn.Module, in_list: bool) -> None:
        for child in module.children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)):
                visit(child, True)
            elif in_list and any(p.requires_grad for p in child.parameters()):
                units.append(child)
            else:
                visit(child, False)

    visit(model, isinstance(model, (nn.ModuleList, nn.Sequential)))
    return units


def edge_units(model: nn.Module, units: Sequence[nn.Module]) -> list[nn.Module]:
    """The matrices outside `units`: each leaf module (an embedding, a head, a CNN's stem)
    holding a trainable parameter of two or more dimensions that no other module holds.

    Without them these belong to the root unit, which stays gathered for the whole forward
    and backward with its whole gradient: an untied embedding and head are often the
    largest tensors of a language model (two of 128 k × 8 k at 70 B). As units of their own
    each is gathered only around its forward and its backward, and its gradient is reduced
    as soon as it is in. A tied weight (one parameter, two modules) stays in the root;
    vectors (the final norm) stay there too, where they cost no collective of their own.
    """
    inside = {m for unit in units for m in unit.modules()}
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                holders[id(param)] = holders.get(id(param), 0) + 1
    edges = []
    for module in model.modules():
        own = [p for p in module._parameters.values() if p is not None and p.requires_grad]
        if (module is model or module in inside or next(module.children(), None) is not None or not own
                or any(holders[id(p)] > 1 for p in own) or all(p.dim() < 2 for p in own)):
            continue
        edges.append(module)
    return edges


def with_edges(model: nn.Module, blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """`blocks` (in the order the forward runs them) with `edge_units` around them: those the
    model registers before its first block ahead (an embedding, a stem), the rest after (a
    head). The prefetch follows this order until a forward has shown the real one."""
    edges = edge_units(model, blocks)
    if not blocks:
        return edges
    order = {m: i for i, m in enumerate(model.modules())}
    first = min(order[b] for b in blocks)
    return [e for e in edges if order[e] < first] + list(blocks) + [e for e in edges if order[e] > first]


Registration = tuple[nn.Module, str, nn.Parameter]


def unit_owners(model: nn.Module, units: Sequence[nn.Module]) -> tuple[dict[nn.Parameter, int], list[Registration]]:
    """The unit owning each trainable parameter (-1: the root, also for one two units share),
    and every (module, name, parameter) registration, tied weights included."""
    unit_of: dict[nn.Module, int] = {}
    for k, unit in enumerate(units):
        for module in unit.modules():
            unit_of[module] = k if unit_of.get(module, k) == k else -1
    owner: dict[nn.Parameter, int] = {}
    where = []
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.requires_grad:
                k = unit_of.get(module, -1)
                owner[param] = k if owner.get(param, k) == k else -1
                where.append((module, name, param))
    return owner, where


# -- the optimizer ----------------------------------------------------------------------------------
