"""The block's element-wise ops, keeping for backward only what backward needs.

Autograd keeps every intermediate an op's backward reads: an RMSNorm computed in fp32 keeps
its input's fp32 copy and the normalised fp32 values beside its output, and silu(gate) · up
keeps silu's output beside gate and up. For a 16-bit Llama block with a 3.25h-wide MLP that
is 14.5h of the 52h bytes a token autograd kept (plait/estimate/activations.py counts each).
Each op here is one autograd function that saves its inputs (and the norm's one fp32 number
a token) and recomputes the rest in backward, as Megatron's and Transformer Engine's fused
kernels do: the same forward, bit for bit, in less memory.

The down projection keeps its input, the gated product, for its weight's gradient: another
f values a token (6.5h of a Llama block's 32.25h). `gated_down` keeps gate and up in its
place, which the gate's own backward keeps anyway, and makes the product again when the down
projection's backward asks for it: silu(gate), which the gate's own backward then reads
rather than making it again, and one multiplication, where keeping it cost a fifth of the
block's bytes.

Under torch.compile the plain ops run instead: Inductor's partitioner chooses itself what a
compiled graph keeps for backward (recomputing cheap element-wise work), and the graph stays
the one a model of plain ops compiles to, whatever wraps the block's weights.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils import checkpoint

from plait.parallel.saved import REMADE, handed_back


def asked(ctx: Any, index: int) -> bool:
    """Whether the backward running now asks for input `index`'s gradient. `needs_input_grad`
    says only whether it may: it is fixed at forward. A backward asked for some gradients alone
    (ZB-H1's I, the input's; its W, the weights': parallel/pipeline/execute.py) would compute
    the others too, and throw them away: each norm's backward ran twice whole under ZB-H1. The
    engine says whether it will run the node that gradient goes to."""
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    try:
        return node is None or torch._C._will_engine_execute_node(node)
    except RuntimeError:  # no graph task the engine can answer for: compute it, as before
        return True


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
        if asked(ctx, 1):
            grad_weight = (grad * normed.to(x.dtype)).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        grad_x = None
        if asked(ctx, 0):
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


class _SiluOnce:
    """silu(gate) as the down projection's backward made it again for the product, handed to
    the gate's own backward, which runs next and needs it too: made once, not twice. Left
    empty once the gate's backward has run (a deferred weight gradient remakes the product
    after it). Held until the graph goes where that backward never runs (a gradient asked of
    down's weights alone), and never made while backward builds a graph (create_graph: a
    value made without one would drop silu's own derivative from it)."""

    __slots__ = ("value", "spent")

    def __init__(self) -> None:
        self.value: torch.Tensor | None = None
        self.spent = False


class _GatedSiLU(torch.autograd.Function):
    """forward: silu(gate) · up; saves gate and up. backward: recomputes silu(gate) (or takes
    it from `slot`, where the down projection's backward made it), and takes silu's
    derivative from aten's own kernel, so the gradients are autograd's, bit for bit."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, slot: _SiluOnce | None) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.slot = slot
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        gate, up = ctx.saved_tensors
        made, slot = None, ctx.slot
        if slot is not None:
            made, slot.value, slot.spent = slot.value, None, True
        if torch.is_grad_enabled():  # create_graph: silu(gate) must carry its own graph
            made = None
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * (F.silu(gate) if made is None else made) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up, None


def gated_silu(gate: torch.Tensor, up: torch.Tensor, slot: _SiluOnce | None = None) -> torch.Tensor:
    """silu(gate) · up, SwiGLU's gate, keeping only gate and up for backward."""
    if torch.compiler.is_compiling():
        return F.silu(gate) * up
    return _GatedSiLU.apply(gate, up, slot)


class _Product(NamedTuple):
    """What the down projection's save of the gated product (or of a view of it: a linear
    flattens its input's leading dims) holds instead: gate and up, detached (a saved output
    holding its own grad_fn is a cycle no collector sees) and as the hooks in place outside
    keep them (`opened` gives them back: an offloading hook's copies, not the device's), and
    the view's geometry."""

    gate: Any
    up: Any
    opened: Callable[[Any], torch.Tensor]
    silu: _SiluOnce
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    @classmethod
    def of(cls, view: torch.Tensor, gate: Any, up: Any, opened: Callable[[Any], torch.Tensor],
           silu: _SiluOnce) -> _Product:
        return cls(gate, up, opened, silu, tuple(view.size()), tuple(view.stride()), view.storage_offset())

    def rebuilt(self) -> torch.Tensor:
        """silu(gate) · up again, the forward's own ops on the same values (bit for bit), as
        the view that was saved; silu(gate) left for the gate's backward, unless it has run
        (or this backward builds a graph: `_SiluOnce`)."""
        share = not self.silu.spent and not torch.is_grad_enabled()
        with torch.no_grad():
            silu = F.silu(self.opened(self.gate))
            if share:
                self.silu.value = silu
            return (silu * self.opened(self.up)).as_strided(self.size, self.stride, self.offset)


def gated_down(down: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) · up), where down's backward gets the product made again from gate and
    up rather than kept (module docstring). Whatever else down saves (its weight, an fp8 copy)
    goes to the hooks already in place (a meter's, the pipeline's), as it would without this.
    Compiled, Inductor chooses what to keep; under full recomputation the block's checkpoint
    keeps nothing of it anyway."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or _checkpointing():
        return product_kept(down, gate, up)
    silu = _SiluOnce()
    product = gated_silu(gate, up, silu)
    if not product.requires_grad:
        return down(product)
    gate, up = gate.detach(), up.detach()
    # for a recorder that would keep down's input itself (parallel.saved.REMADE), while down runs
    setattr(product, REMADE, _Product.of(product, gate, up, _itself, silu).rebuilt)
    try:
        with _product_remade(product, gate, up, silu):
            return down(product)
    finally:
        delattr(product, REMADE)


def product_kept(down: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """down(silu(gate) · up) with the product kept for down's backward, as autograd keeps a
    linear's input: where gated_down does not make it again, and the form it is measured against."""
    return down(gated_silu(gate, up))


def _itself(value: torch.Tensor) -> torch.Tensor:
    return value


def _checkpointing() -> bool:
    """Whether torch's checkpoint holds the saves here: its recomputation makes the product."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return hooks is not None and getattr(hooks[0], "__module__", None) == checkpoint.__name__


@contextlib.contextmanager
def _product_remade(product: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, silu: _SiluOnce) -> Iterator[None]:
    """While inside, a save of `product` or of a view of it holds gate and up to make it
    again (`_Product`); every other save goes to the hooks in place outside (or is kept as
    autograd keeps it, where there are none)."""
    # the hooks in place outside, or autograd's own keeping where there are none (`handed_back`:
    # gate and up, detached, are leaves and go back as themselves)
    pack_outside, unpack_outside = torch._C._autograd._top_saved_tensors_default_hooks(True) or (handed_back, _itself)
    where = _storage_of(product)
    # weakly: every save made inside holds these hooks until its backward, so a strong
    # reference here would hold the product (and gate and up) as long, the very bytes let go
    product_ref, gate_ref, up_ref = weakref.ref(product), weakref.ref(gate), weakref.ref(up)

    def pack(tensor: torch.Tensor) -> Any:
        if tensor is product_ref() or (where is not None and _storage_of(tensor) == where):
            # gate and up are alive: the forward that made them is running
            return _Product.of(tensor, pack_outside(gate_ref()), pack_outside(up_ref()), unpack_outside, silu)
        return (pack_outside(tensor),)

    def unpack(held: Any) -> torch.Tensor:
        return held.rebuilt() if isinstance(held, _Product) else unpack_outside(held[0])

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


def _storage_of(tensor: torch.Tensor) -> int | None:
    """Which storage `tensor` views (the storage object itself: on the meta device, where the
    shape reader runs a large model's forwards, every storage's data address is 0), None for a
    tensor that has none of its own (a wrapper subclass: a DTensor's is its local shard's)."""
    try:
        storage = tensor.untyped_storage()
        return storage._cdata if storage.nbytes() else None
    except (RuntimeError, NotImplementedError):  # "an invalid python storage": a DTensor's own
        return None
