"""The sharded optimizer of ZeRO: each rank steps only the slice of every group it owns.

Also what the rest of plait asks of a ZeRO model: its model-state tensors for the memory
meter and its checkpoint pieces. The shard arithmetic and the flat buffers themselves live
in shard.py; what ZeRO costs (memory per stage, bytes on the wire) is plait/estimate/'s.

`ZeroOptimizer` wraps an ordinary torch optimizer built over *pieces*: one leaf tensor per
(parameter ∩ this rank's shard), aliasing the shard's memory, so the user's optimizer class
steps the shard in place and parameter groups (e.g. no weight decay on norms) still apply
per original parameter. It suits elementwise optimizers (SGD, Adam, AdamW, ...), not those
that need whole matrices. With parameters in bf16/fp16 (mixed precision) or with `offload`,
the pieces are views of an fp32 master copy of the shard (in CPU memory, pinned when the
model is on a GPU, for offload); the step copies the gradient in and the parameters back out.

Those copies reuse buffers and convert on the GPU. A step that allocated its host gradient
afresh paid for the pages as well as the bytes, and torch converts a blocking device-to-host
copy on the CPU, through a second fresh tensor. The 5 B offload run's update moved 13.5 GB/s
of AdamW that way (benchmarks/RESULTS.md, GPU section), where the host's AdamW alone runs at
112-133 GB/s.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.parallel.compiled_update import CompiledAdamW, FlatPart
from plait.parallel.masters import step_scaled
from plait.parallel.pieces import Piece, logical_blocks, param_pieces, writes_its_part, writes_scalars
from plait.parallel.pipeline.split import logical_parameters
from plait.parallel.zero.shard import FlatGroup, owned_pieces
from plait.rules import check_compiled_update


@dataclass
class OwnedSlice:
    """What the optimizer steps of one group: a piece per parameter part, maybe an fp32 master."""

    group: FlatGroup
    pieces: list[nn.Parameter]
    bounds: list[tuple[int, int]]  # each piece's [start, stop) within the owned range
    master: torch.Tensor | None
    offloaded: bool = False  # the master lives in host memory and the host steps it
    grad_copy: torch.Tensor | None = None  # offload: the fp32 gradient the host steps on, kept between steps

    @classmethod
    def of(cls, group: FlatGroup, offload: bool) -> "OwnedSlice":
        lo, _ = group.owned()
        base = group.owned_param()
        master = None
        if offload or base.dtype != torch.float32:
            master = base.to("cpu" if offload else base.device, torch.float32, copy=True)
            master = master.pin_memory() if offload and base.is_cuda else master  # pinned for a GPU's DMA
            base = master
        bounds = [(start - lo, stop - lo) for _, start, stop in owned_pieces(group.sizes, group.n, group.rank)]
        return cls(group, [nn.Parameter(base[start:stop]) for start, stop in bounds], bounds, master, offload)

    def bind_grads(self) -> None:
        grad = self.group.owned_grad()
        if self.master is not None and not self.holds_more():  # fp32 offload: a plain copy, kept fresh
            self.master.copy_(self.group.owned_param())  # so weights loaded into the model count
        if grad is not None and self.master is not None:
            grad = self.master_grad(grad)
        for piece, (start, stop) in zip(self.pieces, self.bounds):
            piece.grad = None if grad is None else grad[start:stop]

    def master_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """`grad` in fp32 where the master lives, ready for the step to read: the gradient
        itself when it already is; on the device, a transient copy its allocator recycles; on
        the host (offload), a copy into `grad_copy` (allocated once, pinned like the master,
        converted on the GPU a chunk at a time, then waited for)."""
        if grad.device == self.master.device and grad.dtype == torch.float32:
            return grad
        if not self.offloaded:
            return grad.to(torch.float32)
        if self.grad_copy is None:
            self.grad_copy = torch.empty(self.master.shape, dtype=torch.float32, device=self.master.device,
                                         pin_memory=self.master.is_pinned())
        copy_in_chunks(self.grad_copy, grad)
        return self.grad_copy

    def write_back(self) -> None:
        """Mixed precision or offload: the stepped master, rounded back into the shard."""
        if self.master is not None:
            copy_in_chunks(self.group.owned_param(), self.master)
            self.unbind_grads()

    def unbind_grads(self) -> None:
        for piece in self.pieces:
            piece.grad = None

    def holds_more(self) -> bool:
        """True if the master is more than a copy: fp32 behind 16-bit parameters."""
        return self.master is not None and self.group.flat.dtype != torch.float32


COPY_CHUNK = 1 << 26  # elements a device-host copy converts at once: 256 MiB of fp32 scratch on the GPU


def copy_in_chunks(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) across devices and dtypes without host-side conversion or a whole-size
    scratch tensor. Between a host buffer and a GPU, a non-blocking copy converts on the GPU
    (torch converts blocking ones on the CPU, through a fresh pageable tensor), and each
    chunk's scratch is at most COPY_CHUNK elements. Returns once dst may be read on the host.
    Tensors on one device, the CPU's included, take one plain copy."""
    gpu = src if src.is_cuda else dst
    if not gpu.is_cuda or dst.device == src.device:
        dst.copy_(src)
        return
    copy_chunks(dst, src, non_blocking=True)
    if not dst.is_cuda:  # the host reads it next: wait for the device's copies
        torch.cuda.current_stream(gpu.device).synchronize()


def copy_chunks(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """dst.copy_(src), COPY_CHUNK elements at a time (flat tensors of one size)."""
    for start in range(0, src.numel(), COPY_CHUNK):
        dst[start:start + COPY_CHUNK].copy_(src[start:start + COPY_CHUNK], non_blocking=non_blocking)


class ZeroOptimizer(torch.optim.Optimizer):
    """A torch optimizer over this rank's shards that looks, to a training loop, like any other.

    `param_groups` and `state` are the inner optimizer's, so setting "lr" works and `state`
    holds the real shard tensors; `step()` steps the shard and hands the new values back
    (stages 1-2 all-gather them); `zero_grad()` clears the ZeRO gradient buffers.
    """

    def __init__(self, sync: Any, optimizer_class: type[torch.optim.Optimizer], groups: list[dict[str, Any]],
                 compiled_update: bool = False, **kwargs: Any):
        self.sync = sync
        self.slices = [OwnedSlice.of(group, sync.offload) for group in sync.groups]
        pieces_of: dict[nn.Parameter, list[nn.Parameter]] = {}
        for part in self.slices:
            for (index, _, _), piece in zip(owned_pieces(part.group.sizes, part.group.n, part.group.rank), part.pieces):
                pieces_of.setdefault(part.group.params[index], []).append(piece)
        sharded = [{**g, "params": [x for p in g["params"] for x in pieces_of.get(p, [])]} for g in groups]
        self.inner = optimizer_class(sharded, **kwargs)
        super().__init__(self.inner.param_groups, self.inner.defaults)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state
        # 16-bit parameters: precision.StepGuard sets this (1 / loss scale × the clip factor)
        # before each step, applied once to the fp32 copy of the gradient. None: fp32, clip in place.
        self.grad_scale: float | None = 1.0 if any(part.holds_more() for part in self.slices) else None
        # --optimizer-kernel compiled: masters, moments and 16-bit shard in one pass (compiled_update.py)
        self.compiled = None
        if compiled_update:
            check_compiled_update(all(part.holds_more() for part in self.slices),
                                  any(part.offloaded for part in self.slices))
            self.compiled = CompiledAdamW(self.inner)
            self.compiled.own_flat_state(self._flat_parts())

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.compiled is not None and self._compiled_step():
            self.grad_scale = 1.0
            self.sync.gather_params()
            return loss
        for part in self.slices:
            part.bind_grads()
        # 16-bit parameters: every piece's gradient is an fp32 copy, unscaled and clipped by
        # the fused kernel as it reads it (masters.step_scaled); fp32 was clipped in place
        grads = [p.grad for part in self.slices if part.holds_more() for p in part.pieces if p.grad is not None]
        step_scaled(self.inner, grads, 1.0 if self.grad_scale is None else self.grad_scale,
                    fold=all(part.holds_more() for part in self.slices))
        self.grad_scale = None if self.grad_scale is None else 1.0
        for part in self.slices:
            part.write_back()
        self.sync.gather_params()
        return loss

    def _compiled_step(self) -> bool:
        """The compiled pass over the owned shards' runs, reading the 16-bit gradient shard
        and writing the 16-bit parameter shard; False where torch's kernel must step instead."""
        return self.compiled.step_flat(self._flat_parts(), self.grad_scale)

    def _flat_parts(self) -> list[FlatPart]:
        return [FlatPart(part.master, part.group.owned_param(), part.group.owned_grad(), part.pieces, part.bounds)
                for part in self.slices]

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - torch's signature
        self.sync.zero_grad()
        for part in self.slices:
            part.unbind_grads()

    def init_state(self) -> None:
        """Create the state tensors (a zero-lr step on zero gradients), e.g. to load a checkpoint into."""
        if self.state:
            return
        lrs = [group["lr"] for group in self.param_groups]
        for group in self.param_groups:
            group["lr"] = 0.0
        for piece in (p for part in self.slices for p in part.pieces):
            piece.grad = torch.zeros_like(piece)
        self.inner.step()
        for group, lr in zip(self.param_groups, lrs):
            group["lr"] = lr
        for part in self.slices:
            part.unbind_grads()

    def model_state_tensors(self, model: nn.Module) -> dict[str, list[torch.Tensor]]:
        """Every tensor of model state this rank holds, by kind, for a storage-deduplicating meter.

        Gradients include the ZeRO buffers (a stage-2 shard is the gradient of no parameter);
        optimizer state includes the fp32 master copies, which the paper's K counts.
        """
        params = list(model.parameters())
        pieces = [p for part in self.slices for p in part.pieces]
        grads = [p.grad for p in params + pieces if p.grad is not None] + self.sync.grad_tensors()
        states = [v for s in self.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.ndim > 0]
        masters = [part.master for part in self.slices if part.master is not None]
        return {"params": params, "grads": grads, "optim": states + masters}


# -- checkpoints: shards as blocks of the logical tensors ----------------------------------------
def flat_blocks(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Elements [start, stop) of a row-major tensor of `shape` as rectangular blocks.

    Each block is (offsets, lengths, flat index of its first element); a block is contiguous
    in the flat order, so it is a view of the flat range.
    """
    if stop <= start:
        return []
    if len(shape) <= 1:
        return [((start,) * len(shape), (stop - start,) * len(shape), start)]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:  # within one row
        return [((first, *o), (1, *n), first * row + f) for o, n, f in flat_blocks(shape[1:], start - first * row,
                                                                                     stop - first * row)]
    head = flat_blocks(shape, start, (first + 1) * row) if start % row else []
    whole_from, whole_to = -(-start // row), stop // row
    middle = [((whole_from, *(0,) * (len(shape) - 1)), (whole_to - whole_from, *shape[1:]), whole_from * row)]
    tail = flat_blocks(shape, whole_to * row, stop) if stop % row else []
    return head + (middle if whole_to > whole_from else []) + tail


def checkpoint_pieces(model: nn.Module, optimizer: ZeroOptimizer, mesh: Any) -> list[Any]:
    """plait.train.checkpoint.write's view of a ZeRO model: every tensor by its unsharded name and shape.

    Whole parameters (stages 1-2) are written as data parallelism writes them; shards
    (stage-3 parameters, optimizer state, fp32 masters) as the blocks each dp rank owns,
    placed in the logical tensor through the parameter's placement (an expert shard's blocks
    sit at its experts' offset in the tensor of all experts). A tensor that tensor
    parallelism does not split is written by tp rank 0 only, a pipeline's copy of a tied
    weight by nobody (it is loaded). So a checkpoint moves between any layouts.
    """
    sync = optimizer.sync
    pieces = param_pieces(model, optimizer, mesh) if sync.stage < 3 else _frozen_pieces(model, optimizer, mesh)
    optimizer.init_state()
    for part in optimizer.slices:
        group, lo = part.group, part.group.owned()[0]
        offsets = [0, *itertools.accumulate(group.sizes)]
        for (index, start, stop), piece in zip(owned_pieces(group.sizes, group.n, group.rank), part.pieces):
            param, first = group.params[index], start - offsets[index]
            name, shape = sync.names[param], tuple(param.shape)
            writes = (param not in sync.replicas and writes_its_part(param, mesh)
                      and (group.replicate is None or group.replicate.rank == 0))  # --dp-shard: one copy
            # every part's rank holds a first element of its part: one writes the shared scalars
            writes_scalar = writes and first == 0 and writes_scalars(param, mesh)
            flat = {f"optim/{name}/{k}": v for k, v in optimizer.state[piece].items() if isinstance(v, torch.Tensor)}
            if part.holds_more():
                flat[f"optim/{name}/master"] = piece.detach()
            if sync.stage == 3:
                flat[f"model/{name}"] = group.owned_param()[start - lo:stop - lo]
            for key, tensor in flat.items():
                if tensor.ndim == 0:  # e.g. Adam's step: the same on every piece, written once
                    pieces.append(Piece(key, tensor, (), (), writes_scalar))
                    continue
                for block, lengths, f in flat_blocks(shape, first, first + stop - start):
                    view = tensor[f - first:f - first + math.prod(lengths)].view(lengths)
                    pieces += [Piece(key, part, where, full, writes)
                               for part, where, full in logical_blocks(param, view, block)]
    return pieces


def _frozen_pieces(model: nn.Module, optimizer: ZeroOptimizer, mesh: Any) -> list[Any]:
    """Stage 3 shards the trainable parameters only: the others (the sigmoid router's bias,
    moved by counts, not gradients) stay whole on every rank, written as data parallelism
    writes them."""
    frozen = {f"model/{name}" for name, param, _ in logical_parameters(model) if not param.requires_grad}
    return [piece for piece in param_pieces(model, optimizer, mesh) if piece.name in frozen] if frozen else []


# -- measured and predicted --------------------------------------------------------------------------
def zero_state_bytes(model: nn.Module, optimizer: ZeroOptimizer) -> dict[str, int]:
    """Measured parameter, gradient and optimizer bytes on this rank (distinct storages)."""
    out = {}
    for kind, tensors in optimizer.model_state_tensors(model).items():
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
        out[kind] = sum(storages.values())
    return out
