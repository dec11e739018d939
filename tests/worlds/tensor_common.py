"""Pieces shared by the tensor-parallel world scripts: data, training loops, the native plan.

Every rank of a TP group sees the same batch, so the one-process reference is computed
inside the world, on each rank, with no collectives at all.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.gpt.config import GPTConfig
from plait.models.gpt.model import build_gpt

SEED, STEPS, LR = 0, 3, 0.5


def batches(config: GPTConfig, batch: int, seq: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, config.vocab_size, (batch, seq), generator=generator),
             torch.randint(0, config.vocab_size, (batch, seq), generator=generator)) for _ in range(steps)]


def train(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], loss_fn: Callable[..., torch.Tensor],
          clip: Callable[[], torch.Tensor], ledger: Any = None, context: Callable[[], Any] = contextlib.nullcontext,
          ) -> dict[str, Any]:
    """A few SGD steps with clipping; losses, grad norms and the first step's traffic.

    SGD, not AdamW: Adam divides each update by sqrt(v), so a component whose gradient is
    ~0 turns a last-bit difference (TP sums matmuls in another order) into an lr-sized one
    (up to 1e-5 here, torch's own tensor_parallel likewise). SGD keeps the parameters'
    error proportional to the gradients', which is what the parity is about.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, norms, traffic = [], [], None
    for step, (inputs, targets) in enumerate(data):
        before = ledger.snapshot() if ledger else None
        with context():
            loss = loss_fn(model(inputs), targets)
            loss.backward()
        if ledger and step == 0:
            traffic = ledger.since(before)
        norms.append(float(clip()))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()))
    return {"losses": losses, "grad_norms": norms, "traffic": traffic}


def reference(config: GPTConfig, data: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[dict[str, Any], nn.Module]:
    model = build_gpt(config, SEED)
    run = train(model, data, lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()),
                lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    return run, model


def param_error(full: dict[str, torch.Tensor], model: nn.Module, rtol: float = 1e-4,
                atol: float = 1e-6) -> dict[str, float]:
    """How far gathered parameters are from the reference model's.

    "scale": largest |a − b| / max|b| of any tensor; "excess": largest |a − b| / (atol + rtol·|b|)
    of any element (≤ 1 means torch.testing.assert_close(rtol, atol) passes).
    """
    scale = excess = 0.0
    for name, ref in model.named_parameters():
        diff = (full[name] - ref.detach()).abs()
        scale = max(scale, (diff.max() / ref.detach().abs().max()).item())
        excess = max(excess, (diff / (atol + rtol * ref.detach().abs())).max().item())
    return {"scale": scale, "excess": excess}


def close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def native_plan(config: GPTConfig, sp: bool) -> dict[str, Any]:
    """torch.distributed.tensor.parallel's version of GPT_PLAN (torchtitan's Llama plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    seq = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sp:
        plan["norm"] = SequenceParallel()
    for i in range(config.n_layers):
        block = f"blocks.{i}."
        plan.update({
            block + "attn": PrepareModuleInput(input_layouts=(seq, None, None),
                                               desired_input_layouts=(Replicate(), None, None)),
            block + "attn.q_proj": ColwiseParallel(), block + "attn.k_proj": ColwiseParallel(),
            block + "attn.v_proj": ColwiseParallel(), block + "attn.o_proj": RowwiseParallel(output_layouts=seq),
            block + "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            block + "mlp.gate_proj": ColwiseParallel(), block + "mlp.up_proj": ColwiseParallel(),
            block + "mlp.down_proj": RowwiseParallel(output_layouts=seq),
        })
        if sp:
            plan.update({block + "attn_norm": SequenceParallel(), block + "mlp_norm": SequenceParallel()})
    return plan


def build_native(config: GPTConfig, device_mesh: Any, sp: bool) -> nn.Module:
    from torch.distributed.tensor.parallel import parallelize_module

    model = build_gpt(config, SEED)
    parallelize_module(model, device_mesh, native_plan(config, sp))
    if config.tie_embeddings:  # both halves are Shard(0) of the same table: tie them again
        model.lm_head.weight = model.embed.weight
    return model


def native_clip(model: nn.Module, max_norm: float = 1.0) -> torch.Tensor:
    """clip_grad_norm_ for a model mixing DTensor and plain parameters (torch's refuses the mix)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in full]))
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    for grad in grads:
        grad.mul_(coef)
    return total


def native_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
