"""The ring formula: bytes one rank puts on the wire per collective (and per expert dispatch).

Its one home, below both `runtime/` (the ledger counts what was moved with it) and
`estimate/` (predictions use it), so that a prediction and a measurement can never drift
apart and neither layer imports the other. Pure arithmetic, no torch.

With S the bytes of the full tensor and n ranks in the group, a ring moves per rank
  all_reduce 2(n-1)/n·S (a reduce-scatter then an all-gather);
  all_gather, reduce_scatter, all_to_all (n-1)/n·S (all_to_all keeps its own 1/n part);
  broadcast, send, recv S;
  scatter and gather (n-1)/n·S (the root's share, S/n to each other rank);
  reduce S (a pipelined chain: each rank passes on a full partial sum).
"""

from __future__ import annotations


def ring_bytes(op: str, payload: float, n: int) -> float:
    """Bytes one rank sends for `op` on a `payload`-byte tensor among n ranks."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n * payload
    if op in ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"):
        return (n - 1) / n * payload
    if op in ("broadcast", "reduce", "send", "recv"):
        return float(payload)
    raise ValueError(f"unknown collective {op!r}")


COUNT_BYTES = 8  # an expert dispatch's counts travel as int64


def dispatch_bytes(sent_rows: float, received_rows: float, row_bytes: int, experts: int, ep: int,
                   backward: bool) -> float:
    """Bytes one rank puts on the wire for one expert dispatch (one MoE block, one forward):
    the counts' all-to-all of E int64 ((ep-1)/ep of them, the ring formula), the rows it sends
    to other ranks and the rows it returns to them; `backward`: the same rows' gradients again.
    The ledger's check (plait.parallel.expert.dispatch, on the rows it actually sent) and the
    estimate (plait.estimate.experts, on uniform routing) share it."""
    rows = (sent_rows + received_rows) * row_bytes
    return ring_bytes("all_to_all", experts * COUNT_BYTES, ep) + rows * (2 if backward else 1)
