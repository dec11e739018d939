"""A transformers model under tensor × pipeline parallelism, from the plans it declares.

    plait launch --nproc 4 examples/hf_tp_pp.py                  # tp 2 × pp 2 (or torchrun)
    plait launch --nproc 1 examples/hf_tp_pp.py --tp 1 --pp 1    # one process: the same losses

A small Qwen3 built from its config (no download): transformers declares how its layers split
(`model.tp_plan`) and where a pipeline may cut it (`model.pp_plan`), and `plait.parallelize`
reads both, so the model needs no plan or adapter from you. With pp > 1 `parallelize` returns
this rank's pipeline stages, and a `PipelineRunner` runs the schedule (1F1B) over the step's
micro-batches; with pp = 1 the loop is the plain one. Rank 0 prints each step's loss.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3ForCausalLM

import plait

STEPS, MICRO_BATCHES, BATCH, SEQ, SEED = 4, 2, 2, 16, 0


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each position predicts the next token (what `labels=ids` computes)."""
    logits = getattr(logits, "logits", logits)  # a pipeline stage returns the tensor, the model an output
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()

    mesh = plait.init_mesh(tp=args.tp, pp=args.pp, schedule="1f1b")
    torch.manual_seed(SEED)  # every rank builds the same whole model, then keeps its part
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    model = plait.parallelize(Qwen3ForCausalLM(config), mesh)
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, lr=1e-3)
    runner = plait.PipelineRunner(model, mesh) if mesh.size("pp") > 1 else None
    data = torch.randint(0, 256, (STEPS, MICRO_BATCHES, BATCH, SEQ), generator=torch.Generator().manual_seed(SEED))
    for step, micro_batches in enumerate(data):
        if runner is not None:  # the schedule runs every micro-batch's forward and backward
            loss = runner.step(list(micro_batches), list(micro_batches), next_token_loss)
        else:
            loss = 0.0
            for ids in micro_batches:
                micro = next_token_loss(model(input_ids=ids), ids) / MICRO_BATCHES
                micro.backward()
                loss += micro.item()
        plait.clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if mesh.is_main:
            print(f"step {step + 1} loss {loss:.6f}", flush=True)
    mesh.close()


if __name__ == "__main__":
    main()
