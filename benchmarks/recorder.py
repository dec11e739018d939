"""What the flight recorder costs: small all-reduces with and without it, taking turns.

Run: python -m plait launch --nproc 2 benchmarks/recorder.py [--calls 2000] [--numel 1024]
Rank 0 prints one line per variant: microseconds per all-reduce (median of 5 rounds), and
what the recorder's own bookkeeping costs per collective, timed alone (no collective).
With the recorder on, a collective only updates counters in memory; a thread writes the
record to the store once a second (runtime/recorder.py), so the two lines should agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import plait
from plait.runtime import comm
from plait.runtime.recorder import FlightRecorder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--numel", type=int, default=1024)
    args = parser.parse_args()
    mesh = plait.init_mesh()
    axis, tensor = mesh.axis("world"), torch.ones(args.numel)
    recorder = mesh.ledger.recorder
    times: dict[str, list[float]] = {"recorder off": [], "recorder on": []}
    for _ in range(5):
        for name in times:
            mesh.ledger.recorder = recorder if name == "recorder on" else None
            comm.barrier(axis)
            start = time.perf_counter()
            for _ in range(args.calls):
                comm.all_reduce(tensor, axis)
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    if mesh.is_main:
        for name, values in times.items():
            print(f"{name}: {statistics.median(values):.1f} us per all_reduce of {args.numel} fp32 "
                  f"({mesh.env.world_size} ranks, {mesh.backend})")
        print(f"recorder bookkeeping alone: {bookkeeping_us():.2f} us per collective (enter + finish)")
    mesh.ledger.recorder = recorder
    mesh.close()


def bookkeeping_us(calls: int = 200_000) -> float:
    """What comm._run adds per collective with the recorder on, on a recorder of its own."""
    recorder = FlightRecorder(None, 0, 2, {"world": [0, 1]}, hosts_store=False)  # never started
    start = time.perf_counter()
    for _ in range(calls):
        recorder.finish(recorder.enter("world", "all_reduce"))
    return (time.perf_counter() - start) / calls * 1e6


if __name__ == "__main__":
    main()
