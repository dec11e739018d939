"""The ring formula: bytes one rank puts on the wire per collective.

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
