"""The block's element-wise ops, keeping for backward only what backward needs.

Autograd keeps every intermediate an op's backward reads: an RMSNorm computed in fp32 keeps
its input's fp32 copy and the normalised fp32 values beside its output, and silu(gate) · up
keeps silu's output beside gate and up. For a 16-bit Llama block with a 3.25h-wide MLP that
is 14.5h of the 52h bytes a token autograd kept (plait/estimate/activations.py counts each).
Each op here is one autograd function that saves its inputs (and the norm's one fp32 number
a token) and recomputes the rest in backward, as Megatron's and Transformer Engine's fused
kernels do: the same forward, bit for bit, in less memory.

Under torch.compile the plain ops run instead: Inductor's partitioner chooses itself what a
compiled graph keeps for backward (recomputing cheap element-wise work), and the graph stays
the one a model of plain ops compiles to, whatever wraps the block's weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class _RMSNorm(torch.autograd.Function):
    """forward: x / rms(x) in fp32, cast back to x's dtype, times the weight; saves x and
    the fp32 reciprocal rms a token. backward: recomputes x / rms(x) from them."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        wide = x.float()
        rstd = torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (wide * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).float()
            # d/dx of x·r with r = (mean(x²) + eps)^-½: r·(g - x·r · mean(g · x·r))
            grad_x = (rstd * (g - normed * (g * normed).mean(-1, keepdim=True))).to(x.dtype)
        return grad_x, grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x²) + eps) · weight, the rms in fp32 whatever x's dtype."""
    if torch.compiler.is_compiling():
        wide = x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
    return _RMSNorm.apply(x, weight, eps)


class _GatedSiLU(torch.autograd.Function):
    """forward: silu(gate) · up; saves gate and up. backward: recomputes silu(gate), and
    takes silu's derivative from aten's own kernel, so the gradients are autograd's, bit for
    bit."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


def gated_silu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up, SwiGLU's gate, keeping only gate and up for backward."""
    if torch.compiler.is_compiling():
        return F.silu(gate) * up
    return _GatedSiLU.apply(gate, up)
