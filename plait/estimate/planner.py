"""Enumerate every layout of a model on a number of GPUs, keep those that fit, rank them.

A layout is valid when plait train would run it (plait.rules: tp divides the heads, the
key/value heads, the vocabulary and the MLP width) and tp stays inside one node; pp is at
most the number of layers; context parallelism (ring, and Ulysses where cp divides the
heads) at every cp that 2·cp divides the sequence for; for a mixture of experts, expert
parallelism at every ep that divides both dp and the experts (without cp); dp·cp·tp·pp is the GPU count; and
the global batch is dp·micro_batch·grad_accum. ZeRO stages 2 and 3 are tried only where dp > 1 (with one
replica there is nothing to shard over); mixed precision needs ZeRO 1 or more, even on one
replica, for its fp32 masters; sequence parallelism with and without where tp > 1 divides
the sequence; recomputation off and full. The survivors are ranked by predicted step time,
then by memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import product
from dataclasses import dataclass

from plait.errors import PlaitError
from plait.estimate.hardware import GIB, Hardware, resolve_hardware
from plait.estimate.layout import Workload
from plait.layout import Layout
from plait.rules import CP_KINDS, check_pipeline_cut
from plait.estimate.memory import estimate_memory
from plait.estimate.time import estimate_time
from plait.models.gpt.config import GPTConfig

MAX_MICRO_BATCH = 64  # larger micro-batches only add memory once the GPU is saturated


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for: a model, a cluster and a batch."""

    config: GPTConfig
    gpus: int
    gpus_per_node: int
    hardware: Hardware
    global_batch: int
    seq_len: int
    precision: str = "bf16"
    schedule: str = "1f1b"
    recompute: tuple[str, ...] = ("none", "full")
    offload: bool = False
    stage_layers: tuple[int, ...] = ()  # a fixed cut: only layouts with that many pipeline stages

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "global_batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = name.replace("_", "-")
                raise PlaitError(f"--{flag} must be a whole number of at least 1, got {value!r}",
                                 hint=f"pass --{flag} 1 or more")
        if self.schedule == "interleaved":
            raise PlaitError("plan searches the gpipe and 1f1b schedules only",
                             hint="use --schedule 1f1b, then try interleaving with plait estimate")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_degrees(request: PlanRequest) -> list[int]:
    """tp values that split the heads, kv heads and MLP evenly and fit in one node (fp8: tp 1,
    plait.rules.check_fp8)."""
    c = request.config
    if request.precision == "fp8":
        return [1]
    return [t for t in divisors(request.gpus) if t <= request.gpus_per_node and _splits(c, t)]


def _splits(config: GPTConfig, tp: int) -> bool:
    """plait train's own check (heads, KV heads, vocabulary, MLP); SP's sequence check is per layout."""
    try:
        config.check_split(tp)
    except PlaitError:
        return False
    return True


def zero_stages(precision: str, dp: int) -> tuple[int, ...]:
    """ZeRO stages worth trying: only 0 with one replica (nothing to shard over). Every
    precision runs at every stage: without ZeRO, 16-bit training keeps its fp32 masters in
    plait.parallel.masters."""
    return (0, 1, 2, 3) if dp > 1 else (0,)


def candidates(request: PlanRequest) -> Iterator[Workload]:
    """Every valid layout for the request (before asking whether it fits)."""
    for tp in tp_degrees(request):
        for pp in divisors(request.gpus // tp):
            if (pp != len(request.stage_layers) if request.stage_layers else pp > request.config.n_layers):
                continue  # a given cut fixes pp (its end stages may hold no block); else a block per stage
            for cp in divisors(request.gpus // (tp * pp)):
                dp = Layout.fill(request.gpus, tp=tp, pp=pp, cp=cp).dp  # the one home of dp = world / (tp·pp·cp)
                if request.global_batch % dp:
                    continue
                for kind in CP_KINDS if cp > 1 else CP_KINDS[:1]:
                    yield from _variants(request, dp, tp, pp, cp, kind)


def _variants(request: PlanRequest, dp: int, tp: int, pp: int, cp: int = 1, cp_kind: str = "ring"
              ) -> Iterator[Workload]:
    per_replica = request.global_batch // dp
    micro_batches = [b for b in divisors(per_replica) if b <= MAX_MICRO_BATCH]
    zeros = zero_stages(request.precision, dp * cp)
    sps = (False, True) if tp > 1 else (False,)  # check_model refuses a sequence SP cannot split
    experts = request.config.experts
    eps = [e for e in divisors(dp) if experts % e == 0] if experts and cp == 1 else [1]
    for zero, micro_batch, recompute, sp, ep in product(zeros, micro_batches, request.recompute, sps, eps):
        try:  # combinations plait train refuses (zb-h1 with recompute, tp with experts) are skipped
            layout = Workload(dp=dp, tp=tp, pp=pp, cp=cp, cp_kind=cp_kind, ep=ep, zero=zero,
                              offload=request.offload and zero > 0, precision=request.precision,
                              micro_batch=micro_batch, grad_accum=per_replica // micro_batch,
                              seq_len=request.seq_len, recompute=recompute, schedule=request.schedule, sp=sp,
                              stage_layers=request.stage_layers)
            layout.check_model(request.config)  # Ulysses' heads, SP's share of the sequence
        except PlaitError:
            continue
        yield layout


def _row(layout: Workload, memory: float, request: PlanRequest) -> dict[str, object]:
    step = estimate_time(request.config, layout, request.hardware, request.gpus_per_node)
    return {
        "dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "cp_kind": layout.cp_kind, "ep": layout.ep,
        "zero": layout.zero,
        "micro_batch": layout.micro_batch, "grad_accum": layout.grad_accum,
        "recompute": layout.recompute, "sp": layout.sp, "offload": layout.offload,
        "memory_bytes": memory, "step_s": step.step_s, "tokens_per_s": step.tokens_per_s,
        "mfu": step.mfu,
    }


def plan_layouts(request: PlanRequest, top: int | None = None) -> list[dict[str, object]]:
    """The layouts that fit, fastest first; PlaitError if none does."""
    usable = request.hardware.usable_bytes
    rows, smallest = [], None
    for layout in candidates(request):
        total = estimate_memory(request.config, layout).total
        smallest = total if smallest is None else min(smallest, total)
        if total <= usable:
            rows.append(_row(layout, total, request))
    if smallest is None:
        raise PlaitError(
            f"no layout of {request.gpus} GPUs fits this model and a global batch of "
            f"{request.global_batch}",
            hint="make the global batch a multiple of the data-parallel degree, or change --gpus")
    if not rows:
        raise PlaitError(
            f"nothing fits: the smallest layout needs {smallest / GIB:.1f} GiB per GPU "
            f"and {request.hardware.name} has {usable / GIB:.1f} GiB usable",
            hint="use more GPUs, GPUs with more memory, --offload, or a shorter --seq-len")
    rows.sort(key=lambda r: (r["step_s"], r["memory_bytes"]))
    return rows[:top] if top else rows


def plan(config: GPTConfig, *, gpus: int, global_batch: int, hardware: str | Hardware = "h100-sxm",
         gpus_per_node: int | None = None, seq_len: int | None = None, precision: str = "bf16",
         schedule: str = "1f1b", offload: bool = False, top: int | None = None,
         stage_layers: tuple[int, ...] = ()) -> list[dict[str, object]]:
    """Rank every layout of `config` on `gpus` GPUs that fits; see `plan_layouts`.
    `stage_layers` fixes the pipeline cut (and so pp: one number per stage)."""
    hw = resolve_hardware(hardware)
    if stage_layers:
        check_pipeline_cut(config.n_layers, len(stage_layers), 1, stage_layers)
    request = PlanRequest(config=config, gpus=gpus, gpus_per_node=gpus_per_node or hw.gpus_per_node,
                          hardware=hw, global_batch=global_batch,
                          seq_len=seq_len or config.max_seq_len, precision=precision,
                          schedule=schedule, offload=offload, stage_layers=tuple(stage_layers))
    return plan_layouts(request, top)
