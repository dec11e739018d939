"""Tensor-parallel world: every rank is one tp rank (tp = world size). One spawn, many checks.

1. each sharded layer against its dense twin (tensor_layer_checks);
2. the GPT trained 3 SGD steps without SP, with SP, and with SP saving whole region inputs,
   against the one-process run: loss and grad norm every step, final parameters gathered;
   the first step's traffic; activation bytes of one block and of the whole forward;
3. the same model under torch.distributed.tensor.parallel (with loss_parallel) against the
   same one-process run;
4. bad input: --sp with a sequence length tp does not divide;
5. with --dp-tp (4 ranks): dp 2 × tp 2 with SP against one process on the global batch.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Any

import torch

import tensor_common as common
from tensor_layer_checks import all_layer_errors
from plait.errors import PlaitError
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import GPT, build_gpt
from plait.parallel.data.sync import apply_data_parallel
from plait.parallel.clip import clip_grad_norm
from plait.parallel.tensor.plan import apply_tensor_parallel, gather_full_params, tp_loss_fn
from plait.runtime.mesh import init_mesh
from plait.bench.meter import ActivationMeter
from tests.worldlib import save_report

BATCH, SEQ = 2, 16
torch.set_num_threads(1)


def block_bytes(model: GPT, tp: int, sp: bool) -> int:
    """Bytes one block saves for backward on this rank (its input is a sequence chunk under SP),
    the model's weights and buffers apart (its rope tables, of which the block saves views)."""
    x = torch.randn(BATCH, SEQ // tp if sp else SEQ, model.config.d_model, requires_grad=True)
    meter = ActivationMeter()
    with meter.track(model):
        out = model.blocks[0](x, model.rope_cos[:SEQ], model.rope_sin[:SEQ])  # held: the meter reads what the graph holds
    assert out.requires_grad
    return meter.last


def model_bytes(model: GPT, ids: torch.Tensor) -> int:
    meter = ActivationMeter()
    with meter.track(model):
        out = model(ids)  # held: the meter reads what the graph still holds
    assert out.requires_grad
    return meter.last


def plait_run(config: Any, mesh: Any, data: list, ref_model: GPT, sp: bool, regather: bool = True) -> dict[str, Any]:
    axis = mesh.axis("tp")
    model = apply_tensor_parallel(build_gpt(config, common.SEED), axis, sp=sp, regather=regather)
    out = common.train(model, data, tp_loss_fn(model), lambda: clip_grad_norm(model, 1.0), mesh.ledger)
    out["param_error"] = common.param_error(gather_full_params(model), ref_model)
    out["block_bytes"] = block_bytes(model, axis.size, sp)
    out["model_bytes"] = model_bytes(model, data[0][0])
    return out


def native_run(config: Any, mesh: Any, data: list, ref_model: GPT, sp: bool) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import loss_parallel

    model = common.build_native(config, mesh.device_mesh["tp"], sp)
    out = common.train(model, data, common.native_loss, lambda: common.native_clip(model), context=loss_parallel)
    full = {name: p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for name, p in model.named_parameters()}
    out["param_error"] = common.param_error(full, ref_model)
    return out


def bad_sequence(config: Any, mesh: Any) -> str:
    model = apply_tensor_parallel(build_gpt(config, common.SEED), mesh.axis("tp"), sp=True)
    try:
        model(torch.zeros(1, SEQ + 1, dtype=torch.long))
    except PlaitError as exc:
        return str(exc)
    return "no error"


def dp_tp_run(config: Any) -> dict[str, Any]:
    """dp 2 × tp 2, SP on: each dp rank trains on half of a batch of 4."""
    mesh = init_mesh(dp=2, tp=2)
    data = common.batches(config, 2 * BATCH, SEQ)
    ref_run, ref_model = common.reference(config, data)
    rows = slice(mesh.rank("dp") * BATCH, (mesh.rank("dp") + 1) * BATCH)
    model = apply_tensor_parallel(build_gpt(config, common.SEED), mesh.axis("tp"), sp=True)
    apply_data_parallel(model, mesh.axis("dp"))
    local = [(x[rows], y[rows]) for x, y in data]
    out = common.train(model, local, tp_loss_fn(model), lambda: clip_grad_norm(model, 1.0))
    return {"param_error": common.param_error(gather_full_params(model), ref_model),
            "grad_norm_error": common.close(out["grad_norms"], ref_run["grad_norms"])}


def main() -> None:
    mesh = init_mesh(tp=int(os.environ["WORLD_SIZE"]))
    tp = mesh.size("tp")
    config = get_preset("tiny") if tp <= 2 else replace(get_preset("tiny"), n_kv_heads=tp)
    data = common.batches(config, BATCH, SEQ)
    ref_run, ref_model = common.reference(config, data)
    report: dict[str, Any] = {"tp": tp, "batch": BATCH, "seq": SEQ, "config": config.__dict__,
                              "layers": all_layer_errors(mesh.axis("tp")), "reference": ref_run,
                              "reference_block_bytes": block_bytes(ref_model, 1, False),
                              "reference_model_bytes": model_bytes(ref_model, data[0][0])}
    for sp in (False, True):
        report["sp" if sp else "tp_only"] = plait_run(config, mesh, data, ref_model, sp)
        if "--native" in sys.argv:
            report["native_sp" if sp else "native"] = native_run(config, mesh, data, ref_model, sp)
    report["sp_no_regather"] = plait_run(config, mesh, data, ref_model, True, regather=False)
    report["bad_sequence"] = bad_sequence(config, mesh)
    if "--dp-tp" in sys.argv:
        report["dp_tp"] = dp_tp_run(config)
    save_report(report)
    mesh.close()


if __name__ == "__main__":
    main()
