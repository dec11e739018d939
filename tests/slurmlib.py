"""A one-node Slurm cluster on localhost for tests: slurmctld and slurmd in the foreground,
configured in a temporary folder (auth/none: no munge), torn down by their process ids."""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

BINARIES = ("srun", "slurmctld", "slurmd", "sinfo")
# What a launcher sets for its ranks: never inherited from the test's own environment.
CLEAN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "PLAIT_SPAWNED")
START_S = 30.0


def launcher_env(**extra: str) -> dict[str, str]:
    """The environment to start srun, mpirun or torchrun in: plait importable, a free port,
    nothing a launcher sets for its ranks."""
    from plait.runtime.launch import free_port
    from tests.worldlib import ROOT

    env = {k: v for k, v in os.environ.items() if k not in CLEAN and not k.startswith(("SLURM_", "OMPI_"))}
    return {**env, "PYTHONPATH": str(ROOT), "MASTER_PORT": str(free_port()), **extra}


def missing() -> str | None:
    """Why the cluster cannot start here, or None."""
    absent = [b for b in BINARIES if shutil.which(b) is None and not Path(f"/usr/sbin/{b}").exists()]
    if absent:
        return f"slurm-wlm is not installed ({', '.join(absent)} missing; .ci/run installs it with apt-get)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start job steps, and this test is not root"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_conf(folder: Path) -> Path:
    """slurm.conf for one node with 8 CPUs (config_overrides: the real core count may be lower)."""
    user, host = getpass.getuser(), socket.gethostname()
    for sub in ("state", "spool"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    lines = [
        "ClusterName=plaittest", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "AuthType=auth/none", "CredType=cred/none", f"SlurmUser={user}", f"SlurmdUser={user}",
        f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'slurmd.log'}",
        "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "SwitchType=switch/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/builtin",
        "ReturnToService=2", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "SlurmdParameters=config_overrides",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs=8 RealMemory=4000 State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
    ]
    conf = folder / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


@contextmanager
def cluster(folder: Path):
    """Yield the environment (SLURM_CONF set) in which `srun` reaches the running cluster."""
    conf = write_conf(folder)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen([name, "-D", "-f", str(conf), *extra], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
               for name, extra in (("slurmctld", ["-i"]), ("slurmd", []))]
    try:
        _wait_idle(env, folder, daemons)
        yield env
    finally:
        for proc in daemons:
            proc.terminate()
        for proc in daemons:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_idle(env: dict[str, str], folder: Path, daemons: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if any(proc.poll() is not None for proc in daemons):
            break
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
        if state.stdout.strip() == "idle":
            return
        time.sleep(0.3)
    logs = "\n".join(p.read_text()[-1500:] for p in folder.glob("*.log"))
    raise RuntimeError(f"the test Slurm cluster did not come up within {START_S:.0f} s:\n{logs}")
