"""A mixture of experts' costs: the all-to-all's bytes, memory of experts / ep, active FLOPs.

Pure arithmetic. One dispatch (one MoE layer, one forward) from one rank of an ep group:

    counts   all-to-all of E int64 counts          (ep-1)/ep · 8E        (ring formula)
    rows     the rows it sends to other ranks      s · d · b
             the rows it returns to them           r · d · b
    backward the same rows' gradients, reversed    (s + r) · d · b

where s and r are the (token, choice) assignments this rank sends to experts held elsewhere
and receives from other ranks. On the routing that happened (the ledger's check, measured
by plait.parallel.expert.dispatch) s and r are counted; for a prediction, uniform routing
gives s = r = tokens · top_k · (ep-1)/ep.
"""

from __future__ import annotations

from plait.wire import ring_bytes

COUNT_BYTES = 8  # the counts travel as int64


def dispatch_bytes(sent_rows: float, received_rows: float, row_bytes: int, experts: int, ep: int,
                   backward: bool) -> float:
    """Bytes one rank puts on the wire for one dispatch: forward, plus backward when `backward`."""
    rows = (sent_rows + received_rows) * row_bytes
    return ring_bytes("all_to_all", experts * COUNT_BYTES, ep) + rows * (2 if backward else 1)


def uniform_rows(tokens: int, top_k: int, ep: int) -> float:
    """Assignments a rank sends to (and, by symmetry, receives from) other ep ranks when the
    router spreads them evenly: all but the 1/ep that stay."""
    return tokens * top_k * (ep - 1) / ep
