"""A transformers Llama through every strategy, split by the plans it declares: one spawn.

`plait.parallelize(model, mesh, ParallelConfig(...))` takes the `LlamaForCausalLM` as it is
(no plan, no adapter from the user). The one-process reference trains the same model on
the whole batch inside each rank. Argument "small" (2 ranks): pp 2 with 1F1B, interleaved
(2 virtual stages), zb-h1, a tied-embedding model (and one whose head holds a bias, under ZeRO-3)
and full recomputation; tp 2 on the adapter's plan, without and with
sequence parallelism; a Qwen2 (biased q, k, v) under tp 2; and a model plait cannot cut.
Argument "3d" (8 ranks): dp 2 × tp 2 × pp 2 with ZeRO-1, and with ZeRO-3, SP, full
recomputation and tied embeddings.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import plait
from plait.runtime import comm
from tests.worldlib import save_report

SEED, STEPS, BATCH, SEQ, LR, CLIP = 0, 3, 4, 16, 0.5, 1.0
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
torch.set_num_threads(1)


def build(family: str = "llama", tied: bool = False, head_bias: bool = False) -> torch.nn.Module:
    """`head_bias`: a bias beside the head's weight (CTRL's, ModernBERT-decoder's), which a
    pipeline's copy of a tied table shares its module with."""
    families = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_class, model_class = families[family]
    torch.manual_seed(SEED)
    model = model_class(config_class(**SHAPE, tie_word_embeddings=tied))
    if head_bias:
        model.lm_head.bias = torch.nn.Parameter(torch.linspace(-0.5, 0.5, SHAPE["vocab_size"]))
    return model


def data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def reference(batches: list[torch.Tensor], **build_args: Any) -> dict[str, Any]:
    """One process, the whole batch: next-token loss, clipped SGD with momentum."""
    model = build(**build_args)
    labels_loss = model(input_ids=batches[0][:, :-1], labels=batches[0][:, :-1]).loss.item()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for rows in batches:
        loss = loss_fn(model(input_ids=rows[:, :-1]).logits, rows[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "labels_loss": labels_loss}


def whole(batches: list[torch.Tensor], config: Any, build_args: dict[str, Any], **degrees: int) -> dict[str, Any]:
    """tp (± sp) over the whole model, called as user code calls it: `model(input_ids=...)`."""
    mesh = plait.init_mesh(**degrees)
    model = plait.parallelize(build(**build_args), mesh, config)
    labels_loss = model(input_ids=batches[0][:, :-1], labels=batches[0][:, :-1]).loss.item()
    optimizer = plait.build_optimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
    losses, backward_all_reduces = [], None
    before_step = mesh.ledger.snapshot()
    for rows in batches:
        logits = model(input_ids=rows[:, :-1]).logits
        loss = loss_fn(logits, rows[:, 1:])
        before = mesh.ledger.tallies[(comm.TRAIN, "tp", "all_reduce")].calls
        loss.backward()
        if backward_all_reduces is None:
            backward_all_reduces = mesh.ledger.tallies[(comm.TRAIN, "tp", "all_reduce")].calls - before
        plait.clip_grad_norm(model, CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    tp_ops = sorted(mesh.ledger.since(before_step).get("tp", {}))  # the kinds of collective tp made
    return {"losses": losses, "labels_loss": labels_loss, "logits_shape": list(logits.shape),
            "backward_tp_all_reduces": backward_all_reduces, "tp_ops": tp_ops,
            "head_rows": model.lm_head.weight.shape[0]}


def piped(batches: list[torch.Tensor], config: Any, schedule: str, build_args: dict[str, Any],
          **degrees: int) -> dict[str, Any]:
    """This rank's stages from parallelize, driven by PipelineRunner; the dp-mean loss per step."""
    mesh = plait.init_mesh(schedule=schedule, **degrees)
    stages = plait.parallelize(build(**build_args), mesh, config)
    optimizer = plait.build_optimizer(stages, torch.optim.SGD, lr=LR, momentum=0.9)
    runner = plait.PipelineRunner(stages, mesh, schedule)
    dp, rank = mesh.size("dp"), mesh.rank("dp")
    losses = []
    for rows in batches:
        mine = rows.chunk(dp)[rank]
        loss = runner.step([r[None, :-1] for r in mine], [r[None, 1:] for r in mine], loss_fn)
        plait.clip_grad_norm(stages, CLIP)
        optimizer.step()
        optimizer.zero_grad()
        mean = torch.tensor([loss], dtype=torch.float64)
        comm.all_reduce(mean, mesh.axis("dp"), purpose=comm.TELEMETRY)
        losses.append(mean.item() / dp)
    return {"losses": losses, "stages": [type(s).__name__ for s in stages]}


def refusal() -> str:
    """pp 2 on a model with no blocks plait can find: the one line a user gets."""

    class MyNet(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    try:
        plait.parallelize(MyNet(), plait.init_mesh(pp=2), plait.ParallelConfig())
    except plait.PlaitError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def main() -> None:
    batches, which = data(), sys.argv[1]
    P = plait.ParallelConfig
    report: dict[str, Any] = {"reference": reference(batches)}
    if which == "small":
        report["reference_tied"] = reference(batches, tied=True)
        report["reference_qwen2"] = reference(batches, family="qwen2")
        report["pp_1f1b"] = piped(batches, P(), "1f1b", {}, pp=2)
        report["pp_interleaved"] = piped(batches, P(), "interleaved", {}, pp=2, virtual_stages=2)
        report["pp_tied"] = piped(batches, P(), "1f1b", {"tied": True}, pp=2)
        report["reference_tied_bias"] = reference(batches, tied=True, head_bias=True)
        report["pp_tied_bias_zero3"] = piped(batches, P(), "1f1b", {"tied": True, "head_bias": True}, pp=2, zero=3)
        report["pp_recompute"] = piped(batches, P(recompute="full"), "1f1b", {}, pp=2)
        report["pp_zb"] = piped(batches, P(), "zb-h1", {}, pp=2)
        report["tp"] = whole(batches, P(), {}, tp=2)
        report["tp_sp"] = whole(batches, P(), {}, tp=2, sp=True)
        report["qwen2_tp"] = whole(batches, P(), {"family": "qwen2"}, tp=2)
        report["tp_tied"] = whole(batches, P(), {"tied": True}, tp=2)
        report["refusal"] = refusal()
    else:
        report["dp_tp_pp_zero1"] = piped(batches, P(), "1f1b", {}, dp=2, tp=2, pp=2, zero=1)
        report["dp_tp_sp_pp_zero3_recompute"] = piped(batches, P(recompute="full"), "1f1b", {"tied": True},
                                                      dp=2, tp=2, pp=2, zero=3, sp=True)
        report["reference_tied"] = reference(batches, tied=True)
    save_report(report)


if __name__ == "__main__":
    main()
