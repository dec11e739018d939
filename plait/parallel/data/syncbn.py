"""Synchronised BatchNorm: normalise with the statistics of the whole global batch.

A BatchNorm layer under plain data parallelism normalises each rank's micro-batch with that
micro-batch's own mean and variance: with small per-rank batches these are noisy, and the
model trained is not the one a single process with the whole batch would train. Here every
rank sends three things per layer through one all-reduce over the dp group:

    forward   [Σx (C), Σ(x−K)² (C), count (1)]       (2C + 1) fp32 values
    backward  [Σ dy (C), Σ dy·x̂ (C)]                 2C fp32 values

so the ledger shows 2(n−1)/n·(2C+1)·4 B forward and 2(n−1)/n·2C·4 B backward per layer per
micro-batch. K is the layer's running mean (identical on every rank, since the running
statistics are computed from the same global numbers): subtracting it before squaring keeps
the variance accurate when the mean is large (E[x²] − E[x]² cancels badly in fp32).

The backward is BatchNorm's, with the sums taken over the global batch:
dx = w·invstd·(dy − Σdy/M − x̂·Σ(dy·x̂)/M), M the global count. Each rank gets the gradient
of its own loss; data parallelism then averages, as for every other parameter.

torch's nn.SyncBatchNorm needs CUDA; this one runs on any backend, Gloo included.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from plait.runtime import comm
from plait.runtime.comm import Axis


class SyncBatchNormFunction(torch.autograd.Function):
    """Forward: all-reduce the batch sums, normalise. Backward: all-reduce Σdy and Σdy·x̂."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                shift: torch.Tensor, eps: float, axis: Axis) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dims = [d for d in range(x.dim()) if d != 1]
        shape = [1, -1] + [1] * (x.dim() - 2)
        xf = x.float()
        centred = xf - shift.view(shape)
        count = torch.tensor([x.numel() / x.shape[1]], dtype=torch.float32, device=x.device)
        packed = torch.cat([centred.sum(dims), centred.pow(2).sum(dims), count])
        comm.all_reduce(packed, axis)
        channels = x.shape[1]
        total = packed[-1]
        mean_c = packed[:channels] / total  # mean of x − K
        var = (packed[channels:2 * channels] / total - mean_c.pow(2)).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        x_hat = (centred - mean_c.view(shape)) * invstd.view(shape)
        out = x_hat
        if weight is not None:
            out = out * weight.float().view(shape) + bias.float().view(shape)
        ctx.save_for_backward(x_hat, invstd, weight)
        ctx.axis, ctx.total, ctx.dims, ctx.shape = axis, total.item(), dims, shape
        mean = mean_c + shift
        ctx.mark_non_differentiable(mean, var)
        return out.to(x.dtype), mean, var

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor, _mean: Any, _var: Any) -> tuple[Any, ...]:
        x_hat, invstd, weight = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        dy = grad_out.float()
        local = torch.cat([dy.sum(dims), (dy * x_hat).sum(dims)])
        grad_weight = local[x_hat.shape[1]:].clone() if weight is not None else None  # this rank's own
        grad_bias = local[:x_hat.shape[1]].clone() if weight is not None else None
        comm.all_reduce(local, ctx.axis)
        channels = x_hat.shape[1]
        sum_dy, sum_dy_xhat = local[:channels] / ctx.total, local[channels:] / ctx.total
        scale = invstd if weight is None else invstd * weight.float()
        grad_x = scale.view(shape) * (dy - sum_dy.view(shape) - x_hat * sum_dy_xhat.view(shape))
        cast = (lambda g: g.to(weight.dtype)) if weight is not None else (lambda g: g)
        return (grad_x.to(grad_out.dtype), cast(grad_weight) if grad_weight is not None else None,
                cast(grad_bias) if grad_bias is not None else None, None, None, None)


class SyncBatchNorm(_BatchNorm):
    """A BatchNorm (any of 1d/2d/3d) whose training statistics span the dp group `axis`.

    Same parameters, buffers and state_dict names as torch's BatchNorm, so checkpoints move
    freely between a run with --sync-bn and one without. In eval mode, or without running
    statistics to update when not training, it is an ordinary BatchNorm.
    """

    def __init__(self, num_features: int, axis: Axis, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, **kwargs: Any):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, **kwargs)
        self.axis = axis

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training and self.track_running_stats:
            return super().forward(x)
        shift = self.running_mean.float() if self.running_mean is not None else x.new_zeros(x.shape[1], dtype=torch.float32)
        out, mean, var = SyncBatchNormFunction.apply(x, self.weight, self.bias, shift.detach(), self.eps, self.axis)
        if self.training and self.track_running_stats:
            self._update_running(mean.detach(), var.detach(), x.numel() / x.shape[1] * self.axis.size)
        return out

    @torch.no_grad()
    def _update_running(self, mean: torch.Tensor, var: torch.Tensor, count: float) -> None:
        """running ← (1 − m)·running + m·batch, with the unbiased variance, as torch does."""
        self.num_batches_tracked.add_(1)
        factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        unbiased = var * count / max(count - 1, 1)
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(unbiased.to(self.running_var.dtype), alpha=factor)


def convert_sync_batchnorm(model: nn.Module, axis: Axis) -> int:
    """Replace every BatchNorm of `model` by a SyncBatchNorm over `axis` (in place), keeping
    its parameter and buffer objects, so an optimizer built before or after sees the same
    tensors. Returns how many layers were converted."""
    converted = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _BatchNorm) and not isinstance(child, SyncBatchNorm):
                parent._modules[name] = _sync_copy(child, axis)
                converted += 1
    return converted


def _sync_copy(bn: _BatchNorm, axis: Axis) -> SyncBatchNorm:
    sync = SyncBatchNorm(bn.num_features, axis, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                         device="meta")
    for name, param in bn.named_parameters(recurse=False):
        sync._parameters[name] = param
    for name, buffer in bn.named_buffers(recurse=False):
        sync._buffers[name] = buffer
    sync.train(bn.training)
    return sync


def sync_bn_wire_bytes(channels: int, n: int) -> tuple[float, float]:
    """Ring wire bytes per rank of one SyncBatchNorm layer per micro-batch: (forward, backward)."""
    return (comm.ring_wire_bytes("all_reduce", (2 * channels + 1) * 4, n),
            comm.ring_wire_bytes("all_reduce", 2 * channels * 4, n))
