"""`plait report RUN_DIR`: PNG plots of a finished run and a Markdown page embedding them.

It reads only what `plait train` leaves in its `--out` directory: metrics.jsonl (one line
per step), summary.json (predicted and measured cost) and, for a pipeline run,
timeline.json (the last step as it was measured). matplotlib is an optional extra: it is
imported when a report is drawn, never when plait starts.
"""

from __future__ import annotations

from pathlib import Path

from plait.errors import PlaitError

PLOTS_HINT = "pip install matplotlib"


def has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def write_report(run_dir: str | Path) -> Path:
    """Draw the run's plots into RUN_DIR/report/ and write RUN_DIR/report.md; return its path."""
    if not has_matplotlib():
        raise PlaitError("plait report draws with matplotlib, which is not installed", hint=PLOTS_HINT)
    from plait.report.page import write_page

    return write_page(Path(run_dir))


def report_after_training(out: Path) -> str:
    """The closing line of `plait train`: where the report is, or how to get plots."""
    if not has_matplotlib():
        return f"  report      no plots: {PLOTS_HINT}, then run `plait report {out}`"
    page = write_report(out)
    return f"  report      {page} (plots in {page.parent / 'report'})"
