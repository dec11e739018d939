"""Preemption: SIGTERM or SIGUSR1 stops the run at a step boundary every rank agrees on.

Slurm sends SIGTERM (or the signal `--signal` names, often SIGUSR1) some time before a job's
time limit or its preemption; torchrun's agent passes SIGTERM on to its workers. The signal
reaches one rank or all of them, at different moments, but a checkpoint needs every rank at
the same step. So a signal only raises this rank's flag; after each step the ranks reduce
their flags (in the one small all-reduce over the world the trainer makes after each step,
with the background saves' state), and when any is up, all of them save at that step and
leave with EXIT_PREEMPTED (plait.errors). `--resume auto` then continues
exactly where they stopped.

A signal often arrives twice: a scheduler signals the whole job step (the spawner or
torchrun's agent and every rank at once) and the spawner or agent then passes it on to the
ranks again. Such a burst is one preemption, so after the first signal this rank ignores
that same signal until it exits, even inside a collective or a write (the OS drops it); what
escalates after a grace period is the scheduler's SIGKILL (Slurm's KillWait). The other
signal (SIGTERM after a SIGUSR1 warning: the time limit is here) still ends the process at
once, and the checkpoint being written is then simply not published (the previous one stays
whole, plait.train.checkpoint.write).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption:
    """This rank's flag, raised by a signal (the trainer's step boundary reduces it over the world)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "Preemption":
        """Catch the signals (signal handlers can only be set from the main thread: a run
        started from another thread is simply not preemptible this way)."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Put the previous handlers back; but a preempted rank keeps ignoring its signal while
        it leaves with EXIT_PREEMPTED: the copy the spawner passes on may still be on its way."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if sig == self.received else handler)
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received = signum
        for sig in SIGNALS:  # a repeat of this signal is the same preemption; the other acts at once
            signal.signal(sig, signal.SIG_IGN if sig == signum else signal.SIG_DFL)

    @staticmethod
    def name(number: int) -> str:
        return signal.Signals(number).name
