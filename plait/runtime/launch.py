"""plait's own local spawner: start N copies of a command as one job, and never hang.

It does what torchrun's simplest mode does, without importing torch: pick a free port, start
N processes with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, and watch
them. When one exits with an error, the others are stopped at once (they would otherwise
wait forever in a collective), and the job exits with that rank's code.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

POLL_S = 0.05
GRACE_S = 3.0


def free_port() -> int:
    """A TCP port nobody is listening on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_env(rank: int, nproc: int, port: int) -> dict[str, str]:
    """The variables each spawned rank reads (the same names torchrun sets)."""
    return {
        **os.environ,
        "RANK": str(rank), "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "PLAIT_SPAWNED": "1",
    }


def spawn(command: Sequence[str], nproc: int) -> int:
    """Run `command` as ranks 0..nproc-1 and return the job's exit code."""
    port = free_port()
    procs = [subprocess.Popen(list(command), env=rank_env(rank, nproc, port)) for rank in range(nproc)]
    try:
        return _watch(procs)
    except KeyboardInterrupt:
        _stop(procs)
        return 130


def _watch(procs: list[subprocess.Popen]) -> int:
    """Wait until every rank succeeded, or one failed (then stop the rest)."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            _report(failed, sum(code is None for code in codes))
            _stop(procs)
            return _exit_code(failed[0][1])
        if all(code == 0 for code in codes):
            return 0
        time.sleep(POLL_S)


def _report(failed: list[tuple[int, int]], still_running: int) -> None:
    which = ", ".join(f"rank {rank} exited with code {_describe(code)}" for rank, code in failed)
    tail = f"; stopping the other {still_running} rank(s)" if still_running else ""
    print(f"plait: {which}{tail} (the failing rank's error is above)", file=sys.stderr, flush=True)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def _exit_code(code: int) -> int:
    """Shell convention: a rank killed by signal N makes the job exit 128 + N."""
    return 128 - code if code < 0 else code


def _stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every live rank; SIGKILL whatever is left after a grace period."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
