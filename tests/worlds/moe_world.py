"""Expert-parallel world: 4 ranks, one spawn, the checks of plait.parallel.expert.

argv: OUT CORPUS MIXTRAL_DIR QWEN2_MOE_DIR.
1. The real Trainer (what `plait train --ep N` runs) on plait's MoE GPT, both routers
   (softmax with the balancing loss; sigmoid with the bias), under ep 2 × (dp 4), ep 4,
   ep 2 × pp 2 (1F1B, accumulation 2) and ep 2 × tp 2 (the experts whole on each tp rank); on
   transformers' Mixtral (ep 2, ep 2 × pp 2, ep 2 × tp 2, ep 2 with ZeRO-3; its ep 2 run writes
   a checkpoint, exported by the test) and Qwen2-MoE (shared expert, the balancing loss on:
   ep 2, ep 2 × pp 2, ep 2 × tp 2, ep 2 with ZeRO-3). Rank 0 alone trains the same global batch in one process
   (accumulation 4). Losses every step, final weights elementwise, the sigmoid router's biases.
2. One forward and backward of an MoE layer at ep 4: the ledger's ep bytes against the
   formula on the routing that happened; the collectives per layer.
3. A router forced to send every token to expert 0 (top_k 1): the ranks holding the other
   experts receive nothing, and training goes on.
4. A checkpoint written at ep 2 resumed at ep 1 and ep 4.
5. ZeRO 1-3 with ep (tests/worlds/moe_zero_world.py's checks, in this one spawn).
With --extras (make test-all): full and selective recompute, ZeRO-1, bf16 and fp16, both routers;
the sigmoid router at ep 4; the ZeRO layouts make test leaves out (moe_zero_world.EXTRA).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from plait.families import family_of
from plait.layout import Layout
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.api import parallelize
from plait.parallel.expert.dispatch import take_formula
from plait.runtime import comm
from plait.runtime.env import ProcessEnv
from plait.runtime.mesh import init_mesh
from plait.train.config.settings import TrainConfig
from plait.train.loop.run import final_weights
from plait.train.loop.trainer import Trainer
from tests.hf_versions import declares_dispatched_experts
from tests.parity import PARAM_RTOL, weight_excess
from tests.worldlib import save_report
from tests.worlds.moe_zero_world import run_all

LAYOUTS = {
    "ep2": dict(dp=4, ep=2, grad_accum=1),
    "ep4": dict(dp=4, ep=4, grad_accum=1),
    "ep2-pp2": dict(pp=2, dp=2, ep=2, grad_accum=2),
    "ep2-tp2": dict(tp=2, dp=2, ep=2, grad_accum=2),
    "ep2-zero3": dict(dp=4, ep=2, grad_accum=1, zero=3),
}
EXTRA = {  # make test-all's
    "ep2-recompute": dict(dp=4, ep=2, grad_accum=1, recompute="full"),
    "ep2-selective": dict(dp=4, ep=2, grad_accum=1, recompute="selective"),
    "ep2-zero1": dict(dp=4, ep=2, grad_accum=1, zero=1),
}
LAYOUTS.update(EXTRA)
MODELS = {"softmax": "tiny-moe", "sigmoid": "tiny-moe,router=sigmoid,bias_rate=0.01"}


def train(config: TrainConfig, mesh: Any) -> tuple[list[float], dict[str, torch.Tensor] | None, list[Any]]:
    trainer = Trainer(config, mesh, family_of(config).task(config))
    trainer.run()
    history = trainer.metrics.history
    return [r["loss"] for r in history], final_weights(trainer), [r.get("moe") for r in history]


def family_runs(base: TrainConfig, out: Path, rank: int,
                 layouts: tuple[str, ...] = ("ep2", "ep4", "ep2-pp2", "ep2-tp2"),
                 saved: str = "") -> dict[str, Any]:
    """One process on rank 0, then each layout; `saved` names a layout that checkpoints its last step."""
    found: dict[str, Any] = {}
    reference = None
    if rank == 0:
        one = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
        losses, reference, routing = train(replace(base, grad_accum=4, nproc=1, dp=1, out=str(out / "one")), one)
        found["one"] = {"losses": losses, "routing": routing}
        found["bias"] = [v.tolist() for k, v in reference.items() if k.endswith("expert_bias")]
        save_file({k: v.contiguous() for k, v in reference.items()}, str(out / "one.safetensors"))
    for name in layouts:
        fields = {**LAYOUTS[name], **({"save_every": base.steps} if name == saved else {})}
        config = replace(base, **fields, nproc=4, out=str(out / name))
        losses, weights, routing = train(config, init_mesh(config.layout))
        found[name] = {"losses": losses, "routing": routing}
        if rank == 0:
            found[name]["excess"] = weight_excess(weights, reference)
            found[name]["worst"] = max(reference, key=lambda k: ((weights[k] - reference[k]).abs()
                                                                  - PARAM_RTOL * reference[k].abs()).max().item())
    return found


def one_layer(rank: int) -> dict[str, Any]:
    """A forward and backward of plait's MoE GPT at ep 4 (dp 4): the ledger's ep traffic and
    calls against the formula on the routing that happened."""
    mesh = init_mesh(Layout(dp=4, ep=4))
    model = parallelize(build_gpt(get_preset("tiny-moe"), 0), mesh)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    before = mesh.ledger.snapshot()
    model(ids).sum().backward()
    calls = {key[2]: tally.calls - (before[key].calls if key in before else 0)
             for key, tally in mesh.ledger.tallies.items() if key[:2] == (comm.TRAIN, "ep")}
    return {"measured": mesh.ledger.since(before).get("ep", {}), "formula": take_formula(model), "calls": calls,
            "moe_layers": get_preset("tiny-moe").moe_layers}


def forced(base: TrainConfig, out: Path) -> dict[str, Any]:
    """Every token to expert 0 (top_k 1, a bias no score can beat): ranks 1-3 receive nothing."""
    config = replace(base, model="tiny-moe,top_k=1,router=sigmoid,bias_rate=0", dp=4, ep=4, nproc=4, steps=2,
                     out=str(out / "forced"))
    trainer = Trainer(config, init_mesh(config.layout), family_of(config).task(config))
    for block in trainer.model.modules():
        if hasattr(block, "expert_bias"):
            block.expert_bias.data[0] = 1e3
    trainer.run()
    history = trainer.metrics.history
    return {"losses": [r["loss"] for r in history], "routing": [r["moe"] for r in history]}


def resumed(base: TrainConfig, out: Path) -> dict[str, Any]:
    """Save after step 1 at ep 2 (dp 4); resume step 2 at ep 1 and at ep 4."""
    first = replace(base, dp=4, ep=2, nproc=4, save_every=1, steps=1, out=str(out / "saved"))
    train(first, init_mesh(first.layout))
    checkpoint = str(out / "saved" / "checkpoints" / "step-00000001")
    found = {}
    for ep in (1, 4):
        config = replace(base, dp=4, ep=ep, nproc=4, resume=checkpoint, out=str(out / f"resumed-ep{ep}"))
        found[f"ep{ep}"] = train(config, init_mesh(config.layout))[0]
    return found


def main() -> None:
    out, corpus, mixtral, qwen2_moe = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    extras = sys.argv[5:] == ["--extras"]
    torch.set_num_threads(1)
    rank, report = int(os.environ["RANK"]), {}
    common = dict(data=corpus, steps=2, micro_batch=2, seq_len=16, eval_every=0, eval_samples=4, sample_tokens=0,
                  warmup_steps=1, lr=1e-3)
    bases = {name: TrainConfig(model=model, **common) for name, model in MODELS.items()}
    if extras:  # full and selective recompute, ZeRO-1, bf16 and fp16 (ZeRO-1: fp32 masters), both routers
        report["zero"] = run_all(out / "zero", corpus, rank, extras=True)
        for name, base in bases.items():
            report[name] = family_runs(base, out / name, rank, tuple(EXTRA) + (("ep4",) if name == "sigmoid" else ()))
            for precision in ("bf16", "fp16"):
                report[f"{name}-{precision}"] = family_runs(replace(base, precision=precision),
                                                            out / f"{name}-{precision}", rank, ("ep2-zero1",))
        save_report(report)
        return
    for name, base in bases.items():  # the sigmoid router at ep 4: make test-all's
        layouts = ("ep2", "ep2-pp2", "ep2-tp2") + (("ep4",) if name == "softmax" else ())
        report[name] = family_runs(base, out / name, rank, layouts)
    if declares_dispatched_experts():  # else tests/test_moe_worlds.py skips them, saying why
        report["mixtral"] = family_runs(TrainConfig(model=f"hf:{mixtral}", **common), out / "mixtral", rank,
                                        ("ep2", "ep2-pp2", "ep2-tp2", "ep2-zero3"), saved="ep2")
        report["qwen2_moe"] = family_runs(TrainConfig(model=f"hf:{qwen2_moe}", **common), out / "qwen2_moe", rank,
                                          ("ep2", "ep2-pp2", "ep2-tp2", "ep2-zero3"))
    report["layer"] = one_layer(rank)
    report["forced"] = forced(bases["softmax"], out)
    report["resumed"] = resumed(bases["softmax"], out)
    report["zero"] = run_all(out / "zero", corpus, rank)  # tests/worlds/moe_zero_world.py's checks, this spawn
    save_report(report)


if __name__ == "__main__":
    main()
