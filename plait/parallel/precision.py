"""Mixed precision: the loss scale, and one verdict, shared by every rank, on each step's gradients.

Seed 003's recipe: fp32 master weights and Adam moments, a 16-bit copy of the weights for
forward and backward, 16-bit gradients, and an optimizer that updates the masters from them.
The masters live in ZeRO's optimizer (zero/optim.py) or, without ZeRO, in `MasterOptimizer`
(masters.py); this module holds what both share:

* `LossScaler`: fp16 has 5 exponent bits, so small gradients underflow to zero. The loss is
  multiplied by a scale S before backward (`scale_grad`, identity in forward, so the
  reported loss stays the true loss); the optimizer divides by S again in fp32. S halves
  when a step overflows and doubles after `growth_interval` clean steps, as torch's
  GradScaler does. bf16 and fp32 keep S = 1.
* `StepGuard`: after backward, each rank looks at the gradients it holds (and its loss) for
  a non-finite value; one all-reduce over the whole world turns that into one verdict, so an
  inf on any rank of any tp, pp or dp group skips the step on every rank, or (fp32/bf16
  without --skip-nonfinite) stops every rank with the same message naming the step, the
  first rank and the first parameter that went non-finite. A skipped step leaves
  parameters and optimizer state untouched: the optimizer is simply not stepped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from plait.errors import PlaitError
from plait.rules import check_precision, default_reduce_dtype
from plait.parallel.clip import GradientSquares, clip_grad_norm, gradient_squares, held_gradients
from plait.runtime import comm
from plait.runtime.comm import Axis

__all__ = ["DTYPES", "LossScaler", "StepGuard", "param_dtype", "reduce_dtype_of", "scale_grad"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8": torch.bfloat16}  # fp8: bf16 weights and gradients, float8 products (plait.parallel.fp8)
INITIAL_SCALE = 2.0**16  # torch's GradScaler starts here too
GROWTH_INTERVAL = 1000  # clean steps before the scale doubles (Megatron's window)
NAME_BYTES = 200  # a parameter name travels between ranks as this many code points


def param_dtype(precision: str) -> torch.dtype:
    """The dtype the model's weights, activations and gradients are held in."""
    return DTYPES[precision]


def reduce_dtype_of(precision: str, reduce_dtype: str = "") -> torch.dtype:
    """The dtype gradients are reduced in over dp (`--reduce-dtype`, or the default's)."""
    return DTYPES[reduce_dtype or default_reduce_dtype(precision)]


class _ScaleGrad(torch.autograd.Function):
    """Forward: the loss unchanged. Backward: the incoming gradient times the loss scale."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def scale_grad(loss: torch.Tensor, scale: float) -> torch.Tensor:
    """`loss`, whose backward starts from `scale` instead of 1 (a no-op when scale is 1)."""
    return loss if scale == 1.0 else _ScaleGrad.apply(loss, scale)


@dataclass
class LossScaler:
    """Dynamic loss scaling: halve on overflow, double after `growth_interval` clean steps."""

    scale: float = 1.0
    growth_interval: int = GROWTH_INTERVAL
    dynamic: bool = False
    clean_steps: int = 0
    skipped: int = 0

    @classmethod
    def for_precision(cls, precision: str, initial: float = INITIAL_SCALE) -> "LossScaler":
        return cls(initial, dynamic=True) if precision == "fp16" else cls()

    def update(self, finite: bool) -> None:
        """Record one step's verdict; a non-finite step counts as skipped."""
        if not finite:
            self.skipped += 1
            self.clean_steps = 0
            if self.dynamic:
                self.scale = max(self.scale / 2, 1.0)
            return
        self.clean_steps += 1
        if self.dynamic and self.clean_steps % self.growth_interval == 0:
            self.scale *= 2

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "dynamic": self.dynamic, "clean_steps": self.clean_steps,
                "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a checkpoint's scale and counts. The scale of an fp32 or bf16 checkpoint is
        a fixed 1, which an fp16 run does not take: it keeps its initial scale."""
        if self.dynamic and state.get("dynamic"):
            self.scale = float(state["scale"])
        self.clean_steps, self.skipped = int(state.get("clean_steps", 0)), int(state.get("skipped", 0))


class StepGuard:
    """Everything between backward and the optimizer step that precision decides.

    `clip()` agrees on the verdict over `world`, then unscales and clips (in fp32), or says
    that every rank skips the step, or raises on every rank; the optimizer steps after it.
    """

    def __init__(self, precision: str, world: Axis, device: torch.device, *, skip_nonfinite: bool = False,
                 loss_scale: float = INITIAL_SCALE):
        check_precision(precision)
        self.precision, self.world, self.device, self.skip_nonfinite = precision, world, device, skip_nonfinite
        self.scaler = LossScaler.for_precision(precision, loss_scale)

    def loss_fn(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`loss_fn` whose backward carries the current loss scale (read at each call)."""
        def scaled(*args: Any, **kwargs: Any) -> torch.Tensor:
            loss = loss_fn(*args, **kwargs)
            return scale_grad(loss, self.scaler.scale) if loss.requires_grad else loss
        return scaled

    def clip(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, loss: float | None,
             max_norm: float) -> float | None:
        """Agree with every rank on this step's gradients, then unscale and clip them: the
        gradient norm, or None when every rank skips the step (fp16 overflow, or
        --skip-nonfinite); raises on every rank otherwise. `loss` is None when the step did
        not read it back (`--measure off`): a non-finite loss makes non-finite gradients, so
        the gradients alone still decide. Then `optimizer.step()` (if not None) and
        `after_step`: the loop shows them (plait.train.loop.trainer)."""
        squares = gradient_squares(model)  # read once: the finite check and the norm share it
        bad = "the loss" if loss is not None and not math.isfinite(loss) else first_nonfinite(model, squares)
        verdict = agree_on_nonfinite(bad, self.world, self.device)
        if verdict is not None:
            # fp16 lowers its scale and tries again; at scale 1 lowering is over, and an inf is
            # no overflow of the scale's making: it stops like fp32 (unless told to skip).
            if self.skip_nonfinite or self.scaler.dynamic and self.scaler.scale > 1.0:
                return None
            rank, name = verdict
            raise PlaitError(f"step {step + 1}: {name} went non-finite on rank {rank}",
                             hint="lower --lr or raise --warmup-steps; --skip-nonfinite skips such steps instead")
        if getattr(optimizer, "grad_scale", None) is None:  # fp32 weights, no masters: clip in place
            return clip_grad_norm(model, max_norm, squares)
        # unscale and clip once, in fp32, as the masters take the gradient
        norm = clip_grad_norm(model, math.inf, squares) / self.scaler.scale
        clip = min(1.0, max_norm / (norm + 1e-6)) if max_norm < math.inf else 1.0
        optimizer.grad_scale = clip / self.scaler.scale
        return norm

    def after_step(self, stepped: bool) -> None:
        """The loss scale learns whether the step went through (fp16: halve or, in time, double)."""
        self.scaler.update(stepped)

    def step(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, loss: float | None,
             max_norm: float) -> tuple[float, bool]:
        """`clip`, `optimizer.step()` and `after_step` in one call: (grad norm, stepped)."""
        norm = self.clip(step, model, optimizer, loss, max_norm)
        if norm is not None:
            optimizer.step()
        self.after_step(norm is not None)
        return (math.nan, False) if norm is None else (norm, True)


def named_grads(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, gradient) of what this rank holds, in the model's order: ZeRO's owned shards, or
    every parameter's .grad."""
    return [(name, grad) for name, _, grad, _ in held_gradients(model)]


def first_nonfinite(model: nn.Module, squares: GradientSquares | None = None) -> str | None:
    """'the gradient of <name>' for the first gradient holding an inf or nan, or None.

    A gradient's fp64 sum of squares is non-finite exactly when one of its elements is, so
    the check costs no pass of its own (`squares`, shared with clipping) and one device sync."""
    squares = squares if squares is not None else gradient_squares(model)
    flags = torch.isfinite(squares.values).cpu()
    if bool(flags.all()):
        return None
    return f"the gradient of {squares.names[int((~flags).nonzero()[0])]}"


def agree_on_nonfinite(bad: str | None, world: Axis, device: torch.device) -> tuple[int, str] | None:
    """One verdict for all ranks: None if no rank saw a non-finite value, else the lowest such
    rank and what it saw. One tiny all-reduce a step; a second one carries the name."""
    flag = torch.tensor([-float(world.rank) if bad else -math.inf], dtype=torch.float64, device=device)
    comm.all_reduce(flag, world, op="max", purpose=comm.CONTROL)
    if flag.item() == -math.inf:
        return None
    rank = int(-flag.item())
    text = torch.zeros(NAME_BYTES, dtype=torch.int32, device=device)
    if world.rank == rank:
        codes = [ord(c) for c in bad[:NAME_BYTES]]
        text[:len(codes)] = torch.tensor(codes, dtype=torch.int32)
    comm.all_reduce(text, world, op="max", purpose=comm.CONTROL)
    return rank, "".join(chr(c) for c in text.tolist() if c)
