"""transformers models split by the plans they declare, through plait's API, on 2 ranks. One spawn.

No plan and no adapter from the user: `plait.parallelize` reads the model's own `tp_plan`
and `pp_plan` (plait/models/hf/plans.py). Each family is built from the same seed, trained a
few AdamW steps with gradient accumulation 2 on the same global batches, and compared with
one process training the whole batch:

- Qwen3 (per-head q_norm/k_norm, tied embeddings) and Mistral (a sliding window shorter than
  the sequence), each under tp 2, tp 2 + SP, pp 2 (1F1B) and dp 2 × ZeRO-3: every step's loss
  and the final parameters, gathered whole, and under tp the first step's gradients;
- Phi-3 (fused qkv_proj and gate_up_proj, gathered whole, then row layers that keep their
  slice of a whole input) under tp 2 and tp 2 + SP;
- a Llama under the declared plan and under the hand-written region plan it replaces (the
  old adapter's: attention and MLP marked as regions), with and without SP: the tp bytes of
  every step, which must be the same.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

import plait
from plait.models.hf.plans import declared
from plait.parallel.tensor.layers import shard_of
from plait.parallel.tensor.plan import gather_full_params
from plait.parallel.tensor.ops import all_gather_stacked
from plait.runtime import comm
from tests.worldlib import save_report
from tests.worlds.hf_common import pipeline_steps

SEED, STEPS, BATCH, ACCUM, SEQ, LR = 0, 3, 4, 2, 16, 1e-3
# Adam divides each update by sqrt(v) + eps: a last-bit difference in a near-zero gradient
# (another summation order) moves it by up to lr·δg/eps (tests/parity.py); eps 1e-6 keeps
# that under the parameters' atol where the default 1e-8 lets one element of a Qwen3 o_proj
# drift by 1e-5 under ZeRO-3 and tp alike.
ADAM = dict(lr=LR, weight_decay=0.0, eps=1e-6)
SHAPE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
FAMILIES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=8, tie_word_embeddings=True)),
            "mistral": (MistralConfig, MistralForCausalLM, dict(sliding_window=6)),
            "phi3": (Phi3Config, Phi3ForCausalLM, dict(pad_token_id=0)),
            "llama": (LlamaConfig, LlamaForCausalLM, {})}
LAYER = "model.layers.*"
HAND = {f"{LAYER}.self_attn": "region", f"{LAYER}.mlp": "region",
        **{f"{LAYER}.self_attn.{p}_proj": "column" for p in "qkv"}, f"{LAYER}.self_attn.o_proj": "row",
        f"{LAYER}.mlp.gate_proj": "column", f"{LAYER}.mlp.up_proj": "column", f"{LAYER}.mlp.down_proj": "row"}
HAND_VOCAB = {"model.embed_tokens": "vocab", "lm_head": "column_gather"}  # the old adapter's
HAND_SP = {f"{LAYER}.input_layernorm": "sequence", f"{LAYER}.post_attention_layernorm": "sequence"}
torch.set_num_threads(1)


def build(family: str) -> torch.nn.Module:
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(SEED)
    return model_class(config_class(**SHAPE, **extra))


def hand_vocab(sp: bool = False) -> dict[str, str]:
    """HAND_VOCAB as far as the installed transformers declares it: 5.17 declares no plan for
    the embedding (it stays whole), later releases split its rows. Under SP they read the
    whole sequence ("+whole"): only the blocks run on sequence slices."""
    declared_plan = declared(build("llama"), "tp")
    return {key: style + ("+whole" if sp else "") for key, style in HAND_VOCAB.items() if key in declared_plan}


def data() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (BATCH, SEQ + 1), generator=generator) for _ in range(STEPS)]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def named(params: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    return {name: tensor.detach().flatten().tolist() for name, tensor in params.items()}


def train(model: Any, batches: list[torch.Tensor], optimizer: Any, sync: Any = None, ledger: Any = None,
          grads: Any = None) -> dict[str, Any]:
    """AdamW steps, each over ACCUM micro-batches (loss / ACCUM), as user code calls the model.
    `sync`: a context for all but the last micro-batch (plait.no_sync under dp). `grads`:
    what gives the first step's gradients, whole (Adam's update hides a gradient's scale, so
    a gradient summed twice over tp would leave the parameters as they should be)."""
    losses, tp_bytes, first = [], [], {}
    for rows in batches:
        before, micro = ledger.snapshot() if ledger else None, rows.chunk(ACCUM)
        total = 0.0
        for i, part in enumerate(micro):
            with sync(model) if sync and i < len(micro) - 1 else contextlib.nullcontext():
                loss = loss_fn(model(input_ids=part[:, :-1]).logits, part[:, 1:])
                (loss / len(micro)).backward()
            total += loss.item() / len(micro)
        if grads is not None and not first:
            first = named(grads())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
        tp_bytes.append(ledger.since(before).get("tp", {}) if ledger else {})
    return {"losses": losses, "tp_bytes": tp_bytes, "grads": first}


def reference(batches: list[torch.Tensor], family: str) -> dict[str, Any]:
    model = build(family)
    grads = lambda: {name: param.grad for name, param in model.named_parameters()}  # noqa: E731
    out = train(model, batches, torch.optim.AdamW(model.parameters(), **ADAM), grads=grads)
    return {**out, "params": named(dict(model.named_parameters()))}


def tensor_parallel(batches: list[torch.Tensor], family: str, plan: dict[str, str] | None = None,
                    **layout: Any) -> dict[str, Any]:
    mesh = plait.init_mesh(tp=2, **layout)
    model = plait.parallelize(build(family), mesh, plait.ParallelConfig(tp_plan=plan))
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, **ADAM)
    out = train(model, batches, optimizer, ledger=mesh.ledger, grads=lambda: whole_grads(model, mesh))
    whole = gather_full_params(model, purpose=comm.TELEMETRY)  # a collective: every rank gathers
    return {**out, "params": named(whole) if mesh.rank("tp") == 0 else {}}


def zero3(batches: list[torch.Tensor], family: str) -> dict[str, Any]:
    """dp 2 × ZeRO-3: each rank trains its half of every global batch; the dp-mean loss."""
    mesh = plait.init_mesh(dp=2, zero=3)
    model = plait.parallelize(build(family), mesh, plait.ParallelConfig())
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, **ADAM)
    out = train(model, [rows.chunk(2)[mesh.rank("dp")] for rows in batches], optimizer, sync=plait.no_sync)
    out["losses"] = [dp_mean(loss, mesh) for loss in out["losses"]]
    with plait.full_parameters(model):
        out["params"] = named(dict(model.named_parameters())) if mesh.rank("dp") == 0 else {}
    return out


def pipelined(batches: list[torch.Tensor], family: str) -> dict[str, Any]:
    """pp 2 with 1F1B: the ACCUM micro-batches of a step are the pipeline's; each rank reports
    the parameters its stages hold, by the whole model's names."""
    mesh = plait.init_mesh(pp=2, schedule="1f1b")
    stages = plait.parallelize(build(family), mesh, plait.ParallelConfig())
    optimizer = plait.build_optimizer(stages, torch.optim.AdamW, **ADAM)
    out = pipeline_steps(stages, mesh, batches, ACCUM, loss_fn, optimizer)
    return {"losses": out["losses"], "params": named(out["held"])}


def whole_grads(model: torch.nn.Module, mesh: Any) -> dict[str, torch.Tensor]:
    """Every parameter's gradient, tensor-parallel slices joined (no autograd, telemetry)."""
    out = {}
    for name, param in model.named_parameters():
        shard = shard_of(param)
        grad = param.grad.detach()
        out[name] = shard.join(all_gather_stacked(grad, mesh.axis("tp"), comm.TELEMETRY)) if shard else grad
    return out


def dp_mean(value: float, mesh: Any) -> float:
    mean = torch.tensor([value], dtype=torch.float64)
    comm.all_reduce(mean, mesh.axis("dp"), purpose=comm.TELEMETRY)
    return mean.item() / mesh.size("dp")


def main() -> None:
    batches = data()
    report: dict[str, Any] = {}
    for family in ("qwen3", "mistral"):
        report[family] = {"reference": reference(batches, family), "tp": tensor_parallel(batches, family),
                          "tp_sp": tensor_parallel(batches, family, sp=True), "pp": pipelined(batches, family),
                          "zero3": zero3(batches, family)}
    report["phi3"] = {"reference": reference(batches, "phi3"), "tp": tensor_parallel(batches, "phi3"),
                      "tp_sp": tensor_parallel(batches, "phi3", sp=True)}
    report["llama"] = {"reference": reference(batches, "llama"),
                       "declared": tensor_parallel(batches, "llama"),
                       "hand": tensor_parallel(batches, "llama", {**HAND, **hand_vocab()}),
                       "declared_sp": tensor_parallel(batches, "llama", sp=True),
                       "hand_sp": tensor_parallel(batches, "llama", {**HAND, **HAND_SP, **hand_vocab(sp=True)},
                                                  sp=True)}
    save_report(report)


if __name__ == "__main__":
    main()
