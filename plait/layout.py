"""The layout: how one run spreads over its processes, in the one record every part reads.

    layout = Layout(dp=2, tp=2, pp=2, zero=1, sp=True)     # checked here, once
    mesh = plait.init_mesh(layout)                          # the process groups of its axes
    plait.parallelize(model, mesh)                          # the strategies it names

A layout is the degrees of the named axes (pp, dp, cp, ep, tp) and the choices that go with
them: ZeRO's stage and offload, sequence parallelism, the pipeline schedule and its virtual
stages. `plait train` makes one from its flags (plait.train.config.settings), the Python API from
`init_mesh`'s arguments, `plait estimate` from its own flags (plait.estimate.layout.Workload
extends it with the batch and precision); the mesh builds its groups from `grid`, the
strategies read `mesh.layout`, and reports describe it with `describe`. Its rules live in
plait.rules and run in `__post_init__`, so no layout that exists is one training refuses
for its own sake (a model's limits, like heads tp must divide, are its family's).

Torch-free, at the bottom of the package. Adding an axis is one field here, its rules in
plait/rules.py and its costs in plait/estimate/.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from plait import rules
from plait.errors import PlaitError

# The grid of ranks, slowest-varying axis first: tp innermost, so a tensor-parallel group
# sits on neighbouring ranks, which a launcher puts on one node, where the bandwidth is.
GRID = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism and the strategy choices that go with them."""

    dp: int = 1  # data-parallel replicas (or ZeRO shards)
    tp: int = 1  # tensor-parallel ranks (Megatron-style)
    pp: int = 1  # pipeline stages' ranks
    cp: int = 1  # context-parallel ranks: each holds 2 of the sequence's 2·cp chunks (head and tail)
    ep: int = 1  # expert-parallel ranks, carved out of dp: ep consecutive dp ranks split the experts
    zero: int = 0  # 0: DDP; 1: shard optimizer states; 2: + gradients; 3: + parameters
    offload: bool = False  # optimizer states and step in CPU memory (needs zero >= 1)
    dp_shard: int = 0  # ZeRO inside groups of this many dp·cp ranks, replicas across them (0: all of them)
    sp: bool = False  # sequence parallelism outside the tensor-parallel regions (needs tp > 1)
    schedule: str = "1f1b"  # pipeline schedule: gpipe, 1f1b, interleaved, zb-h1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved)
    stage_layers: tuple[int, ...] = ()  # blocks in each of the pp·v stages, in stage order (): plait's cut
    prefetch: int = 1  # ZeRO-3: units gathered ahead of the one running (0: gather on demand)
    reshard_after_forward: bool = True  # ZeRO-3: free a unit after its forward, gather it again for backward
    cp_kind: str = "ring"  # context parallelism's attention: ring (send/recv of K/V) or ulysses (all-to-all)

    def __post_init__(self) -> None:
        rules.check_layout(self)
        object.__setattr__(self, "stage_layers", tuple(self.stage_layers))  # hashable, whatever list it came as

    @property
    def world(self) -> int:
        """Processes the layout needs: the product of the grid's degrees."""
        return self.pp * self.dp * self.cp * self.tp

    @property
    def zero_ranks(self) -> int:
        """Ranks that split ZeRO's shards: a --dp-shard group, or every dp·cp rank."""
        return self.dp_shard or self.dp * self.cp

    @property
    def replicas(self) -> int:
        """Copies of each ZeRO shard: the --dp-shard groups (1 without it)."""
        return self.dp * self.cp // self.zero_ranks

    @property
    def grid(self) -> tuple[tuple[str, int], ...]:
        """(axis, degree) of every grid axis, slowest-varying first."""
        return tuple((axis, getattr(self, axis)) for axis in GRID)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each grid axis."""
        out, stride = {}, 1
        for axis, size in reversed(self.grid):
            out[axis] = rank // stride % size
            stride *= size
        return out

    @classmethod
    def fill(cls, world: int, dp: int | None = None, *, what: str = "world size", **choices: Any) -> "Layout":
        """The layout of `world` processes: dp, when not given, takes what the other axes
        leave (the one place dp = world / (tp·pp·cp) is computed). `what` names the world
        in messages ("--nproc", "--gpus")."""
        # Checks tp, pp, cp and the choices first; dp holds a place that ep and dp_shard divide.
        divides = [v for v in (choices.get("ep", 1), choices.get("dp_shard") or 1)
                   if isinstance(v, int) and not isinstance(v, bool) and v >= 1]  # a bad one is refused below
        others = cls(**{"dp": math.lcm(*divides), **choices})
        if dp is None:
            rest = others.world // others.dp
            if world % rest:
                raise PlaitError(f"{what} {world} is not divisible by {_others(others)}",
                                 hint="choose tp and pp whose product divides the number of processes")
            dp = world // rest
        layout = replace(others, dp=dp)
        layout.check_world(world, what)
        return layout

    def check_world(self, world: int, what: str = "world size") -> None:
        """The layout's product must be the number of processes the job has."""
        if self.world != world:
            raise PlaitError(f"layout dp={self.dp} × {_others(self)} = {self.world} does not match {what} {world}",
                             hint=f"choose degrees whose product is {world}")

    def replace(self, **changes: Any) -> "Layout":
        """A copy with some fields changed, checked like any other."""
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """"dp=2 tp=1 pp=1", plus whatever else is switched on (the reports' one line)."""
        degrees = [f"{axis}={getattr(self, axis)}" for axis in ("dp", "tp", "pp")]
        degrees += [f"{axis}={getattr(self, axis)}" for axis in ("cp", "ep") if getattr(self, axis) > 1]
        extras = [f"zero={self.zero}" if self.zero else "", f"dp-shard={self.dp_shard}" if self.dp_shard else "",
                  "offload" if self.offload else "",
                  "sp" if self.sp else "", f"schedule={self.schedule}" if self.pp > 1 else "",
                  f"virtual-stages={self.virtual_stages}" if self.virtual_stages > 1 else "",
                  f"stage-layers={','.join(map(str, self.stage_layers))}" if self.stage_layers else "",
                  f"prefetch={self.prefetch}" if self.prefetch != 1 else "",
                  "no-reshard-after-forward" if not self.reshard_after_forward else "",
                  f"cp-kind={self.cp_kind}" if self.cp > 1 and self.cp_kind != "ring" else ""]
        return " ".join([*degrees, *filter(None, extras)])


def _others(layout: Layout) -> str:
    """"tp=2 × pp=1": the degrees besides dp, as messages name them (cp once it is above 1)."""
    named = [f"{axis}={getattr(layout, axis)}" for axis in ("tp", "pp", "cp") if axis != "cp" or layout.cp > 1]
    return " × ".join(named)
