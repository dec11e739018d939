"""Each launcher's environment, fed as a dict: who am I, and where is rank 0."""

from __future__ import annotations

import pytest

from plait.errors import PlaitError
from plait.runtime.env import choose_backend, detect, first_host


def test_single_process_when_no_launcher():
    env = detect({})
    assert (env.launcher, env.rank, env.world_size, env.distributed) == ("single", 0, 1, False)


def test_torchrun():
    env = detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("torchrun", 3, 8, 1)
    assert (env.master_addr, env.master_port) == ("node7", 1234)


def test_plait_spawner_is_named():
    env = detect({"RANK": "0", "WORLD_SIZE": "2", "PLAIT_SPAWNED": "1", "MASTER_PORT": "40000"})
    assert env.launcher == "spawn" and env.master_port == 40000


def test_slurm_takes_first_host_and_a_job_specific_port():
    env = detect({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                  "SLURM_JOB_NODELIST": "gpu[012-015,020],cpu3", "SLURM_JOB_ID": "4242"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("slurm", 5, 16, 1)
    assert env.master_addr == "gpu012"
    assert env.master_port == 29500 + 4242


def test_torchrun_inside_a_slurm_allocation_wins():
    env = detect({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert env.launcher == "torchrun" and env.rank == 1


def test_open_mpi():
    env = detect({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                  "MASTER_ADDR": "head"})
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("mpi", 2, 4, "head")


def test_mpich_pmi():
    env = detect({"PMI_RANK": "1", "PMI_SIZE": "3"})
    assert (env.launcher, env.rank, env.world_size, env.master_addr) == ("mpi", 1, 3, "127.0.0.1")


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"), ("a[1-4]", "a1"), ("gpu[003,007]", "gpu003"), ("x[10-11],y[1-2]", "x10"), ("h1,h2", "h1"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


def test_bad_rank_value_is_named():
    with pytest.raises(PlaitError, match="RANK='x' is not an integer"):
        detect({"RANK": "x", "WORLD_SIZE": "2"})


def test_backend_choice():
    assert choose_backend(None, cuda_available=True, mpi_available=False) == "nccl"
    assert choose_backend("auto", cuda_available=False, mpi_available=False) == "gloo"
    assert choose_backend("gloo", cuda_available=True, mpi_available=False) == "gloo"
    with pytest.raises(PlaitError, match="nccl needs CUDA"):
        choose_backend("nccl", cuda_available=False, mpi_available=False)
    with pytest.raises(PlaitError, match="mpi is not built into this PyTorch") as err:
        choose_backend("mpi", cuda_available=False, mpi_available=False)
    assert "under mpirun" in err.value.hint
    with pytest.raises(PlaitError, match="unknown backend 'tcp'"):
        choose_backend("tcp", cuda_available=False, mpi_available=False)


def test_the_spawners_ranks_meet_through_the_worlds_file_and_others_through_the_master():
    spawned = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "1234", "PLAIT_SPAWNED": "1",
                      "PLAIT_STORE_FILE": "/tmp/world/store"})
    assert spawned.init_method == "file:///tmp/world/store"
    torchrun = detect({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
                       "PLAIT_STORE_FILE": "/tmp/world/store"})  # not plait's spawner: its variable is not read
    assert torchrun.init_method == "tcp://10.0.0.1:1234"


def test_four_spawned_jobs_on_one_machine_at_once_never_collide(tmp_path):
    """Each world meets through its own file, not a port picked free and released before its
    rank 0 binds it (another job could take it in between: EADDRINUSE)."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.worldlib import run_plait

    def job(k: int) -> int:
        return run_plait("train", "--model", "tiny", "--steps", "2", "--nproc", "2", "--seq-len", "32",
                         "--sample-tokens", "0", "--eval-every", "0", "--no-report", "--out", str(tmp_path / f"job{k}"),
                         timeout=300).returncode

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(job, range(4))) == [0, 0, 0, 0]
    assert all((tmp_path / f"job{k}" / "summary.json").is_file() for k in range(4))


FAULTS_OF_GROWING_BLOCKS = """
import resource, sys
from plait.runtime.env import keep_freed_memory
if sys.argv[1] == "kept":
    keep_freed_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(12):
    block = b"\\x01" * ((20 << 20) + i * (256 << 10))  # 20 MiB and growing, each page written
    del block
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_rank_keeps_freed_memory_rather_than_fault_it_in_again():
    """glibc hands a freed block above its mmap threshold back to the OS, and each block a
    little larger than the last is mapped and faulted in afresh, a page at a time: ZeRO-2's
    buckets, allocated every backward, doubled a 4-rank run's page faults that way.
    `prepare_host` (every training rank) keeps them in the heap instead."""
    import subprocess
    import sys

    def faults(mode: str) -> int:
        proc = subprocess.run([sys.executable, "-c", FAULTS_OF_GROWING_BLOCKS, mode], capture_output=True, text=True,
                              check=True)
        return int(proc.stdout)

    released, kept = faults("released"), faults("kept")
    pages = (20 << 20) // 4096
    assert released > 8 * pages, released  # each block faulted in again
    assert kept < 2 * pages, (kept, released)  # the heap grows once and is reused
