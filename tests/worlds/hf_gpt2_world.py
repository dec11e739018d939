"""A transformers GPT-2 through `plait.parallelize`, on 2 ranks. One spawn, every check.

The model is built from a tiny GPT2Config (random weights, seeded, no dropout) on every
rank; the one-process reference trains the same model on the whole batch inside each rank,
without collectives. Then, each on its own mesh over the same 2 processes:

1. tp 2 with the GPT-2 adapter's plan (Conv1D layers, the fused q|k|v split "column:3",
   attention and MLP as regions): losses, the gathered final parameters and those a
   checkpoint holds, the tp all-reduces of one backward, and the whole logits
   `model(input_ids=...)` returns;
2. where the seam provides them (see PIPELINE and SEQUENCE below): tp 2 with sequence
   parallelism, and pp 2 (1F1B, and interleaved over the 4 blocks) driven by PipelineRunner,
   each against the same reference;
3. dp 2 (plain data parallelism), ZeRO-3 × 2 (the blocks as units), and ZeRO-3 × 2 with
   every block recomputed in backward, each rank on half the batch.

Argument "3d" (8 ranks, where the seam provides the pipeline cut): dp 2 × tp 2 × pp 2 with
ZeRO-1, and nothing else.

The model is called as user code calls it, `model(input_ids=..., labels=...).loss`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import plait
from plait.models.hf.gpt2 import GPT2Adapter
from plait.parallel import seam
from plait.parallel.tensor.plan import gather_full_params
from plait.parallel.tensor import regions
from plait.runtime import comm
from plait.train.checkpoint.write import save
from plait.train.checkpoint.read import Reader, model_weights
from tests.worldlib import save_report
from tests.worlds.hf_common import train

SEED, STEPS, BATCH, SEQ, LR, VOCAB = 0, 3, 4, 16, 0.5, 128
LAYERS = 4  # interleaved pp 2 with 2 virtual stages: one block per stage
ADAPTER = GPT2Adapter()
PIPELINE = hasattr(seam, "Parts")  # the pipeline cuts any model through its adapter's parts
SEQUENCE = hasattr(regions, "gather_to_replicated")  # SP around the block stack
torch.set_num_threads(1)


def build() -> GPT2LMHeadModel:
    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=LAYERS, n_head=4, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(SEED)
    return GPT2LMHeadModel(config)


def data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def reference(batches: list[torch.Tensor]) -> tuple[dict[str, Any], GPT2LMHeadModel]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    out = train(model, batches, optimizer, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    return out, model


def parallelize(config: plait.ParallelConfig, **degrees: int) -> tuple[torch.nn.Module, Any]:
    mesh = plait.init_mesh(**degrees)
    model = plait.parallelize(build(), mesh, config, adapter=ADAPTER)
    if mesh.size("tp") > 1:  # done once per model: a no-op where apply_tensor_parallel called it
        ADAPTER.after_tensor_parallel(model, mesh.axis("tp"), mesh.layout.sp)
    return model, mesh


def plait_run(batches: list[torch.Tensor], config: plait.ParallelConfig, **degrees: int) -> dict[str, Any]:
    model, mesh = parallelize(config, **degrees)
    dp, rank = mesh.size("dp"), mesh.rank("dp")
    local = [ids[rank * BATCH // dp: (rank + 1) * BATCH // dp] for ids in batches]
    optimizer = plait.build_optimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
    out = train(model, local, optimizer, lambda: plait.clip_grad_norm(model, 1.0), mesh.ledger)
    out["layers"] = model.config.n_layer
    out["recomputed_blocks"] = sum(type(block) is not GPT2Block for block in model.transformer.h)
    out["model"], out["optimizer"], out["mesh"] = model, optimizer, mesh
    return out


def max_rel(params: dict[str, torch.Tensor], trained: torch.nn.Module) -> float:
    """The largest difference from the one-process model's parameters, each tensor to its scale."""
    ref = dict(trained.named_parameters())
    assert sorted(params) == sorted(ref), sorted(set(params) ^ set(ref))
    return max(((params[n] - p).abs().max() / p.abs().max()).item() for n, p in ref.items())


def saved(model: torch.nn.Module, optimizer: Any, mesh: Any, trained: torch.nn.Module, name: str) -> float:
    """Save a checkpoint, read its weights back whole: how far they are from `trained`'s."""
    root = Path(os.environ["PLAIT_TEST_OUT"]) / name
    return max_rel(model_weights(Reader(save(root, STEPS, model, optimizer, mesh, {}))), trained)


def tensor_parallel(batches: list[torch.Tensor], trained: GPT2LMHeadModel, sp: bool = False) -> dict[str, Any]:
    """tp 2: before training, the logits are whole and equal; after, the parameters are."""
    config = plait.ParallelConfig(tp_plan=ADAPTER.tensor_plan(build(), 2, sp))
    model, _ = parallelize(config, tp=2, sp=sp)
    with torch.no_grad():
        logits = model(input_ids=batches[0]).logits
        dense = build()(input_ids=batches[0]).logits
    out = plait_run(batches, config, tp=2, sp=sp)
    trained_model, optimizer, mesh = out.pop("model"), out.pop("optimizer"), out.pop("mesh")
    out["param_max_rel"] = max_rel(gather_full_params(trained_model), trained)
    out["checkpoint_max_rel"] = saved(trained_model, optimizer, mesh, trained, f"ckpt-tp-sp{int(sp)}")
    out["logits_shape"] = list(logits.shape)
    out["logits_max_diff"] = (logits - dense).abs().max().item()
    out["c_attn_local"] = list(model.transformer.h[0].attn.c_attn.weight.shape)
    return out


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What `labels=ids` computes: each position predicts the next id."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def pipelined(batches: list[torch.Tensor], trained: torch.nn.Module, config: plait.ParallelConfig,
              schedule: str = "1f1b", **degrees: int) -> dict[str, Any]:
    """This rank's stages under `schedule`, one sequence per micro-batch (wte and the tied
    head on different ranks); each dp rank on its share of the batch, the dp-mean loss per step."""
    mesh = plait.init_mesh(schedule=schedule, **degrees)
    stages = plait.parallelize(build(), mesh, config, adapter=ADAPTER)
    optimizer = plait.build_optimizer(stages, torch.optim.SGD, lr=LR, momentum=0.9)
    runner = plait.PipelineRunner(stages, mesh, schedule)
    dp, rank = mesh.size("dp"), mesh.rank("dp")
    losses = []
    for ids in batches:
        rows = list(ids.chunk(dp)[rank].split(1))
        mean = torch.tensor([runner.step(rows, rows, next_token_loss)], dtype=torch.float64)
        plait.clip_grad_norm(stages, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        comm.all_reduce(mean, mesh.axis("dp"), purpose=comm.TELEMETRY)
        losses.append(mean.item() / dp)
    name = f"ckpt-{schedule}-" + "-".join(f"{axis}{size}" for axis, size in degrees.items())
    return {"losses": losses, "checkpoint_max_rel": saved(stages, optimizer, mesh, trained, name)}


def main() -> None:
    batches = data()
    ref, trained = reference(batches)
    if sys.argv[1:] == ["3d"]:  # 8 ranks
        save_report({"reference": ref, "3d": pipelined(batches, trained, plait.ParallelConfig(), dp=2, tp=2, pp=2, zero=1)})
        return
    report = {"reference": ref, "tp": tensor_parallel(batches, trained),
              "tp_sp": tensor_parallel(batches, trained, sp=True) if SEQUENCE else None,
              "pp": pipelined(batches, trained, plait.ParallelConfig(), pp=2) if PIPELINE else None,
              "pp_interleaved": pipelined(batches, trained, plait.ParallelConfig(), "interleaved",
                                          pp=2, virtual_stages=2) if PIPELINE else None}
    for name, config, zero in (("dp", plait.ParallelConfig(), 0), ("zero3", plait.ParallelConfig(), 3),
                               ("zero3_recompute", plait.ParallelConfig(recompute="full"), 3)):
        report[name] = plait_run(batches, config, dp=2, zero=zero)
        for key in ("model", "optimizer", "mesh"):
            report[name].pop(key)
    save_report(report)


if __name__ == "__main__":
    main()
