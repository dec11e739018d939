"""The closing report: what the run cost, in a few lines a person can check."""

from __future__ import annotations

from typing import Any


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_comm(comm: dict[str, dict[str, float]]) -> str:
    parts = [f"{axis} {op} {human_bytes(b)}" for axis, ops in sorted(comm.items()) for op, b in sorted(ops.items())]
    return ", ".join(parts) or "none (one process)"


def describe_layout(layout: dict[str, Any]) -> str:
    """"dp=2 tp=1 pp=1", plus whatever else is switched on."""
    text = f"dp={layout['dp']} tp={layout['tp']} pp={layout['pp']}"
    extras = [f"zero={layout['zero']}" if layout.get("zero") else "", "offload" if layout.get("offload") else "",
              "sp" if layout.get("sp") else "", f"schedule={layout['schedule']}" if layout.get("schedule") else "",
              "sync-bn" if layout.get("sync_bn") else ""]
    return " ".join([text, *filter(None, extras)])


def closing_report(summary: dict[str, Any], out: str) -> str:
    """Loss, speed, bytes on the wire (measured vs formula), memory, and a text sample."""
    layout = summary["layout"]
    mem = summary["mem"]
    images = summary.get("task") == "image"
    batch = f"{summary['global_batch']} images" if images else f"{summary['global_batch']} × {summary['seq_len']} tokens"
    unit = "images" if images else "tokens"
    held_out = f"held-out {summary['val_loss']:.3f}" + (
        f", top-1 accuracy {summary['val_accuracy']:.1%}" if "val_accuracy" in summary else "")
    lines = [
        f"plait: trained {summary['model']} ({summary['num_params'] / 1e6:.2f} M params) for "
        f"{summary['steps']} steps on {layout['world_size']} process(es): {describe_layout(layout)}, "
        f"backend {layout['backend']}, global batch {batch}",
        f"  loss        {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}   ({held_out})",
        f"  speed       {summary[f'{unit}_per_s']:,.0f} {unit}/s, {summary['step_time_s_median']:.3f} s/step (median)",
        f"  wire/step   measured {format_comm(summary['comm_per_step'])}",
    ]
    if layout.get("precision", "fp32") != "fp32" or summary.get("skipped_steps"):
        lines.insert(2, f"  precision   {layout.get('precision', 'fp32')}, loss scale {summary.get('loss_scale', 1.0):g}, "
                        f"{summary.get('skipped_steps', 0)} step(s) skipped (non-finite)")
    if summary["comm_formula"]:
        lines += [
            f"              formula  {format_comm(summary['comm_formula'])}   [ring all-reduce 2(n-1)/n·Ψ·4 B]",
            f"              all ranks together: ring {human_bytes(summary['comm_ring_total'])} vs naive exchange "
            f"{human_bytes(summary['comm_naive_total'])}   [Ψ·4·N·(N-1)]",
        ]
    lines += [
        f"  memory/rank params {human_bytes(mem['params'])}, grads {human_bytes(mem['grads'])}, "
        f"optimizer {human_bytes(mem['optim'])}, activations {human_bytes(mem['activations_peak'])} "
        f"(process peak {human_bytes(summary['peak_process_bytes'])})",
    ]
    if summary.get("predicted"):
        lines += predicted_vs_measured(summary)
    if summary.get("sample"):
        sample = summary["sample"].replace("\n", "\n              ")
        lines.append(f"  sample      {sample}")
    lines.append(f"  outputs     {out}/metrics.jsonl, summary.json, model.safetensors")
    return "\n".join(lines)


def predicted_vs_measured(summary: dict[str, Any]) -> list[str]:
    """`plait estimate`'s figures for this layout beside what the run measured (per rank, max)."""
    predicted, mem = summary["predicted"], summary["mem"]
    params_label = "params+gathered" if summary["layout"].get("zero") == 3 else "params"  # shards + whole units
    rows = [(kind, predicted["memory"][key], mem[mkey]) for kind, key, mkey in
            ((params_label, "params", "params"), ("grads", "grads", "grads"), ("optim", "optim", "optim"),
             ("activations", "activations", "activations_peak"))]
    for axis, ops in sorted(predicted["comm"].items()):
        for op, wire in sorted(ops.items()):
            rows.append((f"{axis} {op}", wire, summary["comm_per_step"].get(axis, {}).get(op, 0)))
    lines = [f"  predicted   {'':<16}{'predicted':>12}{'measured':>12}   (plait estimate, {predicted['layout']['hardware']})"]
    lines += [f"              {name:<16}{_predicted(p):>12}{human_bytes(m):>12}" for name, p, m in rows]
    if summary.get("task") == "image":
        lines.append(f"              {'step time':<16}{'not predicted':>12}{summary['step_time_s_median']:>10.3f} s")
        lines.append("              (a CNN: activations and step time are not predicted, the formulas are a "
                     "transformer's; nor ZeRO-3's gathered blocks)")
        return lines
    if not summary.get("step_time"):
        lines.append(f"              {'step time':<16}{predicted['time']['step_s']:>10.3f} s{summary['step_time_s_median']:>10.3f} s")
    from plait.train.timing import step_time_lines

    return lines + step_time_lines(summary)


def _predicted(value: float | None) -> str:
    return "not predicted" if value is None else human_bytes(value)
