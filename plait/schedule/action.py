"""One step of a pipeline schedule on one rank: forward, backward, or a backward's half.

Its own module because both the schedules (schedule.py) and their timed pictures
(timeline.py) speak of actions, and neither should import the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plait.errors import PlaitError

Kind = Literal["F", "B", "I", "W"]


@dataclass(frozen=True)
class Action:
    """One step on one rank: run `kind` for `microbatch` on the rank's `chunk`-th stage.

    "F" is a forward, "B" a full backward (input grad and weight grad). "I" (input grad)
    and "W" (weight grad) are the two halves of "B": the previous stage waits only for I,
    so a schedule can run I at once and keep W to fill a moment the rank would idle.
    """

    kind: Kind
    microbatch: int
    chunk: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("F", "B", "I", "W"):
            raise PlaitError(f"unknown action kind {self.kind!r}", hint="use F, B, I or W")

    def stage(self, rank: int, pp: int) -> int:
        """Global stage index of this action when run on `rank` of a `pp`-rank pipeline."""
        return self.chunk * pp + rank

    def label(self, v: int = 1) -> str:
        """Short name such as "F3"; with v > 1 a chunk letter follows ("F3b" = chunk 1)."""
        suffix = chr(ord("a") + self.chunk) if v > 1 else ""
        return f"{self.kind}{self.microbatch}{suffix}"
