"""Who am I? Rank, world size and rendezvous address, read from whichever launcher started us.

Launchers each speak their own dialect of environment variables; this module turns every
dialect into one `ProcessEnv`. It reads `os.environ` (or a dict, for tests) and never
touches torch.distributed, so it can be tested by feeding it each launcher's variables.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from plait.errors import PlaitError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class ProcessEnv:
    """This process's place in the job, and how to reach the others."""

    launcher: str  # "torchrun", "slurm", "mpi", "spawn" or "single"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    # plait's own spawner: a file in the world's own directory the ranks meet through (torch's
    # FileStore), so no port is picked, released and handed on for another job to take first.
    store_file: str = ""

    @property
    def init_method(self) -> str:
        """Where the ranks meet: the world's store file, or the master's TCP address."""
        return f"file://{self.store_file}" if self.store_file else f"tcp://{self.master_addr}:{self.master_port}"

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


STORE_ENV = "PLAIT_STORE_FILE"  # the spawner's per-world rendezvous file (ProcessEnv.store_file)


def detect(environ: Mapping[str, str] | None = None) -> ProcessEnv:
    """Read the launcher's variables; a process started by none of them runs alone.

    Order matters: plait's spawner and torchrun set RANK explicitly; Slurm and MPI set their
    own names, and a job may be *inside* an allocation (SLURM_* present) while launched by
    torchrun, so the explicit RANK wins.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "spawn" if env.get("PLAIT_SPAWNED") == "1" else "torchrun"
        return _from_torchrun(env, launcher)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _from_mpi(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                         "OMPI_COMM_WORLD_LOCAL_RANK")
    if "PMI_RANK" in env:
        return _from_mpi(env, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID")
    return ProcessEnv("single", 0, 1, 0, "127.0.0.1", DEFAULT_PORT)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise PlaitError(f"launcher variable {name} is not set",
                             hint="start the job with torchrun, srun, mpirun or `plait train --nproc N`")
        return default
    try:
        return int(value)
    except ValueError:
        raise PlaitError(f"launcher variable {name}={value!r} is not an integer") from None


def _from_torchrun(env: Mapping[str, str], launcher: str) -> ProcessEnv:
    return ProcessEnv(
        launcher=launcher,
        rank=_int(env, "RANK"),
        world_size=_int(env, "WORLD_SIZE"),
        local_rank=_int(env, "LOCAL_RANK", 0),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", DEFAULT_PORT),
        store_file=env.get(STORE_ENV, "") if launcher == "spawn" else "",
    )


def _from_slurm(env: Mapping[str, str]) -> ProcessEnv:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
    # Derive the port from the job id so that two jobs sharing a node do not collide.
    job_port = DEFAULT_PORT + int(env.get("SLURM_JOB_ID", "0")) % 10000
    return ProcessEnv(
        launcher="slurm",
        rank=_int(env, "SLURM_PROCID"),
        world_size=_int(env, "SLURM_NTASKS"),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        master_addr=env.get("MASTER_ADDR", first_host(nodelist)),
        master_port=_int(env, "MASTER_PORT", job_port),
    )


def _from_mpi(env: Mapping[str, str], rank: str, size: str, local: str) -> ProcessEnv:
    # mpirun gives ranks but no rendezvous: the user sets MASTER_ADDR for multi-node jobs
    # (e.g. `mpirun -x MASTER_ADDR=node0`); a single node needs nothing.
    return ProcessEnv(
        launcher="mpi",
        rank=_int(env, rank),
        world_size=_int(env, size),
        local_rank=_int(env, local, 0),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", DEFAULT_PORT),
    )


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[003-005,009],cpu1" -> "gpu003"."""
    match = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise PlaitError(f"cannot read the Slurm node list {nodelist!r}",
                         hint="set MASTER_ADDR to the first node's hostname")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


BACKENDS = ("nccl", "gloo", "mpi")  # what --backend names besides "auto"


def check_backend_name(requested: str, flag: str = "--backend") -> None:
    """A --backend names one plait runs (auto, or one of BACKENDS): checked before spawning,
    so a typo is one line rather than a world that starts and fails."""
    if requested not in ("auto", *BACKENDS):
        raise PlaitError(f"{flag} {requested!r} is not one plait runs", hint=f"choose from: auto, {', '.join(BACKENDS)}")


def choose_backend(requested: str | None, cuda_available: bool, mpi_available: bool) -> str:
    """NCCL with CUDA, else Gloo; an explicit choice must be one this torch build has."""
    if requested in (None, "", "auto"):
        return "nccl" if cuda_available else "gloo"
    if requested == "nccl" and not cuda_available:
        raise PlaitError("backend nccl needs CUDA, and no GPU is visible",
                         hint="use --backend gloo (the default on CPU)")
    if requested == "mpi" and not mpi_available:
        raise PlaitError("backend mpi is not built into this PyTorch",
                         hint="under mpirun plait reads ranks from MPI's variables and uses gloo/nccl; drop --backend mpi")
    if requested not in BACKENDS:
        raise PlaitError(f"unknown backend {requested!r}", hint="choose nccl, gloo, mpi or auto")
    return requested


def prepare_host(local_world: int) -> None:
    """A rank's host, set as training runs it: its share of the cores, and freed memory kept
    for reuse. Every plait process that trains, evaluates or times a model starts here, so
    that `plait calibrate` measures the host training gets."""
    set_cpu_threads(local_world)
    keep_freed_memory()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_memory() -> None:
    """Let glibc keep freed memory in the heap instead of handing it back to the OS.

    A CPU has no caching allocator: what torch frees goes back to glibc, which returns
    large blocks to the OS and faults them in again, a page at a time, when they are
    allocated next. ZeRO-2 allocates its whole gradient buckets every backward: on 4 ranks
    of `small` on 2 cores that doubled the run's page faults (1.25 M against 0.64 M) and
    cost 5% a step (0.88 s against 0.84 s for ZeRO-1); with these thresholds it faulted as
    ZeRO-1 does and ran within 1.2% of it. Plain training pays too: one one-thread rank of
    `small` at micro-batch 8 faulted 10.3 k pages a step (12 ms of system time, 2% of the
    step) under glibc's defaults and none with these thresholds; with the trim threshold
    alone, which also freezes glibc's mmap threshold at 128 KiB, 52 k (55 ms). Blocks up to
    32 MiB (glibc's largest mmap threshold) come from the heap, and up to 1 GiB of free heap
    is kept. A no-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_TRIM_THRESHOLD, 1 << 30)
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
    except (OSError, AttributeError):
        pass


def set_cpu_threads(local_world: int) -> None:
    """Share the cores between the local processes instead of oversubscribing them (torch is
    imported here, not at the top: the spawner reads this module and never loads torch)."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))


def cache_root() -> Path:
    """plait's cache directory: $PLAIT_CACHE_DIR, else $XDG_CACHE_HOME/plait, else
    ~/.cache/plait (calibrations and compiled graphs live there)."""
    given = os.environ.get("PLAIT_CACHE_DIR")
    return Path(given) if given else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "plait"


def cxx_compiler() -> tuple[str, bool]:
    """The C++ compiler torch's Inductor builds CPU code with ($CXX, else g++), and whether
    it is on the PATH."""
    name = os.environ.get("CXX") or "g++"
    return name, shutil.which(name) is not None


@functools.cache
def torch_release() -> tuple[int, int] | None:
    """The installed torch's (major, minor), read without importing it; None if unreadable.
    Read once a process: the packages' metadata is parsed from disk (a few ms), and a plan's
    layouts are each checked against it."""
    import importlib.metadata
    import re

    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torch"))
    except importlib.metadata.PackageNotFoundError:
        return None
    return (int(found[1]), int(found[2])) if found else None


@functools.cache
def have_torchao() -> bool:
    """Whether torchao (plait[fp8]) is installed, found without importing it: the launcher asks
    before spawning, where nothing imports torch, and each rank asks again (once a process)."""
    import importlib.util

    return importlib.util.find_spec("torchao") is not None
