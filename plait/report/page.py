"""Read a run directory, save each figure as a PNG, and write the Markdown page around them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from plait.errors import PlaitError
from plait.report import plots
from plait.report.closing import describe_layout, describe_worlds, format_metrics, human_bytes


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """metrics.jsonl's lines and summary.json, with one clear error when either is missing."""
    metrics, summary = run_dir / "metrics.jsonl", run_dir / "summary.json"
    for path in (metrics, summary):
        if not path.is_file():
            raise PlaitError(f"{path} does not exist", hint="give the --out directory of a finished `plait train`")
    records = [_record(metrics, number, line) for number, line in enumerate(_text(metrics).splitlines(), 1)
               if line.strip()]
    try:
        data = json.loads(_text(summary))
    except json.JSONDecodeError as err:
        raise PlaitError(f"{summary} is not JSON ({err.msg} at line {err.lineno})", hint=DAMAGED) from None
    if not isinstance(data, dict) or not isinstance(data.get("task"), dict):
        raise PlaitError(f"{summary} is not a plait run's summary (it has no task)", hint=DAMAGED)
    if not records:
        raise PlaitError(f"{metrics} has no steps", hint="the run stopped before its first step")
    return records, data


DAMAGED = "the file was cut short or edited: train again with --out here, or restore the file"


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise PlaitError(f"{path} is not UTF-8 text", hint=DAMAGED) from None


def _record(path: Path, number: int, line: str) -> dict[str, Any]:
    """One line of metrics.jsonl: a JSON object with the step it records."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PlaitError(f"{path}:{number} is not JSON ({err.msg})", hint=DAMAGED) from None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        raise PlaitError(f"{path}:{number} is not a step's record (no step number)", hint=DAMAGED)
    return record


def figures(records: list[dict[str, Any]], summary: dict[str, Any]) -> dict[str, Any]:
    """name -> Figure for every plot this run can have (the timeline is drawn on save): the
    task says what throughput counts and which held-out metrics besides the loss it has."""
    task = summary["task"]
    out = {"loss": plots.loss_figure(records, summary.get("val_losses", {}), task["unit"]),
           "throughput": plots.throughput_figure(records, task["unit"])}
    for name, (label, _) in task["metrics"].items():
        if name != "val_loss":
            out[name] = plots.metric_figure(name, label, summary.get("evaluations", {}))
    out["memory"] = plots.memory_figure(summary)
    for name, figure in (("comm", plots.comm_figure(summary)), ("experts", plots.experts_figure(summary))):
        if figure is not None:
            out[name] = figure
    return out


def write_page(run_dir: Path) -> Path:
    """PNGs under RUN_DIR/report/, and RUN_DIR/report.md that shows them with a few numbers."""
    records, summary = read_run(run_dir)
    images = run_dir / "report"
    images.mkdir(exist_ok=True)
    try:
        drawn = figures(records, summary)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a summary or record missing a field
        raise PlaitError(f"{run_dir}: summary.json or metrics.jsonl lacks what the report draws "
                         f"({type(exc).__name__}: {exc})", hint=DAMAGED) from None
    for name, fig in drawn.items():
        fig.savefig(images / f"{name}.png", format="png", dpi=100)
    timeline = run_dir / "timeline.json"
    if timeline.is_file():
        from plait.schedule.timeline import render_png, timeline_from_dict

        measured = timeline_from_dict(json.loads(timeline.read_text()))
        render_png(measured, images / "timeline.png",
                   title=f"last step as measured: bubble {measured.bubble:.1%}, {measured.makespan * 1e3:.1f} ms")
        drawn["timeline"] = None
    page = run_dir / "report.md"
    page.write_text(_markdown(summary, records, list(drawn)))
    return page


_CAPTIONS = {
    "loss": "Loss per step; the dots are the held-out loss.",
    "throughput": "{unit} per second, every step (the dotted line is the median after the first step).",
    "memory": "Memory per rank by kind: `plait estimate`'s prediction beside what the run held (max over ranks).",
    "comm": "Bytes on the wire per step on each mesh axis, predicted and measured (busiest rank).",
    "timeline": "The pipeline schedule of the last step, as the ranks timed it.",
    "experts": "Tokens each expert received over the run, by MoE layer (every rank's, summed).",
}


def _caption(name: str, summary: dict[str, Any]) -> str:
    task = summary["task"]
    if name in task["metrics"]:
        return f"{task['metrics'][name][0].capitalize()} on the held-out split, at each evaluation."
    return _CAPTIONS[name].format(unit=task["unit"].capitalize())


def _markdown(summary: dict[str, Any], records: list[dict[str, Any]], names: list[str]) -> str:
    layout, task = summary["layout"], summary["task"]
    unit = task["unit"]
    lines = [
        f"# plait run: {summary['model']}, {describe_layout(layout)}", "",
        f"- {summary['steps']} steps on {layout['world_size']} process(es), backend {layout['backend']}, "
        f"global batch {task['batch']}",
        f"- loss {summary['loss_first']:.3f} → {summary['loss_last']:.3f} "
        f"({format_metrics(summary['metrics'], task['metrics'])})",
        f"- {summary[f'{unit}_per_s']:,.0f} {unit}/s, {summary['step_time_s_median']:.3f} s/step (median)",
        "- memory per rank: " + ", ".join(f"{k} {human_bytes(v)}" for k, v in summary["mem"].items()),
        f"- measurement: {summary.get('measure', 'full')}",
        *([f"- world size changed (elastic restart): {describe_worlds(summary['worlds'])}"]
          if len(summary.get("worlds", [])) > 1 else []), "",
    ]
    if "comm" not in names:
        lines += ["No bytes on the wire: one process.", ""]
    for name in names:
        lines += [f"## {name}", "", _caption(name, summary), "", f"![{name}](report/{name}.png)", ""]
    return "\n".join(lines)
