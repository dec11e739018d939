"""The closing report `plait train` prints: what the run cost, in a few lines a person can check.

It reads only the run's summary (summary.json's dict), so it sits beside `plait report`'s
plots, below the training code that writes that summary.
"""

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
    """"dp=2 tp=1 pp=1", plus whatever else is switched on (a summary's layout: plait.layout's
    fields, with the run's recompute and SyncBatchNorm beside them)."""
    from plait.layout import Layout

    fields = {k: layout[k] for k in Layout.__dataclass_fields__ if k in layout}
    extras = ["sync-bn" if layout.get("sync_bn") else "",
              f"recompute={layout['recompute']}" if layout.get("recompute", "none") != "none" else ""]
    return " ".join([Layout(**fields).describe(), *filter(None, extras)])


def describe_worlds(worlds: list[dict[str, Any]]) -> str:
    """"steps 1-5 on 4 processes (grad-accum 1), steps 6-12 on 2 (grad-accum 2)": where an
    elastic restart changed the world (the global batch stayed)."""
    parts = [f"steps {w['first_step']}-{w['last_step']} on {w['world_size'] or '?'} process(es)"
             + (f" (grad-accum {w['grad_accum']})" if w.get("grad_accum") else "") for w in worlds]
    return ", ".join(parts) + ", the same global batch"


def format_metrics(metrics: dict[str, float], labels: dict[str, Any]) -> str:
    """"held-out 2.303, top-1 accuracy 98.9%": each metric as the task labels and formats it."""
    return ", ".join(f"{labels[name][0]} {format(value, labels[name][1])}"
                     for name, value in metrics.items() if name in labels)


def describe_compile(compiled: dict[str, Any]) -> str:
    """"21.4 s in the first step; 2 graphs, 0 graph breaks; cache 0 hits, 2 misses (DIR)"."""
    return (f"{compiled['seconds']:.1f} s in the first step; {compiled['graphs']} graph(s), "
            f"{compiled['graph_breaks']} graph break(s); cache {compiled['cache_hits']} hit(s), "
            f"{compiled['cache_misses']} miss(es) ({compiled['cache_dir']})")


def closing_report(summary: dict[str, Any], out: str) -> str:
    """Loss, speed, bytes on the wire (measured vs formula), memory, and a text sample."""
    layout, mem, task = summary["layout"], summary["mem"], summary["task"]
    unit = task["unit"]
    lines = [
        f"plait: trained {summary['model']} ({summary['num_params'] / 1e6:.2f} M params) for "
        f"{summary['steps']} steps on {layout['world_size']} process(es): {describe_layout(layout)}, "
        f"backend {layout['backend']}, global batch {task['batch']}",
        f"  loss        {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}   "
        f"({format_metrics(summary['metrics'], task['metrics'])})",
        f"  speed       {summary[f'{unit}_per_s']:,.0f} {unit}/s, {summary['step_time_s_median']:.3f} s/step (median)",
        f"  wire/step   measured {format_comm(summary['comm_per_step'])}",
    ]
    if len(summary.get("worlds", [])) > 1:
        lines.insert(2, f"  elastic     {describe_worlds(summary['worlds'])}")
    if summary.get("compile"):
        lines.insert(3, f"  compile     {describe_compile(summary['compile'])}")
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
        f"({process_peak_text(summary)})",
    ]
    if summary.get("experts"):
        lines.append(experts_line(summary["experts"], summary.get("predicted") or {}))
    if summary.get("blend"):
        lines.append(blend_line(summary["blend"]))
    if (summary.get("predicted") or {}).get("context"):
        lines.append(context_line(summary["predicted"]["context"], summary["comm_per_step"]))
    if summary.get("predicted"):
        lines += predicted_vs_measured(summary)
    if summary.get("sample"):
        sample = summary["sample"].replace("\n", "\n              ")
        lines.append(f"  sample      {sample}")
    lines.append(f"  outputs     {out}/metrics.jsonl, summary.json, {weights_text(summary.get('weights'))}")
    return "\n".join(lines)


def process_peak_text(summary: dict[str, Any]) -> str:
    """The measured process peak, and beside it what the run added to the process it started
    as (the most over ranks) against the estimate's peak per rank (states, activations,
    buffers and the largest transient of setup or of writing the outputs)."""
    text = f"process peak {human_bytes(summary['peak_process_bytes'])}"
    peaks, starts = summary.get("peak_process_bytes_by_rank") or [], summary.get("start_process_bytes_by_rank") or []
    predicted = ((summary.get("predicted") or {}).get("memory") or {}).get("peak")
    if peaks and len(starts) == len(peaks):
        added = max(peak - start for peak, start in zip(peaks, starts))
        text += f"; the run added at most {human_bytes(added)} to a rank"
        if predicted:
            text += f", estimated at most {human_bytes(predicted)}"
    return text + reserved_text(summary)


def reserved_text(summary: dict[str, Any]) -> str:
    """On a GPU, what the caching allocator reserved beside the allocated peak: the measure of
    the estimate's allowance for it (10% of the device bytes). Empty on a CPU."""
    reserved, allocated = summary.get("peak_reserved_bytes") or 0, summary.get("peak_process_bytes") or 0
    if not reserved or not allocated:
        return ""
    return f"; the allocator reserved {human_bytes(reserved)}, {reserved / allocated - 1:+.0%} over the allocated peak"


def blend_line(blend: dict[str, Any]) -> str:
    """A blend's realised share of each corpus over the run's sequences, beside the asked one."""
    parts = ", ".join(f"{part['source']} {100 * part['realised']:.1f}% (asked {100 * part['weight']:.1f}%)"
                      for part in blend["parts"])
    return f"  data blend  {parts} of {blend['samples']:,} sequences"


def weights_text(files: list[str] | None) -> str:
    """The weights' files as the closing line names them: one file, or the index and its shards."""
    shards = [name for name in files or [] if name.startswith("model-")]
    if not shards:
        return "model.safetensors"
    return f"model.safetensors.index.json ({len(shards)} shards)"


def experts_line(experts: dict[str, Any], predicted: dict[str, Any]) -> str:
    """A mixture of experts' routing and all-to-all (docs/moe.md): tokens per expert per MoE
    layer over the run (min/mean/max), the balancing loss, dropped assignments; the last
    step's ep bytes measured, by the formula on its routing, and predicted (uniform routing)."""
    layers = ", ".join(f"{p['min']:.0f}/{p['mean']:.0f}/{p['max']:.0f}" for p in experts["per_layer"])
    line = f"  experts     tokens per expert min/mean/max by MoE layer: {layers}"
    if experts.get("aux_loss_last") is not None:
        line += f"; balancing loss {experts['aux_loss_first']:.3f} -> {experts['aux_loss_last']:.3f}"
    line += f"; dropped {experts['dropped']:.0f}"
    if experts["alltoall_measured"] or experts["alltoall_formula"]:
        uniform = predicted.get("comm", {}).get("ep", {}).get("all_to_all")
        line += (f"\n              ep all-to-all/step measured {human_bytes(experts['alltoall_measured'])}, "
                 f"formula on this routing {human_bytes(experts['alltoall_formula'])}"
                 + (f", predicted (uniform routing) {human_bytes(uniform)}" if uniform else ""))
    return line


def context_line(formula: dict[str, Any], measured: dict[str, dict[str, float]]) -> str:
    """Context parallelism's bytes per layer: the ledger's cp figure over the layers,
    micro-batches and passes that made it, beside the formula (docs/context.md)."""
    per_step = measured.get("cp", {}).get(formula["op"], 0.0)
    runs = formula["layers"] * formula["micro_batches"]
    per_layer = formula["forwards"] * formula["forward"] + formula["backward"]
    return (f"  context     cp={formula['cp']} {formula['kind']}: {formula['op']} per layer and micro-batch "
            f"measured {human_bytes(per_step / runs)}, formula {human_bytes(per_layer)} "
            f"(forward {human_bytes(formula['forward'])} × {formula['forwards']}, backward "
            f"{human_bytes(formula['backward'])})")


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
    if summary.get("step_time"):
        return lines + step_time_lines(summary)
    time = (predicted.get("time") or {}).get("step_s")
    shown = "not predicted" if time is None else f"{time:.3f} s"
    lines.append(f"              {'step time':<16}{shown:>12}{summary['step_time_s_median']:>10.3f} s")
    return lines


def _predicted(value: float | None) -> str:
    return "not predicted" if value is None else human_bytes(value)


def step_time_lines(summary: dict[str, Any]) -> list[str]:
    """The report's step-time table."""
    st = summary.get("step_time")
    if not st:
        return []
    p, m = st["predicted"], st["measured"]
    rest = p["compute"] + p["exposed_comm"] + p["bubble"] + p["overhead"]
    return [
        f"  step time   {'':<28}{'predicted':>10}{'measured':>10}   ({st['hardware_source']})",
        f"              {'compute':<28}{p['compute']:>9.3f}s",
        f"              {'exposed comm':<28}{p['exposed_comm']:>9.3f}s",
        f"              {'pipeline bubble':<28}{p['bubble']:>9.3f}s",
        f"              {'loop overhead':<28}{p['overhead']:>9.3f}s",
        f"              {'  = all but the optimizer':<28}{rest:>9.3f}s{m['forward_backward_comm_overhead']:>9.3f}s",
        f"              {'optimizer (clip + update)':<28}{p['optimizer']:>9.3f}s{m['optimizer']:>9.3f}s",
        f"              {'step (median)':<28}{p['step']:>9.3f}s{m['step']:>9.3f}s   predicted/measured {st['ratio']:.2f}",
    ]
