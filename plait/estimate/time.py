"""FLOPs, link times and the pipeline bubble, turned into a step time and an MFU.

Assumptions, each visible in `ASSUMPTIONS`:
* Training costs 6Ψ + 12·L·h·s FLOPs per token: 2Ψ forward and 4Ψ backward for the
  matmuls (Ψ = the weights a token is multiplied by: every block plus the output head; the
  input embedding is a lookup), and 4·h·s per layer forward for QKᵀ and attention·V,
  tripled for backward. The causal mask is not discounted (PaLM's convention). Full
  recompute adds one forward, 2Ψ + 4·L·h·s; selective recompute adds the attention
  core's forward, 4·L·h·s. MFU counts only the 6Ψ + 12·L·h·s.
* Compute is costed operation by operation (plait/estimate/ops.py): each GEMM on a roofline
  of its shape with a fixed ramp (or at its measured rate, from `plait calibrate`), the
  attention core at its rate, element-wise work by the bytes it moves at the bandwidth of
  its size, each op's fixed launch cost (on a GPU the host's launches overlap the device's
  work: the longer counts). A model known only by its size runs at `compute_efficiency` of
  the peak.
* The update (finite check, clipping, AdamW, zeroing) costs its bytes over the calibrated
  update bandwidth plus fixed costs per tensor, and tiny all-reduces (the verdict over every
  rank, the norm); the loop costs `step_overhead_us` plus two telemetry all-reduces.
* A ring collective on n ranks takes steps·α + wire_bytes/bandwidth, where steps is
  2(n-1) for all-reduce, n-1 for all-gather and reduce-scatter, 1 for a send; α and the
  bandwidth are the intra-node link's if the group fits in one node (ranks are numbered tp
  fastest, then cp, then dp, then pp; a calibrated hardware file gives them per group
  size). A group that spans nodes is priced as NCCL's tuning model prices it: the network's
  α only on the steps that cross nodes, its bytes on the NICs of its ranks in each node
  (k ranks a node: k times a GPU's share of the network, up to the node's link), an
  all-reduce's double binary tree when faster; an all-to-all or a send on one NIC.
* Data-parallel gradient reduction overlaps the last micro-batch's backward; only the
  last bucket is always exposed (with a pipeline nothing overlaps it: plait reduces after
  the schedule's last action). ZeRO-1/2's weight all-gather after the step is exposed.
  ZeRO-3 prefetches: its gathers overlap forward and backward compute, except the first
  unit. Pipeline sends are not overlapped, nor are tensor-parallel collectives, but on a
  stack that overlaps them (`Stack.tp_overlap`, with sequence parallelism inside a node),
  where a block's collectives hide behind its GEMMs but for their first piece (tp_s).
* A pipeline step runs the schedule the runner executes (pipeline.py): each rank's actions
  in its order, each costing its share of that rank's micro-batch, each started once its
  inputs exist. Its span less the slowest rank's m micro-batches is the bubble: (p-1)/(m+p-1)
  of the step for GPipe and 1F1B with even stages, (p-1)/v slots interleaved, ZB-H1's
  deferred weight gradients filling the rest; what a lopsided or uneven cut does, it does.
* `--stack` (stacks.py) prices the layout as another framework runs it: its attention and
  element-wise kernels, its gradient accumulation, and what its data and tensor parallelism
  overlap (Megatron-LM of 2021 reduced after the schedule; Megatron-Core gathers ZeRO-1's
  weights behind the next forward; NeMo's Transformer Engine overlaps tp with the GEMMs).
* Offload ships the gradient shard to the host and the updated weights back over PCIe,
  in fp32 (4 bytes a parameter each way), and runs AdamW there at the host's measured rate
  (28 bytes per parameter touched); nothing overlaps it. The device optimizer step itself
  is not timed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from plait.estimate.traffic import ring_bytes, tp_collectives, tp_traffic, zero3_gathers
from plait.estimate.hardware import Hardware
from plait.estimate.layout import Workload, StageShare, chunk_layers, layout_stages
from plait.estimate.memory import shard, state_bytes
from plait.estimate.pipeline import makespan
from plait.estimate.context import forward_passes, layer_bytes, ring_exposed_s
from plait.estimate.experts import layer_alltoall
from plait.estimate.ops import (accumulate_s, attention_time, micro_batch_compute_s, optimizer_s, outer_precision,
                                stage_gemm_s, stage_pieces, stage_tensors)
from plait.models.gpt.config import GPTConfig

HOST_ADAM_BYTES = 28  # read weight, grad, m, v; write weight, m, v (fp32): host_mem_gb_s's unit
TELEMETRY_BYTES = 8 * 64  # the loop's per-step max-reduction of time, memory and traffic

ASSUMPTIONS = (
    "FLOPs per token 6Ψ + 12·L·h·s (PaLM convention, causal mask not discounted); "
    "full recompute adds 2Ψ + 4·L·h·s, selective 4·L·h·s; MFU counts neither",
    "compute per operation: GEMMs on a roofline of their shape (peak·compute_efficiency plus "
    "a fixed ramp, memory bandwidth) or at their calibrated rate, attention at attention_efficiency, "
    "element-wise work memory-bound at the bandwidth measured for its size (bytes counted on "
    "plait's GPT, or the --stack's), a fixed cost per op: added on a CPU, overlapped with the device's work "
    "on a GPU; each micro-batch after the first adds its gradients into the kept ones (3 × their bytes a "
    "parameter, or the --stack's)",
    "update (norm + clipping + AdamW + zeroing: 100 B per fp32 parameter) over the update's "
    "rate (measured on that update at the model's size, keyed by it; memory_gb_s where not "
    "measured), plus fixed costs per tensor (overlapped on a GPU) and the verdict's and norm's all-reduces; "
    "loop overhead = step_overhead_us + two telemetry all-reduces",
    "ring collective time = steps·latency + wire bytes / link bandwidth; a group uses the "
    "intra-node link when it fits in one node (ranks numbered tp fastest, then cp, then dp, then pp); "
    "across nodes the network's latency only on the steps that cross, the bytes on the NICs of the "
    "group's k ranks a node (k x inter_node_gb_s, up to the node's link); all-to-all and sends on one NIC",
    "DP gradient reduction overlaps the last backward except the last bucket (not at all "
    "with pp > 1); ZeRO-1/2 weight all-gather exposed; ZeRO-3 gathers prefetched, one per block, "
    "its backward's gathers and reduce-scatters hidden in one backward; --dp-shard's "
    "all-reduce of each shard over its replicas exposed; PP traffic not overlapped; TP traffic "
    "not overlapped but on a --stack that overlaps it (nemo: with SP inside a node, a block's "
    "collectives behind its GEMMs but for a tp-th of them)",
    "pipeline: the schedule run action by action, each a share of its rank's micro-batch (forward "
    "a third, a quarter with full recompute; ZB-H1's weight gradients a forward) scaled by its "
    "chunk's blocks; the bubble is the span's idle time (even stages: (p−1)/(m+p−1) for gpipe "
    "and 1f1b, (p−1)/v slots interleaved)",
)


@dataclass
class StepTime:
    """Seconds per optimizer step, split by cause, and what they add up to."""

    flops_per_token: float
    hardware_flops_per_token: float
    compute_s: float
    tp_s: float
    pp_s: float
    bubble_s: float
    dp_s: float
    offload_s: float
    step_s: float
    tokens_per_s: float
    mfu: float
    optimizer_s: float = 0.0
    overhead_s: float = 0.0
    cp_s: float = 0.0  # context parallelism's transfers the step waits for (the ring's exposed part)
    ep_s: float = 0.0  # expert parallelism's all-to-alls (the dispatch waits for them)
    hfu: float = 0.0  # hardware FLOPs utilisation: MFU's FLOPs plus what recompute redoes (Megatron's Eq. 3 counts these)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def matmul_params(config: GPTConfig) -> int:
    """Ψ for FLOPs: the blocks plus the output head, not the embedding lookup; of an MoE
    block, what a token passes through (its top_k and shared experts)."""
    return sum(config.active_block_params(i) for i in range(config.n_layers)) + config.vocab_size * config.d_model


def flops_per_token(config: GPTConfig, seq_len: int, recompute: str = "none") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of training on one token: 6Ψ + 12·L·h·s, plus what
    recomputation redoes."""
    psi, attn = matmul_params(config), 4 * config.n_layers * config.d_model * seq_len
    model = 6 * psi + 3 * attn
    extra = {"none": 0, "selective": attn, "full": 2 * psi + attn}[recompute]
    return float(model), float(model + extra)


def collective_s(op: str, payload: float, n: int, hw: Hardware, inter: int | bool, count: float = 1) -> float:
    """Time of `count` collectives on n ranks moving `payload` bytes in total, as NCCL's own
    tuning model prices them (src/graph/tuning.cc): a ring pays the network's latency only on
    the steps that cross nodes (2(N-1) of an all-reduce's 2(n-1) on N nodes, N-1 of a gather's
    or scatter's) and the link's on the rest; an all-reduce may instead take the double
    binary tree, 2·((ranks per node - 1)·intra + ⌊log2 N⌋·inter) latency with 2S through each
    link at 0.9 of its bandwidth, whichever is faster (NCCL picks so). A cross-node ring's
    steps inside a node take the preset's intra-node latency, not a calibrated group's.
    `inter` is 0 (or False) for a group inside one node, else how many of its ranks share
    each node (True: one; `inter_node` gives it per axis).

    Across nodes a ring runs one channel per NIC, each at that NIC's bandwidth (tuning.cc:
    busBw = nChannels · bwInter), and only one hop a node crosses the network; so a group
    with k ranks in each node moves its bytes on those k ranks' NICs together, k times one
    rank's share of the node's network, up to the node's own links (`Hardware.ring_bandwidth`).
    A point-to-point message or an all-to-all's crosses on the sender's own NIC."""
    if n <= 1 or payload <= 0:
        return 0.0
    bandwidth = ring_link_bandwidth(n, hw, inter) if op in RINGS else hw.link(n, bool(inter))[1]
    ring = count * ring_latency_s(op, n, hw, inter) + ring_bytes(op, payload, n) / bandwidth
    if op != "all_reduce" or not inter:
        return ring
    per_node = ranks_a_node(n, inter)
    depth = (-(-n // per_node)).bit_length() - 1  # NCCL's log2i of the node count: the floor
    hops = (per_node - 1) * hw.latency(False) + depth * hw.link(n, True)[0]
    tree = count * 2 * hops + 2 * payload / (TREE_BANDWIDTH * bandwidth)
    return min(ring, tree)


RINGS = ("all_reduce", "all_gather", "reduce_scatter")


def ranks_a_node(n: int, inter: int | bool) -> int:
    """How many of a cross-node group's n ranks share each node (`inter`: True for one)."""
    return max(1, min(n, int(inter)))


def ring_link_bandwidth(n: int, hw: Hardware, inter: int | bool) -> float:
    """Bytes/s through each rank of a ring on n ranks: the node's link (calibrated per group
    size where measured) inside a node, its ranks' NICs across nodes (Hardware.ring_bandwidth)."""
    return hw.ring_bandwidth(ranks_a_node(n, inter)) if inter else hw.link(n, False)[1]


def ring_latency_s(op: str, n: int, hw: Hardware, inter: int | bool) -> float:
    """One collective's latency on n ranks: a step's latency for each of its steps, the
    network's only on the steps that cross nodes when a ring spans them (collective_s)."""
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "all_to_all": n - 1}.get(op, 1)
    latency = hw.link(n, bool(inter))[0]
    if not inter or op not in RINGS:
        return steps * latency
    nodes = -(-n // ranks_a_node(n, inter))
    crossings = min(steps, 2 * (nodes - 1) if op == "all_reduce" else nodes - 1)
    return (steps - crossings) * hw.latency(False) + crossings * latency


TREE_BANDWIDTH = 0.9  # NCCL's tree all-reduce: each rank's link at 0.9 of the ring's bus bandwidth, 2S through it


def inter_node(layout: Workload, gpus_per_node: int) -> dict[str, int]:
    """For each axis's group (and the whole world): 0 when its ranks share one node, else how
    many of them share each node, with ranks numbered tp fastest, then cp, dp, pp."""
    t, c = layout.tp, layout.cp
    groups = {"tp": (1, t), "cp": (t, c), "dp": (t * c, layout.dp), "ep": (t * c, layout.ep),
              "dp_shard": (t, layout.zero_ranks), "dp_replicate": (t * layout.zero_ranks, layout.replicas),
              "pp": (t * c * layout.dp, layout.pp), "world": (1, layout.world)}
    return {axis: _ranks_per_node(stride, size, gpus_per_node) for axis, (stride, size) in groups.items()}


def _ranks_per_node(stride: int, size: int, gpus_per_node: int) -> int:
    """0 if a group of `size` ranks `stride` apart fits in one node (or is one rank), else its
    ranks per node."""
    if size <= 1 or stride * size <= gpus_per_node:
        return 0
    return max(1, min(size, gpus_per_node // stride))


def tp_s(config: GPTConfig, layout: Workload, stage: StageShare, hw: Hardware, inter: int) -> float:
    """Tensor-parallel seconds per micro-batch on `stage` that the step waits for: all of
    them (plait runs each collective between its GEMMs), or, on a stack that overlaps the
    blocks' collectives with the GEMMs they feed (Transformer Engine's userbuffers,
    `Stack.tp_overlap`, with sequence parallelism inside a node), what those GEMMs cannot
    hide: each collective is cut in tp pieces, each moved while the GEMM works on the one
    before, so the first piece shows, and whatever outlasts the GEMMs. The embedding's, the
    head's, the loss's and the norms' collectives are never overlapped."""
    t = layout.tp
    if t == 1:
        return 0.0
    wire = sum(tp_traffic(config, layout, stage).get("tp", {}).values()) / layout.grad_accum
    total = _collectives_s(tp_collectives(layout, stage), wire, t, hw, inter)
    if not (layout.software.tp_overlap and layout.sp and inter == 0):
        return total
    counts = tp_collectives(layout, stage, ends=False)
    act = layout.hidden_bytes(config.d_model)
    block_s = _collectives_s(counts, sum(ring_bytes(op, act, t) * n for op, n in counts.items()), t, hw, inter)
    gemms = stage_gemm_s(config, layout, stage.layers, replace(hw, op_overhead_us=0.0))
    return total - block_s + max(block_s / t, block_s - gemms)


def _collectives_s(counts: dict[str, int], wire: float, t: int, hw: Hardware, inter: int) -> float:
    """Seconds of `counts` ring collectives over t ranks moving `wire` bytes a rank in all:
    each ring step's latency, and the bytes over the link's bandwidth; across nodes, priced
    as collective_s prices a ring (the network's latency where a step crosses, the bytes on
    the group's NICs)."""
    latency = sum(count * ring_latency_s(op, t, hw, inter) for op, count in counts.items())
    return latency + wire / ring_link_bandwidth(t, hw, inter)


def pp_s(config: GPTConfig, layout: Workload, stage: StageShare, hw: Hardware, inter: int) -> float:
    """Seconds of sends per micro-batch on `stage` (activations forward, gradients back)."""
    if layout.pp == 1:
        return 0.0
    message = layout.stage_message_bytes(config.d_model)
    sends = (layout.virtual_stages - stage.last) + (layout.virtual_stages - stage.first)
    latency, bandwidth = hw.link(2, inter)
    return sends * (latency + message / bandwidth)


def cp_s(config: GPTConfig, layout: Workload, stage: StageShare, hw: Hardware, inter: int) -> float:
    """Context parallelism's seconds per micro-batch on `stage` that compute does not hide
    (estimate/context.py): the ring's transfers beyond each pass's attention, or Ulysses'
    all-to-alls whole."""
    cp = layout.cp
    if cp == 1:
        return 0.0
    per = layer_bytes(config, layout)
    latency, bandwidth = hw.link(cp, inter)
    forwards = forward_passes(layout.recompute)
    if layout.cp_kind == "ulysses":
        one_way = 4 * (cp - 1) * latency + per["forward"] / bandwidth
        return stage.layers * (forwards + 1) * one_way
    attention = attention_time(config, layout, hw, 1)  # one forward of one layer's attention
    forward = ring_exposed_s((cp - 1) * latency + per["forward"] / bandwidth, attention, cp)
    backward = ring_exposed_s((2 * cp - 1) * latency + per["backward"] / bandwidth,
                              attention_time(config, layout, hw, 0, 1), cp)
    return stage.layers * (forwards * forward + backward)


def ep_s(config: GPTConfig, layout: Workload, stage: StageShare, hw: Hardware, inter: int) -> float:
    """Expert parallelism's all-to-alls per micro-batch on `stage`, whole (the dispatch waits
    for them): per MoE block, three forward (counts, rows out, rows back; again when
    recomputed) and two backward, uniform routing (estimate/experts.py)."""
    if layout.ep == 1 or not stage.moe_layers:
        return 0.0
    latency, bandwidth = hw.link(layout.ep, inter)
    per = layer_alltoall(config, layout)
    forwards = forward_passes(layout.recompute)
    one_layer = forwards * (3 * latency + per["forward"] / bandwidth) + 2 * latency + per["backward"] / bandwidth
    return stage.moe_layers * one_layer


def dp_exposed_s(params: int, unit: int, layout: Workload, hw: Hardware, inter: int,
                 compute_mb: float, forward_share: float, replicate_inter: int = 0) -> float:
    """Data-parallel seconds left after overlap with compute (see module docstring).

    With a pipeline, plait reduces the gradients after the last action of the schedule,
    so nothing overlaps them there. Under --dp-shard, ZeRO's collectives run over the shard
    group (`inter`: whether it spans nodes) and each reduced shard is then summed over its
    replicas (`replicate_inter`), whole: the rank waits for it before the next bucket.
    """
    return (_dp_sync_s(params, unit, layout, hw, inter, compute_mb, forward_share)
            + _replicate_s(params, layout, hw, replicate_inter))


def _replicate_s(params: int, layout: Workload, hw: Hardware, inter: int) -> float:
    """--dp-shard's all-reduces of the reduced shards over the replicas, per step: one per
    bucket (or unit) of the whole gradient, each a 1/N shard of it (nothing with one replica)."""
    grad = state_bytes(layout.precision).grad
    times = layout.grad_accum if layout.zero >= 2 else 1
    return times * collective_s("all_reduce", shard(params, layout.zero_ranks) * layout.reduce_bytes, layout.replicas,
                                hw, inter, max(1.0, params * grad / layout.bucket_bytes))


def _dp_sync_s(params: int, unit: int, layout: Workload, hw: Hardware, inter: int,
               compute_mb: float, forward_share: float) -> float:
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
    overlap = layout.pp == 1 and layout.software.dp_overlap
    fwd = compute_mb * forward_share if overlap else 0.0
    bwd = compute_mb - fwd if overlap else 0.0
    op = "all_reduce" if layout.zero == 0 else "reduce_scatter"
    last = collective_s(op, min(held, layout.bucket_bytes) * layout.reduce_bytes / per.grad, n, hw, inter)
    reduce = max(last, collective_s(op, grads, n, hw, inter, buckets) - bwd)
    if layout.zero == 0:
        return reduce
    gather = collective_s("all_gather", weights, n, hw, inter, buckets)
    if layout.zero in (1, 2):
        if layout.software.gather_overlap and overlap:  # behind the next step's first forward, but its first bucket
            first = collective_s("all_gather", min(held, layout.bucket_bytes) * per.param / per.grad, n, hw, inter)
            return reduce + max(first, gather - compute_mb * forward_share)
        return reduce + gather
    # ZeRO-3: every micro-batch gathers in forward and (unless kept) again in backward,
    # hidden behind the compute when prefetched, exposed whole when gathered on demand.
    if layout.prefetch == 0:
        return m * gather * zero3_gathers(layout) + reduce
    first = collective_s("all_gather", unit * per.param, n, hw, inter)
    regather = gather if layout.reshard_after_forward else 0.0
    # A backward's gathers and the step's reduce-scatters share the links and the one backward
    # that hides them: what the window cannot hold is exposed once, not hidden twice.
    reduce_all = collective_s(op, grads, n, hw, inter, buckets)
    last_backward = max(last + (first if regather else 0.0), regather + reduce_all - bwd)
    return m * max(first, gather - fwd) + (m - 1) * max(first, regather - bwd) * (regather > 0) + last_backward


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


def forward_fraction(recompute: str) -> float:
    """Fraction of a micro-batch's compute that is its (first) forward pass."""
    return {"none": 1 / 3, "selective": 1 / 3, "full": 1 / 4}[recompute]


def estimate_time(config: GPTConfig, layout: Workload, hw: Hardware, gpus_per_node: int) -> StepTime:
    """Step time of the busiest pipeline stage, with the bubble, DP sync, the optimizer,
    offload and the loop's own overhead."""
    links = inter_node(layout, gpus_per_node)
    rows = _micro_batch_parts(config, layout, hw, links)
    compute, tp, pp, cp, ep, stage = max(rows, key=_micro_batch_total)
    dp = dp_exposed_s(stage.params, stage.block_params, layout, hw, links["dp_shard"], compute,
                      forward_fraction(layout.recompute), links["dp_replicate"])
    model, hardware = flops_per_token(config, layout.seq_len, layout.recompute)
    updated = shard(stage.params, layout.zero_ranks) if layout.zero else stage.params
    step = 0.0 if layout.offload else optimizer_s(updated, stage_tensors(stage, layout), hw,
                                                  stage_pieces(stage, layout))
    step += clip_s(layout, hw, links)
    return _assemble(layout, hw, model, hardware, (compute, tp, pp), dp,
                     offload_s(stage.params, layout, hw), step, overhead_s(layout, hw, gpus_per_node), cp, ep,
                     span=pipeline_span(layout, [_micro_batch_total(row) for row in rows],
                                        [row[-1] for row in rows]),
                     accumulate=accumulate_s(layout, stage, hw))


def pipeline_span(layout: Workload, stage_s: list[float], shares: list[StageShare]) -> float:
    """Seconds of the schedule's m micro-batches, bubble included, given each pipeline rank's
    micro-batch (`stage_s`, in stage order) and its share of the model (for its chunks'
    blocks): pipeline.makespan over the schedule the runner executes."""
    if layout.pp == 1:
        return layout.grad_accum * stage_s[0]
    return makespan(layout.schedule, layout.pp, layout.grad_accum, layout.virtual_stages, stage_s,
                    forward_fraction(layout.recompute),
                    [chunk_weights(layout, share) for share in shares] if shares else None)


def chunk_weights(layout: Workload, stage: StageShare) -> list[float]:
    """Each of `stage`'s chunks' share of its work: its blocks over the rank's (equal for a
    rank that holds none)."""
    layers = chunk_layers(layout, stage)
    total = sum(layers)
    return [n / total for n in layers] if total else [1.0 / len(layers)] * len(layers)


def _micro_batch_parts(config: GPTConfig, layout: Workload, hw: Hardware,
                       links: dict[str, int]) -> list[tuple[float, float, float, float, float, StageShare]]:
    """Each pipeline rank's (compute, tp, pp, cp, ep) seconds of one micro-batch, and its share."""
    return [(micro_batch_compute_s(config, layout, stage, hw), tp_s(config, layout, stage, hw, links["tp"]),
             pp_s(config, layout, stage, hw, links["pp"]), cp_s(config, layout, stage, hw, links["cp"]),
             ep_s(config, layout, stage, hw, links["ep"]), stage) for stage in layout_stages(config, layout)]


def micro_batch_s_per_stage(config: GPTConfig, layout: Workload, hw: Hardware, gpus_per_node: int) -> list[float]:
    """Seconds of one micro-batch's forward and backward on each pipeline rank, in stage
    order: the slowest sets the pace of the whole schedule, bubble included."""
    links = inter_node(layout, gpus_per_node)
    return [_micro_batch_total(row) for row in _micro_batch_parts(config, layout, hw, links)]


def _micro_batch_total(row: tuple[float, float, float, float, float, StageShare]) -> float:
    """compute + tp + pp + cp + ep, added in that order as `_assemble` adds them (not `sum`,
    which Python 3.12 compensates: the torch-free runs must print the same digits)."""
    compute, tp, pp, cp, ep, _ = row
    return compute + tp + pp + cp + ep


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


def estimate_time_params_only(params: int, layout: Workload, hw: Hardware,
                              gpus_per_node: int) -> StepTime:
    """Step time of a model known only by its size: 6Ψ per token, DP/ZeRO traffic only."""
    rate = hw.peak_flops(layout.precision) * hw.compute_efficiency
    compute = layout.tokens_per_micro_batch * 6 * params / rate
    links = inter_node(layout, gpus_per_node)
    dp = dp_exposed_s(params, 0, layout, hw, links["dp_shard"], compute, 1 / 3, links["dp_replicate"])
    step = 0.0 if layout.offload else optimizer_s(shard(params, layout.zero_ranks) if layout.zero else params,
                                                  2, hw)
    return _assemble(layout, hw, 6.0 * params, 6.0 * params, (compute, 0.0, 0.0), dp,
                     offload_s(params, layout, hw), step, overhead_s(layout, hw, gpus_per_node))


def estimate_time_measured_compute(params: int, tensors: int, compute_s: float, flops_per_sample: float,
                                   layout: Workload, hw: Hardware, gpus_per_node: int,
                                   blocking_dp: list[tuple[str, float, float]] = ()) -> StepTime:
    """Step time of a data-parallel model whose forward and backward of one micro-batch the
    caller has costed (`compute_s`: a CNN's convolutions, plait/estimate/cnn.py) with
    `tensors` parameter tensors: DP/ZeRO traffic, offload and the update as for any model,
    plus `blocking_dp`: (op, payload bytes, calls per step) of collectives over dp that the
    step waits for (BatchNorm's). A "token" of the result is one sample (seq_len 1)."""
    links = inter_node(layout, gpus_per_node)
    dp = dp_exposed_s(params, 0, layout, hw, links["dp_shard"], compute_s, 1 / 3, links["dp_replicate"])
    dp += math.fsum(collective_s(op, payload, layout.dp, hw, links["dp"]) * calls for op, payload, calls in blocking_dp)
    owned = shard(params, layout.zero_ranks) if layout.zero else params
    step = 0.0 if layout.offload else optimizer_s(owned, tensors, hw)
    return _assemble(layout, hw, flops_per_sample, flops_per_sample, (compute_s, 0.0, 0.0), dp,
                     offload_s(params, layout, hw), step, overhead_s(layout, hw, gpus_per_node))


def _assemble(layout: Workload, hw: Hardware, model: float, hardware: float,
              micro_batch: tuple[float, float, float], dp: float, offload: float,
              optimizer: float = 0.0, overhead: float = 0.0, cp: float = 0.0, ep: float = 0.0,
              span: float | None = None, accumulate: float = 0.0) -> StepTime:
    """The schedule's span (`span`: m micro-batches and the bubble; when not given, stages
    alike: pipeline_span of the slowest's micro-batch on every rank), plus what is not
    overlapped, -> StepTime. `accumulate` (ops.accumulate_s) counts as compute."""
    compute, tp, pp = micro_batch
    m = layout.grad_accum
    per_mb = compute + tp + pp + cp + ep
    if span is None:
        span = pipeline_span(layout, [per_mb] * layout.pp, [])
    bubble = max(0.0, span - m * per_mb)
    step = m * per_mb + accumulate + bubble + dp + offload + optimizer + overhead
    tokens_per_s = layout.global_batch * layout.seq_len / step
    # MFU against the 16-bit peak for fp8 too, as torchtitan reports it: fp8's gain shows as MFU above bf16's
    peak = layout.world * hw.peak_flops(outer_precision(layout.precision))
    mfu, hfu = model * tokens_per_s / peak, hardware * tokens_per_s / peak
    return StepTime(flops_per_token=model, hardware_flops_per_token=hardware, compute_s=m * compute + accumulate,
                    tp_s=m * tp, pp_s=m * pp, bubble_s=bubble, dp_s=dp,
                    offload_s=offload, step_s=step, tokens_per_s=tokens_per_s, mfu=mfu,
                    optimizer_s=optimizer, overhead_s=overhead, cp_s=m * cp, ep_s=m * ep, hfu=hfu)
