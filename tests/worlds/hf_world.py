"""A transformers Llama through `plait.parallelize`, on 2 ranks. One spawn, every check.

The model is built from a tiny LlamaConfig (random weights, seeded) on every rank; the
one-process reference trains the same model on the whole batch inside each rank, without
collectives. Then, each on its own mesh over the same 2 processes:

1. tp 2 with a user plan on transformers' module names, attention and MLP marked as
   regions (transformers calls `self_attn(hidden_states=...)`: a keyword input): losses,
   and the tp all-reduces of one backward;
2. the same without regions: every column layer all-reduces its own input gradient;
3. dp 2 (plain data parallelism) and ZeRO-3 × 2, each rank on half of the batch.

The model is called as user code calls it, `model(input_ids=..., labels=...).loss`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import plait
from tests.worldlib import save_report
from tests.worlds.hf_common import train

SEED, STEPS, BATCH, SEQ, LR = 0, 3, 4, 16, 0.5
LAYER = "model.layers.*"
REGIONS = {f"{LAYER}.self_attn": "region", f"{LAYER}.mlp": "region"}
LINEARS = {f"{LAYER}.self_attn.q_proj": "column", f"{LAYER}.self_attn.k_proj": "column",
           f"{LAYER}.self_attn.v_proj": "column", f"{LAYER}.self_attn.o_proj": "row",
           f"{LAYER}.mlp.gate_proj": "column", f"{LAYER}.mlp.up_proj": "column",
           f"{LAYER}.mlp.down_proj": "row"}
torch.set_num_threads(1)


def build() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(SEED)
    return LlamaForCausalLM(config)


def data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (BATCH, SEQ), generator=generator) for _ in range(STEPS)]


def reference(batches: list[torch.Tensor]) -> dict[str, Any]:
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    return train(model, batches, optimizer, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))


def plait_run(batches: list[torch.Tensor], config: Any, **degrees: int) -> dict[str, Any]:
    mesh = plait.init_mesh(**degrees)
    model = plait.parallelize(build(), mesh, config)
    dp, rank = mesh.size("dp"), mesh.rank("dp")
    local = [ids[rank * BATCH // dp: (rank + 1) * BATCH // dp] for ids in batches]
    optimizer = plait.build_optimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
    out = train(model, local, optimizer, lambda: plait.clip_grad_norm(model, 1.0), mesh.ledger)
    out["layers"] = model.config.num_hidden_layers
    return out


def main() -> None:
    batches = data()
    report = {"reference": reference(batches),
              "tp_regions": plait_run(batches, plait.ParallelConfig(tp_plan={**REGIONS, **LINEARS}), tp=2),
              "tp_no_regions": plait_run(batches, plait.ParallelConfig(tp_plan=LINEARS), tp=2),
              "dp": plait_run(batches, plait.ParallelConfig(), dp=2),
              "zero3": plait_run(batches, plait.ParallelConfig(), dp=2, zero=3)}
    save_report(report)


if __name__ == "__main__":
    main()
