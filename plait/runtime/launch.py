"""plait's own local spawner: start N copies of a command as one job, and never hang.

It does what torchrun's simplest mode does, without importing torch: start N processes with
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT set, and watch them. The ranks meet
through a file in the world's own directory (PLAIT_STORE_FILE: torch's FileStore), not a TCP
port: a port picked free, released and handed on could be taken by another job in between,
so two spawners on one machine never collide. When one exits with an error, the others are stopped at once (they would otherwise
wait forever in a collective), and the job exits with that rank's code.

A rank whose collective failed leaves a note in a scratch folder (PLAIT_FAULT_DIR): what
timed out and which ranks never entered it (runtime/recorder.py). Then the others get a few
seconds to report theirs before they are stopped, and the summary names the culprits.

With `max_restarts`, a world that lost a rank (killed, crashed, or stuck until a collective
timed out) is stopped and started again, up to that many times; `restart_command(nproc)`
says what the new world runs (plait train resumes from the run's latest checkpoint). Given
`sizes` (the world sizes the run can continue on, largest first or not), a rank that fails
in two worlds in a row is taken as lost, as a node that is not coming back would be, and the
next world is the largest of `sizes` the remaining ranks can fill.

SIGTERM and SIGUSR1 sent to the spawner (Slurm's warning before a time limit or a preemption)
are passed on to every rank: plait train saves at the next step boundary and every rank exits
with EXIT_PREEMPTED, which the spawner returns without restarting. A job told to stop is never
restarted, even when its ranks died of the signal (still starting, before their handlers).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from pathlib import Path

from plait.errors import EXIT_INPUT, EXIT_PREEMPTED, PlaitError
from plait.runtime import console
from plait.runtime.env import STORE_ENV

POLL_S = 0.05
STORE_NAME = "store"  # the world's rendezvous file, in its own directory (a restart gets a fresh one)
REPORT_S = 8.0  # how long the other ranks may take to report a failed collective
RESTART_ENV = "PLAIT_RESTART"  # how many restarts came before this world (0: the first)


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


def spawn(command: Sequence[str], nproc: int, max_restarts: int = 0,
          restart_command: Callable[[int], Sequence[str]] | None = None, sizes: Sequence[int] = ()) -> int:
    """Run `command` as ranks 0..nproc-1 and return the job's exit code; restart lost worlds
    (on fewer ranks, one of `sizes`, when a rank keeps failing)."""
    check_local_nproc(nproc, cpu_process_limit())
    attempt, failing = 0, set()
    with _forwarded_signals() as live:
        while True:
            code, restartable, culprits = _run_world(command, nproc, attempt, live.procs)
            if code in (0, EXIT_PREEMPTED) or not restartable or attempt >= max_restarts or live.received:
                return code  # a job told to stop (SIGTERM/SIGUSR1) is not restarted, whatever its ranks did
            lost, failing = failing & culprits, culprits
            if lost and sizes:
                smaller = [n for n in sizes if n <= nproc - len(lost)]
                if not smaller:
                    print(f"plait: rank(s) {_names(lost)} failed in two worlds in a row, and no smaller world the run "
                          f"accepts is left (it can run on {_names(sizes)} processes)", file=sys.stderr, flush=True)
                    return code
                print(f"plait: rank(s) {_names(lost)} failed in two worlds in a row: taken as lost; the world restarts "
                      f"on {max(smaller)} process(es) instead of {nproc}", file=sys.stderr, flush=True)
                nproc, failing = max(smaller), set()
            attempt += 1
            command = restart_command(nproc) if restart_command else command
            print(f"plait: restarting the world ({attempt} of {max_restarts})", file=sys.stderr, flush=True)


def _names(numbers: Any) -> str:
    return ", ".join(map(str, sorted(numbers)))


class _forwarded_signals:
    """While the job runs, SIGTERM and SIGUSR1 to the spawner go to every live rank (they
    decide together where to stop); the spawner keeps watching until they have.

    When a scheduler signals the whole job step, each rank gets the signal twice (directly,
    and from here): plait.train.checkpoint.preempt takes repeats of one signal as one preemption. The
    spawner, too, ignores a late repeat once the job has ended (its exit code is decided)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.previous: dict[int, Any] = {}
        self.received: set[int] = set()

    def __enter__(self) -> "_forwarded_signals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, self._forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_IGN if sig in self.received else handler)

    def _forward(self, signum: int, frame: Any) -> None:
        self.received.add(signum)
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)


def _run_world(command: Sequence[str], nproc: int, attempt: int,
               live: list[subprocess.Popen]) -> tuple[int, bool, set[int]]:
    """One world, from start to its end: (exit code, whether a restart could help, the ranks
    that failed first)."""
    port = free_port()  # read by what ranks run (MASTER_PORT), not by their rendezvous: the store file
    faults = Path(tempfile.mkdtemp(prefix="plait-faults-"))
    extra = {"PLAIT_FAULT_DIR": str(faults), RESTART_ENV: str(attempt), STORE_ENV: str(faults / STORE_NAME)}
    procs = [subprocess.Popen(list(command), env={**rank_env(rank, nproc, port), **extra}) for rank in range(nproc)]
    live[:] = procs
    try:
        return _watch(procs, faults)
    except KeyboardInterrupt:
        _stop(procs)
        return 130, False, set()
    finally:
        live.clear()
        shutil.rmtree(faults, ignore_errors=True)


def _watch(procs: list[subprocess.Popen], faults: Path) -> tuple[int, bool, set[int]]:
    """Wait until every rank succeeded (or stopped, preempted), or one failed (then stop the
    rest)."""
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0, EXIT_PREEMPTED)]
        if failed:
            first = {rank for rank, _ in failed}
            notes = _notes(faults)
            if notes:  # a collective failed: the others are diagnosing theirs, give them a moment
                _wait_for_reports(procs, faults)
                notes = _notes(faults)
                failed = [(r, p.poll()) for r, p in enumerate(procs) if p.poll() not in (None, 0)] or failed
            mark = console.mark_in(faults)  # rank 0's bar may have left its line open
            _report(failed, sum(proc.poll() is None for proc in procs), mark)
            _name_culprits(notes, procs, mark)
            _stop(procs)
            restartable = bool(notes) or any(code != EXIT_INPUT for _, code in failed)
            culprits = {rank for note in notes for rank in note["culprits"]} or first
            return _exit_code(failed[0][1]), restartable, culprits
        if all(code is not None for code in codes):
            return (EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0), False, set()
        time.sleep(POLL_S)


def _wait_for_reports(procs: list[subprocess.Popen], faults: Path) -> None:
    """Until every rank that may still print its diagnosis has exited, or REPORT_S.

    A rank is not waited for once it exited, or when the notes name it and the OS says its
    process is stopped. A named rank whose process still runs is waited for: it may be a live
    rank whose record reached the store late, still diagnosing its own timeout, and stopping
    it now would silence it (a rank truly stuck in compute costs at most REPORT_S)."""
    deadline = time.monotonic() + REPORT_S
    while time.monotonic() < deadline:
        culprits = {rank for note in _notes(faults) for rank in note["culprits"]}
        if all(p.poll() is not None or (rank in culprits and _is_stopped(p)) for rank, p in enumerate(procs)):
            return
        time.sleep(POLL_S)


def _notes(faults: Path) -> list[dict]:
    """What the ranks whose collective failed found (runtime/recorder.py writes them)."""
    notes = []
    for path in sorted(faults.glob("rank*.json")):
        try:
            notes.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue  # half-written as the rank was stopped
    return notes


def _name_culprits(notes: list[dict], procs: list[subprocess.Popen], mark: Path | None = None) -> None:
    """One line naming the ranks the others waited for, and what each of those was doing."""
    if not notes:
        return
    culprits = sorted({rank for note in notes for rank in note["culprits"]})
    reporters = ", ".join(str(note["rank"]) for note in notes)
    if not culprits:
        console.say(f"plait: ranks {reporters} saw a collective fail, but every rank had entered it "
                    f"(first report: {notes[0]['message']})", mark)
        return
    states = [f"rank {r}{_process_state(procs[r])}" for r in culprits if r < len(procs)]
    console.say(f"plait: stuck or dead: {', '.join(states)}, named by rank(s) {reporters}: {notes[0]['finding']}",
                mark)


def _process_state(proc: subprocess.Popen) -> str:
    """' (stopped)', ' (exited with …)' or '': what the OS says about a culprit's process."""
    code = proc.poll()
    if code is not None:
        return f" (exited with code {_describe(code)})"
    return " (its process is stopped)" if _is_stopped(proc) else ""


def _is_stopped(proc: subprocess.Popen) -> bool:
    """Whether /proc says the process is stopped (SIGSTOP, a debugger); False where unknown."""
    try:
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in ("T", "t")


def _report(failed: list[tuple[int, int]], still_running: int, mark: Path | None = None) -> None:
    which = ", ".join(f"rank {rank} exited with code {_describe(code)}" for rank, code in failed)
    tail = f"; stopping the other {still_running} rank(s)" if still_running else ""
    console.say(f"plait: {which}{tail} (the failing rank's error is above)", mark)


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
    """SIGKILL every live rank, stopped ones too. Not SIGTERM: a plait rank takes SIGTERM as a
    preemption and would try to reach a step boundary with a world that has lost a rank."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        proc.wait()


def max_local_processes() -> int:
    """How many ranks one machine may train with: one per GPU (NCCL), or a few per CPU core."""
    return local_gpus() or cpu_process_limit()


def cpu_process_limit() -> int:
    """How many processes the spawner starts on one machine whatever they run (a script under
    `plait launch` may use Gloo beside a GPU): a few per CPU core."""
    return max(8, 4 * (os.cpu_count() or 1))


def check_local_nproc(nproc: int, limit: int | None = None) -> None:
    """At most `limit` processes on this machine (`max_local_processes()` by default): a typo
    of --nproc 1000 is one line, not a thousand processes."""
    limit = max_local_processes() if limit is None else limit
    if nproc > limit:
        raise PlaitError(f"--nproc {nproc} is more than this machine allows ({limit})",
                         hint="use fewer processes, or launch across nodes with torchrun or srun")


def local_gpus() -> int:
    """NVIDIA GPUs this process may use, without importing torch (the check runs before
    spawning): CUDA_VISIBLE_DEVICES when set, else the driver's device files."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))
