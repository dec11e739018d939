"""The (pp, dp, tp) grid of ranks and one process group per axis.

tp varies fastest, then dp, then pp: global rank = (pp_index·dp + dp_index)·tp + tp_index.
Keeping tp innermost places a tensor-parallel group on neighbouring ranks, which a launcher
puts on one node, where the bandwidth is.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from plait.errors import PlaitError
from plait.runtime.comm import Axis, Ledger
from plait.runtime.env import ProcessEnv, choose_backend, detect
from plait.runtime.recorder import FlightRecorder

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class MeshShape:
    """Degrees of parallelism; their product must be the world size."""

    pp: int = 1
    dp: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise PlaitError(f"--{axis} must be at least 1, got {getattr(self, axis)}")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def check(self, world_size: int) -> None:
        if self.world_size != world_size:
            raise PlaitError(
                f"layout dp={self.dp} × tp={self.tp} × pp={self.pp} = {self.world_size} "
                f"does not match world size {world_size}",
                hint=f"choose degrees whose product is {world_size}",
            )

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each axis."""
        return {"tp": rank % self.tp, "dp": rank // self.tp % self.dp, "pp": rank // (self.tp * self.dp)}

    @classmethod
    def fill(cls, world_size: int, dp: int | None = None, tp: int = 1, pp: int = 1) -> "MeshShape":
        """A shape for `world_size` ranks; dp, when not given, takes what tp and pp leave."""
        if dp is None:
            if world_size % (tp * pp):
                raise PlaitError(
                    f"world size {world_size} is not divisible by tp={tp} × pp={pp}",
                    hint="choose tp and pp whose product divides the number of processes",
                )
            dp = world_size // (tp * pp)
        shape = cls(pp=pp, dp=dp, tp=tp)
        shape.check(world_size)
        return shape


@dataclass
class Mesh:
    """This rank's view of the grid: its coordinates and the group of each axis.

    Besides pp, dp and tp there is a "world" axis (every rank), used for the report's
    max-over-ranks numbers.
    """

    shape: MeshShape
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


def init_mesh(dp: int | None = None, tp: int = 1, pp: int = 1, *, backend: str | None = None,
              timeout_s: float = 300.0, env: ProcessEnv | None = None) -> Mesh:
    """Join the job (torchrun, srun, mpirun, plait's spawner, or none) and build the grid.

    The layout is checked against the world size before any process group exists, so a bad
    layout fails fast on every rank with the same message instead of hanging in a rendezvous.
    """
    env = env or detect()
    shape = MeshShape.fill(env.world_size, dp=dp, tp=tp, pp=pp)
    device = _device(env)
    ledger = Ledger()
    if not env.distributed:
        axes = {name: Axis(name, 1, 0, None, ledger, 0) for name in (*AXES, "world")}
        return Mesh(shape, env, None, device, ledger, axes)
    chosen = choose_backend(backend, torch.cuda.is_available(), dist.is_mpi_available())
    if not dist.is_initialized():
        dist.init_process_group(
            backend=chosen, init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank, world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    from torch.distributed.device_mesh import init_device_mesh

    device_mesh = init_device_mesh(device.type, (shape.pp, shape.dp, shape.tp), mesh_dim_names=AXES)
    coords = shape.coords(env.rank)
    axes = {
        name: Axis(name, getattr(shape, name), coords[name], device_mesh.get_group(name), ledger, env.rank)
        for name in AXES
    }
    axes["world"] = Axis("world", env.world_size, env.rank, dist.group.WORLD, ledger, env.rank)
    ledger.recorder = flight_recorder(env, axes)
    return Mesh(shape, env, chosen, device, ledger, axes, device_mesh)


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
