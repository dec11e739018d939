"""The one exception type users see: a clear line, plus a hint saying what to change."""

from __future__ import annotations

import argparse
import difflib


class PlaitError(Exception):
    """An error caused by the input (layout, config, files), not by a bug in plait.

    The CLI prints `message` on one line and `hint` on the next, without a traceback
    unless `--debug` is given.
    """

    def __init__(self, message: str, hint: str | None = None):
        message = one_line(message)  # the user's own text may hold a line break (--imports "a\nb")
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} (hint: {self.hint})"
        return self.message


def one_line(text: str) -> str:
    """`text` with each line break written as the two characters a Python string shows."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


class CommandParser(argparse.ArgumentParser):
    """argparse, but a flag it cannot read is a PlaitError: one line and a hint (the nearest
    flag it knows, or where its flags are listed), not argparse's usage block and exit.

    Every plait command parses with it, so `plait estimate --global-batch 256` reads like any
    other refusal of the input; `--help` still prints the usage."""

    def error(self, message: str):  # type: ignore[override] - raises, as argparse's exits
        raise PlaitError(f"{self.prog}: {message}", hint=self._hint(message))

    def _hint(self, message: str) -> str:
        listed = f"`{self.prog} --help` lists its flags"
        if not message.startswith("unrecognized arguments:"):
            return listed
        known = [name for action in self._actions for name in action.option_strings]
        given = [word.split("=", 1)[0] for word in message.split(":", 1)[1].split() if word.startswith("-")]
        near = [match for word in given for match in difflib.get_close_matches(word, known, n=1, cutoff=0.75)]
        return f"did you mean {' or '.join(dict.fromkeys(near))}? " + listed if near else listed


def check_writable_file(path: str, flag: str) -> None:
    """A command's output FILE, checked before any work: a name, not a directory, in a
    directory that exists (a measurement is not thrown away for a typo at its end)."""
    import os

    if not path.strip():
        raise PlaitError(f"{flag} is empty", hint=f"name the file to write, e.g. {flag} out.json")
    if os.path.isdir(path):
        raise PlaitError(f"{flag} {path} is a directory", hint=f"name a file in it, e.g. {flag} {os.path.join(path, 'out')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise PlaitError(f"{flag} {path}: its directory {parent} does not exist", hint="create it first")


# The exit codes plait's commands and ranks end with, named once (the CLI, the spawner and
# the docs read them here).
EXIT_CRASH = 1  # anything else: a bug, or a fault the run did not expect
EXIT_INPUT = 2  # bad input (a PlaitError): starting again would fail the same way
EXIT_CORRUPT = 3  # replicas that should be equal are not (--check-replicas): restart from a checked checkpoint
EXIT_PREEMPTED = 75  # SIGTERM/SIGUSR1 honoured: saved at a step boundary; continue with --resume auto
# (75 is EX_TEMPFAIL in sysexits.h: a temporary failure, to be retried.)


class Preempted(Exception):
    """Every rank stopped at one step boundary after SIGTERM or SIGUSR1, and saved there.

    Not an error: the CLI prints `message` and exits with EXIT_PREEMPTED, so a job script or
    Slurm's --requeue starts the run again with `--resume auto`."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message
