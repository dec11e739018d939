"""Context-parallel world: 4 ranks, one spawn, every check of plait.parallel.context.

argv: OUT CORPUS LLAMA_DIR GPT2_DIR, for `make test`'s checks below; or
OUT CORPUS LLAMA_DIR GPT2_DIR --extras MORE_DIRS... for `make test-all`'s: full recompute (the
three families), ZeRO-1 and -2 (the GPT), bf16 (the GPT), other transformers families at
cp 2 × dp 2.
1. One attention layer (fp64) at cp 4 (ring) and cp 2 (ring with the CPU's fused kernels and
   with the plain ops other devices run, Ulysses) against SDPA on the
   whole sequence, causal and not, with 4, 2 and 1 K/V heads: the output and dq, dk, dv of
   this rank's tokens; the ledger's cp traffic of one forward and backward.
2. The real Trainer (what `plait train --cp N` runs) on plait's GPT, transformers' Llama and
   GPT-2 under cp 4, cp 2 × dp 2 (ring and Ulysses), cp 2 × tp 2 + SP, cp 2 × dp 2 with
   ZeRO-3 and cp 2 × pp 2 (1F1B); rank 0 alone trains the same global batch in one process. Losses every step,
   final weights against the one-process run's, elementwise.
3. A checkpoint written at cp 2 × dp 2 resumed at cp 4 and at tp 2 × dp 2 (the GPT).
4. Refusals at run time: Ulysses with heads cp does not divide, a caller's attention mask.
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
from plait.parallel.context import ring
from plait.parallel.context.chunks import shard_sequence
from plait.parallel.context.plan import ContextParallel, context_engaged, shard_batch
from plait.runtime.env import ProcessEnv
from plait.runtime.mesh import init_mesh
from plait.train.config.settings import TrainConfig
from plait.train.loop.run import final_weights
from plait.train.loop.trainer import Trainer
from tests.parity import weight_excess
from tests.worldlib import save_report

B, H, SEQ, D = 2, 4, 16, 8
LAYOUTS = {
    "cp4": dict(cp=4, dp=1, grad_accum=2),
    "cp2-dp2": dict(cp=2, dp=2, grad_accum=1),
    "ulysses-cp2-dp2": dict(cp=2, dp=2, grad_accum=1, cp_kind="ulysses"),
    "cp2-tp2-sp": dict(cp=2, tp=2, sp=True, dp=1, grad_accum=2),
    "cp2-dp2-zero3": dict(cp=2, dp=2, grad_accum=1, zero=3),
    "cp2-pp2": dict(cp=2, pp=2, dp=1, grad_accum=2),
}
EXTRA = {
    "cp2-dp2-recompute": dict(cp=2, dp=2, grad_accum=1, recompute="full"),
    "cp2-dp2-zero1": dict(cp=2, dp=2, grad_accum=1, zero=1),
    "cp2-dp2-zero2": dict(cp=2, dp=2, grad_accum=1, zero=2),
}
ALL = {**LAYOUTS, **EXTRA}


def attention_inputs(kv_heads: int, gen: torch.Generator, v_dim: int = D) -> tuple[torch.Tensor, ...]:
    """q, k, v (fp64, needing gradients) and the output's gradient, drawn from `gen`; V's heads
    `v_dim` wide (narrower than K's in multi-head latent attention)."""
    q = torch.randn(B, H, SEQ, D, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(B, kv_heads, SEQ, D, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(B, kv_heads, SEQ, v_dim, dtype=torch.float64, generator=gen, requires_grad=True)
    return q, k, v, torch.randn(B, H, SEQ, v_dim, dtype=torch.float64, generator=gen)


WINDOW = 5  # a sliding window shorter than the sequence: blocks wholly inside, partly and wholly outside it
# (K/V heads, V's head size): grouped heads, and for the ring V's heads half as wide as K's
CASES = ((4, D), (2, D), (1, D))
RING_CASES = (*CASES, (2, D // 2))


def attention_errors(mesh: Any, kind: str) -> dict[str, Any]:
    """Max |error| of the output and the three gradients, over every case, and the traffic."""
    axis, found = mesh.axis("cp"), {}
    context = ContextParallel(axis, kind)
    for kv_heads, v_dim in RING_CASES if kind == "ring" else CASES:
        for causal, window in ((True, None), (False, None), (True, WINDOW)):
            q, k, v, grad = attention_inputs(kv_heads, torch.Generator().manual_seed(kv_heads), v_dim)
            group = H // kv_heads
            behind = torch.arange(SEQ).unsqueeze(-1) - torch.arange(SEQ).unsqueeze(0)
            band = (behind >= 0) & (behind < window) if window else None  # transformers' sliding window
            ref = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                                 is_causal=causal and band is None, attn_mask=band)
            ref.backward(grad)
            mine = [shard_sequence(t.detach(), axis.rank, axis.size, 2).requires_grad_() for t in (q, k, v)]
            before = mesh.ledger.snapshot()
            out = context.attend(*mine, causal=causal, window=window)
            forward = mesh.ledger.since(before)
            out.backward(shard_sequence(grad, axis.rank, axis.size, 2))
            both = mesh.ledger.since(before)
            errors = [(out - shard_sequence(ref.detach(), axis.rank, axis.size, 2)).abs().max().item()]
            errors += [(m.grad - shard_sequence(t.grad, axis.rank, axis.size, 2)).abs().max().item()
                       for m, t in zip(mine, (q, k, v))]
            narrow = f"-v{v_dim}" if v_dim != D else ""
            found[f"kv{kv_heads}{narrow}-{f'window{window}' if window else 'causal' if causal else 'full'}"] = {
                "errors": errors, "forward": forward.get("cp", {}), "total": both.get("cp", {}),
                "calls": calls_since(mesh.ledger, before)}
    return found


def calls_since(ledger: Any, before: dict) -> dict[str, int]:
    """{op: collectives on the cp axis} recorded after `before`."""
    calls = {key[2]: tally.calls - (before[key].calls if key in before else 0)
             for key, tally in ledger.tallies.items() if key[1] == "cp"}
    return {op: n for op, n in calls.items() if n}


def train(config: TrainConfig, mesh: Any) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    trainer = Trainer(config, mesh, family_of(config).task(config))
    trainer.run()
    return [r["loss"] for r in trainer.metrics.history], final_weights(trainer)


def family_runs(base: TrainConfig, out: Path, rank: int, layouts: tuple[str, ...] = tuple(LAYOUTS)) -> dict[str, Any]:
    found: dict[str, Any] = {}
    reference = None
    if rank == 0:
        one = init_mesh(env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
        losses, reference = train(replace(base, grad_accum=2, nproc=1, dp=1, out=str(out / "one")), one)
        found["one"] = {"losses": losses}
    for name in layouts:
        fields = ALL[name]
        config = replace(base, **fields, nproc=4, out=str(out / name))
        losses, weights = train(config, init_mesh(config.layout))
        found[name] = {"losses": losses}
        if rank == 0:
            found[name]["excess"] = weight_excess(weights, reference)
    return found


def resumed(base: TrainConfig, out: Path, rank: int) -> dict[str, Any]:
    """Save after step 1 at cp 2 × dp 2; resume step 2 at cp 4 and at tp 2 × dp 2."""
    first = replace(base, cp=2, dp=2, nproc=4, save_every=1, steps=1, out=str(out / "saved"))
    train(first, init_mesh(first.layout))
    checkpoint = str(out / "saved" / "checkpoints" / "step-00000001")
    found = {}
    for name, fields in {"cp4": dict(cp=4, dp=1, grad_accum=2), "tp2-dp2": dict(tp=2, dp=2)}.items():
        config = replace(base, **fields, nproc=4, resume=checkpoint, out=str(out / f"resumed-{name}"))
        losses, _ = train(config, init_mesh(config.layout))
        found[name] = losses
    return found


def extra_runs(bases: dict[str, TrainConfig], common: dict[str, Any], more: list[str], out: Path,
               rank: int) -> dict[str, Any]:
    """make test-all's: recompute for every family, ZeRO-1/2 and bf16 for the GPT, more families."""
    report = {name: family_runs(base, out / name, rank, ("cp2-dp2-recompute",) if name != "gpt" else
                                ("cp2-dp2-recompute", "cp2-dp2-zero1", "cp2-dp2-zero2"))
              for name, base in bases.items()}
    for directory in more:  # Mistral's window is shorter than the sequence: both kinds mask by it
        name = Path(directory).name
        report[name] = family_runs(TrainConfig(model=f"hf:{directory}", **common), out / name, rank,
                                   ("cp2-dp2", "ulysses-cp2-dp2") if name == "mistral" else ("cp2-dp2",))
    report["bf16"] = family_runs(replace(bases["gpt"], precision="bf16"), out / "bf16", rank, ("cp2-dp2",))
    return report


def refusals(mesh: Any, gpt_base: TrainConfig) -> dict[str, str]:
    found = {}
    context = ContextParallel(mesh.axis("cp"), "ulysses")
    q = torch.zeros(1, 3, 4, 8)
    try:
        context.attend(q, q, q)
    except PlaitError as exc:
        found["ulysses_heads"] = str(exc)
    config = replace(gpt_base, cp=2, dp=2, nproc=4, out="/tmp/unused")
    trainer = Trainer(config, mesh, family_of(config).task(config))
    ids = torch.zeros(2, 8, dtype=torch.long)
    try:
        with context_engaged(trainer.model):
            trainer.model(ids, attention_mask=torch.ones(2, 8))
    except PlaitError as exc:
        found["mask"] = str(exc)
    mine, _ = shard_batch(trainer.model, ids, ids)
    try:
        trainer.model(mine)  # not engaged: attention would see this rank's chunks only
    except PlaitError as exc:
        found["not_engaged"] = str(exc)
    try:
        with context_engaged(trainer.model):
            shard_batch(trainer.model, ids, ids)
            trainer.model(ids)  # the whole sequence while engaged
    except PlaitError as exc:
        found["unsharded"] = str(exc)
    return found


def main() -> None:
    out, corpus, llama, gpt2, extras = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
    torch.set_num_threads(1)
    rank, report = int(os.environ["RANK"]), {}
    common = dict(data=corpus, steps=2, micro_batch=2, seq_len=16, eval_every=0, eval_samples=4, sample_tokens=0,
                  warmup_steps=1, lr=1e-3)
    bases = {"gpt": TrainConfig(model="tiny", **common), "llama": TrainConfig(model=f"hf:{llama}", **common),
             "gpt2": TrainConfig(model=f"hf:{gpt2}", **common)}
    if extras:
        save_report(extra_runs(bases, common, extras[1:], out, rank))
        return
    report["attention"] = {"ring-cp4": attention_errors(init_mesh(Layout(cp=4)), "ring")}
    cp2 = init_mesh(Layout(cp=2, dp=2))
    report["attention"]["ring-cp2"] = attention_errors(cp2, "ring")
    report["attention"]["ulysses-cp2"] = attention_errors(cp2, "ulysses")
    ring.PLAIN_OPS = True  # the plain matmul/softmax path other devices run
    report["attention"]["ring-plain-cp2"] = attention_errors(cp2, "ring")
    ring.PLAIN_OPS = False
    for name, base in bases.items():
        report[name] = family_runs(base, out / name, rank)
    report["resumed"] = resumed(bases["gpt"], out / "resume", rank)
    report["refusals"] = refusals(cp2, bases["gpt"])
    save_report(report)


if __name__ == "__main__":
    main()
