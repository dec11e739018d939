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
