"""The executor: how a step's micro-batches, an evaluation and a sample run through whatever
`parallelize` applied, so that the training loop never asks which strategies it has.

The loop (plait.train.loop.trainer) keeps the step in plain sight: the micro-batches, the
guard's verdict, `optimizer.step()`, `zero_grad()`. What differs by layout lives here:

- **the micro-batch loop**: the pipeline's schedule (every micro-batch, gradients reduced at
  its end), or a plain loop that syncs gradients on the last micro-batch only;
- **step hooks** the strategies and models contribute (`StepHooks`): context parallelism
  keeps this cp rank's tokens of each batch and is engaged through forward and backward; a
  mixture of experts scales its balancing loss, counts its routing into the step's record
  and sums it up for the run;
- **forward-only passes**: evaluation's per-sample rows, and the next-token logits sampling
  needs (padded to tp under sequence parallelism, gathered over the vocabulary when the head
  keeps it split, sent from the last pipeline stage to the others);
- **the whole weights**, by one in-memory route for every layout: the pieces a checkpoint
  would write (plait.parallel.pieces), gathered on the main rank and assembled.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.errors import PlaitError
from plait.parallel.compiled import eager
from plait.parallel.context.plan import ContextHooks, context_of
from plait.parallel.data.sync import no_sync
from plait.parallel.expert.plan import ExpertHooks, moe_blocks
from plait.parallel.hooks import StepHooks
from plait.parallel.packed import loss_tokens, run_model
from plait.parallel import replicas
from plait.parallel.pieces import local_pieces
from plait.parallel.pipeline.runner import PipelineRunner
from plait.schedule.timeline import timeline_to_dict
from plait.parallel.seam import logits_of
from plait.parallel.tensor.loss import gather_vocab, lm_loss
from plait.parallel.tensor.plan import tensor_parallel_of
from plait.runtime import comm
from plait.runtime.mesh import SYNC, Mesh

Batch = tuple[Any, torch.Tensor]  # (token ids, images or packed documents: plait.parallel.packed; targets)
LossFn = Callable[..., torch.Tensor]


def step_hooks(model: nn.Module, mesh: Mesh) -> list[StepHooks]:
    """What the applied strategies and the model add to each step, in the order they run."""
    hooks: list[StepHooks] = []
    if context_of(model) is not None:
        hooks.append(ContextHooks(model))
    if moe_blocks(model):
        hooks.append(ExpertHooks(model, mesh))
    return hooks


class Executor:
    """Runs steps, evaluations and samples of `model` (what `parallelize` returned) on `mesh`."""

    def __init__(self, model: nn.Module, mesh: Mesh):
        self.model, self.mesh = model, mesh
        self.runner = PipelineRunner(model, mesh) if mesh.size("pp") > 1 else None
        self.hooks = step_hooks(model, mesh)

    # -- a training step ---------------------------------------------------------------------
    def token_loss(self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean", *,
                   sliced: bool = True) -> torch.Tensor:
        """Next-token cross-entropy of (batch, seq, V) logits, or of the vocabulary slice a
        tensor-parallel head keeps (the ranks then exchange three floats per token).
        `sliced=False`: the logits are whole whatever the layout (gathered for the user's code)."""
        info = tensor_parallel_of(self.model) if sliced else None
        return lm_loss(logits, targets, axis=info.axis if info else None, reduction=reduction)

    def batch(self, inputs: Any, targets: torch.Tensor) -> Batch:
        """A micro-batch on this rank's device, as the hooks keep it (cp: this rank's tokens)."""
        batch = (inputs.to(self.mesh.device), targets.to(self.mesh.device))
        for hook in self.hooks:
            batch = hook.batch(*batch)
        return batch

    def begin_step(self, loss_scale: float, micro_batches: int) -> None:
        for hook in self.hooks:
            hook.begin_step(loss_scale, micro_batches)

    def forward_backward(self, batches: Sequence[Batch], loss_fn: LossFn, *, measure: bool, read_loss: bool,
                         meter: Any, per_token: bool = False) -> tuple[float | None, int]:
        """Forward and backward every micro-batch: the step's mean loss (None when not read
        back: one host sync a step, none under --measure off) and the bytes saved for backward
        (`meter` tracks them in a plain loop when `measure`; the pipeline counts its own).
        `per_token`: some targets carry no loss (documents' ends, prompts), so micro-batches and
        ranks hold different numbers of loss tokens; the loss is then their sum over the count
        the whole step holds (`per_token_loss`), the same as one process's mean."""
        if per_token:
            loss_fn = self.per_token_loss(batches, loss_fn)
        with self._engaged():
            if self.runner is not None:
                self.runner.measure = measure  # the barrier and the timeline's all-gather
                loss = self.runner.step([x for x, _ in batches], [t for _, t in batches], loss_fn)
                return loss, self.runner.last_stats.peak_saved_bytes
            loss_sum = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
            for k, (inputs, targets) in enumerate(batches):
                # Only the last micro-batch synchronises gradients: the others accumulate locally.
                with contextlib.nullcontext() if k == len(batches) - 1 else no_sync(self.model):
                    with meter.track(self.model) if measure else contextlib.nullcontext():
                        outputs = run_model(self.model, inputs)
                    loss = loss_fn(outputs, targets)
                    (loss / len(batches)).backward()
                loss_sum += loss.detach()
        mean = (loss_sum / len(batches)).item() if read_loss else None
        return mean, meter.last if measure else 0

    def per_token_loss(self, batches: Sequence[Batch], loss_fn: LossFn) -> LossFn:
        """`loss_fn` as each micro-batch's summed loss over the step's loss tokens on every dp × cp
        rank (one all-reduce of one number), times what the executor and the gradient sync
        divide by (the micro-batches, the dp × cp ranks): every token weighs the same wherever
        it lies, as in one process's mean."""
        count = sum((loss_tokens(t) for _, t in batches), torch.zeros((), dtype=torch.float64)).to(self.mesh.device)
        comm.all_reduce(count, self.mesh.axis(SYNC), purpose=comm.CONTROL)
        scale = len(batches) * self.mesh.size(SYNC) / count.clamp(min=1)

        def summed(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
            return loss_fn(outputs, targets, reduction="sum") * scale.to(torch.float32)

        return summed

    def end_step(self, step_comm: dict[str, Any]) -> dict[str, Any]:
        """After the optimizer step: what the hooks add to the step's record."""
        record: dict[str, Any] = {}
        for hook in self.hooks:
            record.update(hook.end_step(step_comm))
        return record

    def summary(self, history: list[dict[str, Any]]) -> dict[str, Any]:
        """What the hooks add to the run's summary, from the steps' records."""
        out: dict[str, Any] = {}
        for hook in self.hooks:
            out.update(hook.summary(history))
        return out

    @contextlib.contextmanager
    def _engaged(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.engaged())
            yield

    # -- forward only --------------------------------------------------------------------------
    def eval_rows(self, batches: Sequence[Batch], rows: Callable[[Any, torch.Tensor], torch.Tensor],
                  width: int) -> torch.Tensor:
        """(batches, micro-batch, width): `rows(outputs, targets)` of every micro-batch, on every rank."""
        if self.runner is not None:
            return self.runner.eval_rows([x for x, _ in batches], [t for _, t in batches], rows, width)
        return torch.stack([rows(run_model(self.model, x), t) for x, t in batches]).to(self.mesh.device)

    @torch.no_grad()
    @eager()
    def next_logits(self, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Whole-vocabulary logits after the last position of `ids` (batch, seq), on every rank.
        Causal attention never lets a position see the padding sequence parallelism adds after it."""
        info = tensor_parallel_of(self.model)
        multiple = info.axis.size if info is not None and info.sp else 1
        length = ids.shape[1]
        padded = F.pad(ids, (0, -length % multiple))
        self.model.eval()
        try:
            if self.runner is not None:
                logits = self.runner.last_logits(padded, position=length - 1)
            else:
                logits = logits_of(self.model(padded))[:, length - 1]
        finally:
            self.model.train()
        if logits is not None and info is not None and logits.shape[-1] != vocab_size:
            logits = gather_vocab(logits, info.axis)  # the head keeps them split by vocabulary
        if self.runner is None:
            return logits
        whole = logits.float() if logits is not None else torch.zeros((ids.shape[0], vocab_size),
                                                                       device=self.mesh.device)
        comm.broadcast(whole, self.mesh.axis("pp"), src=self.mesh.size("pp") - 1, purpose=comm.TELEMETRY)
        return whole

    # -- replicas ------------------------------------------------------------------------------
    def check_replicas(self, optimizer: torch.optim.Optimizer, step: int) -> int:
        """Every block several ranks hold compared by hash (plait.parallel.replicas; collective)."""
        return replicas.check_replicas(self.model, optimizer, self.mesh, step)

    def flip_bit(self, optimizer: torch.optim.Optimizer) -> str:
        """--inject bitflip: one bit of this rank's first weight block flipped, in place."""
        return replicas.flip_bit(self.model, optimizer, self.mesh)

    # -- what a run keeps --------------------------------------------------------------------
    def timeline(self) -> dict | None:
        """The last measured pipeline step's timeline as plain data (None without a pipeline)."""
        timeline = self.runner.last_timeline if self.runner is not None else None
        return timeline_to_dict(timeline) if timeline is not None else None

    def whole_weights(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor] | None:
        """The whole model's weights by their logical names on the main rank (None elsewhere;
        collective). Every layout describes what this rank holds as checkpoint pieces; each
        piece is written by one rank, so gathering the written ones covers every tensor once."""
        return whole_weights(self.model, optimizer, self.mesh)

    def weight_blocks(self, optimizer: torch.optim.Optimizer
                      ) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Iterator[Piece]]:
        """The whole weights as the blocks the ranks hold, a block at a time on the main rank
        (see `weight_blocks`)."""
        return weight_blocks(self.model, optimizer, self.mesh)


def whole_weights(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> dict[str, torch.Tensor] | None:
    """See `Executor.whole_weights`: `weight_blocks` assembled (rank 0 holds the model)."""
    _, blocks = weight_blocks(model, optimizer, mesh)
    whole = Assembly()
    for block in blocks:
        whole.add([block])
    return whole.finish() if mesh.axis("world").rank == 0 else None


def weight_blocks(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh
                  ) -> tuple[list[tuple[str, tuple[int, ...], torch.dtype]], Iterator[Piece]]:
    """The whole model's weights as the blocks that tile them, for writing them out without
    assembling even one tensor (collective): the plan, every tensor's (name, shape, dtype) in
    name order, and an iterator every rank must drain, giving on world rank 0 each tensor's
    blocks in the plan's order, as (name, block, offsets, whole shape), and nothing elsewhere.
    Rank 0's own blocks come first, then each other rank's, sent as a tensor and received
    into a buffer of its size: rank 0 holds one block beyond its share."""
    world = mesh.axis("world")
    owned: dict[str, list[Any]] = {}
    for piece in local_pieces(model, optimizer, mesh):
        if piece.owned and piece.name.startswith("model/"):
            owned.setdefault(piece.name.removeprefix("model/"), []).append(piece)
    # Who holds which blocks, known to rank 0 in one round; then each block travels as a tensor
    # (no pickle: the receiver holds one block-sized buffer, not two copies).
    held: list[dict[str, list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], torch.dtype]]]] = []

    def by_name(pieces: list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], torch.dtype]]) -> None:
        table: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], torch.dtype]]] = {}
        for name, *rest in pieces:
            table.setdefault(name, []).append(tuple(rest))  # type: ignore[arg-type]
        held.append(table)

    comm.gather_objects([(name, tuple(p.offsets), tuple(p.tensor.shape), tuple(p.full_shape), p.tensor.dtype)
                         for name, pieces in owned.items() for p in pieces], world, by_name)
    full = {name: (blocks[0][2], blocks[0][3]) for table in held for name, blocks in table.items()}
    plan = comm.broadcast_object(sorted((name, shape, dtype) for name, (shape, dtype) in full.items()), world)

    def blocks() -> Iterator[Piece]:
        for name, _, _ in plan:
            if world.rank != 0:
                for piece in owned.get(name, []):
                    comm.send(piece.tensor.detach().contiguous(), world, 0, purpose="checkpoint").wait()
                continue
            for piece in owned.get(name, []):
                yield name, piece.tensor.detach().to("cpu"), tuple(piece.offsets), tuple(piece.full_shape)
            for rank in range(1, world.size):
                for offsets, shape, full_shape, dtype in held[rank].get(name, []):
                    block = torch.empty(shape, dtype=dtype, device=mesh.device)
                    comm.recv(block, world, rank, purpose="checkpoint").wait()
                    yield name, block.to("cpu"), offsets, full_shape

    return plan, blocks()


Piece = tuple[str, torch.Tensor, tuple[int, ...], tuple[int, ...]]  # (name, block, offsets, full shape)


class Assembly:
    """Whole tensors put together from the blocks that tile them, added in any order."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.covered: dict[str, int] = {}
        self.seen: set[tuple[str, tuple[int, ...]]] = set()

    def add(self, pieces: Sequence[Piece]) -> None:
        for name, block, offsets, full_shape in pieces:
            if (name, tuple(offsets)) in self.seen:  # two ranks wrote one block: a layout's pieces are wrong
                raise PlaitError(f"the whole weights of {name} got its block at {tuple(offsets)} twice",
                                 hint="a strategy's checkpoint pieces do not tile its tensors; report it with the layout")
            self.seen.add((name, tuple(offsets)))
            if name not in self.tensors:
                self.tensors[name] = block.new_empty(full_shape)
            full = self.tensors[name]
            region = functools.reduce(lambda t, d: t.narrow(d, offsets[d], block.shape[d]), range(block.ndim), full)
            region.copy_(block)
            self.covered[name] = self.covered.get(name, 0) + block.numel()

    def finish(self) -> dict[str, torch.Tensor]:
        """The tensors, each checked whole: never uninitialised memory handed back as weights."""
        short = [name for name, tensor in self.tensors.items() if self.covered[name] != tensor.numel()]
        if short:
            raise PlaitError(f"the whole weights of {', '.join(short[:3])} were assembled from pieces covering "
                             f"{self.covered[short[0]]} of {self.tensors[short[0]].numel()} elements",
                             hint="a strategy's checkpoint pieces do not tile its tensors; report it with the layout")
        return dict(sorted(self.tensors.items()))
