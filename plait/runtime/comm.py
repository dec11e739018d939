"""Instrumented collectives: every byte plait moves passes through here and is counted.

The `Ledger` records, per axis and op, the payload and the bytes this rank puts on the wire
under a ring algorithm. That is what lets a test assert that DDP moves exactly
2(n-1)/n·Ψ·b per step, and what `metrics.jsonl` reports as `comm`.

Ring costs per rank, with S the bytes of the full tensor and n ranks in the group:
- all-reduce: 2(n-1)/n·S (a reduce-scatter then an all-gather, each moving (n-1)/n·S)
- all-gather, reduce-scatter, all-to-all: (n-1)/n·S
- broadcast, reduce, send: S (recv puts nothing on the wire; it is counted as what arrives)
- scatter, gather: (n-1)/n·S at the root, which sends (receives) every other rank's part
"""

from __future__ import annotations

import pickle

import math
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from plait.errors import PlaitError
from plait.runtime.inject import maybe_inject
from plait.wire import ring_bytes as ring_wire_bytes  # one formula, shared with estimate/

OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "send", "recv", "reduce", "scatter",
       "gather")
TRAIN = "train"  # traffic that trains the model
TELEMETRY = "telemetry"  # traffic that only gathers numbers for the report
SETUP = "setup"  # what a run sends once before training (the model's broadcast, shapes, checks)
CONTROL = "control"  # a few numbers every rank must agree on (are this step's gradients finite?)


def naive_exchange_bytes(payload: int, n: int) -> int:
    """Total bytes if every rank sent its whole tensor to every other: S·N·(N-1).

    The seeds' formula for a naive gradient exchange; ring all-reduce moves 2(N-1)·S in
    total instead, which is why it wins as N grows.
    """
    return payload * n * (n - 1)


@dataclass
class Tally:
    calls: int = 0
    payload: int = 0
    wire: float = 0.0


@dataclass
class Ledger:
    """Counts of every collective, keyed by (purpose, axis, op)."""

    tallies: dict[tuple[str, str, str], Tally] = field(default_factory=lambda: defaultdict(Tally))
    recorder: Any = None  # a recorder.FlightRecorder once the mesh has a store; names stuck ranks

    def record(self, axis: str, op: str, payload: int, n: int, purpose: str = TRAIN,
               wire: float | None = None) -> None:
        """`wire`: the bytes this rank sent, where the ring formula does not give them (an
        all-to-all with uneven parts sends what it does not keep)."""
        tally = self.tallies[(purpose, axis, op)]
        tally.calls += 1
        tally.payload += payload
        tally.wire += ring_wire_bytes(op, payload, n) if wire is None else wire

    def wire(self, purpose: str = TRAIN) -> dict[str, dict[str, float]]:
        """{axis: {op: wire bytes}} so far, for one purpose."""
        out: dict[str, dict[str, float]] = {}
        for (p, axis, op), tally in sorted(self.tallies.items()):
            if p == purpose and tally.calls:
                out.setdefault(axis, {})[op] = tally.wire
        return out

    def calls(self, purpose: str = TRAIN) -> int:
        return sum(t.calls for (p, _, _), t in self.tallies.items() if p == purpose)

    def snapshot(self) -> dict[tuple[str, str, str], Tally]:
        return {key: Tally(t.calls, t.payload, t.wire) for key, t in self.tallies.items()}

    def move_since(self, snapshot: dict[tuple[str, str, str], Tally], purpose: str) -> None:
        """Count what was recorded for training after `snapshot` as `purpose` instead (a check
        before training runs the training code, and sends what that sends)."""
        for (p, axis, op), tally in list(self.tallies.items()):
            before = snapshot.get((p, axis, op), Tally())
            if p != TRAIN or tally.calls == before.calls:
                continue
            moved = self.tallies[(purpose, axis, op)]
            moved.calls += tally.calls - before.calls
            moved.payload += tally.payload - before.payload
            moved.wire += tally.wire - before.wire
            tally.calls, tally.payload, tally.wire = before.calls, before.payload, before.wire

    def since(self, snapshot: dict[tuple[str, str, str], Tally],
              purpose: str = TRAIN) -> dict[str, dict[str, float]]:
        """{axis: {op: wire bytes}} recorded after `snapshot` was taken."""
        out: dict[str, dict[str, float]] = {}
        for key, tally in sorted(self.tallies.items()):
            p, axis, op = key
            before = snapshot.get(key, Tally())
            if p == purpose and tally.calls > before.calls:
                out.setdefault(axis, {})[op] = tally.wire - before.wire
        return out


@dataclass(frozen=True)
class Axis:
    """One axis of the mesh as this rank sees it: its group, size, and the shared ledger."""

    name: str
    size: int
    rank: int
    group: Any  # a ProcessGroup, or None when the axis has one rank
    ledger: Ledger
    global_rank: int = 0

    def __deepcopy__(self, memo: dict) -> "Axis":
        # A handle on a process group: a copied module must talk to the same ranks.
        return self


class CommError(PlaitError):
    """A collective failed or timed out; the message names the rank, the op and the group."""


class Handle:
    """An in-flight collective; `wait()` turns torch's errors into ones that name the op."""

    def __init__(self, work: Any, axis: Axis, op: str, entry: Any = None):
        self._work, self._axis, self._op, self._entry = work, axis, op, entry

    def completed(self) -> bool:
        """Done, as far as the backend can tell without waiting (Gloo's sends: only once waited)."""
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:  # None: a blocking call, done already
            try:
                self._work.wait()
            except RuntimeError as exc:
                raise _comm_error(self._axis, self._op, exc, self._entry) from exc
            finally:
                self._work = None
        if self._entry is not None:
            self._axis.ledger.recorder.finish(self._entry)
            self._entry = None


def _comm_error(axis: Axis, op: str, exc: Exception, entry: Any = None) -> CommError:
    """Name the op and group, and (from the flight recorder) the ranks that never entered it."""
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    first_line = re.sub(r"^\[[^\]]*\]\s*", "", first_line)  # drop the "[/path/file.cc:78]" prefix
    first_line = first_line.split(". ")[0].rstrip(".")  # the first sentence: torch's advice follows
    recorder = axis.ledger.recorder
    culprit = recorder.diagnose(entry) if recorder is not None else ""
    where = f" (step {entry.step})" if entry is not None and entry.step else ""
    suspects = ", ".join(map(str, recorder.culprits)) if recorder is not None else ""
    error = CommError(
        f"rank {axis.global_rank}: {op} on the {axis.name} group ({axis.size} ranks){where} failed: {first_line}{culprit}",
        hint=f"look at rank {suspects}'s output (or its stack: py-spy dump); raise --timeout if it is only slow"
        if suspects else "another rank probably died or is stuck; check its output above, or raise --timeout",
    )
    if recorder is not None:
        recorder.report(axis.global_rank, error.message)
        error.recorder = recorder
    return error


def _run(axis: Axis, op: str, call: Any, async_op: bool, peer: int | None = None) -> Handle:
    recorder = axis.ledger.recorder
    entry = recorder.enter(axis.name, op, peer) if recorder is not None else None
    try:
        work = call()
    except RuntimeError as exc:
        raise _comm_error(axis, op, exc, entry) from exc
    handle = Handle(work, axis, op, entry)
    if not async_op:
        handle.wait()
    return handle


def mark_step(ledger: Ledger, step: int) -> None:
    """Tell the flight recorder which optimizer step the next collectives belong to."""
    if ledger.recorder is not None:
        ledger.recorder.begin_step(step)
        maybe_inject(ledger.recorder.rank, step, before=ledger.recorder.publish)


def settle_after_failure(exc: BaseException) -> None:
    """Before a rank leaves after a failed collective: the store's host waits for the others
    to finish reading it (see recorder.FlightRecorder.linger)."""
    recorder = getattr(exc, "recorder", None)
    if recorder is not None:
        recorder.linger()


# torch 2.13 names the one-tensor gather and reduce-scatter `*_single` and deprecates the older
# names; torch 2.11 (pyproject allows >= 2.4) has only the older ones. Same arguments in both.
_ALL_GATHER_ONE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER_ONE = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(tensor: torch.Tensor, axis: Axis, op: str = "sum", async_op: bool = False,
               purpose: str = TRAIN) -> Handle:
    """In-place all-reduce of `tensor` over `axis`."""
    if axis.size == 1:
        return Handle(None, axis, "all_reduce")
    axis.ledger.record(axis.name, "all_reduce", _nbytes(tensor), axis.size, purpose)
    if _by_all_to_all("all_reduce", tensor):
        return _run(axis, "all_reduce", lambda: _all_reduce_by_all_to_all(tensor, axis, op), async_op)
    return _run(axis, "all_reduce", lambda: dist.all_reduce(
        tensor, op=_REDUCE_OPS[op], group=axis.group, async_op=async_op), async_op)


def broadcast(tensor: torch.Tensor, axis: Axis, src: int = 0, purpose: str = TRAIN) -> None:
    """In-place broadcast from the rank whose index along `axis` is `src`."""
    if axis.size == 1:
        return
    axis.ledger.record(axis.name, "broadcast", _nbytes(tensor), axis.size, purpose)
    group_src = dist.get_global_rank(axis.group, src)
    _run(axis, "broadcast", lambda: dist.broadcast(tensor, src=group_src, group=axis.group), False)


# Past this, a tensor is broadcast alone: packing it would only copy it twice.
PACKED_BROADCAST_BYTES = 32 << 20


def broadcast_many(tensors: list[torch.Tensor], axis: Axis, src: int = 0, purpose: str = TRAIN) -> None:
    """Broadcast each of `tensors` in place, the small ones packed: one flat broadcast for each
    run of them of one device and dtype, up to PACKED_BROADCAST_BYTES.

    A model's set-up broadcast is one message a parameter and buffer: a tiny transformers
    model's 30-odd are 30 round trips of a few hundred bytes, 2.3 ms each on Gloo here, where
    torch DDP packs its state into buckets (`_sync_module_states`). The ledger counts each
    packed broadcast as one, with the same bytes."""
    if axis.size == 1:
        return
    for group in _broadcast_groups(tensors):
        if len(group) == 1 and group[0].is_contiguous():
            broadcast(group[0], axis, src, purpose)
            continue
        flat = torch.cat([tensor.reshape(-1) for tensor in group])
        broadcast(flat, axis, src, purpose)
        for tensor, value in zip(group, flat.split([tensor.numel() for tensor in group])):
            tensor.copy_(value.view_as(tensor))


def broadcast_each(pairs: list[tuple[torch.Tensor, Axis]], purpose: str = TRAIN) -> None:
    """Broadcast each tensor in place over its own axis, from the axis's first rank, packed
    axis by axis (`broadcast_many`) in the order each axis is first met: the same order on
    every rank of a model built alike (a parameter replicated over edp beside the dp ones)."""
    by_axis: dict[int, tuple[Axis, list[torch.Tensor]]] = {}
    for tensor, axis in pairs:
        by_axis.setdefault(id(axis), (axis, []))[1].append(tensor)
    for axis, tensors in by_axis.values():
        broadcast_many(tensors, axis, purpose=purpose)


def _broadcast_groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`tensors` in packs of one device and dtype, each up to PACKED_BROADCAST_BYTES (a larger
    tensor alone), in the order each pack is first met: the same packs on every rank."""
    open_packs: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    filled: dict[tuple[torch.device, torch.dtype], int] = {}
    packs: list[list[torch.Tensor]] = []
    for tensor in tensors:
        key = (tensor.device, tensor.dtype)
        if key not in open_packs or filled[key] + _nbytes(tensor) > PACKED_BROADCAST_BYTES:
            open_packs[key], filled[key] = [], 0
            packs.append(open_packs[key])
        open_packs[key].append(tensor)
        filled[key] += _nbytes(tensor)
    return packs


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_gather(output: torch.Tensor, shard: torch.Tensor, axis: Axis, async_op: bool = False,
               purpose: str = TRAIN) -> Handle:
    """Concatenate every rank's `shard` (same size everywhere) into `output` along dim 0."""
    if axis.size == 1:
        output.copy_(shard.reshape(output.shape))
        return Handle(None, axis, "all_gather")
    axis.ledger.record(axis.name, "all_gather", _nbytes(output), axis.size, purpose)
    if _by_all_to_all("all_gather", output):
        return _run(axis, "all_gather", lambda: _all_gather_by_all_to_all(output, shard, axis), async_op)
    return _run(axis, "all_gather", lambda: _ALL_GATHER_ONE(
        output, shard, group=axis.group, async_op=async_op), async_op)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, axis: Axis, async_op: bool = False,
                   purpose: str = TRAIN, native: bool = False) -> Handle:
    """Sum `full` over the axis and keep this rank's 1/n slice of dim 0 in `output`. `native`:
    the backend's own reduce-scatter at any size (a probe of whether it has one)."""
    if axis.size == 1:
        output.copy_(full.reshape(output.shape))
        return Handle(None, axis, "reduce_scatter")
    axis.ledger.record(axis.name, "reduce_scatter", _nbytes(full), axis.size, purpose)
    if not native and _by_all_to_all("reduce_scatter", full):
        return _run(axis, "reduce_scatter", lambda: _reduce_scatter_by_all_to_all(output, full, axis), async_op)
    return _run(axis, "reduce_scatter", lambda: _REDUCE_SCATTER_ONE(
        output, full, group=axis.group, async_op=async_op), async_op)


# Gloo (the backend of every CPU tensor here) runs an all-reduce, an all-gather and a
# reduce-scatter as a segmented ring: a 2-rank all-reduce of four numbers sends a dozen messages
# one after another, 1.6-1.9 ms back to back on a 2-core host, where its all-to-all posts every
# send at once, 0.4 ms. Up to these sizes (bytes: the all-reduce's tensor, the all-gather's
# output, the reduce-scatter's input) each runs as one all-to-all and a combine in rank order,
# the same result on every rank: benchmarks/gloo_collectives.py times both ways (RESULTS.md,
# "gloo-collectives"); past them the ring's fewer bytes, or the all-gather's one copy, win. The
# reduce-scatter's all-to-all won at every size timed, but it stops where the others do: the
# calibration times ZeRO's collectives at 2 or 16 MiB, and a bucket (25 MiB by default) must take
# the path its rate was timed on. The ledger counts the collective each stands for.
GLOO_BY_ALL_TO_ALL = {"all_reduce": 64 << 10, "all_gather": 256 << 10, "reduce_scatter": 256 << 10}


def _by_all_to_all(op: str, tensor: torch.Tensor) -> bool:
    return tensor.is_cpu and tensor.is_contiguous() and _nbytes(tensor) <= GLOO_BY_ALL_TO_ALL[op]


def _copies(tensor: torch.Tensor, n: int) -> torch.Tensor:
    """`tensor`'s elements n times over, one row each: what an all-to-all sends every rank."""
    return tensor.reshape(1, -1).expand(n, -1).contiguous()


def _combined(rows: torch.Tensor, op: str) -> torch.Tensor:
    """`rows` (an all-to-all's received scratch) combined along dim 0, one after another in rank
    order (the same sum on every rank); a sum lands in the first row."""
    if op == "max":
        return rows.amax(0)
    if op == "min":
        return rows.amin(0)
    total = rows[0]
    for row in rows[1:]:
        total += row
    return total


class _ThenCombine:
    """An all-to-all in flight, and what makes its output the collective's result once it lands
    (it holds what it sends until then)."""

    def __init__(self, work: Any, sent: torch.Tensor, finish: Callable[[], Any] = lambda: None):
        self.work, self.sent, self.finish = work, sent, finish

    def wait(self) -> None:
        self.work.wait()
        self.sent = None
        self.finish()


def _all_to_all(received: torch.Tensor, sent: torch.Tensor, axis: Axis,
                finish: Callable[[], Any] = lambda: None) -> _ThenCombine:
    return _ThenCombine(dist.all_to_all_single(received, sent, group=axis.group, async_op=True), sent, finish)


def _all_reduce_by_all_to_all(tensor: torch.Tensor, axis: Axis, op: str) -> _ThenCombine:
    received = torch.empty((axis.size, tensor.numel()), dtype=tensor.dtype)
    return _all_to_all(received, _copies(tensor, axis.size), axis,
                       lambda: tensor.copy_(_combined(received, op).view_as(tensor)))


def _all_gather_by_all_to_all(output: torch.Tensor, shard: torch.Tensor, axis: Axis) -> _ThenCombine:
    return _all_to_all(output.view(axis.size, -1), _copies(shard, axis.size), axis)


def _reduce_scatter_by_all_to_all(output: torch.Tensor, full: torch.Tensor, axis: Axis) -> _ThenCombine:
    received = torch.empty((axis.size, full.numel() // axis.size), dtype=full.dtype)
    return _all_to_all(received, full.reshape(axis.size, -1), axis,
                       lambda: output.copy_(_combined(received, "sum").view_as(output)))


def all_to_all(output: torch.Tensor, full: torch.Tensor, axis: Axis, async_op: bool = False,
               purpose: str = TRAIN) -> Handle:
    """Cut `full` into n equal parts along dim 0 and send part j to rank j; `output` gets the
    parts every rank sent this one, in rank order."""
    if axis.size == 1:
        output.copy_(full.reshape(output.shape))
        return Handle(None, axis, "all_to_all")
    axis.ledger.record(axis.name, "all_to_all", _nbytes(full), axis.size, purpose)
    return _run(axis, "all_to_all", lambda: dist.all_to_all_single(
        output, full, group=axis.group, async_op=async_op), async_op)


def all_to_all_uneven(output: torch.Tensor, full: torch.Tensor, out_splits: list[int], in_splits: list[int],
                      axis: Axis, purpose: str = TRAIN) -> None:
    """Send `full`'s rows in_splits[j] (in order) to rank j; `output` gets out_splits[j] rows
    from each rank j, in rank order. Any part may be empty. The ledger counts the rows this
    rank sent to the others: the payload, less the part it keeps."""
    if axis.size == 1:
        output.copy_(full.reshape(output.shape))
        return
    row = math.prod(full.shape[1:]) * full.element_size()
    sent = (sum(in_splits) - in_splits[axis.rank]) * row
    axis.ledger.record(axis.name, "all_to_all", _nbytes(full), axis.size, purpose, wire=sent)
    _run(axis, "all_to_all", lambda: dist.all_to_all_single(
        output, full, output_split_sizes=out_splits, input_split_sizes=in_splits, group=axis.group), False)


def send(tensor: torch.Tensor, axis: Axis, dst: int, purpose: str = TRAIN) -> Handle:
    """Send to the rank whose index along `axis` is `dst` (returns at once; wait before reuse)."""
    axis.ledger.record(axis.name, "send", _nbytes(tensor), axis.size, purpose)
    peer = dist.get_global_rank(axis.group, dst)
    return _run(axis, "send", lambda: dist.isend(tensor, dst=peer, group=axis.group), True, peer)


def recv(tensor: torch.Tensor, axis: Axis, src: int, purpose: str = TRAIN) -> Handle:
    """Receive from the rank whose index along `axis` is `src` (wait before reading)."""
    axis.ledger.record(axis.name, "recv", _nbytes(tensor), axis.size, purpose)
    peer = dist.get_global_rank(axis.group, src)
    return _run(axis, "recv", lambda: dist.irecv(tensor, src=peer, group=axis.group), True, peer)


def send_recv(tensor: torch.Tensor, received: torch.Tensor, axis: Axis, dst: int, src: int,
              purpose: str = TRAIN) -> Handle:
    """Send `tensor` to the rank whose index along `axis` is `dst` and receive `received`
    from `src`, posted together (returns at once; wait before reading or reusing either).

    One batched pair rather than a send then a receive: where both peers are each other's
    `dst` and `src` (a ring of two) NCCL may hold a large send until its receive is posted,
    and two separate sends would then wait on each other."""
    axis.ledger.record(axis.name, "send", _nbytes(tensor), axis.size, purpose)
    axis.ledger.record(axis.name, "recv", _nbytes(received), axis.size, purpose)
    to, sender = dist.get_global_rank(axis.group, dst), dist.get_global_rank(axis.group, src)
    ops = [dist.P2POp(dist.isend, tensor, to, axis.group), dist.P2POp(dist.irecv, received, sender, axis.group)]
    return _run(axis, "send_recv", lambda: _Works(dist.batch_isend_irecv(ops)), True, to)


class _Works:
    """Several in-flight works waited as one."""

    def __init__(self, works: list[Any]):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def reduce(tensor: torch.Tensor, axis: Axis, dst: int = 0, op: str = "sum",
           purpose: str = TRAIN) -> None:
    """Sum (or max/min) `tensor` over the axis into the rank whose index is `dst`; the
    others' tensors are left undefined (Gloo may use them as scratch)."""
    if axis.size == 1:
        return
    axis.ledger.record(axis.name, "reduce", _nbytes(tensor), axis.size, purpose)
    peer = dist.get_global_rank(axis.group, dst)
    _run(axis, "reduce", lambda: dist.reduce(tensor, dst=peer, op=_REDUCE_OPS[op], group=axis.group), False)


def scatter(output: torch.Tensor, full: torch.Tensor | None, axis: Axis, src: int = 0,
            purpose: str = TRAIN) -> None:
    """Rank `src` cuts `full` into n equal parts along dim 0; rank i receives part i in
    `output`. Only `src` needs `full` (others may pass None). Counted as S = n·|output|."""
    if axis.size == 1:
        output.copy_(full.reshape(output.shape))
        return
    axis.ledger.record(axis.name, "scatter", _nbytes(output) * axis.size, axis.size, purpose)
    peer = dist.get_global_rank(axis.group, src)
    parts = list(full.chunk(axis.size)) if axis.rank == src else None
    _run(axis, "scatter", lambda: dist.scatter(output, parts, src=peer, group=axis.group), False)


def gather(full: torch.Tensor | None, shard: torch.Tensor, axis: Axis, dst: int = 0,
           purpose: str = TRAIN) -> None:
    """Rank `dst` receives every rank's `shard`, concatenated along dim 0 into `full`
    (others may pass None). Counted as S = n·|shard|."""
    if axis.size == 1:
        full.copy_(shard.reshape(full.shape))
        return
    axis.ledger.record(axis.name, "gather", _nbytes(shard) * axis.size, axis.size, purpose)
    peer = dist.get_global_rank(axis.group, dst)
    parts = list(full.chunk(axis.size)) if axis.rank == dst else None
    _run(axis, "gather", lambda: dist.gather(shard, parts, dst=peer, group=axis.group), False)


def barrier(axis: Axis) -> None:
    """Wait until every rank of `axis` arrives (carries no data, so the ledger has no entry)."""
    if axis.size == 1:
        return
    _run(axis, "barrier", lambda: dist.barrier(group=axis.group), False)


def broadcast_object(value: Any, axis: Axis, src: int = 0, purpose: str = "checkpoint") -> Any:
    """`value` from the rank whose index along `axis` is `src`, on every rank (a picklable plan;
    small: it is pickled whole). Counted as its pickled bytes broadcast."""
    if axis.size == 1:
        return value
    box = [value if axis.rank == src else None]
    axis.ledger.record(axis.name, "broadcast", len(pickle.dumps(value)) if axis.rank == src else 0, axis.size, purpose)
    group_src = dist.get_global_rank(axis.group, src)
    _run(axis, "broadcast", lambda: _done(dist.broadcast_object_list(box, src=group_src, group=axis.group)), False)
    return box[0]


def gather_objects(payload: list[Any], axis: Axis, consume: Callable[[list[Any]], None], dst: int = 0,
                   purpose: str = "checkpoint") -> None:
    """Rank `dst` calls `consume` on every rank's picklable `payload` (a list; tensors on the
    CPU), in rank order, one rank's at a time: it never holds more than one other rank's
    share (a gather would pad every share to the largest and hold them all at once). For what
    has no common shape across ranks (the pieces of a model each rank holds). Counted as the
    tensors' bytes each rank sends, as a gather's S would be summed."""
    tensors = [t for item in payload for t in (item if isinstance(item, (tuple, list)) else (item,))
               if isinstance(t, torch.Tensor)]
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("gather_objects sends CPU tensors: move them first (pickled device tensors land on "
                         "the receiver's device of the same index)")
    if axis.size == 1 or axis.rank == dst:
        consume(payload)
    if axis.size == 1:
        return
    axis.ledger.record(axis.name, "gather", sum(_nbytes(t) for t in tensors) * axis.size, axis.size, purpose)
    peer = dist.get_global_rank(axis.group, dst)
    if axis.rank != dst:
        _run(axis, "send", lambda: _done(dist.send_object_list([payload], dst=peer, group=axis.group)), False, peer)
        return
    for rank in range(axis.size):
        if rank != dst:
            received: list[Any] = [None]
            source = dist.get_global_rank(axis.group, rank)
            _run(axis, "recv", lambda: _done(dist.recv_object_list(received, src=source, group=axis.group)), False,
                 source)
            consume(received[0])


def _done(_: Any) -> None:
    """A blocking call's result (send_object_list answers with a count, not a work): nothing to wait on."""
    return None
