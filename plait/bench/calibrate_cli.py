"""`plait calibrate`: measure this machine and write a hardware file (and cache it).

The file is a `[hardware]` table that `plait estimate/plan --hardware-file` and
`plait train --hardware-file` read; the cached copy is what `plait train` uses by itself.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from plait.errors import CommandParser, PlaitError, check_writable_file
from plait.runtime.env import check_backend_name


def calibrate_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="plait calibrate",
        description="Measure this machine for the time model: the model's GEMMs and attention, memory "
                    "bandwidth, op and loop overheads, collective latency and bandwidth per group size.")
    parser.add_argument("--nproc", type=int, default=2, help="ranks that will share this machine when training")
    parser.add_argument("--out", required=True, help="the hardware TOML file to write")
    parser.add_argument("--model", default="small", help="whose GEMM shapes to measure (tiny, small, ...)")
    parser.add_argument("--micro-batch", default="8",
                        help="sequences per micro-batch; a comma list (8,4,2,1) times each one's GEMMs and attention, "
                             "for a plan that weighs them")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel degrees whose shard shapes to measure")
    parser.add_argument("--cp", default="1", help="context-parallel degrees whose ring attention to measure")
    parser.add_argument("--precision", default="fp32",
                        help="fp32, bf16, or fp8 (the blocks' GEMMs as float8 products, the rest bf16)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions: what plait train does for its closing prediction; plan from a full "
                             "one (3 rounds a shape order close micro-batches by chance on a noisy host)")
    parser.add_argument("--no-cache", action="store_true", help="do not also store it as this machine's calibration")
    parser.add_argument("--backend", default="auto", help="auto, nccl or gloo")
    return parser


def calibrate_main(argv: list[str]) -> int:
    args = calibrate_parser().parse_args(argv)
    tps, cps = _degrees("--tp", args.tp), _degrees("--cp", args.cp)
    micro_batches = _degrees("--micro-batch", args.micro_batch, "8,4,2,1")
    if args.nproc < 1 or args.precision not in ("fp32", "bf16", "fp8"):
        raise PlaitError("--nproc must be 1 or more, --precision fp32, bf16 or fp8")
    if args.seq_len < 1:
        raise PlaitError(f"--seq-len {args.seq_len}: give 1 or more", hint="e.g. --seq-len 128")
    check_backend_name(args.backend)
    check_writable_file(args.out, "--out")  # before measuring, not after
    from plait.models.gpt.config import get_preset

    config = get_preset(args.model)
    if "RANK" not in os.environ and args.nproc > 1:
        from plait.runtime.launch import check_local_nproc, spawn

        check_local_nproc(args.nproc)  # NCCL puts one rank on one GPU
        return spawn([sys.executable, "-m", "plait", "calibrate", *argv], args.nproc)
    return _rank_main(args, config, tps, cps, micro_batches)


def _degrees(flag: str, text: str, example: str = "1,2") -> list[int]:
    """A comma list of sizes (degrees, micro-batches), each 1 or more."""
    try:
        degrees = sorted({int(t) for t in text.split(",")})
    except ValueError:
        raise PlaitError(f"bad {flag} {text}", hint=f"a comma list of whole numbers, e.g. {flag} {example}") from None
    if min(degrees) < 1:
        raise PlaitError(f"bad {flag} {text}: each is 1 or more", hint=f"e.g. {flag} {example}")
    return degrees


def _rank_main(args: argparse.Namespace, config: object, tps: list[int], cps: list[int],
               micro_batches: list[int]) -> int:
    from plait.bench import machine
    from plait.runtime.mesh import init_mesh
    from plait.runtime.env import prepare_host

    mesh = init_mesh(backend=args.backend)
    try:
        if args.precision == "fp8":  # its GEMMs are timed as float8 products
            import torch

            from plait.rules import check_float8_units

            device = mesh.device
            check_float8_units(device.type, torch.cuda.get_device_capability(device) if device.type == "cuda" else None)
        prepare_host(mesh.env.world_size)
        from plait.bench import timing

        timing.SPREADS.seen.clear()
        *others, largest = micro_batches  # ascending; memory is timed at the largest's activation
        hw = machine.calibrate(mesh, config, micro_batch=largest, seq_len=args.seq_len, tp_sizes=tps,
                               precision=args.precision, quick=args.quick, cp_sizes=cps, other_micro_batches=others)
        busy = machine.noisy(mesh)
        if mesh.is_main:
            facts = machine.machine_facts(mesh, precision=args.precision)
            machine.save(hw, Path(args.out), facts)
            if not args.no_cache and not busy:
                machine.save(hw, machine.cache_path(facts), facts)
            print(describe(hw, args.out), flush=True)
            if busy:
                print(f"plait: the machine was busy while measuring ({busy}): {args.out} is written as asked, "
                      "but not cached as this machine's calibration; measure again when it is quiet", flush=True)
        return 0
    finally:
        mesh.close()


def describe(hw: object, out: str) -> str:
    gemm = sorted(r for k, r in hw.gemm if not k.startswith("attn"))
    lines = [f"plait: {hw.name} -> {out}",
             f"  GEMMs       {len(gemm)} shapes, {gemm[0] * 1e3:.1f} to {gemm[-1] * 1e3:.1f} GFLOP/s" if gemm else "",
             f"  memory      {hw.memory_gb_s:.2f} GB/s (activations), {hw.stream_bytes_per_s / 1e9:.2f} GB/s (optimizer); "
             f"op {hw.op_overhead_us:.1f} us, view {hw.view_overhead_us:.1f} us, "
             f"loop {hw.step_overhead_us:.0f} us/step"]
    lines += [f"  all-reduce  n={n}: {lat:.1f} us per ring step, {bw:.2f} GB/s busbw" for n, lat, bw in hw.links]
    if hw.p2p_latency_us:
        lines.append(f"  send/recv   {hw.p2p_latency_us:.1f} us a message (ring attention's steps, pipeline messages)")
    for n in sorted({row[0] for row in hw.lags}):
        after = ", ".join(f"{extra:.0f} us after {burst / 1e3:.1f} ms" for m, burst, extra in hw.lags if m == n)
        lines.append(f"  lag         n={n}: a collective adds {after} of compute")
    return "\n".join(line for line in lines if line)
