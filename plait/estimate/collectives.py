"""What a collective's measured time means: nccl-tests' size, algbw and busbw, as arithmetic.

nccl-tests (NVIDIA's benchmark of NCCL) reports, for an op on a buffer of S bytes that took
t seconds on n ranks:
  algbw = S / t        (S: the whole buffer: all-gather's output, reduce-scatter's input,
                        scatter's and gather's buffer at the root, the message of a send)
  busbw = algbw · factor(op, n)
The factor turns algbw into the speed each rank's link actually ran at under the best
algorithm, so that every op can be compared with the link's bandwidth and with each other:
an all-reduce moves 2(n-1)/n·S through every rank's link (reduce-scatter then all-gather),
an all-gather or reduce-scatter (n-1)/n·S, a scatter or gather (n-1)/n·S through the root's,
a broadcast or reduce (pipelined along a chain) S, a send S. These are also the bytes the
ledger (plait/runtime/comm.py) counts per rank, so factor·S is what the ledger must show.
"""

from __future__ import annotations

from plait.wire import ring_bytes

PRIMITIVES = ("broadcast", "scatter", "reduce", "gather", "all_gather", "reduce_scatter",
              "all_reduce", "send_recv")

FACTOR_TEXT = {"all_reduce": "2(n-1)/n", "all_gather": "(n-1)/n", "reduce_scatter": "(n-1)/n",
               "scatter": "(n-1)/n", "gather": "(n-1)/n", "broadcast": "1", "reduce": "1",
               "send_recv": "1"}


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor of `op` on n ranks: the bytes per byte of S that the
    ring formula (plait.wire, which the ledger counts with) puts through each rank's link."""
    if op not in FACTOR_TEXT:
        raise ValueError(f"unknown collective {op!r}")
    if n <= 1:
        return float(FACTOR_TEXT[op] == "1")
    return ring_bytes("send" if op == "send_recv" else op, 1.0, n)


def bandwidths(op: str, size: float, seconds: float, n: int) -> tuple[float, float]:
    """(algbw, busbw) in bytes per second."""
    algbw = size / seconds if seconds > 0 else float("inf")
    return algbw, algbw * busbw_factor(op, n)


def parse_size(text: str) -> int:
    """'1K' -> 1024, '256M' -> 268435456, '4096' -> 4096 (binary units, as nccl-tests)."""
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    number = text[:-1] if scale > 1 else text
    if not number.isdigit() or int(number) < 1:
        raise ValueError(text)
    return int(number) * scale


def size_range(spec: str, factor: int = 2) -> list[int]:
    """'1K:256M' -> 1K, 2K, 4K, ... 256M (each `factor` times the last); 'A' -> [A]."""
    low, _, high = spec.partition(":")
    start, stop = parse_size(low), parse_size(high or low)
    if stop < start or factor < 2:
        raise ValueError(spec)
    sizes = [start]
    while sizes[-1] * factor <= stop:
        sizes.append(sizes[-1] * factor)
    return sizes
