"""ZeRO world: every stage against one process, plait's DDP and torch FSDP2; memory and ledger.

Run as `plait launch --nproc N zero_parity.py SET DIR` where SET is "n2" (the full matrix) or "n4"
(a subset: 4 processes on a 2-core machine are slow). Each rank reports, per run, the losses,
gradient norms, how far its final parameters are from the reference, the measured memory
and the ledger of every step, then the real Trainer's history at every stage
(zero_trainer.py); tests/test_zero_worlds.py asserts on them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from zero_common import (ATOL, CLIP, RTOL, batches, build, full_state, loss_excess, loss_fn, make_model,
                         run_plait, run_reference, train)
from zero_trainer import trainer_runs

import plait
from plait.errors import PlaitError
from plait.parallel.zero.stages import apply_zero
from plait.runtime import comm
from tests.parity import PARAM_ATOL, PARAM_RTOL, weight_excess
from tests.worldlib import save_report

BF16 = torch.bfloat16

# (name, plait options, reference key). bf16 runs are held to bf16 tolerances (BF16 below).
N2 = [
    *[(f"gpt-adamw-z{s}", {"stage": s}, "gpt-adamw") for s in (0, 1, 2, 3)],
    ("gpt-adamw-z3-accum2", {"stage": 3, "accum": 2}, "gpt-adamw"),
    *[(f"gpt-adamw-z{s}-offload", {"stage": s, "offload": True}, "gpt-adamw") for s in (1, 2, 3)],
    *[(f"gpt-sgd-z{s}-accum{a}", {"stage": s, "accum": a, "optim": "sgd"}, "gpt-sgd")
      for s in (1, 2, 3) for a in (1, 2)],
    *[(f"gpt-sgd-z{s}-accum2-offload", {"stage": s, "accum": 2, "optim": "sgd", "offload": True}, "gpt-sgd")
      for s in (1, 2, 3)],
    *[(f"mlp-sgd-z{s}-accum2", {"stage": s, "kind": "mlp", "accum": 2, "optim": "sgd", "bucket_mb": 3e-4}, "mlp-sgd")
      for s in (1, 2, 3)],
    *[(f"mlp-adamw-z{s}", {"stage": s, "kind": "mlp", "bucket_mb": 3e-4}, "mlp-adamw") for s in (1, 2, 3)],
    *[(f"gpt-bf16-adamw-z{s}", {"stage": s, "dtype": BF16}, "gpt-bf16-adamw") for s in (1, 2, 3)],
    *[(f"gpt-bf16-sgd-z{s}", {"stage": s, "dtype": BF16, "optim": "sgd"}, "gpt-bf16-sgd") for s in (1, 2, 3)],
    # one flat group a rank (bucket 1 MB), so the compiled pass has runs of pieces to join
    *[(f"gpt-bf16-adamw-compiled-z{s}", {"stage": s, "dtype": BF16, "optim": "adamw-compiled", "bucket_mb": 1.0},
       "gpt-bf16-adamw") for s in (1, 3)],
    # ZeRO-3's gathers, tuned: prefetch depth 0, 1, 2 and units kept from forward to backward
    *[(f"deep-adamw-z3-prefetch{d}", {"stage": 3, "kind": "deep", "prefetch": d}, "deep-adamw") for d in (0, 1, 2)],
    ("deep-adamw-z3-keep", {"stage": 3, "kind": "deep", "reshard": False}, "deep-adamw"),
    ("deep-sgd-z3-keep-accum2", {"stage": 3, "kind": "deep", "reshard": False, "accum": 2, "optim": "sgd"},
     "deep-sgd"),
]
N4 = [
    *[(f"gpt-adamw-z{s}", {"stage": s}, "gpt-adamw") for s in (0, 1, 2, 3)],
    ("gpt-sgd-z3-accum2", {"stage": 3, "accum": 2, "optim": "sgd"}, "gpt-sgd"),
    ("gpt-sgd-z1-accum1", {"stage": 1, "optim": "sgd"}, "gpt-sgd"),
    ("gpt-sgd-z2-accum2-offload", {"stage": 2, "accum": 2, "optim": "sgd", "offload": True}, "gpt-sgd"),
    *[(f"mlp-sgd-z{s}-accum2", {"stage": s, "kind": "mlp", "accum": 2, "optim": "sgd", "bucket_mb": 3e-4}, "mlp-sgd")
      for s in (1, 2, 3)],
    ("mlp-adamw-z3-offload", {"stage": 3, "kind": "mlp", "offload": True}, "mlp-adamw"),
    ("gpt-bf16-sgd-z3", {"stage": 3, "dtype": BF16, "optim": "sgd"}, "gpt-bf16-sgd"),
]
REFERENCES = {
    "gpt-adamw": {}, "gpt-sgd": {"optim": "sgd"}, "mlp-sgd": {"kind": "mlp", "optim": "sgd"},
    "mlp-adamw": {"kind": "mlp"}, "deep-adamw": {"kind": "deep"}, "deep-sgd": {"kind": "deep", "optim": "sgd"},
    "gpt-bf16-adamw": {"dtype": BF16}, "gpt-bf16-sgd": {"dtype": BF16, "optim": "sgd"},
}
# bf16 parameters and gradients round to 8 bits: losses agree to 1e-4, gradient norms to 1e-2
# (gradients are averaged in bf16), SGD parameters to 1e-3 (a few bf16 ulps; they move by 2.4e-2).
BF16_TOL = {"loss_rtol": 1e-4, "norm_rtol": 1e-2, "param_rtol": 0.0, "param_atol": 1e-3}


def run_fsdp2(mesh: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """torch's FSDP2 (`fully_shard` per block, then the root) with SGD, as the native reference."""
    from torch.distributed.fsdp import fully_shard

    model = make_model("gpt")
    for block in model.blocks:
        fully_shard(block, mesh=mesh.device_mesh["dp"])
    fully_shard(model, mesh=mesh.device_mesh["dp"])
    params = list(model.parameters())
    optimizer = torch.optim.SGD([{"params": [p for p in params if p.ndim >= 2]},
                                 {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                                lr=0.5, momentum=0.9, weight_decay=0.1)
    n, r = mesh.size("dp"), mesh.rank("dp")
    out: dict[str, Any] = {"losses": [], "norms": []}
    for rows in batches("gpt"):
        loss = loss_fn(model, rows[r * len(rows) // n:(r + 1) * len(rows) // n], "gpt")
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        out["norms"].append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optimizer.step()
        optimizer.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        out["losses"].append(mean.item() / n)
    return out, {k: v.full_tensor().float() for k, v in model.state_dict().items()}


def checkpoints(mesh: Any, root: Path) -> dict[str, Any]:
    """Save after 2 of 3 steps under one layout, resume the last step under another.

    SGD (momentum state) is compared with the 3-step reference, parameters and last loss;
    AdamW (0-dim step counters too) resumes under the same layout and must match the run
    that never stopped.
    """
    from plait.train.checkpoint import read as checkpoint_read, write as checkpoint

    out: dict[str, Any] = {}
    ref, ref_params = run_reference(optim="sgd")
    for before, after, offload in ((3, 1, False), (3, 0, False), (0, 2, False), (1, 3, False), (0, 3, True)):
        model, optimizer = build(mesh, stage=before, optim="sgd")
        train(mesh, model, optimizer, batches("gpt")[:2])
        path = checkpoint.save(root / f"sgd{before}{after}{offload}", 2, model, optimizer, mesh, {})
        model, optimizer = build(mesh, stage=after, optim="sgd", offload=offload)
        checkpoint_read.load(path, model, optimizer, mesh)
        last = train(mesh, model, optimizer, batches("gpt")[2:])
        name = f"sgd z{before}->z{after}{'+offload' if offload else ''}"
        out[name] = {"param_excess": weight_excess(full_state(model), ref_params, RTOL, ATOL),
                     "loss_excess": loss_excess(last["losses"], ref["losses"][2:])}
    whole, _ = run_plait(mesh, stage=3)
    model, optimizer = build(mesh, stage=3)
    train(mesh, model, optimizer, batches("gpt")[:2])
    path = checkpoint.save(root / "adamw", 2, model, optimizer, mesh, {})
    model, optimizer = build(mesh, stage=3)
    checkpoint_read.load(path, model, optimizer, mesh)
    last = train(mesh, model, optimizer, batches("gpt")[2:])
    out["adamw z3->z3"] = {"loss_excess": loss_excess(last["losses"], whole["losses"][2:], rtol=0.0)}
    return out


def backend_error(mesh: Any) -> str:
    """The message apply_zero gives when the backend cannot reduce-scatter (simulated here)."""
    real = comm._REDUCE_SCATTER_ONE

    def missing(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("ProcessGroupGloo does not support reduce_scatter")

    comm._REDUCE_SCATTER_ONE = missing
    try:
        apply_zero(make_model("mlp"), mesh.axis("dp"), stage=2)
    except PlaitError as exc:
        return str(exc)
    finally:
        comm._REDUCE_SCATTER_ONE = real
    return "no error"


def main() -> None:
    which = sys.argv[1]
    torch.set_num_threads(1)
    mesh = plait.init_mesh()
    refs = {key: run_reference(**options) for key, options in REFERENCES.items()}
    runs: dict[str, Any] = {}
    final: dict[str, dict[str, torch.Tensor]] = {}
    for name, options, ref in N2 if which == "n2" else N4:
        numbers, params = run_plait(mesh, **options)
        ref_numbers, ref_params = refs[ref]
        tol = BF16_TOL if "bf16" in name else {"loss_rtol": RTOL, "param_rtol": RTOL, "param_atol": ATOL}
        numbers["ref_losses"] = ref_numbers["losses"]
        numbers["loss_excess"] = loss_excess(numbers["losses"], ref_numbers["losses"], tol["loss_rtol"])
        numbers["norm_excess"] = loss_excess(numbers["norms"], ref_numbers["norms"], tol.get("norm_rtol", RTOL))
        # Adam turns fp32 summation-order noise into parameter noise where a gradient nearly
        # cancels (torch DDP too): its parameters are held to tests/parity.py's bar, SGD's to 1e-7.
        if numbers["optim"] == "adamw" and "bf16" not in name:
            numbers["param_excess"] = weight_excess(params, ref_params, PARAM_RTOL, PARAM_ATOL)
        elif numbers["optim"] == "sgd":
            numbers["param_excess"] = weight_excess(params, ref_params, tol["param_rtol"], tol["param_atol"])
        runs[name] = numbers
        final[name] = params
    report: dict[str, Any] = {"n": mesh.size("dp"), "runs": runs}
    if which == "n2":
        fsdp, fsdp_params = run_fsdp2(mesh)
        ours = final["gpt-sgd-z3-accum1"]
        report["fsdp2"] = {"losses": fsdp["losses"], "ours": runs["gpt-sgd-z3-accum1"]["losses"],
                           "loss_excess": loss_excess(runs["gpt-sgd-z3-accum1"]["losses"], fsdp["losses"]),
                           "norm_excess": loss_excess(runs["gpt-sgd-z3-accum1"]["norms"], fsdp["norms"]),
                           "param_excess": weight_excess(ours, fsdp_params, RTOL, ATOL)}
        report["backend_error"] = backend_error(mesh)
        report["checkpoints"] = checkpoints(mesh, Path(sys.argv[2]))
    report["trainer"] = trainer_runs(mesh, Path(sys.argv[2]).parent / "trainer")  # last: it patches the trainer
    save_report(report)
    mesh.close()


if __name__ == "__main__":
    main()
