"""Logging for a run of many processes: one handler on the `plait` logger, ranks named.

The library logs through `logging.getLogger(__name__)` (what ZeRO and tensor parallelism
applied, for instance) and configures nothing itself, as a library should. `plait train`
calls `setup_logging` once per rank: rank 0's lines read as they are, every other rank's
start with `[rank N]`, so that eight copies of one message can be told apart. Only the
`plait` loggers are configured; torch's and the user's are left alone.
"""

from __future__ import annotations

import logging
import os
import sys

from plait.runtime import console

LEVELS = ("debug", "info", "warning", "error")
_HANDLER_NAME = "plait-rank"


class RankFormatter(logging.Formatter):
    """`[rank 3] plait.parallel.zero.stages: ...` on rank 3, no prefix on rank 0."""

    def __init__(self, rank: int):
        prefix = f"[rank {rank}] " if rank else ""
        super().__init__(f"{prefix}%(name)s: %(message)s")


class LineHandler(logging.StreamHandler):
    """Each record in one write, on a line of its own: rank 0's progress bar may hold the
    line of the stderr every rank shares (plait.runtime.console)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            console.say(self.format(record), stream=self.stream)
        except Exception:  # noqa: BLE001 - logging's own rule: a failed record never stops the run
            self.handleError(record)


def setup_logging(level: str = "warning", rank: int | None = None) -> logging.Logger:
    """Send the `plait` loggers' records at `level` and above to stderr, once per process."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    logger = logging.getLogger("plait")
    logger.setLevel(level.upper())
    for handler in [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]:
        logger.removeHandler(handler)  # called again (tests, a second run): replace, never double
    handler = LineHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(RankFormatter(rank))
    logger.addHandler(handler)
    logger.propagate = False  # an application's root handler would print every line twice
    return logger
