"""Real launchers start plait: Slurm's srun (a one-node cluster started here) and Open MPI's
mpirun each train 4 ranks with the same losses as plait's own spawner on the same layout.

Skipped, saying why, where slurm-wlm or openmpi-bin is not installed (.ci/run installs both)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests import slurmlib
from tests.parity import assert_losses_close
from tests.slurmlib import launcher_env
from tests.worldlib import ROOT, run_plait

TRAIN = ["train", "--model", "tiny", "--steps", "3", "--micro-batch", "2", "--seq-len", "16", "--eval-every", "0",
         "--sample-tokens", "0", "--warmup-steps", "1", "--tp", "2"]


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The same layout (dp 2 × tp 2) under plait's spawner: the losses to match."""
    out = tmp_path_factory.mktemp("spawned")
    proc = run_plait(*TRAIN, "--nproc", "4", "--out", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return losses(out)


@pytest.mark.slow  # make test runs srun in tests/test_faults_restart.py (preempted, then resumed)
def test_srun_trains_like_the_spawner(spawned, tmp_path):
    why = slurmlib.missing()
    if why:
        pytest.skip(why)
    with slurmlib.cluster(tmp_path / "slurm") as env:
        cmd = ["srun", "-n", "4", "--time", "5", sys.executable, "-m", "plait", *TRAIN, "--out", str(tmp_path / "out")]
        proc = subprocess.run(cmd, env=launcher_env(SLURM_CONF=env["SLURM_CONF"]), cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["layout"]["launcher"] == "slurm" and summary["layout"]["world_size"] == 4
    assert_losses_close(losses(tmp_path / "out"), spawned)


def test_mpirun_trains_like_the_spawner(spawned, tmp_path):
    if shutil.which("mpirun") is None:
        pytest.skip("openmpi-bin is not installed (mpirun missing; .ci/run installs it with apt-get)")
    env = launcher_env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if not (shutil.which("ssh") or shutil.which("rsh")):  # one node: no agent is started, but one must exist
        env["OMPI_MCA_plm_rsh_agent"] = "false"
    cmd = ["mpirun", "-np", "4", "--oversubscribe", "-x", "PYTHONPATH", "-x", "MASTER_PORT",
           sys.executable, "-m", "plait", *TRAIN, "--out", str(tmp_path / "out")]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["layout"]["launcher"] == "mpi" and summary["layout"]["world_size"] == 4
    assert_losses_close(losses(tmp_path / "out"), spawned)


@pytest.mark.slow
def test_under_torchrun_a_hung_rank_is_named_through_the_agents_store(tmp_path):
    """torchrun's agent hosts the store, so even a hung rank 0 is named by the others.

    The test stops reading once rank 1 has named it and ends the job itself: a hung rank
    finishes no step, so it never acts on the SIGTERM the agent then sends, and torchrun
    (2.13) waits a fixed 30 s before its SIGKILL on this path, whatever --shutdown-timeout says."""
    env = launcher_env(PLAIT_INJECT="0:0:2:HANG")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", env["MASTER_PORT"],
           "-m", "plait", *TRAIN[:-2], "--steps", "4", "--timeout", "5", "--out", str(tmp_path)]
    line = first_line_starting(cmd, env, "plait: error: rank 1: ", timeout=300)
    assert "rank 0 never entered all_reduce #" in line and "on the dp group at step 2" in line, line
    assert "rank 0 is at step 2, the last collective it finished was all_reduce #" in line, line


def first_line_starting(cmd: list[str], env: dict[str, str], prefix: str, timeout: float) -> str:
    """The first stderr line of `cmd` that starts with `prefix`; then the job is killed, its
    workers first (torchrun starts each in a session of its own)."""
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    timer = threading.Timer(timeout, kill_tree, (proc.pid,))
    timer.start()
    seen = []
    try:
        for line in proc.stderr:
            seen.append(line)
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no line starting {prefix!r} (rc {proc.wait()}):\n{''.join(seen)[-3000:]}")
    finally:
        timer.cancel()
        kill_tree(proc.pid)
        proc.wait()
        proc.stderr.close()


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it (found by their parents in /proc)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            child, parent = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
            parents.setdefault(parent, []).append(child)
    todo, tree = [pid], []
    while todo:
        tree.append(todo.pop())
        todo.extend(parents.get(tree[-1], []))
    for member in reversed(tree):
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)
