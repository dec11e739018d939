"""fp32 master weights for 16-bit parameters, without ZeRO (DDP, TP, PP and their products).

ZeRO keeps its masters in its sharded optimizer (zero/optim.py). Without ZeRO every rank
holds whole (or tensor-parallel) parameters, so the masters are simply one fp32 copy per
parameter: `MasterOptimizer` builds the user's optimizer over those copies and, at each
step, hands it the 16-bit gradients in fp32 (times `grad_scale`: the loss scale's inverse
and the clipping factor, applied once, in fp32), steps, and rounds the masters back into
the 16-bit parameters. Its memory is seed 003's: 2 (weights) + 2 (gradients) + 12 (master,
Adam m and v) bytes per parameter.

To checkpoints, a master is one more optimizer state of its parameter ("master", beside
"exp_avg"), so `checkpoint.param_pieces` writes and loads it as it does Adam's moments.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from plait.parallel.compiled_update import CompiledAdamW, Slot
from plait.parallel.data.sync import grad_sync


def step_scaled(inner: torch.optim.Optimizer, grads: list[torch.Tensor], scale: float, fold: bool = True) -> None:
    """`inner.step()` on `grads` times `scale` (the loss scale's inverse and the clip factor);
    `fold=False` when `inner` also steps gradients that must not be scaled.

    torch's fused Adam, AdamW and SGD divide each gradient by a `grad_scale` tensor in the
    same pass that reads it for the update (GradScaler's hook): the scale costs no pass of
    its own there. Any other optimizer gets one multi-tensor multiply first. Dividing by
    1/scale in fp32 rounds differently from multiplying by scale, by an fp32 ulp of the
    gradient: far below what the update's own arithmetic rounds away.
    """
    if scale == 1.0:
        inner.step()
    elif fold and _folds_grad_scale(inner) and grads:
        inner.grad_scale = torch.full((), 1.0 / scale, dtype=torch.float32, device=grads[0].device)
        try:
            inner.step()
        finally:
            del inner.grad_scale
    else:
        torch._foreach_mul_(grads, scale)
        inner.step()


def _folds_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """torch's fused kernels of Adam, AdamW and SGD take a gradient scale."""
    fused = isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD))
    return fused and all(group.get("fused") for group in optimizer.param_groups)


class _MasterState(Mapping):
    """`optimizer.state` keyed by the model's parameters: the inner state of each master, plus
    the master itself. Read live, so loading into these tensors loads the optimizer."""

    def __init__(self, owner: "MasterOptimizer"):
        self.owner = owner

    def __getitem__(self, param: nn.Parameter) -> dict[str, Any]:
        master = self.owner.masters[param]
        return {**self.owner.inner.state[master], "master": master}

    def __iter__(self) -> Iterator[nn.Parameter]:
        return (p for p, m in self.owner.masters.items() if m in self.owner.inner.state)

    def __len__(self) -> int:
        return len(self.owner.inner.state)


class MasterOptimizer(torch.optim.Optimizer):
    """`optimizer_class` stepping fp32 masters of 16-bit parameters; looks like any optimizer."""

    def __init__(self, groups: list[dict[str, Any]], optimizer_class: type[torch.optim.Optimizer],
                 compiled_update: bool = False, **kwargs: Any):
        self.masters: dict[nn.Parameter, nn.Parameter] = {}
        for group in groups:
            for param in group["params"]:
                self.masters[param] = nn.Parameter(param.detach().to(torch.float32, copy=True))
        inner_groups = [{**g, "params": [self.masters[p] for p in g["params"]]} for g in groups]
        self.inner = optimizer_class(inner_groups, **kwargs)
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.param_groups = self.inner.param_groups
        self.state = _MasterState(self)  # type: ignore[assignment]
        self.grad_scale = 1.0  # set by precision.StepGuard before each step
        self.compiled = CompiledAdamW(self.inner) if compiled_update else None  # --optimizer-kernel compiled

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.compiled is not None and self.compiled.step(
                [Slot(master, param, param.grad) for param, master in self.masters.items()], self.grad_scale):
            self.grad_scale = 1.0
            return loss
        for param, master in self.masters.items():
            master.grad = None if param.grad is None else param.grad.to(torch.float32, copy=True)
        step_scaled(self.inner, [m.grad for m in self.masters.values() if m.grad is not None], self.grad_scale)
        params, masters = list(self.masters), list(self.masters.values())
        torch._foreach_copy_(params, masters)  # rounded back into the 16-bit weights, one multi-tensor pass
        for master in masters:
            master.grad = None
        self.grad_scale = 1.0
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param in self.masters:
            param.grad = None

    def refresh(self) -> None:
        """Masters from the parameters, e.g. after weights were loaded into the model only."""
        with torch.no_grad():
            for param, master in self.masters.items():
                master.copy_(param)

    def model_state_tensors(self, model: nn.Module) -> dict[str, list[torch.Tensor]]:
        """The meter's view: 16-bit weights and gradients; masters and Adam state as optimizer."""
        params = list(model.parameters())
        states = [v for s in self.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
        sync = grad_sync(model)
        buckets = [b.flat for b in sync.buckets if b.flat is not None] if sync is not None else []
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None] + buckets,
                "optim": states + list(self.masters.values())}
