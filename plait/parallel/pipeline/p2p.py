"""Point-to-point traffic between pipeline stages, all of it through `comm` (so in the ledger).

Three kinds of message cross a stage boundary:
- an activation, forward: stage k's output for micro-batch i, to stage k + 1;
- a gradient, backward: the gradient of stage k's input for micro-batch i, to stage k - 1;
- once per input shape, a shape message (`agree_shapes`), so that the receivers can size
  their buffers without a shape riding along with every activation.

Ordering. Between two ranks messages travel on one FIFO channel (torch's send/recv match in
posting order), and with interleaving one channel can carry activations *and* gradients,
which the receiver may need in another order than the sender sends them. The receiver
therefore never posts receives in its own order: knowing the whole schedule (it is data),
it posts them in the *sender's* order, up to the message it needs, and keeps the early ones
in buffers until their turn. Receive buffers come from a pool and are reused across steps.

A sent message is let go of once it is known delivered: when the backend says so
(NCCL), or when a later message from its receiver shows that the receiver had it
(`delivery_proofs`, from the schedule). Held to the step's end, a step's sends had
kept every micro-batch's activation and gradient at each boundary alive at once.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable

import torch

from plait.errors import PlaitError
from plait.schedule.action import Action
from plait.schedule.build import Schedule
from plait.runtime import comm
from plait.runtime.comm import Axis, Handle

Key = tuple[str, int, int]  # ("act" or "grad", micro-batch, stage the message is for)
Shape = tuple[tuple[int, ...], torch.dtype]
SETUP = comm.SETUP  # ledger purpose of the one-off shape messages
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
_META_LEN = 2 + 8  # ndim, dtype code, up to 8 dimensions


def message_in(act: Action, rank: int, pp: int, last: int) -> tuple[Key, int] | None:
    """The message `act` on `rank` waits for, and the pipeline rank it comes from."""
    stage = act.stage(rank, pp)
    if act.kind == "F" and stage > 0:
        return ("act", act.microbatch, stage), (stage - 1) % pp
    if act.kind in "BI" and stage < last:
        return ("grad", act.microbatch, stage), (stage + 1) % pp
    return None


def message_out(act: Action, rank: int, pp: int, last: int) -> tuple[Key, int] | None:
    """The message `act` on `rank` sends, and the pipeline rank it goes to."""
    stage = act.stage(rank, pp)
    if act.kind == "F" and stage < last:
        return ("act", act.microbatch, stage + 1), (stage + 1) % pp
    if act.kind in "BI" and stage > 0:
        return ("grad", act.microbatch, stage - 1), (stage - 1) % pp
    return None


def send_order(schedule: Schedule, pp: int, v: int) -> dict[tuple[int, int], list[Key]]:
    """For each (sender, receiver) pair of pipeline ranks, the messages in the order sent."""
    order: dict[tuple[int, int], list[Key]] = defaultdict(list)
    for rank, actions in enumerate(schedule):
        for act in actions:
            out = message_out(act, rank, pp, pp * v - 1)
            if out is not None:
                order[(rank, out[1])].append(out[0])
    return dict(order)


def delivery_proofs(schedule: Schedule, pp: int, v: int) -> dict[int, dict[Key, int]]:
    """For each rank, what each message it receives proves delivered: how many of the
    messages this rank sends its sender, counted in sending order, the sender had by then.

    A sent message must stay alive until it is delivered, and a step sends one per
    micro-batch and boundary each way. Gloo's send says it is done only once waited, and
    waiting for a message the peer has not asked for yet can block; but a peer that sends
    after receiving has received, and the schedule (data) says what. Between two ranks
    messages arrive in the order sent, so the peer having one has every one sent before it:
    the proof is a count."""
    last = pp * v - 1
    position = {pair: {key: i for i, key in enumerate(keys)} for pair, keys in send_order(schedule, pp, v).items()}
    proofs: dict[int, dict[Key, int]] = defaultdict(dict)
    for rank, actions in enumerate(schedule):
        had: dict[int, int] = defaultdict(int)  # by sender: how many of its messages `rank` has
        for act in actions:
            came = message_in(act, rank, pp, last)
            if came is not None and came[1] != rank:
                had[came[1]] = max(had[came[1]], position[(came[1], rank)][came[0]] + 1)
            out = message_out(act, rank, pp, last)
            if out is not None and out[1] != rank and had[out[1]]:
                proofs[out[1]][out[0]] = had[out[1]]
    return dict(proofs)


class Channels:
    """One rank's sends and receives for one step of one schedule.

    `shape_of(key)` sizes the receive buffer of a message; it comes from `agree_shapes`.
    A message between two stages on the same rank (pp = 1 with v > 1) is handed over
    locally without touching the network.
    """

    def __init__(self, axis: Axis, order: dict[tuple[int, int], list[Key]],
                 shape_of: Callable[[Key], Shape], pool: "BufferPool",
                 proofs: dict[Key, int] | None = None):
        """`proofs` is this rank's part of `delivery_proofs`: each message it receives says
        how many of the messages sent to its sender are delivered by then, and can be let go."""
        self.axis, self.rank, self.shape_of, self.pool = axis, axis.rank, shape_of, pool
        self._expected = {src: deque(keys) for (src, dst), keys in order.items()
                          if dst == self.rank and src != self.rank}
        self._posted: dict[Key, tuple[torch.Tensor, Handle]] = {}
        self._local: dict[Key, torch.Tensor] = {}
        self._sends: dict[Key, tuple[torch.Tensor, Handle]] = {}
        self._lent: dict[Key, torch.Tensor] = {}
        self._proofs = proofs or {}
        self._sent_to = {dst: keys for (src, dst), keys in order.items() if src == self.rank}
        self._delivered: dict[int, int] = defaultdict(int)  # by receiver: a prefix of `_sent_to`
        self.sent_bytes = self.peak_sent_bytes = 0  # bytes of sent messages not yet let go

    def send(self, key: Key, tensor: torch.Tensor, dst: int) -> None:
        """Start sending `tensor` (kept alive until it is known delivered, or `finish`)."""
        tensor = tensor.detach()
        if dst == self.rank:
            self._local[key] = tensor
            return
        tensor = tensor.contiguous()
        self._sends[key] = (tensor, comm.send(tensor, self.axis, dst))
        self.sent_bytes += tensor.numel() * tensor.element_size()
        self.peak_sent_bytes = max(self.peak_sent_bytes, self.sent_bytes)
        self._let_go_of_completed()

    def post(self, key: Key, src: int) -> None:
        """Post receives from `src`, in its sending order, up to and including `key`."""
        if src == self.rank or key in self._posted:
            return
        queue = self._expected.get(src)
        while queue:
            nxt = queue.popleft()
            shape, dtype = self.shape_of(nxt)
            buf = self.pool.take(shape, dtype)
            self._posted[nxt] = (buf, comm.recv(buf, self.axis, src))
            if nxt == key:
                return
        raise PlaitError(f"pipeline rank {self.rank} waits for {key} from rank {src}, "
                         "which the schedule never sends")

    def recv(self, key: Key, src: int) -> torch.Tensor:
        """The message `key` from `src`, once it has arrived."""
        if src == self.rank:
            return self._local.pop(key)
        self.post(key, src)
        buf, handle = self._posted.pop(key)
        handle.wait()
        self._lent[key] = buf
        delivered = self._proofs.get(key, 0)
        for sent in self._sent_to.get(src, [])[self._delivered[src]:delivered]:
            self._let_go(sent)
        self._delivered[src] = max(self._delivered[src], delivered)
        self._let_go_of_completed()
        return buf

    def _let_go(self, key: Key) -> None:
        """Drop a sent message (its wait returns at once: it is delivered)."""
        entry = self._sends.pop(key, None)
        if entry is not None:
            tensor, handle = entry
            handle.wait()
            self.sent_bytes -= tensor.numel() * tensor.element_size()

    def _let_go_of_completed(self) -> None:
        """Drop the sent messages the backend says are done (NCCL's report it; Gloo's not)."""
        for key in [key for key, (_, handle) in self._sends.items() if handle.completed()]:
            self._let_go(key)

    def release(self, key: Key) -> None:
        """The receiver is done with message `key`: its buffer goes back to the pool."""
        buf = self._lent.pop(key, None)
        if buf is not None:
            self.pool.give(buf)

    def finish(self) -> None:
        """Wait for every send; every expected message must have been received."""
        for key in list(self._sends):
            self._let_go(key)
        left = [k for q in self._expected.values() for k in q] + list(self._posted) + list(self._local)
        if left:
            raise PlaitError(f"pipeline rank {self.rank} ended a step with messages unread: {left[:3]}")


class BufferPool:
    """Receive buffers by (shape, dtype), reused from step to step instead of reallocated."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: dict[Shape, list[torch.Tensor]] = defaultdict(list)
        self.allocated = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        free = self._free[(shape, dtype)]
        if free:
            return free.pop()
        self.allocated += 1
        return torch.empty(shape, dtype=dtype, device=self.device)

    def give(self, tensor: torch.Tensor) -> None:
        self._free[(tuple(tensor.shape), tensor.dtype)].append(tensor)


def agree_shapes(stages: dict[int, torch.nn.Module], axis: Axis, num_stages: int,
                 first_input: torch.Tensor) -> dict[int, Shape]:
    """Output shape and dtype of every stage this rank holds or receives from, agreed once.

    Stages are visited in order; stage k learns its input shape from stage k - 1 (one small
    message), runs one forward on zeros of that shape without autograd to learn its output
    shape, and tells stage k + 1. Every later message of that shape is sent bare.
    Returns {stage: output shape} for this rank's stages and the stages that feed them.
    """
    pp, rank = axis.size, axis.rank
    shapes: dict[int, Shape] = {}
    sends: list[tuple[torch.Tensor, Handle]] = []
    for k in sorted(stages):
        if k == 0:
            x = first_input
        else:
            if (k - 1) % pp != rank:
                meta = torch.zeros(_META_LEN, dtype=torch.int64, device=first_input.device)
                comm.recv(meta, axis, (k - 1) % pp, purpose=SETUP).wait()
                shapes[k - 1] = _decode(meta)
            shape, dtype = shapes[k - 1]
            x = torch.zeros(shape, dtype=dtype, device=first_input.device)
        stages[k].token_ids = getattr(first_input, "ids", first_input)  # as the step hands every stage
        try:
            with torch.no_grad():
                y = stages[k](x)
        finally:
            stages[k].token_ids = None
        shapes[k] = (tuple(y.shape), y.dtype)
        if k < num_stages - 1 and (k + 1) % pp != rank:
            meta = _encode(shapes[k]).to(first_input.device)
            sends.append((meta, comm.send(meta, axis, (k + 1) % pp, purpose=SETUP)))
    for _, handle in sends:
        handle.wait()
    return shapes


def _encode(shape: Shape) -> torch.Tensor:
    dims, dtype = shape
    if len(dims) > _META_LEN - 2 or dtype not in _DTYPES:
        raise PlaitError(f"a pipeline stage output of shape {dims} and dtype {dtype} cannot be sent",
                         hint=f"stage outputs need at most {_META_LEN - 2} dims and a dtype in {_DTYPES}")
    return torch.tensor([len(dims), _DTYPES.index(dtype), *dims, *[0] * (_META_LEN - 2 - len(dims))])


def _decode(meta: torch.Tensor) -> Shape:
    values = meta.tolist()
    return tuple(values[2:2 + values[0]]), _DTYPES[values[1]]


def sum_tied_grads(param: torch.nn.Parameter, axis: Axis, peer: int) -> None:
    """Add the gradient of the other copy of a tied weight (held by pipeline rank `peer`)."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    add_from_peer(param.grad, axis, peer)


def add_from_peer(tensor: torch.Tensor, axis: Axis, peer: int) -> None:
    """tensor += the same-shaped tensor of pipeline rank `peer`, which does the same.

    Both ranks send theirs and add what they receive: a + b on one rank, b + a on the
    other, which floating point makes bitwise equal, so the copies never drift apart.
    """
    theirs = torch.empty_like(tensor)
    sent = comm.send(tensor.contiguous(), axis, peer)
    comm.recv(theirs, axis, peer).wait()
    sent.wait()
    tensor.add_(theirs)
