"""A pipeline world: every schedule against one process and against torch.distributed.pipelining.

Layout from the process count and `--dp`: pp = world / dp. Each case trains the tiny GPT
for STEPS steps with plait's PipelineRunner and reports, per rank: losses next to the
one-process reference, whether the final parameters match it, the step's ledger, the
activations held (count and bytes) and the measured timeline. With dp = 1 the same stages
also run under torch's ScheduleGPipe / Schedule1F1B / ScheduleInterleaved1F1B.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

import plait
from plait.parallel.zero.stages import full_parameters
from plait.schedule.action import Action
from plait.schedule.build import Schedule, build_schedule
from tests.worldlib import save_report
from tests.worlds.pipeline_common import (
    MICRO, PARAM_ATOL, SEQ, ZERO_PARAM_ATOL, batches, gpt_config, loss_fn, max_param_diff, param_error, train_plait,
    train_reference, train_torch,
)


def cases(pp: int, dp: int) -> list[tuple[str, int, int, int]]:
    """(schedule, v, m, layers) to run: every schedule, m = 1, 4, 8, and interleaved where pp
    does not divide m (plait.interleave's rounds): on pp 2, m = 5 in rounds of 3 and 2; on
    pp 4, m = 3 (one round, fewer than the ranks) and m = 6 (one round of 6)."""
    layers = 2 if pp == 2 else 8
    if dp > 1:
        return [("gpipe", 1, 1, layers), ("1f1b", 1, 4, layers), ("zb-h1", 1, 4, layers), ("interleaved", 2, 4, 4)]
    plain = [(s, 1, m, layers) for s in ("gpipe", "1f1b", "zb-h1") for m in (1, 4, 8)]
    uneven = (5,) if pp == 2 else (3, 6)
    return plain + [("interleaved", 2, m, 2 * pp if pp == 2 else 8) for m in (4, 8, *uneven)]


def last_rank_reversed(pp: int, m: int, v: int) -> Schedule:
    """GPipe, but the last rank takes the micro-batches in reverse order, so activations
    and gradients arrive in another order than the receiver needs them: a custom schedule
    (any valid one runs) that only works if receives are posted in the sender's order."""
    schedule = build_schedule("gpipe", pp, m, v)
    schedule[-1] = [Action(a.kind, m - 1 - a.microbatch, a.chunk) for a in schedule[-1]]
    return schedule


def torch_cases(pp: int) -> list[tuple[str, int, int, int]]:
    return [("gpipe", 1, 4, 2 if pp == 2 else 8), ("1f1b", 1, 4, 2 if pp == 2 else 8),
            ("interleaved", 2, 4 if pp == 2 else 8, 4 if pp == 2 else 8)]


class References:
    """One-process runs, computed once per (layers, tied, m) and shared by the schedules."""

    def __init__(self, dp: int):
        self.dp, self._runs = dp, {}

    def get(self, layers: int, tied: bool, m: int, clip: bool) -> dict[str, Any]:
        key = (layers, tied, m, clip)
        if key not in self._runs:
            self._runs[key] = train_reference(gpt_config(layers, tied), batches(m, self.dp), clip)
        return self._runs[key]


def run_case(mesh: Any, refs: References, schedule: Any, v: int, m: int, layers: int,
             tied: bool = True, clip: bool = True, zero: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    config = gpt_config(layers, tied)
    run = train_plait(config, mesh, schedule, v, batches(m, mesh.size("dp")), clip, zero)
    ref = refs.get(layers, tied, m, clip)
    with full_parameters(run["stages"]):  # ZeRO-3's whole parameters (the others hold them whole)
        error = param_error(run["stages"], ref["model"], atol=ZERO_PARAM_ATOL if zero else PARAM_ATOL)
    stats, timeline = run["runner"].last_stats, run["runner"].last_timeline
    report = {
        "losses": run["losses"], "ref_losses": ref["losses"], "param_error": error,
        "comm": run["comm"], "peak_inflight": stats.peak_inflight, "peak_saved_bytes": stats.peak_saved_bytes,
        "peak_sent_bytes": stats.peak_sent_bytes,
        "saved_bytes": list(stats.saved_bytes), "bubble": timeline.bubble,
        "timeline_rows": [len(row) for row in timeline.rows], "timeline_peak": list(timeline.peak_inflight),
        "act_bytes": MICRO * SEQ * config.d_model * 4, "tied_bytes": config.vocab_size * config.d_model * 4 * tied,
        "stage_param_bytes": sum(p.numel() * p.element_size() for p in run["stages"].parameters()),
        "pool_buffers": run["runner"].pool.allocated, "events": run["events"],
        "grads_at_forward": run["grads_at_forward"],
    }
    return report, run


def eval_check(mesh: Any, run: dict[str, Any], reference: torch.nn.Module) -> dict[str, float]:
    """runner.eval_loss on held-out micro-batches against the trained reference's loss."""
    rows = torch.randint(0, 256, (4, MICRO, SEQ + 1), generator=torch.Generator().manual_seed(99))
    ours = run["runner"].eval_loss([r[:, :-1] for r in rows], [r[:, 1:] for r in rows], loss_fn)
    with torch.no_grad():
        theirs = sum(loss_fn(reference(r[:, :-1]), r[:, 1:]).item() for r in rows) / len(rows)
    return {"plait": ours, "reference": theirs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, default=1)
    args = parser.parse_args()
    mesh = plait.init_mesh(dp=args.dp, pp=int(os.environ["WORLD_SIZE"]) // args.dp)
    pp, dp = mesh.size("pp"), mesh.size("dp")
    refs = References(dp)
    report: dict[str, Any] = {"pp": pp, "dp": dp, "rank": mesh.rank("pp"), "runs": {}, "torch": {}}
    for schedule, v, m, layers in cases(pp, dp):
        report["runs"][f"{schedule}/v{v}/m{m}"], run = run_case(mesh, refs, schedule, v, m, layers)
        if (schedule, m) == ("1f1b", 4):
            report["eval"] = eval_check(mesh, run, refs.get(layers, True, m, True)["model"])
    if dp > 1:  # ZeRO-2 and -3 under the interleaved schedule: their collectives inside each chunk's passes
        for stage in (2, 3):
            report[f"zero{stage}"], _ = run_case(mesh, refs, "interleaved", 2, 4, 4, zero=stage)
    if dp == 1:
        report["runs"]["reversed/v1/m4"], _ = run_case(mesh, refs, last_rank_reversed, 1, 4, 2 if pp == 2 else 8)
        for schedule, v, m, layers in torch_cases(pp):
            ours, run = run_case(mesh, refs, schedule, v, m, layers, tied=False, clip=False)
            theirs = train_torch(gpt_config(layers, tied=False), mesh, schedule, v, batches(m))
            ref = refs.get(layers, False, m, False)
            report["torch"][f"{schedule}/v{v}/m{m}"] = {
                "plait": ours, "torch_losses": theirs["losses"],
                "torch_param_error": param_error(theirs["stages"], ref["model"]),
                "max_param_diff": max_param_diff(run["stages"], theirs["stages"]),
            }
    save_report(report)
    mesh.close()


if __name__ == "__main__":
    main()
