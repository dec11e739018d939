"""The pipeline's bubble as the estimate now prices it (the schedule run action by action,
plait/estimate/pipeline.py) against the closed form it replaced: (p − 1) slots for GPipe and
1F1B, (p − 1)/v interleaved, (p − 1)/3 for ZB-H1, each slot the mean micro-batch of the
stages besides the slowest. Published runs' layouts (Narayanan et al. 2021, BLOOM) and cuts
where the two part: uneven --stage-layers, ZB-H1 with fewer micro-batches than stages, an
interleaved cut whose chunks differ. Also the time the run takes (compiled schedules cached
afresh per row: the first estimate of a layout). Pure arithmetic, one process.

    python benchmarks/pipeline_span.py            # writes its section of RESULTS.md
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import new_parser, write_section  # noqa: E402
from gpu_presets import BLOOM_176B, GPT3_175B, NARAYANAN_TABLE_1, machine  # noqa: E402
from plait.estimate import pipeline  # noqa: E402
from plait.estimate.layout import Workload  # noqa: E402
from plait.estimate.time import (estimate_time, micro_batch_s_per_stage, schedule_ends,  # noqa: E402
                                 step_costs)
from plait.families import shape_of  # noqa: E402
from plait.models.gpt.config import GPTConfig  # noqa: E402


def closed_form_bubble(layout: Workload, stage_s: list[float]) -> float:
    """The bubble as the estimate priced it before the schedule was run: slots × the mean
    micro-batch of the stages besides the slowest."""
    p = layout.pp
    slots = {"interleaved": (p - 1) / layout.virtual_stages, "zb-h1": (p - 1) / 3}.get(layout.schedule, p - 1)
    return slots * (sum(stage_s) - max(stage_s)) / (p - 1)


def rows() -> list[tuple[str, str, GPTConfig, Workload]]:
    """(name, hardware, model, layout) of each row."""
    out = []
    for size, heads, h, layers, t, p, gpus, batch, _, _ in NARAYANAN_TABLE_1:
        if p > 1:
            config = GPTConfig(vocab_size=51200, n_layers=layers, d_model=h, n_heads=heads, n_kv_heads=heads,
                               ffn_hidden=4 * h, max_seq_len=2048, arch="gpt2")
            dp = gpus // (t * p)
            out.append((f"Narayanan Table 1, {size} B (t {t}, p {p}, 1F1B)", "a100-80gb", config,
                        Workload(dp=dp, tp=t, pp=p, precision="bf16", micro_batch=1, grad_accum=batch // dp,
                                 seq_len=2048, recompute="full", schedule="1f1b", stack="megatron-2021")))
    out.append(("GPT-3 175 B, t 8, p 12 interleaved ×2, 384 GPUs", "a100-80gb", GPT3_175B,
                Workload(dp=4, tp=8, pp=12, precision="bf16", micro_batch=1, grad_accum=384, seq_len=2048,
                         recompute="full", schedule="interleaved", virtual_stages=2, stack="megatron-2021")))
    out.append(("BLOOM-176B, tp 4, pp 12, 1F1B", "a100-80gb jean-zay", BLOOM_176B,
                Workload(dp=8, tp=4, pp=12, zero=1, precision="bf16", micro_batch=2, grad_accum=128, seq_len=2048,
                         recompute="full", schedule="1f1b", stack="megatron-deepspeed")))
    llama = shape_of("llama-70b")
    base = Workload(tp=8, pp=4, precision="bf16", micro_batch=1, seq_len=4096, grad_accum=16)
    out.append(("llama-70b, pp 4, --stage-layers 26,18,18,18, 1F1B", "h100-sxm", llama,
                base.replace(stage_layers=(26, 18, 18, 18))))
    out.append(("llama-70b, pp 4, --stage-layers 14,22,22,22, 1F1B", "h100-sxm", llama,
                base.replace(stage_layers=(14, 22, 22, 22))))
    out.append(("llama-70b, pp 4, ZB-H1, m = 2 (fewer than the stages)", "h100-sxm", llama,
                base.replace(schedule="zb-h1", grad_accum=2)))
    out.append(("llama-70b, pp 4, ZB-H1, m = 16", "h100-sxm", llama, base.replace(schedule="zb-h1")))
    out.append(("llama-70b, pp 4 interleaved ×2, --stage-layers 14,6,6,6,6,6,14,22", "h100-sxm", llama,
                base.replace(schedule="interleaved", virtual_stages=2, stage_layers=(14, 6, 6, 6, 6, 6, 14, 22))))
    return out


def measure(name: str, hardware: str, config: GPTConfig, layout: Workload) -> dict:
    hw = machine(hardware)
    stage_s = micro_batch_s_per_stage(config, layout, hw, 8)
    pipeline.compiled.cache_clear()
    pipeline._rank_ends.cache_clear()
    start = time.perf_counter()
    step = estimate_time(config, layout, hw, 8)
    seconds = time.perf_counter() - start
    old = closed_form_bubble(layout, stage_s)
    # the schedule's own idle time, as the closed form counts it: its span (messages aside)
    # less the slowest stage's m micro-batches
    span = max(schedule_ends(layout, step_costs(config, layout, hw, 8), message=0.0))
    return {"name": name, "hardware": hardware, "m": layout.grad_accum, "stages": stage_s, "old": old,
            "new": span - layout.grad_accum * max(stage_s), "step": step.step_s, "ms": seconds * 1e3}


def table(results: list[dict]) -> str:
    lines = ["| layout | hardware | m | stage micro-batch s (min / max) | closed-form bubble s | "
             "schedule-run bubble s | run / closed form | step s | first estimate ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        ratio = r["new"] / r["old"] if r["old"] else float("nan")
        lines.append(f"| {r['name']} | {r['hardware']} | {r['m']} | {min(r['stages']):.4f} / {max(r['stages']):.4f} | "
                     f"{r['old']:.4f} | {r['new']:.4f} | {ratio:.3f} | {r['step']:.3f} | {r['ms']:.0f} |")
    return "\n".join(lines)


READING = """
Reading it: where the stages are alike and the slowest is the last (the head), as in every
published layout here, running the schedule gives the closed form's bubble to four digits
(BLOOM's, whose stages hold 5, 6, ..., 6, 5 blocks, too): the last rank sets the pace, and
the others' fill and drain is the bubble. They part where the closed form's assumptions do
not hold. A heavy first stage runs back to back once the first gradient returns, so it idles
less than its neighbours' mean would say (0.56×). ZB-H1 with fewer micro-batches than stages
has no bubble to fill with its weight gradients (1.66×). An interleaved cut whose chunks
differ leaves even the slowest rank idle between them (2.43×). The schedule-run column is the
span, messages aside, less the slowest stage's m micro-batches; the step (the slowest rank's
path, messages on the schedule's edges, each rank's own tail: plait/estimate/time.py) is the
second-last column. Running a 64-stage schedule the first time costs a few tenths of a
second, as the machine goes (the last column); it is cached after.
"""


def main() -> None:
    args = new_parser(__doc__).parse_args()
    results = [measure(*row) for row in rows()]
    text = "\n".join([
        "## Pipeline bubble: the schedule run action by action vs the closed form it replaced",
        "",
        "- command: `python benchmarks/pipeline_span.py` (arithmetic, no GPU)",
        f"- machine: {os.cpu_count()}-core CPU ({platform.machine()}), Python {platform.python_version()}",
        f"- date: {datetime.date.today().isoformat()}",
        "- closed form: (p − 1) slots for GPipe and 1F1B, (p − 1)/v interleaved, (p − 1)/3 for ZB-H1, each the "
        "mean micro-batch of the stages besides the slowest; schedule run: plait/estimate/pipeline.py over the "
        "runner's own lists",
        "",
        table(results),
        READING,
    ])
    print(text)
    if not args.no_write:
        write_section("pipeline-span", text)


if __name__ == "__main__":
    main()
