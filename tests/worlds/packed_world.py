"""Packed-documents world: 4 ranks, one spawn, document masks under every axis.

argv: OUT CORPUS LLAMA_DIR, CORPUS a prepared completion corpus (documents and a loss mask).
1. One attention layer (fp64) with packed documents at cp 4 and cp 2 (ring, and Ulysses)
   against SDPA with the block-causal mask on the whole sequence, 4, 2 and 1 K/V heads:
   the output and dq, dk, dv of this rank's tokens (documents crossing chunk edges, and
   one-token documents, included).
2. The real Trainer (what `plait train --packing best-fit --doc-mask true` runs) on plait's GPT,
   its mixture of experts and transformers' Llama, under dp 2 × tp 2 + SP, cp 2 × dp 2 (ring
   and Ulysses; and with ZeRO-3), cp 4, pp 2 × dp 2 and ep 2 × dp 4 (the MoE); rank 0 alone trains the same global
   batch in one process. The loss masks give each micro-batch and rank its own count of loss
   tokens, so a mean of means would differ: losses every step and final weights are compared,
   and each run's activations measured against plait estimate's prediction for it.
3. What is refused: a transformers model's stages handed documents under cp × pp.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from plait.errors import PlaitError
from plait.families import family_of
from plait.layout import Layout
from plait.parallel.context.chunks import shard_sequence
from plait.parallel.context.plan import ContextParallel
from plait.parallel.packed import block_causal
from plait.runtime.env import ProcessEnv
from plait.runtime.mesh import init_mesh
from plait.train.config.settings import TrainConfig
from plait.train.loop.run import final_weights, prediction
from plait.train.loop.trainer import Trainer
from tests.parity import weight_excess
from tests.worlds.context_world import B, H, SEQ, attention_inputs
from tests.worldlib import save_report

LAYOUTS = {
    "dp2-tp2-sp": dict(dp=2, tp=2, sp=True, grad_accum=1),
    "cp2-dp2": dict(cp=2, dp=2, grad_accum=1),
    "ulysses-cp2-dp2": dict(cp=2, dp=2, grad_accum=1, cp_kind="ulysses"),
    "cp4": dict(cp=4, dp=1, grad_accum=2),
    "pp2-dp2": dict(pp=2, dp=2, grad_accum=1),
    "cp2-dp2-zero3": dict(cp=2, dp=2, grad_accum=1, zero=3),
}
# plait's GPT alone: recomputation keeps the documents' numbers where attention kept its mask
RECOMPUTED = {
    "recompute-selective": dict(cp=2, dp=2, grad_accum=1, cp_kind="ulysses", recompute="selective"),
    "recompute-full": dict(pp=2, dp=2, grad_accum=1, recompute="full"),
}
MOE_LAYOUTS = {"ep2-dp4": dict(ep=2, dp=4, micro_batch=1, grad_accum=1)}


def documents(gen: torch.Generator) -> torch.Tensor:
    """(B, SEQ) document numbers: random lengths, some of one token."""
    rows = []
    for _ in range(B):
        lengths, left = [], SEQ
        while left:
            n = min(left, int(torch.randint(1, 7, (1,), generator=gen)))
            lengths.append(n)
            left -= n
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows)


def attention_errors(mesh: Any, kind: str) -> dict[str, list[float]]:
    axis, found = mesh.axis("cp"), {}
    context = ContextParallel(axis, kind)
    for kv_heads in (4, 2, 1):
        gen = torch.Generator().manual_seed(kv_heads)
        docs = documents(gen)
        q, k, v, grad = attention_inputs(kv_heads, gen)
        group = H // kv_heads
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                             attn_mask=block_causal(docs, docs, True))
        ref.backward(grad)
        mine = [shard_sequence(t.detach(), axis.rank, axis.size, 2).requires_grad_() for t in (q, k, v)]
        out = context.attend(*mine, documents=docs)
        out.backward(shard_sequence(grad, axis.rank, axis.size, 2))
        errors = [(out - shard_sequence(ref.detach(), axis.rank, axis.size, 2)).abs().max().item()]
        errors += [(m.grad - shard_sequence(t.grad, axis.rank, axis.size, 2)).abs().max().item()
                   for m, t in zip(mine, (q, k, v))]
        found[f"kv{kv_heads}"] = errors
    return found


def train(config: TrainConfig, mesh: Any) -> tuple[list[float], dict[str, torch.Tensor] | None, list[float]]:
    """Losses, final weights, and [measured, predicted] activation bytes of the busiest rank."""
    trainer = Trainer(config, mesh, family_of(config).task(config))
    assert getattr(trainer.train_split, "per_token", False), "the corpus must be packed with masks"
    trainer.run()
    measured = max(r["mem"]["activations_peak"] for r in trainer.metrics.history if "mem" in r)
    predicted = prediction(trainer)["memory"]["activations"]
    return [r["loss"] for r in trainer.metrics.history], final_weights(trainer), [measured, predicted]


def family_runs(base: TrainConfig, layouts: dict[str, dict[str, Any]], out: Path, rank: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    reference = None
    if rank == 0:
        one = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
        losses, reference, activations = train(replace(base, grad_accum=4 // base.micro_batch,
                                                       micro_batch=base.micro_batch, nproc=1, dp=1,
                                                       out=str(out / "one")), one)
        found["one"] = {"losses": losses, "activations": activations}
    for name, fields in layouts.items():
        config = replace(base, **fields, nproc=4, out=str(out / name))
        losses, weights, activations = train(config, init_mesh(config.layout))
        found[name] = {"losses": losses, "activations": activations}
        if rank == 0:
            found[name]["excess"] = weight_excess(weights, reference)
            found[name]["worst"] = max(reference, key=lambda k: weight_excess({k: weights[k]}, {k: reference[k]}))
    return found


def refusals(base: TrainConfig, out: Path) -> dict[str, str]:
    found = {}
    config = replace(base, cp=2, pp=2, dp=1, grad_accum=2, nproc=4, out=str(out / "refused"))
    try:
        train(config, init_mesh(config.layout))
    except PlaitError as exc:
        found["hf_cp_pp"] = str(exc)
    return found


def main() -> None:
    out, corpus, llama = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    torch.set_num_threads(1)
    rank, report = int(os.environ["RANK"]), {}
    common = dict(data=corpus, steps=2, micro_batch=2, seq_len=32, eval_every=0, eval_samples=4, sample_tokens=0,
                  warmup_steps=1, lr=1e-4, packing="best-fit", doc_mask="true")
    report["attention"] = {"ring-cp4": attention_errors(init_mesh(Layout(cp=4)), "ring")}
    cp2 = init_mesh(Layout(cp=2, dp=2))
    report["attention"]["ring-cp2"] = attention_errors(cp2, "ring")
    report["attention"]["ulysses-cp2"] = attention_errors(cp2, "ulysses")
    gpt, hf = TrainConfig(model="tiny,vocab_size=258", **common), TrainConfig(model=f"hf:{llama}", **common)
    report["gpt"] = family_runs(gpt, {**LAYOUTS, **RECOMPUTED}, out / "gpt", rank)
    report["moe"] = family_runs(replace(gpt, model="tiny-moe,vocab_size=258", micro_batch=1), MOE_LAYOUTS, out / "moe", rank)
    report["llama"] = family_runs(hf, LAYOUTS, out / "llama", rank)
    report["refusals"] = refusals(hf, out)
    save_report(report)


if __name__ == "__main__":
    main()
