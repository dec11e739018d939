"""The seven collective primitives and send/recv, each run, checked and timed on one group.

Every op gets inputs whose right answer is known exactly (small integers in float32, so
sums are exact), runs once through plait's instrumented collectives, and each rank compares
what it got with that answer: `torch.equal`, not a tolerance. The ledger's bytes for that
one call are kept beside nccl-tests' formula (plait/estimate/collectives.py). Then the op is
timed: a barrier, the op, the clock; the time of an iteration is the slowest rank's, and the
reported time is the median over iterations.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from plait.estimate.collectives import PRIMITIVES, FACTOR_TEXT, bandwidths, busbw_factor
from plait.runtime import comm
from plait.runtime.comm import Axis

DTYPE = torch.float32


def rank_input(rank: int, numel: int) -> torch.Tensor:
    """Rank r's buffer: (r + 1) + (i mod 7), exact in float32 whatever is summed."""
    return (torch.arange(numel) % 7 + rank + 1).to(DTYPE)


def root_buffer(numel: int) -> torch.Tensor:
    """What the root of a scatter holds: i mod 251, so that every part differs."""
    return (torch.arange(numel) % 251).to(DTYPE)


def expected(op: str, rank: int, n: int, numel: int) -> torch.Tensor | None:
    """The exact answer rank `rank` must hold after `op` (None: nothing defined there)."""
    total = sum(rank_input(r, numel) for r in range(n))
    part = numel // n
    if op == "broadcast":
        return rank_input(0, numel)
    if op == "scatter":
        return root_buffer(numel)[rank * part:(rank + 1) * part]
    if op in ("reduce", "gather") and rank != 0:
        return None
    if op in ("reduce", "all_reduce"):
        return total
    if op in ("gather", "all_gather"):
        return torch.cat([rank_input(r, part) for r in range(n)])
    if op == "reduce_scatter":
        return total[rank * part:(rank + 1) * part]
    if op == "send_recv":
        return rank_input((rank - 1) % n, numel)
    raise ValueError(op)


def buffers(op: str, rank: int, n: int, numel: int, device: torch.device | str = "cpu"
            ) -> dict[str, torch.Tensor | None]:
    """This rank's input and output buffers for `op` on `device` (made before the clock
    starts; NCCL wants them on the rank's GPU)."""
    part = numel // n
    ins = {"scatter": root_buffer(numel) if rank == 0 else None,
           "gather": rank_input(rank, part), "all_gather": rank_input(rank, part)}
    inp = ins.get(op, rank_input(rank, numel))
    out_numel = {"scatter": part, "reduce_scatter": part, "gather": numel if rank == 0 else 0,
                 "all_gather": numel, "send_recv": numel}.get(op)
    out = torch.empty(out_numel, dtype=DTYPE) if out_numel else None
    return {k: v.to(device) if v is not None else None for k, v in (("in", inp), ("out", out))}


def call(op: str, axis: Axis, buf: dict[str, torch.Tensor | None]) -> torch.Tensor | None:
    """One call of `op` over `axis` through plait's collectives; what this rank holds after."""
    rank, n, inp, out = axis.rank, axis.size, buf["in"], buf["out"]
    if op in ("broadcast", "reduce", "all_reduce"):
        {"broadcast": lambda: comm.broadcast(inp, axis, src=0),
         "reduce": lambda: comm.reduce(inp, axis, dst=0),
         "all_reduce": lambda: comm.all_reduce(inp, axis)}[op]()
        return None if op == "reduce" and rank != 0 else inp
    if op == "scatter":
        comm.scatter(out, inp, axis, src=0)
    elif op == "gather":
        comm.gather(out, inp, axis, dst=0)
    elif op == "all_gather":
        comm.all_gather(out, inp, axis)
    elif op == "reduce_scatter":
        comm.reduce_scatter(out, inp, axis)
    elif op == "send_recv":
        handles = [comm.send(inp, axis, (rank + 1) % n), comm.recv(out, axis, (rank - 1) % n)]
        for handle in handles:
            handle.wait()
    else:
        raise ValueError(op)
    return out


def is_right(result: torch.Tensor | None, answer: torch.Tensor | None) -> bool:
    """Exact equality with the known answer (nothing to check where nothing is defined)."""
    if answer is None:
        return True
    return result is not None and result.shape == answer.shape and torch.equal(result.cpu(), answer)


def iterations(size: int) -> int:
    """Timed repetitions: more for small messages, whose time is mostly noise and latency."""
    return 3 if size >= 4 * 2**20 else 8 if size >= 64 * 2**10 else 20


def measure(op: str, axis: Axis, size: int, corrupt: bool = False, iters: int = 0,
            device: torch.device | str = "cpu") -> dict[str, Any]:
    """Check, count and time `op` on a `size`-byte buffer; every rank of `axis` calls this."""
    n = axis.size
    numel = max(n, size // 4 // n * n)  # a whole number of float32 parts per rank
    size = numel * 4
    before = axis.ledger.snapshot()
    result = call(op, axis, buffers(op, axis.rank, n, numel, device))
    ledger = sum(axis.ledger.since(before).get(axis.name, {}).values())
    answer = expected(op, axis.rank, n, numel)
    checks = [is_right(result, answer)]
    if corrupt:  # a deliberately wrong answer on one rank that holds one: must be caught
        spoiled = result.clone() if result is not None and axis.rank == spoiled_rank(op, n) else result
        if spoiled is not result:
            spoiled.view(-1)[0] += 1
        checks.insert(0, is_right(spoiled, answer))
    ok = torch.tensor([float(c) for c in checks], device=device)
    comm.all_reduce(ok, axis, op="min", purpose=comm.TELEMETRY)
    buf = buffers(op, axis.rank, n, numel, device)
    times = torch.tensor([_timed(op, axis, buf) for _ in range(iters or iterations(size))], dtype=torch.float64,
                         device=device)
    comm.all_reduce(times, axis, op="max", purpose=comm.TELEMETRY)
    seconds = statistics.median(times.tolist())
    algbw, busbw = bandwidths(op, size, seconds, n)
    # A send/recv pair is two ledger entries (send S, recv S); the wire sees the send only.
    wire = ledger / 2 if op == "send_recv" else ledger
    return {"op": op, "n": n, "bytes": size, "time_s": seconds, "algbw_gb_s": algbw / 1e9,
            "busbw_gb_s": busbw / 1e9, "busbw_factor": busbw_factor(op, n),
            "busbw_factor_formula": FACTOR_TEXT[op], "ledger_wire_bytes": wire,
            "formula_wire_bytes": busbw_factor(op, n) * size, "ok": bool(ok[0].item()),
            **({"ok_unspoiled": bool(ok[1].item())} if corrupt else {})}


def spoiled_rank(op: str, n: int) -> int:
    """Where the self-test spoils a result: the root for reduce and gather (the only rank
    that holds one), the last rank otherwise."""
    return 0 if op in ("reduce", "gather") else n - 1


def _timed(op: str, axis: Axis, buf: dict[str, torch.Tensor | None]) -> float:
    comm.barrier(axis)
    start = time.perf_counter()
    call(op, axis, buf)
    if buf["in"] is not None and buf["in"].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def bench_group(axis: Axis, sizes: list[int], ops: tuple[str, ...] = PRIMITIVES,
                corrupt: tuple[str, ...] = (), iters: int = 0,
                device: torch.device | str = "cpu") -> list[dict[str, Any]]:
    """Every op at every size on one group (`iters` timed calls each; 0: by size)."""
    return [measure(op, axis, size, op in corrupt, iters, device) for op in ops for size in sizes]
