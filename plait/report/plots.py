"""The figures of `plait report`, one function each, from a run's metrics and summary.

Each returns a matplotlib `Figure` built on the Agg canvas (no display, and pyplot's global
state untouched), or None when the run has nothing to draw (no traffic on one process).
Tests read the returned figures' axes and series; `page.py` saves them.
"""

from __future__ import annotations

from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

MIB = 2**20
PREDICTED, MEASURED = "#9ecae1", "#08519c"
MEMORY_KINDS = (("params", "params", "params"), ("grads", "grads", "grads"), ("optimizer", "optim", "optim"),
                ("activations", "activations", "activations_peak"))  # (label, predicted key, measured key)


def _figure(width: float = 6.4, height: float = 3.6) -> tuple[Figure, Any]:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def loss_figure(records: list[dict[str, Any]], val_losses: dict[str, float], unit: str = "tokens") -> Figure:
    """Training loss per step, and the held-out loss where it was evaluated (summary.json's
    `val_losses`, which include the evaluation at the end of the run); nats per `unit` (singular)."""
    fig, ax = _figure()
    steps = [r["step"] for r in records if r.get("loss") is not None]
    ax.plot(steps, [r["loss"] for r in records if r.get("loss") is not None], label="loss", color=MEASURED)
    evaluated = sorted((int(step), loss) for step, loss in val_losses.items())
    if evaluated:
        ax.plot([s for s, _ in evaluated], [v for _, v in evaluated], "o--", label="validation loss", color="#e6550d")
    _mark_world_changes(ax, records)
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (nats/{unit.removesuffix('s')})")
    ax.set_title("loss")
    ax.legend()
    fig.tight_layout()
    return fig


def _mark_world_changes(ax: Any, records: list[dict[str, Any]]) -> None:
    """A dotted line where an elastic restart changed the world size, labelled with it."""
    sizes = [(r["step"], r["world_size"]) for r in records if r.get("world_size")]
    for (_, before), (step, after) in zip(sizes, sizes[1:]):
        if after != before:
            ax.axvline(step - 0.5, color="#636363", linestyle=":", label=f"world {before} -> {after} processes")


def metric_figure(name: str, label: str, evaluations: dict[str, dict[str, float]]) -> Figure:
    """One held-out metric of the task's (top-1 accuracy...) at each step it was evaluated."""
    fig, ax = _figure()
    points = sorted((int(step), values[name]) for step, values in evaluations.items() if name in values)
    ax.plot([s for s, _ in points], [v for _, v in points], "o-", label=label, color=MEASURED)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.set_title(label)
    fig.tight_layout()
    return fig


def throughput_figure(records: list[dict[str, Any]], unit: str = "tokens") -> Figure:
    """`unit`s per second of every step (tokens, images: the task's; the first includes
    warm-up; the median is marked)."""
    fig, ax = _figure()
    steps, rates = [r["step"] for r in records], [r[f"{unit}_per_s"] for r in records]
    ax.plot(steps, rates, label=f"{unit}/s", color=MEASURED)
    if len(rates) > 1:
        median = sorted(rates[1:])[(len(rates) - 1) // 2]
        ax.axhline(median, linestyle=":", color="grey", label=f"median {median:,.0f}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"{unit}/s")
    ax.set_title("throughput")
    ax.legend()
    fig.tight_layout()
    return fig


def _bars(ax: Any, labels: list[str], predicted: list[float], measured: list[float]) -> None:
    positions = range(len(labels))
    ax.bar([x - 0.2 for x in positions], [p / MIB for p in predicted], 0.4, label="predicted", color=PREDICTED)
    ax.bar([x + 0.2 for x in positions], [m / MIB for m in measured], 0.4, label="measured", color=MEASURED)
    ax.set_xticks(list(positions), labels)
    ax.legend()


def memory_figure(summary: dict[str, Any]) -> Figure:
    """Model states and activations per rank: what `plait estimate` predicted, what the run held."""
    fig, ax = _figure()
    predicted = (summary.get("predicted") or {}).get("memory", {})
    labels = [label for label, _, _ in MEMORY_KINDS]
    _bars(ax, labels, [predicted.get(key) or 0 for _, key, _ in MEMORY_KINDS],  # None: not predicted
          [summary["mem"].get(key, 0) for _, _, key in MEMORY_KINDS])
    ax.set_ylabel("MiB per rank")
    ax.set_title("memory per kind (max over ranks)")
    fig.tight_layout()
    return fig


def comm_per_axis(comm: dict[str, dict[str, float]]) -> dict[str, float]:
    """{axis: wire bytes of one step, every collective on that axis summed}."""
    return {axis: float(sum(ops.values())) for axis, ops in comm.items() if sum(ops.values())}


def comm_figure(summary: dict[str, Any]) -> Figure | None:
    """Wire bytes per step on each mesh axis, predicted vs measured; None with no traffic."""
    predicted = comm_per_axis((summary.get("predicted") or {}).get("comm", {}))
    measured = comm_per_axis(summary.get("comm_per_step", {}))
    axes = sorted(set(predicted) | set(measured))
    if not axes:
        return None
    fig, ax = _figure()
    _bars(ax, axes, [predicted.get(a, 0.0) for a in axes], [measured.get(a, 0.0) for a in axes])
    ax.set_ylabel("MiB per step (busiest rank)")
    ax.set_xlabel("mesh axis")
    ax.set_title("wire bytes per axis")
    fig.tight_layout()
    return fig


def experts_figure(summary: dict[str, Any]) -> Figure | None:
    """Tokens each expert received over the run, one group of bars per MoE layer; None
    without experts. An even router draws level bars; a collapsed one, a single tall bar."""
    totals = (summary.get("experts") or {}).get("tokens_per_expert")
    if not totals:
        return None
    fig, ax = _figure()
    experts, width = len(totals[0]), 0.8 / len(totals)
    for layer, counts in enumerate(totals):
        ax.bar([e + layer * width for e in range(experts)], counts, width, label=f"MoE layer {layer}")
    ax.set_xlabel("expert")
    ax.set_ylabel("tokens (assignments) over the run")
    ax.set_title("tokens per expert")
    if len(totals) <= 8:
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig
