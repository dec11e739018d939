"""`plait estimate` and `plait plan`: the estimator and the planner on the command line.

Each takes its own argv and returns an exit code; bad input raises PlaitError, which the
top-level `plait` command prints as a message and a hint.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from plait.errors import CommandParser, PlaitError
from plait.estimate import estimate_layout
from plait.estimate.hardware import PRESETS as HARDWARE, resolve_hardware
from plait.estimate.layout import DEVICES, DOC_MASKS
from plait.rules import BUCKET_MB, PRECISIONS, RECOMPUTE, SCHEDULES, estimate_device, parse_stage_layers
from plait.estimate.planner import explain, plan_layouts, plan_request
from plait.estimate.report import format_estimate, format_explain, format_plan, human_bytes
from plait.estimate.stacks import STACKS
from plait.models.gpt.config import PRESETS as MODELS, GPTConfig


def _common(parser: argparse.ArgumentParser, precision: str | None) -> None:
    """Flags shared by both commands: the model, the hardware, the precision, the output."""
    parser.add_argument("--model", help=f"model preset: {', '.join(MODELS)}; or hf:DIR (a Hugging Face config.json)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's max)")
    default = f"default: {precision}" if precision else "default: bf16 with --zero 1-3, fp32 without"
    parser.add_argument("--precision", default=precision,
                        help=f"one of {', '.join(PRECISIONS)}; bf16 needs --zero 1 or more, as in plait train ({default})")
    parser.add_argument("--hardware", default="h100-sxm", help=f"preset: {', '.join(HARDWARE)}")
    parser.add_argument("--hardware-file", help="TOML file with a [hardware] table (overrides)")
    parser.add_argument("--gpus-per-node", type=int, help="default: the hardware preset's")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--bucket-mb", type=float, default=BUCKET_MB, help="gradient bucket, MiB: one all-reduce or "
                        "reduce-scatter each (plait train --bucket-mb)")
    parser.add_argument("--stack", default="plait", help=f"the framework that runs it: {', '.join(STACKS)} "
                        "(its attention and element-wise kernels, and what its data parallelism overlaps; "
                        "docs/estimate.md)")
    parser.add_argument("--compile", action="store_true", help="each block's forward compiled, as plait train "
                        "--compile runs it: its element-wise work as the compiler fuses it")
    parser.add_argument("--doc-mask", default="none", choices=("none", *filter(None, DOC_MASKS)),
                        help="packed documents' attention mask (plait train --doc-mask true): dense, SDPA's "
                             "b·s² mask a forward, as on a CPU; blocks, FlexAttention's, as on a GPU")


def estimate_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="plait estimate",
        description="Predict memory per GPU, bytes on the wire and step time of one layout.")
    _common(parser, None)  # bf16 keeps its fp32 masters in ZeRO: without ZeRO, fp32
    parser.add_argument("--params", type=float, help="a model known only by its size, e.g. 7e9")
    parser.add_argument("--reduce-dtype", default="", help="dtype gradients are reduced in over dp: fp32, bf16 "
                        "or fp16 (default: the gradients' own)")
    for flag in ("--dp", "--tp", "--pp", "--cp", "--ep", "--micro-batch", "--grad-accum"):
        parser.add_argument(flag, type=int, default=1)
    parser.add_argument("--cp-kind", default="ring", help="context parallelism's attention: ring or ulysses")
    parser.add_argument("--device", choices=DEVICES, help="the ranks' device: a CPU runs some of SDPA's calls in "
                        "its math form, which keeps more (default: cpu with --hardware cpu, else cuda)")
    parser.add_argument("--gpus", type=int, help="check that dp x tp x pp x cp uses this many GPUs")
    parser.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3")
    parser.add_argument("--offload", action="store_true", help="optimizer state in CPU memory")
    parser.add_argument("--dp-shard", type=int, default=0, help="hybrid sharding: ZeRO inside groups of N "
                        "data-parallel ranks, replicas across them (0: all ranks)")
    parser.add_argument("--prefetch", type=int, default=1, help="ZeRO-3: units gathered ahead of the one computing")
    parser.add_argument("--reshard-after-forward", default="true", choices=("true", "false"),
                        help="ZeRO-3: false keeps each unit gathered from forward to backward")
    parser.add_argument("--recompute", default="none", help=f"one of {', '.join(RECOMPUTE)}")
    parser.add_argument("--schedule", default="1f1b", help=f"one of {', '.join(SCHEDULES)}")
    parser.add_argument("--virtual-stages", type=int, default=1, help="chunks per rank (interleaved)")
    parser.add_argument("--stage-layers", default="", help="blocks in each of the pp × virtual-stages stages, in "
                        "stage order, e.g. 3,4,4,3; the first and the last may be 0 (default: plait's cut)")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism (needs --tp > 1)")
    return parser


def plan_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="plait plan",
        description="Rank every layout of a model on N GPUs that fits, fastest first.")
    _common(parser, "bf16")  # every ZeRO stage >= 1 is tried
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    parser.add_argument("--schedule", default="", help="search only these schedules, comma-separated, e.g. 1f1b or "
                        "1f1b,zb-h1 (default: 1f1b, interleaved and zb-h1; gpipe only when named)")
    parser.add_argument("--offload", action="store_true", help="also consider optimizer offload")
    parser.add_argument("--explain", action="store_true", help="say why the first layout wins: its bubble, the "
                        "communication it waits for, recompute, memory headroom, and the best without each choice")
    parser.add_argument("--stage-layers", default="", help="a fixed pipeline cut, blocks per stage (e.g. 7,9,9,7): "
                        "only layouts with that many stages (default: plait's cut for each pp)")
    parser.add_argument("--top", type=int, default=10, help="how many layouts to show")
    return parser


ShapeOf = Callable[[str], GPTConfig]  # --model -> its shape (the families' answer: plait.families.shape_of)


def estimate_main(argv: list[str], shape_of: ShapeOf) -> int:
    """`plait estimate ARGS`: print one layout's breakdown."""
    args = estimate_parser().parse_args(argv)
    if args.precision is None:
        args.precision = "bf16" if args.zero else "fp32"
    if args.gpus is not None:
        _check_gpus(args.gpus, args)
    hardware = resolve_hardware(args.hardware, args.hardware_file)
    config = _model(args.model, shape_of) if args.model or args.params is None else None
    result = estimate_layout(
        config, dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, cp_kind=args.cp_kind, ep=args.ep, zero=args.zero,
        offload=args.offload, dp_shard=args.dp_shard,
        precision=args.precision, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
        seq_len=args.seq_len, recompute=args.recompute, schedule=args.schedule,
        virtual_stages=args.virtual_stages, stage_layers=parse_stage_layers(args.stage_layers), sp=args.sp,
        reduce_dtype=args.reduce_dtype, prefetch=args.prefetch, bucket_mb=args.bucket_mb, stack=args.stack,
        compiled=args.compile, doc_mask=_doc_mask(args.doc_mask),
        device=args.device or estimate_device(hardware.name),
        reshard_after_forward=args.reshard_after_forward == "true", hardware=hardware,
        gpus_per_node=args.gpus_per_node, params=args.params)
    name = args.model or f"a {args.params:.3g}-parameter model"
    _emit(result, args.json, lambda: format_estimate(result, name))
    return 0


def plan_main(argv: list[str], shape_of: ShapeOf) -> int:
    """`plait plan ARGS`: print the fastest layouts that fit (and, with --explain, why the first wins)."""
    args = plan_parser().parse_args(argv)
    if args.top < 1:
        raise PlaitError(f"--top {args.top}: show 1 layout or more", hint="e.g. --top 10")
    hardware = resolve_hardware(args.hardware, args.hardware_file)
    config = _model(args.model, shape_of)
    request = plan_request(config, gpus=args.gpus, global_batch=args.global_batch, hardware=hardware,
                           gpus_per_node=args.gpus_per_node, seq_len=args.seq_len, precision=args.precision,
                           schedule=args.schedule, offload=args.offload,
                           stage_layers=parse_stage_layers(args.stage_layers), bucket_mb=args.bucket_mb,
                           stack=args.stack, compiled=args.compile, doc_mask=_doc_mask(args.doc_mask))
    rows = plan_layouts(request, args.top)
    why = explain(request) if args.explain else None
    title = (f"{args.model} on {args.gpus} x {hardware.name} "
             f"({request.gpus_per_node} per node, {human_bytes(hardware.usable_bytes)} usable each), global batch "
             f"{args.global_batch} x {request.seq_len} tokens, {args.precision}"
             f"{'' if args.stack == 'plait' else ', priced as ' + args.stack + ' runs each layout'}"
             f": top {len(rows)} by step time")
    if why is None:
        _emit(rows, args.json, lambda: format_plan(rows, title))
    else:
        _emit({"layouts": rows, "explain": why}, args.json,
              lambda: format_plan(rows, title) + "\n\n" + format_explain(why))
    return 0


def _doc_mask(flag: str) -> str:
    """--doc-mask's choice as Workload.doc_mask names it ("none" is "")."""
    return "" if flag == "none" else flag


def _model(name: str | None, shape_of: ShapeOf) -> GPTConfig:
    if not name:
        raise PlaitError("no model given", hint=f"pass --model, one of: {', '.join(MODELS)}, or hf:DIR")
    return shape_of(name)  # a preset, or hf:DIR's config.json read as a shape


def _check_gpus(gpus: int, args: argparse.Namespace) -> None:
    from plait.layout import Layout

    Layout(dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, cp_kind=args.cp_kind, ep=args.ep).check_world(gpus, "--gpus")


def _emit(data: Any, as_json: bool, text: Any) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False) if as_json else text())
