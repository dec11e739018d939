"""One stderr for a whole job: rank 0's progress bar and every process's one-line messages.

The ranks and the spawner write to the same stderr. tqdm redraws rank 0's bar after a
carriage return and leaves the cursor at its end, so a line another process writes then
(rank 1's error, the spawner's "rank 1 exited ...") would continue the bar's line. So the
bar draws through `BarStream`, which marks in the world's scratch folder (PLAIT_FAULT_DIR,
made by plait's spawner) that it left a line open; `say` starts its line with a newline
when the mark is there, and takes the mark away (removing a file is atomic: of two
processes saying something at once, one adds the newline). Without that folder (one
process, torchrun) there is no mark: the bar is closed, with its newline, before the
process's own error is printed.

No torch here: the spawner and the CLI import this.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, TextIO

FOLDER_ENV = "PLAIT_FAULT_DIR"  # the spawner's scratch folder for this world (plait.runtime.launch)
MARK = "line-open"  # the file there that says the bar's line is not finished


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
        if text.endswith("\n"):  # closed (tqdm's close): the line is finished
            written = self.stream.write(text)
            _quietly(self.mark.unlink, missing_ok=True)
            return written
        _quietly(self.mark.touch)  # before the write: a line said meanwhile gets a newline too many, never too few
        return self.stream.write(text)

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
    stream.write(_fresh_line(mark) + text + "\n")
    stream.flush()


def _fresh_line(mark: Path | None) -> str:
    if mark is None:
        return ""
    try:
        mark.unlink()
    except FileNotFoundError:
        return ""
    return "\n"
