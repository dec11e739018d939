"""Plain-text tables for `plait estimate` and `plait plan`: aligned columns, human units."""

from __future__ import annotations

from typing import Any

MEMORY_ROWS = ("params", "grads", "optim", "activations", "buffers", "fragmentation")


def human_bytes(n: float | None) -> str:
    """1536 -> '1.50 KiB'; None -> 'unknown'."""
    if n is None:
        return "unknown"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def human_count(n: float) -> str:
    """6738415616 -> '6.74 B'."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f}"


def table(rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    """Align columns: text to the left, the columns in `right` (numbers) to the right."""
    right = right if right is not None else set(range(1, len(rows[0])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w)
                 for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def cp_label(layout: dict[str, Any]) -> str:
    """"2" ("2 ulysses"): the cp degree and a kind other than the default ring."""
    return f"{layout.get('cp', 1)}{' ulysses' if layout.get('cp_kind') == 'ulysses' else ''}"


def cp_text(layout: dict[str, Any]) -> str:
    """" cp=2" (" cp=2 ulysses") when context parallelism is on, else nothing."""
    return f" cp={cp_label(layout)}" if layout.get("cp", 1) > 1 else ""


def ep_text(layout: dict[str, Any]) -> str:
    """" ep=4" when expert parallelism is on, else nothing."""
    return f" ep={layout['ep']}" if layout.get("ep", 1) > 1 else ""


def format_estimate(result: dict[str, Any], model_name: str) -> str:
    """The breakdown `plait estimate` prints."""
    lay, mem = result["layout"], result["memory"]
    active = result["model"].get("active_params")
    params = human_count(result["model"]["params"]) + (f", {human_count(active)} active" if active else "")
    head = (f"{model_name} ({params} params): "
            f"dp={lay['dp']} tp={lay['tp']} pp={lay['pp']}"
            f"{cp_text(lay)}{ep_text(lay)} zero={lay['zero']}"
            f"{' offload' if lay['offload'] else ''}{' sp' if lay['sp'] else ''}, "
            f"{schedule_label(lay) + ', ' if lay['pp'] > 1 else ''}"
            f"{lay['precision']}, micro-batch {lay['micro_batch']} x {lay['grad_accum']}, "
            f"seq {lay['seq_len'] or '?'}, recompute {lay['recompute']}, {lay['hardware']}"
            f"{'' if lay.get('stack', 'plait') == 'plait' else ', as ' + lay['stack'] + ' runs it'}")
    lines = [head, "", "memory per GPU (busiest rank)"]
    rows = [["  " + key, human_bytes(mem[key])] for key in MEMORY_ROWS]
    if mem.get("grads_unmade"):  # an interleaved rank's chunks make theirs at their first backward
        rows.insert(2, ["  - grads not made at the peak", human_bytes(mem["grads_unmade"])])
    rows.append(["  total on device", human_bytes(mem["total"])])
    if mem.get("transient"):
        rows.append(["  + transient", human_bytes(mem["transient"])])
        rows.append(["  peak (CPU)", human_bytes(mem["peak"])])  # the device's memory is the host's
        rows.append(["  host peak (GPU)", human_bytes(mem.get("host_peak") or mem["transient"])])  # beside `total`
    if mem["host"]:
        rows.append(["  on the host (optim + fp32 grad copy)", human_bytes(mem["host"])])
    usable = human_bytes(result["device_usable_bytes"])
    rows.append(["  fits", f"{'yes' if result['fits'] else 'NO'} ({usable} usable)"])
    lines += table(rows) + ["", "communication per GPU per step (wire bytes, ring)"]
    lines += _comm_lines(result)
    if result.get("context"):
        c = result["context"]
        lines.append(f"  cp per layer and micro-batch ({c['kind']}, {c['op']}): forward {human_bytes(c['forward'])}, "
                     f"backward {human_bytes(c['backward'])}; × {c['layers']} block runs × {c['micro_batches']} "
                     f"micro-batch(es), forward {c['forwards']}×")
    if result.get("experts"):
        e = result["experts"]
        lines.append(f"  experts {e['experts']} (top {e['top_k']}, {e['shared']} shared) in {e['moe_layers']} MoE "
                     f"blocks, {e['experts_per_rank']} per ep rank; ep all-to-all per MoE block and micro-batch: "
                     f"forward {human_bytes(e['alltoall_forward'])}, backward {human_bytes(e['alltoall_backward'])}")
    lines += ["", "time per step"] + _time_lines(result["time"])
    if result.get("stages"):
        critical = (result["time"] or {}).get("critical_rank", 0)
        lines += ["", "per pipeline stage (rank)"] + _stage_lines(result["stages"], critical)
    lines += ["", "assumptions"] + [f"  - {note}" for note in result["assumptions"]]
    return "\n".join(lines)


def _comm_lines(result: dict[str, Any]) -> list[str]:
    rows = [["  axis", "link", "op", "bytes", "seed's naive total", "plait total"]]
    links = result.get("links", {})
    for axis, ops in result["comm"].items():
        naive = result["naive_comm"].get(axis, {})
        for i, (op, wire) in enumerate(ops.items()):
            extra = ["", ""]
            if i == 0 and naive:
                extra = [human_bytes(naive["naive_bytes"]), human_bytes(naive["plait_bytes"])]
            rows.append(["  " + axis, links.get(axis, "") if i == 0 else "", op, human_bytes(wire), *extra])
    if len(rows) == 1:
        return ["  none (one GPU)"]
    return table(rows, right={3, 4, 5})


def _stage_lines(stages: list[dict[str, Any]], critical: int) -> list[str]:
    """Each rank's blocks (chunk by chunk), memory and micro-batch time; the slowest marked,
    since the schedule, its bubble included, runs at its pace, and the rank whose path to the
    clip (its schedule's end, accumulation and dp sync) sets the step."""
    slowest = max(stages, key=lambda row: row["micro_batch_s"])["stage"]
    rows = [["  stage", "blocks", "memory", "micro-batch", ""]]
    for row in stages:
        marks = ["slowest: sets the pace"] * (row["stage"] == slowest) + ["its path sets the step"] * (
            row["stage"] == critical)
        rows.append([f"  {row['stage']}", "+".join(map(str, row["blocks"])), human_bytes(row["memory_total"]),
                     f"{row['micro_batch_s']:.4g} s", "; ".join(marks)])
    return table(rows, right={2, 3})


def _time_lines(step: dict[str, float] | None) -> list[str]:
    if step is None:
        return ["  unknown (give --seq-len)"]
    rows = [
        ["  FLOPs per token", human_count(step["flops_per_token"])],
        ["  compute", f"{step['compute_s']:.4g} s"],
        ["  tensor parallel", f"{step['tp_s']:.4g} s"],
        ["  context parallel (exposed)", f"{step.get('cp_s', 0):.4g} s"],
        ["  expert all-to-alls", f"{step.get('ep_s', 0):.4g} s"],
        ["  pipeline messages (waited for)", f"{step['pp_s']:.4g} s"],
        ["  pipeline bubble", f"{step['bubble_s']:.4g} s"],
        ["  data parallel (exposed)", f"{step['dp_s']:.4g} s"],
        ["  offload", f"{step['offload_s']:.4g} s"],
        ["  optimizer", f"{step.get('optimizer_s', 0):.4g} s"],
        ["  loop overhead", f"{step.get('overhead_s', 0):.4g} s"],
        ["  step", f"{step['step_s']:.4g} s"],
        ["  tokens/s", f"{step['tokens_per_s']:,.0f}"],
        ["  MFU", f"{step['mfu']:.1%}"],
        ["  HFU (with recompute)", f"{step.get('hfu', step['mfu']):.1%}"],
    ]
    return table(rows)


def zero_label(row: dict[str, Any]) -> str:
    """"3" ("3/8": ZeRO-3 inside groups of 8 dp·cp ranks; "+off": the optimizer offloaded)."""
    shard = f"/{row['dp_shard']}" if row.get("dp_shard") else ""
    return f"{row['zero']}{shard}{'+off' if row['offload'] else ''}"


def schedule_label(row: dict[str, Any]) -> str:
    """"1f1b", "interleaved x2" (virtual stages), "-" without a pipeline."""
    if row["pp"] == 1:
        return "-"
    schedule = row.get("schedule", "1f1b")
    return f"{schedule} x{row['virtual_stages']}" if row.get("virtual_stages", 1) > 1 else schedule


def layout_text(row: dict[str, Any]) -> str:
    """A plan row's layout in one phrase: "dp=8 tp=2 pp=8 cp=2 zero=1 sp, 1f1b, micro-batch 1 x 64, recompute none"."""
    pipeline = f", {schedule_label(row)}" if row["pp"] > 1 else ""
    return (f"dp={row['dp']} tp={row['tp']} pp={row['pp']}{cp_text(row)}{ep_text(row)} zero={zero_label(row)}"
            f"{' sp' if row['sp'] else ''}{pipeline}, micro-batch {row['micro_batch']} x {row['grad_accum']}, "
            f"recompute {row['recompute']}")


def format_plan(rows: list[dict[str, Any]], title: str) -> str:
    """The ranking `plait plan` prints."""
    header = ["#", "dp", "tp", "pp", "cp", "ep", "zero", "schedule", "sp", "micro", "accum", "recompute",
              "mem/GPU", "step", "tokens/s", "MFU"]
    body = [header]
    for i, r in enumerate(rows, 1):
        body.append([str(i), str(r["dp"]), str(r["tp"]), str(r["pp"]), cp_label(r), str(r.get("ep", 1)),
                     zero_label(r), schedule_label(r), "yes" if r["sp"] else "no",
                     str(r["micro_batch"]), str(r["grad_accum"]), str(r["recompute"]),
                     human_bytes(r["memory_bytes"]), f"{r['step_s']:.3g} s",
                     f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.1%}"])
    return "\n".join([title, ""] + table(body, right={0, 1, 2, 3, 5, 9, 10, 12, 13, 14, 15}))


def format_explain(why: dict[str, Any]) -> str:
    """`plait plan --explain`: why the first layout wins, in a few lines."""
    step, best = why["time"], why["layout"]
    waits = {axis: seconds for axis, seconds in why["exposed_s"].items() if seconds > 0}
    exposed = ", ".join(f"{axis} {seconds:.3g} s ({seconds / step['step_s']:.1%})" for axis, seconds in waits.items())
    lines = [f"why #1 wins: {layout_text(best)}: {step['step_s']:.3g} s a step, MFU {step['mfu']:.1%}",
             f"  compute {step['compute_s']:.3g} s, of which recompute {why['recompute_s']:.3g} s; "
             f"bubble {step['bubble_s']:.3g} s ({why['bubble_share']:.1%} of the step)",
             f"  communication it waits for: {exposed or 'none'}",
             f"  memory {human_bytes(why['memory_bytes'])} of {human_bytes(why['usable_bytes'])} usable: "
             f"{human_bytes(why['headroom_bytes'])} headroom"]
    if why["without"]:
        lines.append("  the best layout with")
    for other in why["without"]:
        lines.append(f"    {other['label']}: {_alternative(other)}")
    return "\n".join(lines)


def _alternative(other: dict[str, Any]) -> str:
    """"9.1 s, 21.0% slower (LAYOUT)", or why nothing of that kind fits."""
    if other["layout"] is None:
        return f"nothing fits (the smallest needs {human_bytes(other['smallest_bytes'])})"
    slower = f"{other['slower']:.1%} slower" if other["slower"] >= 0.0005 else "as fast (within 0.05%)"
    return f"{other['layout']['step_s']:.3g} s, {slower} ({layout_text(other['layout'])})"
