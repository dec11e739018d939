"""Each rank's costs, assembled once into a step time and an MFU.

A step is priced as one record (`StepCosts`): each pipeline rank's parts (`RankCost`: one
micro-batch's compute and the tp, cp and ep collectives it waits for; then its tail:
gradient accumulation, the exposed data-parallel sync, offload, the update), a pipeline
message's delay on the schedule's edges, and what every rank shares (the clip's and the
loop's all-reduces). `assemble` turns it into the step as the loop runs it: each rank's own
path through the schedule (pipeline.rank_ends) plus its accumulation and dp sync, the slowest
of them; the clip's all-reduce, which every rank waits for; then every rank's offload,
update and ZeRO-1/2 gather at once, the slowest of them; then the loop's all-reduce. The
estimate, the planner (its bounds and its rows), `--explain` and the closing report all read
that one assembly.

Assumptions, each visible in `ASSUMPTIONS`:
* Training costs 6Ψ + 12·L·h·s FLOPs per token: 2Ψ forward and 4Ψ backward for the
  matmuls (Ψ = the weights a token is multiplied by: every block plus the output head; the
  input embedding is a lookup), and 4·h·s per layer forward for QKᵀ and attention·V,
  tripled for backward (L counts a hybrid's softmax-attention blocks alone:
  GPTConfig.attention_share; h is q's and the output's width where a latent attention's differ,
  each call counted where a block calls it twice: ops.attention_core_flops). The causal mask
  is not discounted (PaLM's convention). Full recompute adds one forward, 2Ψ + 4·L·h·s;
  selective recompute adds the attention core's forward, 4·L·h·s. MFU counts only the
  6Ψ + 12·L·h·s.
* Compute is costed operation by operation (plait/estimate/ops.py): each GEMM on a roofline
  of its shape with a fixed ramp (or at its measured rate, from `plait calibrate`), the
  attention core at its rate, element-wise work by the bytes it moves at the bandwidth of
  its size, each op's fixed launch cost (on a GPU the host's launches overlap the device's
  work: the longer counts). A model known only by its size runs at `compute_efficiency` of
  the peak.
* The update (finite check, clipping, AdamW, zeroing) costs its bytes over the calibrated
  update bandwidth plus fixed costs per tensor, and tiny all-reduces (the verdict over every
  rank, the norm); the loop costs `step_overhead_us` plus two telemetry all-reduces. Every
  estimate, a model known only by its size or a CNN's too, pays these and the accumulation.
* Transfers are priced by the network model (network.py); what each axis costs a rank is
  in exposed.py. Data-parallel gradient reduction overlaps the last micro-batch's backward;
  only the last bucket is always exposed, and what the backward cannot hide once its first
  bucket is full (a flow shop's fill: B buckets of C behind T expose max(C/B, C - T + T/B);
  ZeRO-1/2's gather behind the next forward alike) (with a pipeline nothing overlaps DP's or ZeRO-1's:
  plait reduces them after the schedule's last action; ZeRO-2 and -3 reduce inside each
  chunk's backward, hidden there but each chunk's last bucket). ZeRO-1/2's weight all-gather
  after the step is exposed.
  ZeRO-3 prefetches: its gathers overlap forward and backward compute, except the first
  unit. Tensor-parallel collectives are not overlapped, but on a stack that overlaps them
  (`Stack.tp_overlap`, with sequence parallelism inside a node), where a block's
  collectives hide behind its GEMMs but for their first piece (tp_s).
* A pipeline step runs the schedule the runner executes (pipeline.py): each rank's actions
  in its order, each costing its share of that rank's micro-batch, each started once its
  inputs exist, a message later when they come from another rank. The step is the slowest
  rank's path to the clip (its schedule's end plus its accumulation and dp sync), the clip,
  then the slowest rank's update (every rank updates at once). What its path waits beyond its
  own m micro-batches is the bubble and the messages' exposed delay; for even stages the bubble is
  (p-1)/(m+p-1) of the step for GPipe and 1F1B, (p-1)/v slots interleaved, ZB-H1's deferred
  weight gradients filling the rest; what a lopsided or uneven cut does, it does.
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
from collections.abc import Callable
from dataclasses import asdict, dataclass

from plait.estimate.exposed import (clip_s, dp_exposed_s, gather_after_update_s, message_s, micro_batch_axes_s,
                                    offload_s, overhead_s)
from plait.estimate.hardware import Hardware
from plait.estimate.layout import StageShare, Workload, chunk_layers, layout_stages
from plait.estimate.memory import shard
from plait.estimate.network import ASSUMPTION as NETWORK_ASSUMPTION, collective_s, inter_node
from plait.estimate.ops import (accumulate_params_s, accumulate_s, attention_core_flops, measured_split,
                                micro_batch_compute_s, optimizer_s, outer_precision, stage_pieces, stage_tensors)
from plait.estimate.pipeline import ALONE, Crowd, Paths, rank_paths
from plait.models.gpt.config import GPTConfig

ASSUMPTIONS = (
    "FLOPs per token 6Ψ + 12·L·h·s (PaLM convention, causal mask not discounted; L the blocks with softmax "
    "attention, not a hybrid's linear-attention, mamba or convolution blocks); "
    "full recompute adds 2Ψ + 4·L·h·s, selective 4·L·h·s; MFU counts neither",
    "compute per operation: GEMMs on a roofline of their shape (peak·compute_efficiency plus "
    "a fixed ramp, memory bandwidth) or at their calibrated rate (an MoE block's: its router, its routed experts' "
    "rows as one grouped SwiGLU, its shared experts), attention at attention_efficiency, "
    "element-wise work memory-bound at the bandwidth measured for its size (bytes counted on "
    "plait's GPT, its compiled block's with --compile, or the --stack's), a fixed cost per op: added on a CPU, overlapped with the device's work "
    "on a GPU; each micro-batch after the first adds its gradients into the kept ones (3 × their bytes a "
    "parameter, or the --stack's)",
    "update (norm + clipping + AdamW + zeroing: 100 B per fp32 parameter) over the update's "
    "rate (measured on that update at the model's size, keyed by it; memory_gb_s where not "
    "measured), plus fixed costs per tensor (overlapped on a GPU) and the verdict's and norm's all-reduces; "
    "loop overhead = step_overhead_us + two telemetry all-reduces",
    NETWORK_ASSUMPTION,
    "DP gradient reduction overlaps the last backward except the last bucket and the fill before "
    "the first bucket is full (not at all with pp > 1); ZeRO-1/2 weight all-gather exposed; ZeRO-3 gathers prefetched, one per block, "
    "its backward's gathers and reduce-scatters hidden in one backward; --dp-shard's "
    "all-reduce of each shard over its replicas exposed; TP traffic "
    "not overlapped but on a --stack that overlaps it (nemo: with SP inside a node, a block's "
    "collectives behind its GEMMs but for a tp-th of them)",
    "pipeline: the schedule run action by action, each a share of its rank's micro-batch (forward "
    "a third, a quarter with full recompute; ZB-H1's weight gradients a forward) scaled by its "
    "chunk's blocks, a message's delay on each edge between ranks; the step is the slowest rank's "
    "path to the clip (its schedule's end plus its own accumulation and dp sync), the clip's all-reduce, "
    "then the slowest rank's offload, update and ZeRO-1/2 gather (every rank updates at once), then the loop's "
    "all-reduce; the bubble is that path's idle time (even stages: (p−1)/(m+p−1) for "
    "gpipe and 1f1b, (p−1)/v slots interleaved); on a crowded host (Hardware.crowding) a waiting rank's "
    "cores run the ranks at work faster",
)


@dataclass
class StepTime:
    """Seconds per optimizer step, split by cause, and what they add up to: the slowest
    rank's parts (`critical_rank`, a pipeline rank), and the parts every rank shares."""

    flops_per_token: float
    hardware_flops_per_token: float
    compute_s: float
    tp_s: float
    pp_s: float  # the pipeline messages' delay the slowest rank's path waits for, beyond its bubble
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
    critical_rank: int = 0  # the pipeline rank whose path sets the step
    gather_s: float = 0.0  # of dp_s, ZeRO-1's and -2's gather after the update: the loop times it there

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class RankCost:
    """One pipeline rank's step, as named parts: one micro-batch (its compute, then the
    collectives it waits for inside it), and its tail after the schedule."""

    compute: float
    tp: float = 0.0
    cp: float = 0.0
    ep: float = 0.0
    accumulate: float = 0.0  # adding each micro-batch's gradients into the kept ones
    dp: float = 0.0  # the data-parallel sync left after overlap, before the clip
    offload: float = 0.0
    update: float = 0.0  # the optimizer over what this rank updates
    gather: float = 0.0  # ZeRO-1's and -2's all-gather of the updated weights, inside the update
    share: StageShare | None = None  # its share of the model (None: a model known by its size)

    @property
    def micro_batch(self) -> float:
        """compute + tp + cp + ep, added in that order (not `sum`, which Python 3.12
        compensates: the torch-free runs must print the same digits)."""
        return self.compute + self.tp + self.cp + self.ep

    @property
    def before_clip(self) -> float:
        """Its tail up to the clip's all-reduce, which every rank waits for: the accumulation
        and the dp sync left after overlap (the loop: forward_backward, then clip)."""
        return self.accumulate + self.dp

    @property
    def after_clip(self) -> float:
        """Its tail after the clip, every rank at once: offload, the update and the gather of
        the updated weights (optimizer.step holds all three)."""
        return self.offload + self.update + self.gather


@dataclass(frozen=True)
class StepCosts:
    """Every rank's costs and what the whole step shares: the one record a step is read from."""

    ranks: tuple[RankCost, ...]  # pipeline ranks in stage order (one without a pipeline)
    model_flops: float  # per token
    hardware_flops: float  # per token, recomputation included
    message: float = 0.0  # one pipeline message's delay on each edge between ranks (exposed.message_s)
    clip: float = 0.0  # the step guard's verdict and the gradient norm's all-reduces
    overhead: float = 0.0  # the loop's bookkeeping and telemetry
    crowd: Crowd = ALONE  # how the host's cores were shared when these were priced (Hardware.crowding)
    forward: float = 1 / 3  # each micro-batch's forward share (forward_share)


def matmul_params(config: GPTConfig) -> int:
    """Ψ for FLOPs: the blocks plus the output head, not the embedding lookup; of an MoE
    block, what a token passes through (its top_k and shared experts); a looped model's blocks
    once a run (GPTConfig.block_runs)."""
    return sum(config.active_block_params(i) * config.runs_of(i) for i in range(config.n_layers)) \
        + config.vocab_size * config.d_model


def flops_per_token(config: GPTConfig, seq_len: int, recompute: str = "none") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of training on one token: 6Ψ + 12·L·h·s, plus what
    recomputation redoes."""
    runs = sum(map(config.runs_of, range(config.n_layers)))
    psi, attn = matmul_params(config), runs * attention_core_flops(config, 1, seq_len)
    model = 6 * psi + 3 * attn
    extra = {"none": 0, "selective": attn, "full": 2 * psi + attn}[recompute]
    return float(model), float(model + extra)


def forward_fraction(recompute: str) -> float:
    """Fraction of a micro-batch's compute that is its (first) forward pass."""
    return {"none": 1 / 3, "selective": 1 / 3, "full": 1 / 4}[recompute]


def forward_share(layout: Workload, hw: Hardware) -> float:
    """The forward's share of a rank's micro-batch as priced: `forward_fraction`, less where
    `hw` measured ZB-H1's split backward dearer (ops.measured_split): the forward is 1F1B's
    (measured so, 96-98 ms against 95-98 on `small`), the split's extra cost is I's and W's."""
    return forward_fraction(layout.recompute) / (measured_split(layout, hw) or 1.0)


MicroBatchParts = Callable[[StageShare], tuple[float, float, float, float]]


def micro_batch_parts(config: GPTConfig, layout: Workload, hw: Hardware, links: dict[str, int]) -> MicroBatchParts:
    """A rank's (compute, tp, cp, ep) seconds of one micro-batch, given its share."""
    def parts(stage: StageShare) -> tuple[float, float, float, float]:
        compute = micro_batch_compute_s(config, layout, stage, hw)
        return (compute, *micro_batch_axes_s(config, layout, stage, hw, links, compute))
    return parts


def rank_tail(layout: Workload, stage: StageShare, hw: Hardware, links: dict[str, int], compute: float,
              forward_share: float) -> dict[str, float]:
    """A rank's parts after its schedule: accumulation, the dp sync left after `compute`
    seconds of one micro-batch (of which `forward_share` is its forward) hide what they can,
    offload, the update. The planner bounds the tail with unbounded compute (every transfer
    overlap can hide, hidden)."""
    trained = stage.trained_params
    updated = shard(trained, layout.zero_ranks) if layout.zero else trained
    update = 0.0 if layout.offload else optimizer_s(updated, stage_tensors(stage, layout), hw,
                                                    stage_pieces(stage, layout))
    return {"accumulate": accumulate_s(layout, stage, hw),
            "dp": dp_exposed_s(trained, stage.trained_block_params, layout, hw, links["dp_shard"], compute,
                               forward_share, links["dp_replicate"], stage.rerun_params),
            "offload": offload_s(trained, layout, hw), "update": update,
            "gather": gather_after_update_s(trained, layout, hw, links["dp_shard"])}


def step_costs(config: GPTConfig, layout: Workload, hw: Hardware, gpus_per_node: int,
               parts: MicroBatchParts | None = None) -> StepCosts:
    """The record of a step of `config` under `layout`: every pipeline rank's parts (`parts`
    gives a rank's micro-batch; the planner passes its cached one)."""
    links = inter_node(layout, gpus_per_node)
    parts = parts or micro_batch_parts(config, layout, hw, links)
    forward = forward_share(layout, hw)
    ranks = []
    for stage in layout_stages(config, layout):
        compute, tp, cp, ep = parts(stage)
        ranks.append(RankCost(compute, tp, cp, ep, share=stage,
                              **rank_tail(layout, stage, hw, links, compute, forward)))
    model, hardware = flops_per_token(config, layout.seq_len, layout.recompute)
    return StepCosts(tuple(ranks), model, hardware, message_s(config, layout, hw, links["pp"]),
                     clip_s(layout, hw, links), overhead_s(layout, hw, gpus_per_node),
                     crowd_of(hw), forward)


def estimate_time(config: GPTConfig, layout: Workload, hw: Hardware, gpus_per_node: int,
                  parts: MicroBatchParts | None = None) -> StepTime:
    """The step of `config` under `layout`: its record (`step_costs`), assembled."""
    return assemble(layout, hw, step_costs(config, layout, hw, gpus_per_node, parts))


def schedule_ends(layout: Workload, costs: StepCosts, message: float | None = None) -> tuple[float, ...]:
    """When each pipeline rank's last action ends (`message`: the edges' delay, the record's
    unless told): m micro-batches back to back without a pipeline."""
    return schedule_paths(layout, costs, message).ends


def schedule_paths(layout: Workload, costs: StepCosts, message: float | None = None) -> Paths:
    """pipeline.rank_paths of the record: each rank's end, time at work and accumulation (its
    dp sync after it takes its price)."""
    tails = [rank.accumulate for rank in costs.ranks]
    if layout.pp == 1:
        busy = tuple(layout.grad_accum * rank.micro_batch for rank in costs.ranks)
        return Paths(busy, busy, tuple(tails))
    syncs = [rank.dp for rank in costs.ranks]
    weights = [chunk_weights(layout, rank.share) for rank in costs.ranks] if costs.ranks[0].share else None
    return rank_paths(layout.schedule, layout.pp, layout.grad_accum, layout.virtual_stages,
                      [rank.micro_batch for rank in costs.ranks], costs.forward, weights,
                      costs.message if message is None else message, costs.crowd, tails, syncs)


def chunk_weights(layout: Workload, stage: StageShare) -> list[float]:
    """Each of `stage`'s chunks' share of its work: its blocks over the rank's (equal for a
    rank that holds none)."""
    layers = chunk_layers(layout, stage)
    total = sum(layers)
    return [n / total for n in layers] if total else [1.0 / len(layers)] * len(layers)


def assemble(layout: Workload, hw: Hardware, costs: StepCosts) -> StepTime:
    """The step as the loop runs it: each rank's path to the clip (its schedule's end, then its
    accumulation and dp sync), the slowest one; the clip's all-reduce, which every rank waits
    for; then every rank's offload and update at once, the slowest of them; then the loop's
    all-reduce. Split into the critical rank's parts and the slowest update. Its messages'
    share is what its path gains when they cost nothing; the bubble is the rest of its idle
    time.

    The update after the clip, not in each rank's own path: with uneven stages (the
    embedding's update on the first, the head's work on the last) the step is the latest end
    plus the longest update, though no one rank holds both. On a crowded host every rank
    updates at once, so at its price (taken with every rank at work)."""
    ends, busy, accumulated = schedule_paths(layout, costs)
    paths = [end + added + rank.dp for end, added, rank in zip(ends, accumulated, costs.ranks)]
    critical = max(range(len(paths)), key=paths.__getitem__)
    rank, m = costs.ranks[critical], layout.grad_accum
    after = max(costs.ranks, key=lambda r: r.after_clip)
    quiet = schedule_ends(layout, costs, message=0.0)[critical] if costs.message else ends[critical]
    messages = max(0.0, ends[critical] - quiet)
    bubble = max(0.0, quiet - busy[critical])
    # On a crowded host a pipeline rank works faster while others wait (pipeline.Crowd): its
    # micro-batches' parts, and its accumulation, take what they took as the schedule ran, shrunk
    # alike; its dp sync, a collective, its price (pipeline.rank_paths).
    pace = busy[critical] / (m * rank.micro_batch) if rank.micro_batch else 1.0
    dp, offload, update, gather = rank.dp, after.offload, after.update, after.gather
    accumulate = accumulated[critical]
    step = (busy[critical] + accumulate + bubble + messages + dp + offload + update + gather
            + costs.clip + costs.overhead)
    tokens_per_s = layout.global_batch * layout.seq_len / step
    # MFU against the 16-bit peak for fp8 too, as torchtitan reports it: fp8's gain shows as MFU above bf16's
    peak = layout.world * hw.peak_flops(outer_precision(layout.precision))
    return StepTime(flops_per_token=costs.model_flops, hardware_flops_per_token=costs.hardware_flops,
                    compute_s=pace * m * rank.compute + accumulate, tp_s=pace * m * rank.tp,
                    pp_s=messages, bubble_s=bubble,
                    dp_s=dp + gather, offload_s=offload, step_s=step, tokens_per_s=tokens_per_s, gather_s=gather,
                    mfu=costs.model_flops * tokens_per_s / peak, optimizer_s=update + costs.clip,
                    overhead_s=costs.overhead, cp_s=pace * m * rank.cp, ep_s=pace * m * rank.ep,
                    hfu=costs.hardware_flops * tokens_per_s / peak, critical_rank=critical)


def crowd_of(hw: Hardware) -> Crowd:
    """How `hw`'s cores were shared when it was calibrated, and how much faster a rank works
    with a core to itself (pipeline.Crowd; Hardware.lone_speedup, one figure for every
    micro-batch)."""
    return Crowd(hw.crowding, hw.lone_speedup)


def micro_batch_s_per_stage(config: GPTConfig, layout: Workload, hw: Hardware, gpus_per_node: int) -> list[float]:
    """Seconds of one micro-batch's forward and backward on each pipeline rank, in stage
    order, its messages aside (they are the schedule's edges)."""
    return [rank.micro_batch for rank in step_costs(config, layout, hw, gpus_per_node).ranks]


def sized_costs(params: int, tensors: int, compute: float, flops: float, layout: Workload, hw: Hardware,
                gpus_per_node: int, blocking_dp: float = 0.0) -> StepCosts:
    """The record of a data-parallel step of a model known by its size: one micro-batch's
    `compute`, `tensors` parameter tensors, `flops` per token, and `blocking_dp` seconds of
    collectives over dp the step waits for (a CNN's BatchNorm)."""
    links = inter_node(layout, gpus_per_node)
    owned = shard(params, layout.zero_ranks) if layout.zero else params
    kept = shard(params, layout.zero_ranks) if layout.zero >= 2 else params
    dp = dp_exposed_s(params, 0, layout, hw, links["dp_shard"], compute, 1 / 3, links["dp_replicate"])
    rank = RankCost(compute, accumulate=accumulate_params_s(layout, kept, tensors, hw), dp=dp + blocking_dp,
                    gather=gather_after_update_s(params, layout, hw, links["dp_shard"]),
                    offload=offload_s(params, layout, hw),
                    update=0.0 if layout.offload else optimizer_s(owned, tensors, hw))
    return StepCosts((rank,), flops, flops, clip=clip_s(layout, hw, links),
                     overhead=overhead_s(layout, hw, gpus_per_node))


def estimate_time_params_only(params: int, layout: Workload, hw: Hardware,
                              gpus_per_node: int) -> StepTime:
    """Step time of a model known only by its size: 6Ψ per token at compute_efficiency of
    the peak, DP/ZeRO traffic, its update (two tensors a rank: plait's flat shards), the
    accumulation, the clip and the loop."""
    rate = hw.peak_flops(layout.precision) * hw.compute_efficiency
    compute = layout.tokens_per_micro_batch * 6 * params / rate
    return assemble(layout, hw, sized_costs(params, 2, compute, 6.0 * params, layout, hw, gpus_per_node))


def estimate_time_measured_compute(params: int, tensors: int, compute_s: float, flops_per_sample: float,
                                   layout: Workload, hw: Hardware, gpus_per_node: int,
                                   blocking_dp: list[tuple[str, float, float]] = ()) -> StepTime:
    """Step time of a data-parallel model whose forward and backward of one micro-batch the
    caller has costed (`compute_s`: a CNN's convolutions, plait/estimate/cnn.py) with
    `tensors` parameter tensors: DP/ZeRO traffic, offload, the update, the accumulation and
    the clip as for any model, plus `blocking_dp`: (op, payload bytes, calls per step) of
    collectives over dp that the step waits for (BatchNorm's). A "token" of the result is one
    sample (seq_len 1)."""
    dp_link = inter_node(layout, gpus_per_node)["dp"]
    blocking = math.fsum(collective_s(op, payload, layout.dp, hw, dp_link) * calls for op, payload, calls in blocking_dp)
    return assemble(layout, hw, sized_costs(params, tensors, compute_s, flops_per_sample, layout, hw,
                                            gpus_per_node, blocking))
