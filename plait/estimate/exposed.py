"""What each axis costs one rank, beyond its compute: the seconds the step waits for.

Each function prices one part of a rank's step (estimate/time.py assembles them): the
collectives inside a micro-batch (tp, cp, ep), a pipeline message on the schedule's edges,
the data-parallel sync left after overlap, offload, the clip's and the loop's all-reduces.
Every transfer is priced by the network model (network.py); what overlaps what is said in
each function, and in time.py's ASSUMPTIONS.
"""

from __future__ import annotations

import math
from dataclasses import replace

from plait.estimate.context import forward_passes, layer_bytes, ring_exposed_s
from plait.estimate.experts import layer_alltoall
from plait.estimate.hardware import Hardware
from plait.estimate.layout import StageShare, Workload
from plait.estimate.memory import shard, state_bytes
from plait.estimate.network import collective_s, collectives_s, inter_node
from plait.estimate.ops import attention_time, stage_gemm_s
from plait.estimate.traffic import (gathered_calls, plan_collectives, ring_bytes, sequence_ends,
                                   tp_traffic, zero3_gathers)
from plait.models.gpt.config import GPTConfig

HOST_ADAM_BYTES = 28  # read weight, grad, m, v; write weight, m, v (fp32): host_mem_gb_s's unit
TELEMETRY_BYTES = 8 * 64  # the loop's per-step max-reduction of time, memory and traffic


def micro_batch_axes_s(config: GPTConfig, layout: Workload, stage: StageShare, hw: Hardware,
                       links: dict[str, int], compute_s: float) -> tuple[float, float, float]:
    """A rank's (tp, cp, ep) seconds of one micro-batch on `stage` whose compute takes
    `compute_s`: each collective after its burst of that compute (`burst_s`, taken once for
    the three). The estimate's assembly and the planner both read this."""
    burst = burst_s(config, layout, stage, compute_s)
    return (tp_s(config, layout, stage, hw, links["tp"], burst=burst),
            cp_s(config, layout, stage, hw, links["cp"], burst=burst),
            ep_s(config, layout, stage, hw, links["ep"], burst=burst))


def tp_s(config: GPTConfig, layout: Workload, stage: StageShare, hw: Hardware, inter: int, *,
         burst: float) -> float:
    """Tensor-parallel seconds per micro-batch on `stage` that the step waits for.

    plait runs each collective between its GEMMs, so the step waits for all of them, each
    with the ranks' lag after its `burst` of compute (`lagged_s`). A stack
    that overlaps the blocks' collectives with the GEMMs they feed (Transformer Engine's userbuffers,
    `Stack.tp_overlap`, with sequence parallelism inside a node), what those GEMMs cannot
    hide: each collective is cut in tp pieces, each moved while the GEMM works on the one
    before, so the first piece shows, and whatever outlasts the GEMMs. The embedding's, the
    head's, the loss's and the norms' collectives are never overlapped."""
    t = layout.tp
    if t == 1:
        return 0.0
    wire = {op: moved / layout.grad_accum for op, moved in tp_traffic(config, layout, stage).get("tp", {}).items()}
    counts = stage_tp_collectives(config, layout, stage)
    total = collectives_s(counts, wire, t, hw, inter) + lagged_s(sum(counts.values()), t, hw, inter, burst)
    if not (layout.software.tp_overlap and layout.sp and inter == 0):
        return total
    counts = plan_collectives(config, layout, stage, ends=False, whole_ends=False)
    act = layout.hidden_bytes(config.d_model)
    block_s = collectives_s(counts, {op: ring_bytes(op, act, t) * n for op, n in counts.items()}, t, hw, inter)
    gemms = stage_gemm_s(config, layout, stage.runs, replace(hw, op_overhead_us=0.0))
    return total - block_s + max(block_s / t, block_s - gemms)


def lagged_s(calls: float, n: int, hw: Hardware, inter: int, burst: float) -> float:
    """What `calls` collectives of n ranks add for the ranks' lag, each after a `burst` of
    compute (`Hardware.lag_s`, measured on a host that runs its own collectives; none across
    nodes, where none was measured)."""
    if not calls or inter:
        return 0.0
    return calls * hw.lag_s(n, burst)


def burst_s(config: GPTConfig, layout: Workload, stage: StageShare, compute_s: float) -> float:
    """Seconds of compute before each collective inside a micro-batch on `stage`: its
    `compute_s` shared out among the tp, cp and ep collectives it runs. Each axis's own count
    alone would give each a longer burst, and a larger lag, than the ranks have between
    collectives where two axes interleave."""
    calls = (_tp_calls(config, layout, stage) + _cp_calls(layout, stage) + _ep_calls(layout, stage))
    return compute_s / calls if calls else compute_s


def _tp_calls(config: GPTConfig, layout: Workload, stage: StageShare) -> float:
    return sum(stage_tp_collectives(config, layout, stage).values()) if layout.tp > 1 else 0.0


def _cp_calls(layout: Workload, stage: StageShare) -> float:
    """A micro-batch's exchanges on `stage`: Ulysses' four all-to-alls a layer each way (and
    again in a recompute's forward), or the ring's (`_ring_exchanges`)."""
    cp, forwards = layout.cp, forward_passes(layout.recompute)
    if cp == 1:
        return 0.0
    if layout.cp_kind == "ulysses":
        return stage.runs * (forwards + 1) * ULYSSES_ALL_TO_ALLS
    forward, backward = _ring_exchanges(cp)
    return stage.runs * (forwards * forward + backward)


ULYSSES_ALL_TO_ALLS = 4  # a layer's, each way: q, k and v, then the output


def _ring_exchanges(cp: int) -> tuple[int, int]:
    """A layer's ring exchanges (send/recv pairs): cp - 1 passes of K/V forward; backward the
    same again plus cp of dK/dV."""
    return cp - 1, 2 * cp - 1


def _ep_calls(layout: Workload, stage: StageShare) -> float:
    """A micro-batch's all-to-alls on `stage`: per MoE block three forward (counts, rows out,
    rows back; again when recomputed) and two backward."""
    if layout.ep == 1 or not stage.moe_layers:
        return 0.0
    return stage.moe_runs * (3 * forward_passes(layout.recompute) + 2)


def stage_tp_collectives(config: GPTConfig, layout: Workload, stage: StageShare) -> dict[str, int]:
    """The b·s·h collectives one micro-batch runs on `stage`, as traffic.tp_traffic counts their
    bytes: the ends' only where the vocabulary is split, and where SP cuts the sequence at the
    blocks alone, the ends whole and the sequence's cut and gather around the blocks."""
    counts = plan_collectives(config, layout, stage, True, config.whole_sequence_ends)
    gathers = sequence_ends(config, layout, stage) + gathered_calls(config, layout, stage)
    return {**counts, "all_gather": counts.get("all_gather", 0) + gathers} if gathers else counts


def message_s(config: GPTConfig, layout: Workload, hw: Hardware, inter: int) -> float:
    """One pipeline message (a stage's activations forward, or their gradient back): the delay
    on each edge of the schedule that crosses ranks. plait posts sends without waiting
    (plait/parallel/pipeline/p2p.py), so a message costs the receiver its wait, not the
    sender its time."""
    if layout.pp == 1:
        return 0.0
    latency, bandwidth = hw.message(2, inter)
    return latency + layout.stage_message_bytes(config.stream_width) / bandwidth


def cp_s(config: GPTConfig, layout: Workload, stage: StageShare, hw: Hardware, inter: int, *,
         burst: float) -> float:
    """Context parallelism's seconds per micro-batch on `stage` that compute does not hide
    (estimate/context.py): the ring's transfers beyond each pass's attention, or Ulysses'
    all-to-alls whole; each exchange with the ranks' lag after its `burst` of compute
    (`lagged_s`)."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    per = layer_bytes(config, layout)
    latency, bandwidth = hw.link(cp, inter)
    forwards = forward_passes(layout.recompute)
    lagged = lagged_s(_cp_calls(layout, stage), cp, hw, inter, burst)
    if layout.cp_kind == "ulysses":
        one_way = ULYSSES_ALL_TO_ALLS * (cp - 1) * latency + per["forward"] / bandwidth
        return stage.runs * (forwards + 1) * one_way + lagged
    latency, bandwidth = hw.message(cp, inter)  # the ring's steps are send/recv pairs
    # one forward (and one backward) of one layer's attention hides the transfers, where the
    # machine computes while its links move bytes (overlaps_comm)
    hides = overlaps_comm(hw)
    exchanges_forward, exchanges_backward = _ring_exchanges(cp)
    forward = ring_exposed_s(exchanges_forward * latency + per["forward"] / bandwidth,
                             attention_time(config, layout, hw, 1) if hides else 0.0, cp)
    backward = ring_exposed_s(exchanges_backward * latency + per["backward"] / bandwidth,
                              attention_time(config, layout, hw, 0, 1) if hides else 0.0, cp)
    return stage.runs * (forwards * forward + backward) + lagged


def overlaps_comm(hw: Hardware) -> bool:
    """Whether compute goes on while a collective moves bytes: a GPU's kernels run beside
    NCCL's on their own streams, but a host that runs its own collectives (a CPU under Gloo,
    each rank on its own cores) has nothing left to compute with while its cores copy and
    wait: there, every transfer the step needs is exposed. Measured on 2 CPU ranks
    (benchmarks/planner_measured.py): ZeRO-3's gathers, which the overlap model hid, made its
    step 4% slower than ZeRO-1's."""
    return hw.queues_kernels


def ep_s(config: GPTConfig, layout: Workload, stage: StageShare, hw: Hardware, inter: int, *,
         burst: float) -> float:
    """Expert parallelism's all-to-alls per micro-batch on `stage`, whole (the dispatch waits
    for them; `_ep_calls` counts them), their bytes by uniform routing (estimate/experts.py),
    each with the ranks' lag after its `burst` of compute (`lagged_s`)."""
    if layout.ep == 1 or not stage.moe_layers:
        return 0.0
    latency, bandwidth = hw.link(layout.ep, inter)
    per = layer_alltoall(config, layout)
    calls = _ep_calls(layout, stage)
    moved = forward_passes(layout.recompute) * per["forward"] + per["backward"]
    return calls * latency + stage.moe_runs * moved / bandwidth + lagged_s(calls, layout.ep, hw, inter, burst)


def dp_exposed_s(params: int, unit: int, layout: Workload, hw: Hardware, inter: int,
                 compute_mb: float, forward_share: float, replicate_inter: int = 0, regathered: float = 0.0) -> float:
    """Data-parallel seconds left after overlap with compute, before the clip (see module
    docstring): ZeRO-1's and -2's all-gather of the updated weights is `gather_after_update_s`,
    which the step places after the clip, but where a stack hides it behind the next forward.

    With a pipeline, DP and ZeRO-1 reduce the gradients after the last action of the
    schedule, so nothing overlaps them there; ZeRO-2 and -3 reduce (and ZeRO-3 gathers) inside
    each chunk's passes, as without one (`_dp_sync_s`). Under --dp-shard, ZeRO's collectives
    run over the shard group (`inter`: whether it spans nodes) and each reduced shard is then
    summed over its replicas (`replicate_inter`), whole: the rank waits for it before the next
    bucket.
    `regathered`: the parameters ZeRO-3 gathers again each forward for a looped block's further
    runs (StageShare.rerun_params, traffic.looped_gathers), experts with the rest.
    """
    return (_dp_sync_s(params, unit, layout, hw, inter, compute_mb, forward_share, regathered)
            + _replicate_s(params, layout, hw, replicate_inter))


def gather_after_update_s(params: int, layout: Workload, hw: Hardware, inter: int) -> float:
    """ZeRO-1's and -2's all-gather of the updated weights where it runs inside the update
    (optimizer.step, after the clip: plait's loop, and a stack that does not hide it behind the
    next forward); 0 elsewhere. The loop times it in its update phase, so the step places it
    there, and the report's predicted update holds it."""
    if layout.zero not in (1, 2) or layout.zero_ranks == 1 or _gather_hidden(layout, hw):
        return 0.0
    return _weights_gather_s(params, layout, hw, inter)


def _weights_gather_s(params: int, layout: Workload, hw: Hardware, inter: int) -> float:
    """ZeRO-1's and -2's all-gather of the updated weights over the ranks that shard them, a
    collective per gradient bucket: after the update, or behind the next forward."""
    per = state_bytes(layout.precision)
    return collective_s("all_gather", params * per.param, layout.zero_ranks, hw, inter,
                        max(1.0, params * per.grad / layout.bucket_bytes))


def _overlaps(layout: Workload, hw: Hardware) -> bool:
    """Whether the dp collectives hide behind compute: without a pipeline, or under ZeRO-2
    and -3 (which run inside each chunk's passes), on a stack and a device that overlap them."""
    return (layout.pp == 1 or layout.zero >= 2) and layout.software.dp_overlap and overlaps_comm(hw)


def _gather_hidden(layout: Workload, hw: Hardware) -> bool:
    """ZeRO-1's and -2's gather behind the next step's first forward (a stack that does so)."""
    return layout.software.gather_overlap and _overlaps(layout, hw) and layout.pp == 1


def _replicate_s(params: int, layout: Workload, hw: Hardware, inter: int) -> float:
    """--dp-shard's all-reduces of the reduced shards over the replicas, per step: one per
    bucket (or unit) of the whole gradient, each a 1/N shard of it (nothing with one replica)."""
    grad = state_bytes(layout.precision).grad
    times = layout.grad_accum if layout.zero >= 2 else 1
    return times * collective_s("all_reduce", shard(params, layout.zero_ranks) * layout.reduce_bytes, layout.replicas,
                                hw, inter, max(1.0, params * grad / layout.bucket_bytes))


def _dp_sync_s(params: int, unit: int, layout: Workload, hw: Hardware, inter: int,
               compute_mb: float, forward_share: float, regathered: float = 0.0) -> float:
    """dp_exposed_s over the ranks that reduce and gather together: the dp × cp ranks, or a
    --dp-shard group (Layout.zero_ranks is both)."""
    n, m, per = layout.zero_ranks, layout.grad_accum, state_bytes(layout.precision)
    if n == 1:
        return 0.0
    # Buckets hold the gradients in their own dtype; the wire carries them in the reduce dtype
    # (--reduce-dtype fp32 doubles a 16-bit run's bytes, as traffic.py counts them).
    held, grads, weights = params * per.grad, params * layout.reduce_bytes, params * per.param
    # One collective per bucket (--bucket-mb, 25 MiB by default); ZeRO-3 reduces and gathers per
    # unit (a block) instead, whatever its size: a 175 B model's 96 blocks are 96 collectives a
    # pass, not 13,000 buckets.
    buckets = max(1.0, params / unit) if layout.zero == 3 and unit else max(1.0, held / layout.bucket_bytes)
    # Under a pipeline, DP and ZeRO-1 reduce after the schedule's last action, behind nothing;
    # ZeRO-2 and -3 run their collectives inside each chunk's forward and backward
    # (zero/hooks.py: each backward waits for its own chunk's reductions at its end), so they
    # hide there as without a pipeline, but for the last bucket (first unit) of every chunk.
    overlap = _overlaps(layout, hw)
    passes = layout.virtual_stages if layout.pp > 1 else 1  # a rank's chunks: each pass ends on its own
    fwd = compute_mb * forward_share if overlap else 0.0
    bwd = compute_mb - fwd if overlap else 0.0
    # The first bucket's collective starts once its share of backward has run, and the next
    # forward's first bucket waits for its gather: a two-stage flow shop, whose exposed time is
    # max(C/B, C - T + T/B) for B buckets of C behind T (Li et al., PyTorch Distributed, VLDB
    # 2020: larger buckets start communicating later). Each chunk of a pipeline fills its own.
    fill = min(1.0, passes / buckets) if layout.zero != 3 else 0.0
    op = "all_reduce" if layout.zero == 0 else "reduce_scatter"
    last = passes * collective_s(op, min(held, layout.bucket_bytes) * layout.reduce_bytes / per.grad, n, hw, inter)
    # DP and ZeRO-1 reduce once, behind the last backward; ZeRO-2 and -3 reduce-scatter every
    # micro-batch (traffic.py counts m of them), each behind its own backward
    times = m if layout.zero >= 2 else 1
    reduce = times * max(last, collective_s(op, grads, n, hw, inter, buckets) - bwd * (1 - fill))
    if layout.zero == 0:
        return reduce
    if layout.zero in (1, 2):
        if not _gather_hidden(layout, hw):
            return reduce  # its gather runs inside the update: gather_after_update_s
        # behind the next step's first forward, but its first bucket (a pipeline's first forward hides nothing)
        first = collective_s("all_gather", min(held, layout.bucket_bytes) * per.param / per.grad, n, hw, inter)
        gather = _weights_gather_s(params, layout, hw, inter)
        return reduce + max(first, gather - compute_mb * forward_share * (1 - fill))
    # ZeRO-3: every micro-batch gathers in forward and (unless kept) again in backward,
    # hidden behind the compute when prefetched, exposed whole when gathered on demand; a
    # looped block's unit again before each further run's forward, when its forward resharded it.
    gather = collective_s("all_gather", weights, n, hw, inter, buckets)  # unit by unit
    again = 0.0
    if regathered and layout.reshard_after_forward:
        again = collective_s("all_gather", regathered * per.param, n, hw, inter, max(1.0, regathered / max(1, unit)))
    if layout.prefetch == 0:
        return m * (gather * zero3_gathers(layout) + again) + reduce
    first = passes * collective_s("all_gather", unit * per.param, n, hw, inter)
    regather = gather if layout.reshard_after_forward else 0.0
    # A backward's gathers and its micro-batch's reduce-scatters share the links and the one
    # backward that hides them: what the window cannot hold is exposed once, not hidden twice.
    reduce_all = collective_s(op, grads, n, hw, inter, buckets)
    backward = max(last + (first if regather else 0.0), regather + reduce_all - bwd)
    return m * max(first, gather + again - fwd) + m * backward


def offload_s(params: int, layout: Workload, hw: Hardware) -> float:
    """PCIe round trip of the shard plus the host's AdamW over it (the CPU's measured rate:
    plait.estimate.hardware, `host_mem_gb_s`). The gradient goes out and the weights come back
    in fp32 whatever the precision: plait converts on the GPU and moves fp32 across
    (plait/parallel/zero/optim.py, copy_in_chunks), so that the host does no conversion."""
    if not layout.offload:
        return 0.0
    part = shard(params, layout.zero_ranks)
    pcie = 2 * part * OFFLOAD_WIRE_BYTES / (hw.pcie_gb_s * 1e9)
    return pcie + part * HOST_ADAM_BYTES / (hw.host_mem_gb_s * 1e9)


OFFLOAD_WIRE_BYTES = 4  # a parameter's fp32 gradient out, or its fp32 master back, over PCIe


def clip_s(layout: Workload, hw: Hardware, links: dict[str, int]) -> float:
    """All-reduces of a few bytes around the update: the step guard's verdict over every
    rank, and the gradient norm over ZeRO's dp group, tp and pp."""
    groups = [("world", layout.world), ("dp_shard", layout.zero_ranks if layout.zero else 1), ("tp", layout.tp),
              ("pp", layout.pp)]
    return math.fsum(collective_s("all_reduce", 16, n, hw, links[axis]) for axis, n in groups)


def overhead_s(layout: Workload, hw: Hardware, gpus_per_node: int) -> float:
    """The loop's own cost: bookkeeping, and its telemetry all-reduces over every rank."""
    telemetry = collective_s("all_reduce", TELEMETRY_BYTES, layout.world, hw,
                             inter_node(layout, gpus_per_node)["world"], count=2)
    return hw.step_overhead_us * 1e-6 + telemetry
