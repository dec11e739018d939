"""A timed pipeline schedule, its bubble and memory figures, and two ways to draw it.

`simulate` in build.py produces a `Timeline`; this module measures it (makespan,
bubble fraction, activations held) and draws it as text or as a PNG, the classic picture
of a pipeline with ranks as rows and time running to the right.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from plait.errors import PlaitError
from plait.schedule.action import Action

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_MAX_COLUMNS = 2000
_COLOURS = {"F": "#4c78a8", "B": "#54a24b", "I": "#f58518", "W": "#b279a2"}
_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}


@dataclass(frozen=True)
class Slot:
    """When one action ran on its rank."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Every rank's actions with their start and end times, in execution order."""

    pp: int
    v: int
    rows: tuple[tuple[Slot, ...], ...]

    @property
    def makespan(self) -> float:
        return max((s.end for row in self.rows for s in row), default=0.0)

    @property
    def busy(self) -> tuple[float, ...]:
        """Time each rank spends computing."""
        return tuple(sum(s.end - s.start for s in row) for row in self.rows)

    @property
    def idle(self) -> float:
        """Idle time summed over ranks, counted up to the makespan."""
        return self.pp * self.makespan - sum(self.busy)

    @property
    def bubble(self) -> float:
        """Fraction of rank-time spent idle: idle / (ranks x makespan)."""
        total = self.pp * self.makespan
        return self.idle / total if total else 0.0

    @property
    def peak_inflight(self) -> tuple[int, ...]:
        """Most (micro-batch, chunk) activations a rank holds at once.

        One is held from the start of its F to the end of its B or I: those need the
        full set of saved activations. W needs only what the weight grads read, so a
        pending W is counted apart, in `peak_pending_w`.
        """
        return tuple(_peak(row, opens="F", closes="BI") for row in self.rows)

    @property
    def peak_pending_w(self) -> tuple[int, ...]:
        """Most weight-grads a rank has put off at once (I done, W not yet)."""
        return tuple(_peak(row, opens="I", closes="W") for row in self.rows)

    @property
    def peak_live(self) -> tuple[int, ...]:
        """Most micro-batches a rank has started (F) and not finished (B or W) at once.

        The pessimistic count, as if a pending W held as much as a full activation.
        """
        return tuple(_peak(row, opens="F", closes="BW") for row in self.rows)


def _peak(row: tuple[Slot, ...], opens: str, closes: str) -> int:
    held = peak = 0
    for slot in row:
        if slot.action.kind in opens:
            held += 1
            peak = max(peak, held)
        elif slot.action.kind in closes:
            held -= 1
    return peak


def timeline_to_dict(timeline: Timeline) -> dict:
    """Plain data for JSON: each slot as [kind, micro-batch, chunk, start, end]."""
    rows = [[[s.action.kind, s.action.microbatch, s.action.chunk, s.start, s.end] for s in row]
            for row in timeline.rows]
    return {"pp": timeline.pp, "v": timeline.v, "rows": rows}


def timeline_from_dict(data: dict) -> Timeline:
    """The inverse of `timeline_to_dict` (a run's timeline.json back into a Timeline)."""
    try:
        rows = tuple(tuple(Slot(Action(kind, int(mb), int(chunk)), float(start), float(end))
                           for kind, mb, chunk, start, end in row) for row in data["rows"])
        return Timeline(pp=int(data["pp"]), v=int(data["v"]), rows=rows)
    except (KeyError, TypeError, ValueError) as err:
        raise PlaitError(f"not a timeline: {err}", hint="timeline.json is written by plait train under pp > 1") from None


def _exact(t: float) -> Fraction:
    """`t` as a fraction, so that 0.1 + 0.2 lands on the same grid line as 0.3."""
    return Fraction(t).limit_denominator(1000)


def _time_unit(timeline: Timeline) -> Fraction:
    """The largest time step that every start and end is a whole multiple of."""
    times = [_exact(t) for row in timeline.rows for slot in row for t in (slot.start, slot.end)]
    denominator = math.lcm(*(t.denominator for t in times)) if times else 1
    step = math.gcd(*(int(t * denominator) for t in times)) if times else 0
    return Fraction(step or 1, denominator)


def render_text(timeline: Timeline) -> str:
    """Ranks as rows, one column per time unit, each cell the action running or '.'.

    An action lasting several units fills several cells. With v > 1 a chunk letter
    follows the micro-batch: "F3b" is micro-batch 3's forward on the rank's chunk 1.
    """
    unit = _time_unit(timeline)
    columns = round(_exact(timeline.makespan) / unit)
    if columns > _MAX_COLUMNS:
        raise PlaitError(f"timeline needs {columns} text columns",
                         hint="use costs that are small multiples of one unit, or render_png")
    labels = [s.action.label(timeline.v) for row in timeline.rows for s in row]
    width = max(map(len, labels), default=1)
    lines = []
    for rank, row in enumerate(timeline.rows):
        cells = ["."] * columns
        for slot in row:
            first, last = round(_exact(slot.start) / unit), round(_exact(slot.end) / unit)
            cells[first:last] = [slot.action.label(timeline.v)] * (last - first)
        body = " ".join(cell.ljust(width) for cell in cells).rstrip()
        lines.append(f"rank {rank:<{len(str(timeline.pp - 1))}} | {body}")
    lines.append(_summary(timeline))
    return "\n".join(lines)


def _summary(timeline: Timeline) -> str:
    return (f"bubble {timeline.bubble:.1%} = idle {timeline.idle:g} / "
            f"({timeline.pp} ranks x makespan {timeline.makespan:g})")


def render_png(timeline: Timeline, path: str | Path, title: str | None = None) -> None:
    """Draw `timeline` as coloured boxes (one colour per kind) and save it to `path`.

    Chunks after the first are hatched. Uses matplotlib's Agg canvas directly, so no
    display is needed and pyplot's global state is left alone.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:
        raise PlaitError("drawing a timeline as PNG needs matplotlib",
                         hint="pip install matplotlib") from err
    longest = max(map(len, timeline.rows), default=0)
    fig = Figure(figsize=(max(6.0, 0.35 * longest), 0.6 * timeline.pp + 1.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for rank, row in enumerate(timeline.rows):
        for slot in row:
            _draw_slot(ax, rank, slot, timeline.v)
    kinds = sorted({s.action.kind for row in timeline.rows for s in row}, key="FBIW".index)
    ax.legend(handles=[Patch(color=_COLOURS[k], label=_NAMES[k]) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(kinds) or 1, frameon=False)
    ax.set_yticks(range(timeline.pp), [f"rank {r}" for r in range(timeline.pp)])
    ax.set_ylim(timeline.pp - 0.5, -0.5)
    ax.set_xlim(0, timeline.makespan or 1)
    ax.set_xlabel("time")
    ax.set_title(title or _summary(timeline), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=120)


def _draw_slot(ax: Axes, rank: int, slot: Slot, v: int) -> None:
    act = slot.action
    ax.barh(rank, slot.end - slot.start, left=slot.start, height=0.8, color=_COLOURS[act.kind],
            edgecolor="black", linewidth=0.5, hatch="//" * act.chunk if act.chunk else None)
    text = str(act.microbatch) + (chr(ord("a") + act.chunk) if v > 1 else "")
    ax.text((slot.start + slot.end) / 2, rank, text,
            ha="center", va="center", fontsize=7, color="white")
