"""What one action does to one stage: forward (F), full backward (B), and B split in I + W.

The split backward, for ZB-H1, lets autograd do the input half and defers the weight half:

- During F, a forward hook records the input x and output y of every module that owns
  parameters directly (each Linear, Embedding, RMSNorm): y is where its weights enter the graph.
- I is `torch.autograd.grad(output, inputs=[stage input, y_1, ..., y_n], retain_graph=True)`.
  Asked only for those, autograd runs the input-gradient path and nothing else: each
  matmul's backward computes the gradient of its input, not of its weight (autograd skips
  outputs nobody asked for; plait's norms ask the engine the same: models/gpt/lean.asked).
  We keep dL/dy_i for every module and send dL/dinput upstream. On the last stage the loss's
  own graph runs first, unretained (`_through_the_loss`), and I starts from the logits.
- W computes each module's weight gradient from the kept dL/dy_i. For a Linear it is the
  deferred GEMM dW = dy^T·x (x is what autograd saved for it anyway, or, where the model lets
  it go and makes it again for the backward, made again here: parallel/saved.REMADE), as in
  Megatron's zero-bubble code. Any other module (norm scales, the embedding) gets an autograd call
  `torch.autograd.backward(y_i, dL/dy_i, inputs=its own weights)`: restricted to those
  weights, dL/dy_i goes no further than the module itself.

The outputs y_i are kept for their graphs alone: I asks for their gradients and W starts
there, and neither reads their values. Once the stage's forward has run, their values go
(`let_go_of_values`), as a sent stage output's do; kept, they held what no backward saves
(q's and k's projections before RoPE, o_proj's and down's outputs): 3h + kv values a token a
block beyond the block's own keep, 27% more on `tiny`, which neither the meter nor the
estimate saw. The stage's own output stays until I (on the last stage the head's logits,
which the loss reads, and a loss may save).

Cost: I + W does the work of one B, plus what W makes again (each norm's normalised values,
a gated product plait's block makes again) and one autograd call per non-Linear module
(about 0.1-0.3 ms each on a CPU; `small` with 8 layers, one process: I + W about 1.3 × B,
benchmarks/split_backward.py). Memory:
between I and W the stage's saved tensors stay alive (autograd cannot free half a graph),
so a pending W holds a micro-batch's activations; `Timeline.peak_live` is the count that
describes this implementation.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.packed import Packed
from plait.parallel.pipeline.p2p import Channels, Key, message_in
from plait.parallel.saved import REMADE, held_saves, resident_storages
from plait.schedule.action import Action
from plait.schedule.timeline import Slot

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _check_weights_used_once(module: nn.Module) -> None:
    """W from a module's output must reach its weights through that module alone.

    A weight shared by two modules of one stage (a tied embedding when one stage holds
    both the embedding and the head) is also reached through the other module, and W
    would walk the whole stage again and count that path twice.
    """
    owners: dict[int, str] = {}
    for name, sub in module.named_modules():
        for pname, param in sub.named_parameters(recurse=False):
            if id(param) in owners:
                raise PlaitError(f"zb-h1 needs each weight used by one module of its stage; "
                                 f"{owners[id(param)]} and {name}.{pname} are one tensor (tied)",
                                 hint="use pp > 1 (the first and last stage then hold separate copies), "
                                      "untie the embeddings, or another schedule")
            owners[id(param)] = f"{name}.{pname}"


@dataclass(frozen=True)
class Capture:
    """A weight-owning module's input and output in one forward: the input itself, or what
    makes it again where its module can (parallel.saved.REMADE: plait's GPT lets the down
    projection's input go, and W makes it again, as that module's own backward would)."""

    module: nn.Module
    x: torch.Tensor | Callable[[], torch.Tensor]
    y: torch.Tensor

    def input(self) -> torch.Tensor:
        return self.x if isinstance(self.x, torch.Tensor) else self.x()


@dataclass
class MicroState:
    """One micro-batch on one stage, from its F until its backward is complete."""

    input: torch.Tensor | None  # leaf that receives dL/dinput (None for token ids)
    output: torch.Tensor  # the stage output, or loss / m on the last stage
    saved_bytes: int  # bytes autograd saved for backward during F
    captured: list[Capture] = field(default_factory=list)
    pending: list[tuple[Capture, torch.Tensor]] = field(default_factory=list)  # with dL/dy
    loss_input: torch.Tensor | None = None  # on the last stage: the stage output the loss was computed from


class StageWork:
    """Runs F, B, I and W for one stage module and counts the activations it holds."""

    def __init__(self, module: nn.Module, split_backward: bool,
                 gathered_weights: Callable[[], set[int]] = set):
        """`gathered_weights` names the storages of weights gathered on the fly (ZeRO-3's
        units): saved for backward, but parameters, not activations."""
        self.module = module
        self.splits = split_backward
        self._param_ptrs = resident_storages(module)
        self._gathered_weights = gathered_weights
        self._recording: list[Capture] | None = None
        if split_backward:
            _check_weights_used_once(module)
            for sub in module.modules():
                if any(True for _ in sub.parameters(recurse=False)):
                    sub.register_forward_hook(self._capture)

    def _capture(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if self._recording is None or not output.requires_grad:
            return
        if any(seen.module is module for seen in self._recording):
            raise PlaitError(f"zb-h1 splits the backward module by module, but {type(module).__name__} "
                             "runs twice in one forward of its stage",
                             hint="use the 1f1b schedule for this model")
        remade = getattr(inputs[0], REMADE, None)
        self._recording.append(Capture(module, remade if remade is not None else inputs[0].detach(), output))

    def forward(self, x: torch.Tensor, grad_input: bool) -> tuple[torch.Tensor, MicroState]:
        """Run the stage; `grad_input` makes x a leaf whose gradient goes back upstream."""
        leaf = x.detach().requires_grad_() if grad_input else None
        recorded: list[Capture] = []
        with self._saved_bytes() as saved, self._record(recorded):
            out = self.module(leaf if leaf is not None else x)
        for capture in recorded:  # I and W read only their graphs (module docstring)
            if capture.y is not out:
                let_go_of_values(capture.y)
        return out, MicroState(leaf, out, saved[0], captured=recorded)

    @contextlib.contextmanager
    def _record(self, into: list[Capture]) -> Iterator[None]:
        self._recording = into
        try:
            yield
        finally:
            self._recording = None

    @contextlib.contextmanager
    def _saved_bytes(self) -> Iterator[list[int]]:
        """Bytes of the tensors autograd saves inside the block, but the stage's weights and buffers.

        What an op made is counted by its storage, as ActivationMeter counts: a view keeps the
        whole (Phi-3's V, a slice of its fused q|k|v projection's output, holds all of it; counted
        as the slice, the meter read 0.93 of the estimate under pp 2). A leaf (a micro-batch of
        token ids, a slice of a larger batch) is counted as its views, once each and at most its
        storage's size: the batch is held whatever runs. Only what autograd still holds when the
        forward ends counts.
        """
        total = [0]

        def is_weight(ptr: int) -> bool:  # gathered weights get fresh memory each time: asked at save time
            return ptr in self._param_ptrs or ptr in self._gathered_weights()

        # an alias of an op's output is handed back (held_saves): I and W retain the graph
        with held_saves(is_weight) as held:
            yield total
        views: dict[int, dict[tuple, int]] = {}
        sizes: dict[int, int] = {}
        for tensor, leaf in held:
            storage = tensor.untyped_storage()
            key = (tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
            size = tensor.numel() * tensor.element_size() if leaf else storage.nbytes()
            views.setdefault(storage.data_ptr(), {})[key] = size
            sizes[storage.data_ptr()] = storage.nbytes()
        total[0] = sum(min(sum(v.values()), sizes[ptr]) for ptr, v in views.items())

    @staticmethod
    def backward(state: MicroState, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """B: gradients of the weights (accumulated into .grad) and of the input (returned)."""
        torch.autograd.backward(state.output, grad_output)
        return state.input.grad if state.input is not None else None

    @staticmethod
    def backward_input(state: MicroState, grad_output: torch.Tensor | None) -> torch.Tensor | None:
        """I: the input gradient only; keeps dL/dy of every weight-owning module for W."""
        targets = ([state.input] if state.input is not None else []) + [c.y for c in state.captured]
        output, grad_output = _through_the_loss(state, grad_output)
        grads = torch.autograd.grad(output, targets, grad_output, retain_graph=True,
                                    allow_unused=True)
        offset = 1 if state.input is not None else 0
        state.pending = [(c, g) for c, g in zip(state.captured, grads[offset:]) if g is not None]
        state.captured = []
        if output is state.loss_input:  # W reads the logits' graph, not their values
            let_go_of_values(output)
        state.loss_input = None
        return grads[0] if state.input is not None else None

    @staticmethod
    def backward_weight(state: MicroState) -> None:
        """W: each module's weight gradients from the dL/dy kept by I, into .grad."""
        for capture, grad in state.pending:
            if type(capture.module) is nn.Linear:
                _linear_weight_grad(capture.module, capture.input(), grad)
                continue
            weights = [p for p in capture.module.parameters(recurse=False) if p.requires_grad]
            if weights:
                # retain_graph: a module's path to its weights may cross a child module's
                # nodes, which that child's own W still needs; all is freed with `state`.
                torch.autograd.backward(capture.y, grad, inputs=weights, retain_graph=True)
        state.pending = []


def _through_the_loss(state: MicroState, grad_output: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(what I starts from, its gradient). On the last stage, the loss's own graph is I's alone
    (W starts at the modules' outputs), so it runs first and is not retained: what the loss saved
    (the logits' softmax) goes now, and the logits with it once I is done, where each pending W
    held them until it ran (the last rank holds up to p micro-batches so under ZB-H1; the
    estimate counts one micro-batch's logits, the one between its F and I). A loss that reads
    the stage elsewhere too (an auxiliary loss on the router's scores) keeps one retained
    graph, as before (`_reads_only`)."""
    logits = state.loss_input
    # a hook on the logits' gradient would run in both calls
    if logits is None or logits._backward_hooks or not _reads_only(state.output, logits, state):
        return state.output, grad_output
    (grad,) = torch.autograd.grad(state.output, logits, grad_output)
    return logits, grad


def _reads_only(loss: torch.Tensor, logits: torch.Tensor, state: MicroState) -> bool:
    """Whether every path of `loss`'s graph into the stage goes through `logits`. A path that
    meets another module output the split records, or the stage's input, is I's too: False.
    One that meets a weight itself would give that weight a gradient no W makes (W starts at
    the modules' outputs): refused, where it had been left out."""
    ends = {id(c.y.grad_fn) for c in state.captured if c.y.grad_fn is not None}
    only, seen, todo = True, set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node is logits.grad_fn or id(node) in seen:
            continue
        seen.add(id(node))
        leaf = getattr(node, "variable", None)  # an AccumulateGrad's
        if id(node) in ends or (leaf is not None and leaf is state.input):
            only = False
        elif leaf is not None:
            raise PlaitError(f"zb-h1: the loss reads a weight of shape {tuple(leaf.shape)} itself, not through the "
                             "stage's outputs; the split backward computes each weight's gradient from its "
                             "module's output, so this part of it would be lost",
                             hint="compute the loss from the stage's output alone, or use the 1f1b schedule")
        else:
            todo.extend(next_node for next_node, _ in node.next_functions)
    return only


def _linear_weight_grad(module: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> None:
    """dW = dy^T·x (and db = sum dy) over every token, accumulated into .grad."""
    dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
    _accumulate(module.weight, dy2.t() @ x2)
    if module.bias is not None:
        _accumulate(module.bias, dy2.sum(0))


def let_go_of_values(out: torch.Tensor) -> None:
    """Drop a tensor's values, keeping its shape and graph for the backward: a sent stage
    output's, and the module outputs the split backward records (`StageWork.forward`).

    The backward reads only their graphs (the next stage holds a sent output's values, and
    the message keeps its own reference until delivered; what an op saved of a recorded
    output is the alias `held_saves` handed autograd, whose values stay). Kept, every
    micro-batch in flight held one more activation a boundary, and under ZB-H1 3h + kv values
    a token a block, which no saved-tensor count sees. A view (its base keeps the values) and
    a leaf (a stage that hands its input on) are left as they are. What is left reads as NaN, so
    that code reading it after all (a loss reading a module's output a hook kept) fails the
    step's finite check rather than train on stale memory."""
    if torch.is_grad_enabled() and out.grad_fn is not None and out._base is None:
        out.data = out.new_full((1,), float("nan")).expand(out.shape)


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    if not param.requires_grad:
        return
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad.add_(grad)


@dataclass(frozen=True)
class PipelineStats:
    """What one step held and waited for, on this rank."""

    peak_inflight: int  # most (micro-batch, chunk) forwards whose B or I had not run yet
    peak_saved_bytes: int  # most bytes autograd held for backward at once (F until B or W)
    peak_sent_bytes: int  # most bytes of sent messages held at once (until known delivered)
    saved_bytes: tuple[int, ...]  # bytes saved by the F of each micro-batch on chunk 0
    wait_s: float  # time spent waiting for activations or gradients to arrive
    busy_s: float  # time spent computing


class StepRun:
    """One step on one pipeline rank: what each action reads, keeps and sends.

    `work` holds one StageWork per chunk; chunk c is stage c·pp + rank.
    """

    def __init__(self, work: Sequence[StageWork], rank: int, pp: int, channels: Channels,
                 inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor], loss_fn: LossFn,
                 device: torch.device):
        self.work, self.rank, self.pp, self.device = work, rank, pp, device
        self.num_stages = pp * len(work)
        self.channels = channels
        self.inputs, self.targets, self.loss_fn = inputs, targets, loss_fn
        self.m = len(inputs)
        self.states: dict[tuple[int, int], MicroState] = {}
        self.losses: list[torch.Tensor] = []
        self.loss_of: dict[int, torch.Tensor] = {}  # the same, by micro-batch (evaluation's rows)
        self.held = self.peak_held = self.held_bytes = self.peak_bytes = 0
        self.saved_chunk0: list[int] = []
        self.wait_s = 0.0

    def do(self, act: Action, nxt: Action | None, origin: float) -> Slot:
        """Wait for what `act` reads (the receive `nxt` needs is posted first), then run it."""
        start = time.perf_counter()
        if nxt is not None:
            self._prefetch(nxt)
        incoming = self._receive(act)
        begin = time.perf_counter()
        self.wait_s += begin - start
        getattr(self, f"_{act.kind}")(act, incoming)
        return Slot(act, begin - origin, time.perf_counter() - origin)

    def _need(self, act: Action) -> tuple[Key, int] | None:
        """The message `act` waits for, and the rank it comes from."""
        return message_in(act, self.rank, self.pp, self.num_stages - 1)

    def _receive(self, act: Action) -> torch.Tensor | None:
        need = self._need(act)
        return self.channels.recv(*need) if need else None

    def _prefetch(self, act: Action) -> None:
        need = self._need(act)
        if need:
            self.channels.post(*need)

    def _F(self, act: Action, incoming: torch.Tensor | None) -> None:
        stage = act.stage(self.rank, self.pp)
        inputs, module = self.inputs[act.microbatch], self.work[act.chunk].module
        if isinstance(inputs, Packed):  # every stage's attention and positions read the documents
            module.packed, inputs = inputs.to(self.device), inputs.ids
        # every pp rank holds the micro-batch's ids: a stage that runs its model's own forward reads them
        module.token_ids = inputs
        x = inputs.to(self.device) if incoming is None else incoming
        try:
            out, state = self.work[act.chunk].forward(x, grad_input=incoming is not None and torch.is_grad_enabled())
        finally:
            module.packed = module.token_ids = None  # a recomputation reads what the blocks were given, not these
        if stage == self.num_stages - 1:
            loss = self.loss_fn(out, self.targets[act.microbatch].to(out.device))
            self.losses.append(loss.detach())
            self.loss_of[act.microbatch] = self.losses[-1]
            state.output = loss / self.m
            if self.work[act.chunk].splits:  # I runs the loss's graph apart (`_through_the_loss`)
                state.loss_input = out
        else:
            self.channels.send(("act", act.microbatch, stage + 1), out, (stage + 1) % self.pp)
            let_go_of_values(out)
        if not torch.is_grad_enabled():
            self._release(act.microbatch, stage)
            return
        self.states[(act.microbatch, act.chunk)] = state
        self.held += 1
        self.held_bytes += state.saved_bytes
        self.peak_held, self.peak_bytes = max(self.peak_held, self.held), max(self.peak_bytes, self.held_bytes)
        if act.chunk == 0:
            self.saved_chunk0.append(state.saved_bytes)

    def _B(self, act: Action, incoming: torch.Tensor | None) -> None:
        state = self.states.pop((act.microbatch, act.chunk))
        self._send_grad(act, StageWork.backward(state, incoming))
        self.held -= 1
        self._done(act, state)

    def _I(self, act: Action, incoming: torch.Tensor | None) -> None:
        state = self.states[(act.microbatch, act.chunk)]
        self._send_grad(act, StageWork.backward_input(state, incoming))
        self.held -= 1

    def _W(self, act: Action, incoming: torch.Tensor | None) -> None:
        state = self.states.pop((act.microbatch, act.chunk))
        StageWork.backward_weight(state)
        self._done(act, state)

    def _send_grad(self, act: Action, grad: torch.Tensor | None) -> None:
        stage = act.stage(self.rank, self.pp)
        if stage > 0 and grad is not None:
            self.channels.send(("grad", act.microbatch, stage - 1), grad, (stage - 1) % self.pp)

    def _done(self, act: Action, state: MicroState) -> None:
        """The micro-batch is finished on this stage: free its buffers and its graph."""
        self.held_bytes -= state.saved_bytes
        self._release(act.microbatch, act.stage(self.rank, self.pp))

    def _release(self, mb: int, stage: int) -> None:
        self.channels.release(("act", mb, stage))
        self.channels.release(("grad", mb, stage))

    def stats(self, slots: list[Slot]) -> PipelineStats:
        return PipelineStats(self.peak_held, self.peak_bytes, self.channels.peak_sent_bytes,
                             tuple(self.saved_chunk0), self.wait_s,
                             sum(s.end - s.start for s in slots))
