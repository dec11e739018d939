"""One stderr for a whole job: rank 0's progress bar and every process's one-line messages.

The ranks and the spawner write to the same stderr. tqdm redraws rank 0's bar after a
carriage return and leaves the cursor at its end, so a line another process writes then
(rank 1's error, the spawner's "rank 1 exited ...") would continue the bar's line. So the
bar draws through `BarStream`, which marks in the world's scratch folder (PLAIT_FAULT_DIR,
made by plait's spawner) that it left a line open; `say` starts its line with a newline
when the mark is there, and takes the mark away. Both hold a lock on a file beside the mark
(flock) from looking at the mark until their text is flushed: without it, a rank that found
no mark could write just after the bar's next redraw (tqdm redraws from its own thread) and
continue its line. Without that folder (one process, torchrun) there is no mark: the bar is
closed, with its newline, before the process's own error is printed.

No torch here: the spawner and the CLI import this.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

FOLDER_ENV = "PLAIT_FAULT_DIR"  # the spawner's scratch folder for this world (plait.runtime.launch)
MARK = "line-open"  # the file there that says the bar's line is not finished
LOCK = "console.lock"  # the file beside it that the bar and `say` lock while they write


def mark_in(folder: str | Path | None) -> Path | None:
    return Path(folder) / MARK if folder else None


def _job_mark() -> Path | None:
    return mark_in(os.environ.get(FOLDER_ENV))


class BarStream:
    """What rank 0's progress bar writes to: the stream itself, plus the open-line mark."""

    def __init__(self, stream: TextIO, mark: Path | None = None) -> None:
        self.stream = stream
        self.mark = mark if mark is not None else _job_mark()

    def write(self, text: str) -> int:
        if self.mark is None or not text:
            return self.stream.write(text)
        with _locked(self.mark):
            if text.endswith("\n"):  # closed (tqdm's close): the line is finished
                written = self.stream.write(text)
                self.stream.flush()
                _quietly(self.mark.unlink, missing_ok=True)
                return written
            _quietly(self.mark.touch)
            written = self.stream.write(text)
            self.stream.flush()  # stderr holds a line without its newline: out now, under the lock
            return written

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding: what tqdm asks of its file
        return getattr(self.stream, name)


def _quietly(action: Any, **kwargs: Any) -> None:
    """The mark is a courtesy: a folder already removed never stops the bar (or the run)."""
    try:
        action(**kwargs)
    except OSError:
        pass


def say(text: str, mark: Path | None = None, stream: TextIO | None = None) -> None:
    """Write `text` and its newline in one call, on a line of its own (after a newline when
    the bar left its line open). The job's processes share one stderr: `print` writes the
    text and the newline separately, so two processes at once could splice their lines; one
    write of a short line to a pipe is atomic."""
    mark = mark if mark is not None else _job_mark()
    stream = stream if stream is not None else sys.stderr
    with _locked(mark):
        stream.write(_fresh_line(mark) + text + "\n")
        stream.flush()


LOCK_WAIT_S = 1.0  # a holder stopped (SIGSTOP) mid-write never makes another process wait longer


@contextlib.contextmanager
def _locked(mark: Path | None) -> Iterator[None]:
    """The job's console lock (an flock on LOCK beside `mark`), held for the block: waited for
    at most LOCK_WAIT_S, then the block runs without it (the lock orders lines, it must never
    hang a process). Nothing without a mark, or where the folder is gone or flock is missing."""
    handle = None
    if mark is not None:
        try:
            import fcntl

            handle = open(mark.parent / LOCK, "a")
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.001)
        except (OSError, ImportError):
            if handle is not None:
                handle.close()
            handle = None
    try:
        yield
    finally:
        if handle is not None:
            handle.close()  # closing the file releases its lock


def _fresh_line(mark: Path | None) -> str:
    if mark is None:
        return ""
    try:
        mark.unlink()
    except FileNotFoundError:
        return ""
    return "\n"
