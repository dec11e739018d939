"""Gloo's small all-reduce, all-gather and reduce-scatter as one all-to-all (plait.runtime.comm):
on 3 ranks (an odd ring), each against torch.distributed's own op on the same input, and which
path each size took (argv: none; the report says what each rank found)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import plait
from plait.runtime import comm
from tests.worldlib import save_report

torch.set_num_threads(1)


def native(op: str, tensor: torch.Tensor, reduce: str = "sum") -> torch.Tensor:
    """torch.distributed's own op on a copy of `tensor` (all-gather: of it as the shard)."""
    n = dist.get_world_size()
    if op == "all_reduce":
        out = tensor.clone()
        dist.all_reduce(out, op=comm._REDUCE_OPS[reduce])
    elif op == "all_gather":
        out = torch.empty(n * tensor.numel(), dtype=tensor.dtype)
        comm._ALL_GATHER_ONE(out, tensor)
    else:
        out = torch.empty(tensor.numel() // n, dtype=tensor.dtype)
        comm._REDUCE_SCATTER_ONE(out, tensor.clone())
    return out


def plaits(op: str, tensor: torch.Tensor, axis: Any, reduce: str = "sum", async_op: bool = False) -> torch.Tensor:
    n = axis.size
    if op == "all_reduce":
        out = tensor.clone()
        handle = comm.all_reduce(out, axis, op=reduce, async_op=async_op)
    elif op == "all_gather":
        out = torch.empty(n * tensor.numel(), dtype=tensor.dtype)
        handle = comm.all_gather(out, tensor, axis, async_op=async_op)
    else:
        out = torch.empty(tensor.numel() // n, dtype=tensor.dtype)
        handle = comm.reduce_scatter(out, tensor, axis, async_op=async_op)
    handle.wait()
    return out


class Counted:
    """torch.distributed's entry points, wrapped to count the calls of each while the block runs."""

    NAMES = ("all_reduce", "all_to_all_single")

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.real = {name: getattr(dist, name) for name in self.NAMES}
        self.real_one = {"all_gather": comm._ALL_GATHER_ONE, "reduce_scatter": comm._REDUCE_SCATTER_ONE}
        for name, fn in self.real.items():
            setattr(dist, name, self._counting(name, fn))
        comm._ALL_GATHER_ONE = self._counting("all_gather", comm._ALL_GATHER_ONE)
        comm._REDUCE_SCATTER_ONE = self._counting("reduce_scatter", comm._REDUCE_SCATTER_ONE)

    def _counting(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    def __enter__(self) -> "Counted":
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, fn in self.real.items():
            setattr(dist, name, fn)
        comm._ALL_GATHER_ONE, comm._REDUCE_SCATTER_ONE = self.real_one["all_gather"], self.real_one["reduce_scatter"]


def paths(axis: Any) -> dict[str, dict[str, int]]:
    """{op@bytes: torch calls} for a size at and just past each op's limit."""
    found = {}
    n = axis.size
    for op, limit in comm.GLOO_BY_ALL_TO_ALL.items():
        at = limit // 4 // n * (1 if op == "all_gather" else n)  # elements: all-gather's shard, else the tensor
        for size, elements in (("limit", at), ("past", at + (1 if op == "all_gather" else n))):
            with Counted() as counted:
                plaits(op, torch.ones(elements), axis)
            found[f"{op}@{size}"] = counted.calls
    with Counted() as counted:
        comm.reduce_scatter(torch.zeros(1), torch.zeros(axis.size), axis, native=True)
    found["reduce_scatter@native"] = counted.calls
    return found


def main() -> None:
    mesh = plait.init_mesh()
    axis, rank = mesh.axis("world"), int(os.environ["RANK"])
    generator = torch.Generator().manual_seed(rank)
    report: dict[str, Any] = {"equal": {}, "close": {}, "same_on_every_rank": {}}
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for elements in (3, 999, 3000):
                whole = (torch.randint(-50, 50, (elements,), generator=generator)).to(dtype)
                noisy = torch.randn(elements, generator=generator).to(dtype) * 7
                key = f"{op} {dtype} {elements}"
                reduces = ("sum", "max", "min") if op == "all_reduce" else ("sum",)
                report["equal"][key] = all(torch.equal(plaits(op, whole, axis, r, async_op=a), native(op, whole, r))
                                           for r in reduces for a in (False, True))
                if dtype != torch.int64:
                    ours, theirs = plaits(op, noisy, axis).float(), native(op, noisy).float()
                    report["close"][key] = ((ours - theirs).abs().max() / theirs.abs().max()).item()
                    if op != "reduce_scatter":  # which leaves each rank its own slice
                        every = torch.empty(axis.size * ours.numel())
                        comm._ALL_GATHER_ONE(every, ours)
                        report["same_on_every_rank"][key] = all(torch.equal(row, ours)
                                                                for row in every.view(axis.size, -1))
    before = mesh.ledger.snapshot()
    comm.all_reduce(torch.ones(30), axis)
    report["ledger"] = mesh.ledger.since(before)
    report["paths"] = paths(axis)
    save_report(report)
    mesh.close()


if __name__ == "__main__":
    main()
