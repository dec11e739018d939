"""The grid of ranks a layout names, and one process group per axis.

The axes and their order come from the layout record (plait.layout: GRID, pp slowest and
tp fastest, so global rank = ((pp_index·dp + dp_index)·cp + cp_index)·tp + tp_index).
Keeping tp innermost places a tensor-parallel group on neighbouring ranks, which a launcher
puts on one node, where the bandwidth is.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from plait.errors import PlaitError
from plait.layout import GRID, Layout
from plait.runtime.comm import Axis, Ledger
from plait.runtime.env import ProcessEnv, choose_backend, detect
from plait.runtime.recorder import FlightRecorder

# The gradients' axis: dp and cp together. Context-parallel ranks hold different tokens of
# the same samples, so they sum gradients (and split ZeRO's shards) with the data-parallel
# ranks, as torchtitan's dp-shard-cp does. With cp = 1 it is the dp axis itself.
SYNC = "dp_cp"
# Expert parallelism folds into dp: consecutive dp ranks, ep at a time, split the experts
# ("ep"); the dp ranks that hold the same experts ("edp", dp / ep of them) average their
# gradients. Both are the dp axis's subgroups; with ep = 1, "ep" has one rank and "edp" is dp.
EXPERT, EXPERT_SYNC = "ep", "edp"
# Hybrid sharding (--dp-shard N) cuts the dp × cp ranks into groups of N consecutive ones that
# split ZeRO's shards ("dp_shard"), and the ranks N apart hold the same shard ("dp_replicate",
# which sums the shards' gradients). Without it "dp_shard" is the dp × cp axis itself (so the
# ledger keeps its name) and "dp_replicate" has one rank.
SHARD, REPLICATE = "dp_shard", "dp_replicate"
AXES = (*GRID, SYNC, EXPERT, EXPERT_SYNC, SHARD, REPLICATE)  # the mesh's axes besides "world"


@dataclass
class Mesh:
    """This rank's view of the grid: the layout it was made for, the group of each axis.

    Besides the layout's axes there is a "world" axis (every rank), used for the report's
    max-over-ranks numbers and the step's all-ranks verdict.
    """

    layout: Layout
    env: ProcessEnv
    backend: str | None
    device: torch.device
    ledger: Ledger = field(default_factory=Ledger)
    axes: dict[str, Axis] = field(default_factory=dict)
    device_mesh: object | None = None

    def axis(self, name: str) -> Axis:
        return self.axes[name]

    def size(self, name: str) -> int:
        return self.axes[name].size

    def rank(self, name: str) -> int:
        return self.axes[name].rank

    def group(self, name: str):
        return self.axes[name].group

    def with_layout(self, **changes: Any) -> "Mesh":
        """The same groups under another strategy choice (another ZeRO stage, schedule,
        SP...): the degrees must stay, since the groups are built for them."""
        layout = self.layout.replace(**changes)
        if layout.grid != self.layout.grid or layout.zero_ranks != self.layout.zero_ranks:
            raise PlaitError(f"a mesh built for {self.layout.describe()} cannot take {layout.describe()}",
                             hint="make a new mesh (init_mesh) for other degrees")
        return replace(self, layout=layout)

    @property
    def global_rank(self) -> int:
        return self.env.rank

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def close(self) -> None:
        """Stop the recorder's publisher, then tear the process groups (and the store) down."""
        if self.ledger.recorder is not None:
            self.ledger.recorder.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


def init_mesh(layout: Layout | None = None, *, backend: str | None = None, timeout_s: float = 300.0,
              env: ProcessEnv | None = None, **choices: Any) -> Mesh:
    """Join the job (torchrun, srun, mpirun, plait's spawner, or none) and build the grid.

    `layout` is the run's plait.layout.Layout; or give its fields as keywords
    (`init_mesh(tp=2, zero=1)`), dp taking what the other degrees leave of the world. The
    layout is checked against the world size before any process group exists, so a bad
    layout fails fast on every rank with the same message instead of hanging in a rendezvous.
    """
    env = env or detect()
    if layout is None:
        layout = Layout.fill(env.world_size, **choices)
    elif choices:
        raise PlaitError(f"init_mesh takes a layout or its fields, not both: {', '.join(sorted(choices))}",
                         hint="put them in the Layout")
    layout.check_world(env.world_size)
    device = _device(env)
    ledger = Ledger()
    if not env.distributed:
        axes = {name: Axis(name, 1, 0, None, ledger, 0) for name in (*AXES, "world")}
        axes[SYNC] = axes[EXPERT_SYNC] = axes[SHARD] = axes["dp"]
        return Mesh(layout, env, None, device, ledger, axes)
    chosen = choose_backend(backend, torch.cuda.is_available(), dist.is_mpi_available())
    if not dist.is_initialized():
        dist.init_process_group(
            backend=chosen, init_method=env.init_method,
            rank=env.rank, world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    from torch.distributed.device_mesh import init_device_mesh

    sizes = tuple(size for _, size in layout.grid)
    device_mesh = init_device_mesh(device.type, sizes, mesh_dim_names=GRID)
    coords = layout.coords(env.rank)
    axes = {name: Axis(name, size, coords[name], device_mesh.get_group(name), ledger, env.rank)
            for name, size in layout.grid}
    axes[SYNC] = sync_axis(layout, env.rank, axes["dp"], ledger)
    axes.update(expert_axes(layout, env.rank, axes["dp"], ledger))
    axes.update(hybrid_axes(layout, env.rank, axes[SYNC], ledger))
    axes["world"] = Axis("world", env.world_size, env.rank, dist.group.WORLD, ledger, env.rank)
    ledger.recorder = flight_recorder(env, axes)
    return Mesh(layout, env, chosen, device, ledger, axes, device_mesh)


def sync_axis(layout: Layout, rank: int, dp: Axis, ledger: Ledger) -> Axis:
    """The dp × cp ranks that share this rank's pp and tp indices (collective: every rank
    makes every group, in one order). With cp = 1 that is the dp axis."""
    if layout.cp == 1:
        return dp
    return _axis_of(SYNC, lines(layout, ("dp", "cp")), rank, ledger)


def expert_axes(layout: Layout, rank: int, dp: Axis, ledger: Ledger) -> dict[str, Axis]:
    """The ep and edp subgroups of this rank's dp axis (collective: every rank makes every
    group, in one order). dp index i is ep rank i % ep of block i // ep, and edp rank i // ep."""
    if layout.ep == 1:
        return {EXPERT: Axis(EXPERT, 1, 0, None, ledger, rank), EXPERT_SYNC: replace(dp, name=EXPERT_SYNC)}
    blocks, strides = blocks_and_strides(lines(layout, ("dp",)), layout.ep)
    return {EXPERT: _axis_of(EXPERT, blocks, rank, ledger), EXPERT_SYNC: _axis_of(EXPERT_SYNC, strides, rank, ledger)}


def hybrid_axes(layout: Layout, rank: int, sync: Axis, ledger: Ledger) -> dict[str, Axis]:
    """ZeRO's shard and replicate groups of this rank's dp × cp axis (collective: every rank
    makes every group, in one order). The axis's rank i is shard rank i % N of group i // N,
    and replicate rank i // N."""
    n = layout.zero_ranks
    if n == sync.size:
        return {SHARD: sync, REPLICATE: Axis(REPLICATE, 1, 0, None, ledger, rank)}
    blocks, strides = blocks_and_strides(lines(layout, ("dp", "cp")), n)
    return {SHARD: _axis_of(SHARD, blocks, rank, ledger), REPLICATE: _axis_of(REPLICATE, strides, rank, ledger)}


def blocks_and_strides(groups: list[list[int]], size: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each group cut into blocks of `size` consecutive ranks, and the ranks `size` apart (one
    from each block): the two subgroups ep / edp and dp_shard / dp_replicate are made of."""
    return ([group[b:b + size] for group in groups for b in range(0, len(group), size)],
            [group[j::size] for group in groups for j in range(size)])


def lines(layout: Layout, across: tuple[str, ...]) -> list[list[int]]:
    """The groups of ranks that differ only along the grid axes `across` (the others fixed),
    each in rank order, the groups in one order on every rank."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(layout.world):
        coords = layout.coords(r)
        groups.setdefault(tuple(coords[a] for a in GRID if a not in across), []).append(r)
    return list(groups.values())


def _axis_of(name: str, groups: list[list[int]], rank: int, ledger: Ledger) -> Axis:
    """Make every group (collective, in the same order on every rank); this rank's as an Axis."""
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = Axis(name, len(ranks), ranks.index(rank), group, ledger, rank)
    return mine


def flight_recorder(env: ProcessEnv, axes: dict[str, Axis]) -> FlightRecorder:
    """Collective counts published through the store the job rendezvoused with (see recorder.py).

    torchrun's agent hosts that store when TORCHELASTIC_USE_AGENT_STORE is set; otherwise rank 0 does."""
    members = {name: dist.get_process_group_ranks(axis.group) for name, axis in axes.items() if axis.size > 1}
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.distributed_c10d._get_default_store()
    recorder = FlightRecorder(store, env.rank, env.world_size, members, hosts_store=env.rank == 0 and not agent_store)
    recorder.start()
    return recorder


def _device(env: ProcessEnv) -> torch.device:
    if torch.cuda.is_available():
        index = env.local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")
