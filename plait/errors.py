"""The one exception type users see: a clear line, plus a hint saying what to change."""

from __future__ import annotations


class PlaitError(Exception):
    """An error caused by the input (layout, config, files), not by a bug in plait.

    The CLI prints `message` on one line and `hint` on the next, without a traceback
    unless `--debug` is given.
    """

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} (hint: {self.hint})"
        return self.message


# The exit codes plait's commands and ranks end with, named once (the CLI, the spawner and
# the docs read them here).
EXIT_CRASH = 1  # anything else: a bug, or a fault the run did not expect
EXIT_INPUT = 2  # bad input (a PlaitError): starting again would fail the same way
EXIT_PREEMPTED = 75  # SIGTERM/SIGUSR1 honoured: saved at a step boundary; continue with --resume auto
# (75 is EX_TEMPFAIL in sysexits.h: a temporary failure, to be retried.)


class Preempted(Exception):
    """Every rank stopped at one step boundary after SIGTERM or SIGUSR1, and saved there.

    Not an error: the CLI prints `message` and exits with EXIT_PREEMPTED, so a job script or
    Slurm's --requeue starts the run again with `--resume auto`."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
