"""Predict what a layout costs before launching it: memory, bytes on the wire, step time.

Pure arithmetic on shapes; nothing here imports torch, so `plait estimate` and `plait plan`
answer in well under a second. `estimate_layout` is the one entry point the trainer and
the CLI need; the modules hold the formulas (memory, activations, comm, time) and the
presets (hardware), each with the reasoning that produced it.
"""

from __future__ import annotations

import math
from typing import Any

from plait.errors import PlaitError
from plait.rules import given_or
from plait.estimate.context import per_layer as context_per_layer
from plait.estimate.experts import ASSUMPTIONS as EXPERT_ASSUMPTIONS, summary as experts_summary
from plait.estimate.traffic import clip_traffic, dp_traffic, estimate_comm, naive_comm
from plait.estimate.hardware import Hardware, resolve_hardware
from plait.estimate.layout import Workload, chunk_layers, layout_stages
from plait.estimate.memory import (
    FRAGMENTATION,
    Memory,
    busiest,
    estimate_memory_params_only,
    memory_per_stage,
)
from plait.estimate.time import (
    ASSUMPTIONS as TIME_ASSUMPTIONS,
    estimate_time,
    estimate_time_params_only,
    micro_batch_s_per_stage,
)
from plait.estimate.network import inter_node
from plait.models.gpt.config import GPTConfig

__all__ = ["estimate_by_size", "estimate_layout", "Workload"]

MEMORY_ASSUMPTIONS = (
    "model states per parameter: bf16/fp16 2 weight + 2 grad + 12 optimizer (fp32 master, "
    "Adam m, v); fp32 4 + 4 + 8 (Adam m, v); ZeRO-1 shards the optimizer over dp, ZeRO-2 "
    "also the grads, ZeRO-3 also the weights, holding the root unit (a tied table, the norms) "
    "and two units (blocks, an untied embedding or head) whole",
    "busiest rank = the pipeline stage with the largest device total; the first stage "
    "holds the embedding, the last the final norm and head (and, with tied embeddings and "
    "pp > 1, its own copy of the embedding); blocks cut to balance parameters, as plait does, or as "
    "--stage-layers gives; the step is the slowest rank's path through the schedule",
    "activations per block of our model: e·(6h + 2kv + 2f) + 8 + 4a bytes per token (e = 4 "
    "fp32, 2 bf16/fp16, the model held in that dtype; the norms keep their input and an fp32 rsqrt, "
    "SwiGLU its gate and up outputs (down's backward makes their product again; compiled, or priced as a stack's kernels, it keeps the product too: 3f), SDPA q, k, v and its output); "
    "selective recompute drops the attention core's output and log-sum-exp; GPT-2: Korthikanti et al. "
    "s·b·h·(34 + 5as/h) in 16-bit; plus token ids, final norm, and under cp the RoPE rows of a "
    "rank's positions (the RoPE tables are the model's buffers); a transformers "
    "model's block keeps what its forwards measured it to keep a token (its mamba's or linear "
    "attention's torch path too; with a GPU's fused kernels it keeps less), and its eager attention "
    "b·s² × the bytes a (query, key) pair (its parameters are counted there too, block by block)",
    "in-flight micro-batches: 1 without a pipeline, m for GPipe, p − r for 1F1B, min(p, m) for "
    "ZB-H1; interleaved, 2(p − r − 1) + (v − 1)N + 1 chunk-forwards on rank r for rounds of N ≥ p "
    "micro-batches (p(1 + (p−1)/(pv)) on the first rank where p divides m)",
    "buffers: the loss (logits, fp32 copy, fp32 log-softmax) on the last stage; two b·s·h "
    "pipeline receive buffers; the RoPE tables; under ZeRO-2 two whole gradient buckets (--bucket-mb, 25 MiB by "
    "default), under ZeRO-3 two blocks' gradients, each backward; none for plain DP or ZeRO-1 "
    "(grads are views into buckets)",
    f"fragmentation allowance {FRAGMENTATION:.0%} of device bytes (caching allocator "
    "rounding and reuse); hardware.reserved_gib set aside for the CUDA context and NCCL",
)

COMM_ASSUMPTIONS = (
    "comm is wire bytes per rank per optimizer step under ring algorithms, max over ranks: "
    "all_reduce 2(n−1)/n·S, all_gather and reduce_scatter (n−1)/n·S, send/recv S; the "
    "few bytes of gradient-norm reductions are left out",
    "DP and ZeRO-1 reduce gradients once per step (accumulation runs under no_sync); ZeRO-2 "
    "and -3 reduce-scatter every micro-batch, and ZeRO-3 gathers weights twice (forward, "
    "backward) every micro-batch",
    "TP: 4 all-reduces of b·s·h per block per micro-batch (5 with full recompute); under "
    "SP each becomes all-gather + reduce-scatter, plus 2 all-gathers re-gathering saved "
    "inputs; plus embedding, head and 3 fp32 cross-entropy numbers per token",
    "PP: b·s·h per message (/t under SP; h times the residual streams a model with "
    "hyper-connections passes on), one per boundary each way per micro-batch; tied "
    "embeddings swap the embedding gradient between first and last stage once per step",
    "CP: per layer and micro-batch, ring: (cp−1) sends of a rank's K/V (2·b·(s/cp)·h_kv·d·e) "
    "forward, (cp−1) again plus cp of its fp32 dK/dV backward; Ulysses: 4 all-to-alls of q, k, "
    "v, out each way; the gradients sync (and ZeRO shards) over dp·cp ranks, as axis dp_cp",
)


def estimate_layout(config: GPTConfig | None, work: Workload | None = None, *, hardware: str | Hardware = "cpu",
                    gpus_per_node: int | None = None, params: int | float | None = None,
                    **fields: Any) -> dict[str, Any]:
    """Predict one layout's cost per rank (the busiest rank), as a JSON-ready dict.

    `work` is the layout with its step's work (plait.estimate.layout.Workload); or give its
    fields as keywords (dp=8, zero=1, micro_batch=4, seq_len=2048...; seq_len defaults to the
    model's longest). `params=N` stands for a model known only by its parameter count: then
    only model states and DP/ZeRO traffic can be predicted; activations, TP and PP are None.
    """
    hw = resolve_hardware(hardware)
    node = given_or(gpus_per_node, hw.gpus_per_node, "--gpus-per-node")
    if (config is None) == (params is None):
        raise PlaitError("give a model or a parameter count, not both" if config else
                         "nothing to estimate", hint="name a --model, or give --params N")
    timed = work is not None or fields.get("seq_len") is not None
    if work is None:
        default_seq = config.max_seq_len if config else 1
        work = Workload(**{**fields, "seq_len": given_or(fields.get("seq_len"), default_seq, "--seq-len")})
    elif fields:
        raise PlaitError(f"estimate_layout takes a Workload or its fields, not both: {', '.join(sorted(fields))}")
    if config is None:
        return _params_only(_whole(params), work, hw, node, timed=timed)
    work.check_model(config)
    per_rank = memory_per_stage(config, work)
    memory = busiest(per_rank)
    step = estimate_time(config, work, hw, node)
    notes = [f"busiest rank: pipeline stage {memory.stage} of {work.pp}"]
    if work.stack != "plait":
        loss = ", but the loss as it keeps it" if work.software.loss != "plait" else ""
        notes.append(f"time as {work.stack} runs it: {work.software.source} (memory and traffic as plait's{loss})")
    report = _report(config.num_params(), work, hw, node, memory.as_dict(),
                     estimate_comm(config, work), naive_comm(config, work),
                     step.as_dict(), notes)
    if work.pp > 1:
        report["stages"] = per_stage(config, work, hw, node, per_rank)
    if work.cp > 1:
        report["context"] = context_per_layer(config, work)
    if config.is_moe:
        report["model"]["active_params"] = config.active_params()
        report["experts"] = experts_summary(config, work)
        report["assumptions"] += list(EXPERT_ASSUMPTIONS)
    return report


def per_stage(config: GPTConfig, work: Workload, hw: Hardware, node: int,
              per_rank: list[Memory]) -> list[dict[str, Any]]:
    """Each pipeline rank's blocks (per chunk), memory on the device (`per_rank`, in stage
    order) and micro-batch time."""
    times = micro_batch_s_per_stage(config, work, hw, node)
    rows = []
    for stage, memory, seconds in zip(layout_stages(config, work), per_rank, times):
        rows.append({"stage": stage.index, "blocks": chunk_layers(work, stage), "memory_total": memory.total,
                     "memory": memory.as_dict(), "micro_batch_s": seconds})
    return rows


def estimate_by_size(params: int, work: Workload, *, hardware: str | Hardware = "cpu",
                     gpus_per_node: int | None = None, seq_len: int | None = None) -> dict[str, Any]:
    """`estimate_layout` of a data-parallel run of a model known only by its parameter count:
    `work`'s dp, ZeRO, offload, precision, batch and reduce dtype (a model plait has no shape
    for: a CNN, a user's family, a transformers config without the usual sizes). Untimed
    unless `seq_len` gives the samples' length."""
    return estimate_layout(None, params=params, hardware=hardware, gpus_per_node=gpus_per_node, dp=work.dp,
                           zero=work.zero, dp_shard=work.dp_shard, prefetch=work.prefetch,
                           reshard_after_forward=work.reshard_after_forward, offload=work.offload, precision=work.precision,
                           micro_batch=work.micro_batch, grad_accum=work.grad_accum,
                           reduce_dtype=work.reduce_dtype, bucket_mb=work.bucket_mb, seq_len=seq_len)


def _whole(params: object) -> int:
    if isinstance(params, bool) or not isinstance(params, (int, float)) or not math.isfinite(params) or params < 1:
        raise PlaitError(f"--params must be a positive number, got {params!r}",
                         hint="give the parameter count, e.g. --params 7e9")
    return int(params)


def _params_only(params: int, layout: Workload, hw: Hardware, node: int,
                 timed: bool) -> dict[str, Any]:
    """The estimate for a model known only by its size."""
    if layout.tp != 1 or layout.pp != 1 or layout.cp != 1:
        raise PlaitError("tensor, pipeline and context parallelism need the model's shape",
                         hint="with --params keep --tp 1 --pp 1 --cp 1, or name a --model")
    memory = estimate_memory_params_only(params, layout)
    notes = ["model known only by its parameter count: activations, TP and PP unknown "
             "(None); ZeRO-3's gathered block not counted; total excludes activations"]
    step = None
    if timed:
        step = estimate_time_params_only(params, layout, hw, node).as_dict()
        notes.append("FLOPs per token taken as 6Ψ (no attention term without the shape)")
    else:
        notes.append("time unknown: give seq_len to estimate it")
    traffic = dp_traffic(params, layout)
    clip_traffic(traffic, None, layout)  # plait train clips: the gradient norm's sums, as for a shaped model
    report = _report(params, layout, hw, node, memory.as_dict(), traffic, naive_comm(None, layout, params), step,
                     notes)
    if not timed:
        report["layout"]["seq_len"] = None
    return report


# The ledger's axis names that are subgroups of the data-parallel ranks, by the inter_node key
# whose span bounds theirs (ranks numbered tp fastest, then cp, then dp).
_DATA_AXES = {"dp_cp": "dp", "edp": "dp"}


def axis_links(comm: dict[str, Any], inter: dict[str, int]) -> dict[str, str]:
    """The link each axis's groups ride: "node" (NVLink, or the PCIe within one box) when a
    group's ranks share a node, "network" when they span nodes (the NICs)."""
    return {axis: "network" if inter.get(_DATA_AXES.get(axis, axis), inter["world"]) else "node" for axis in comm}


def _report(params: int, layout: Workload, hw: Hardware, node: int, memory: dict[str, Any],
            comm: dict[str, dict[str, float]], naive: dict[str, Any],
            step: dict[str, float] | None, notes: list[str]) -> dict[str, Any]:
    """Assemble the JSON-ready answer."""
    return {
        "model": {"params": params},
        "layout": {**layout.as_dict(), "gpus": layout.world, "hardware": hw.name,
                   "gpus_per_node": node},
        "memory": memory,
        "fits": memory["total"] <= hw.usable_bytes,
        "device_usable_bytes": hw.usable_bytes,
        "comm": comm,
        "links": axis_links(comm, inter_node(layout, node)),
        "naive_comm": naive,
        "time": step,
        "assumptions": [*notes, *MEMORY_ASSUMPTIONS, *COMM_ASSUMPTIONS, *TIME_ASSUMPTIONS],
    }
