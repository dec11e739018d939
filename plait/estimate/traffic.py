"""Bytes each rank puts on the wire per optimizer step, per mesh axis and per op.

The keys and the counting are those of plait's ledger (plait/runtime/comm.py), so a
prediction can be compared with `metrics.jsonl`'s `comm` key by key. With S the bytes of
the full tensor and n ranks in the group, a ring moves per rank
  all_reduce 2(n-1)/n·S;  all_gather, reduce_scatter (n-1)/n·S;  broadcast, send, recv S
  (and, for the benchmark's rooted ops: scatter, gather (n-1)/n·S at the root; reduce S).
The gradient norm's few fp64 sums per step are in (`clip_traffic`); left out is what the
ledger files as telemetry (the logged loss, timings) or as control (the step guard's
agreement, the per-token loss's count).

Each axis's figure is the largest over the ranks, as `metrics.jsonl` reports max over ranks.
"""

from __future__ import annotations

from plait.estimate.context import forward_passes, layer_bytes
from plait.estimate.experts import layer_alltoall
from plait.estimate.layout import Workload, StageShare, final_norm_params, layout_stages, rank_blocks, vocab_shard
from plait.estimate.memory import shard, state_bytes, zero3_packed
from plait.models.gpt.config import GPTConfig
from plait.wire import ring_bytes  # the ring formula's one home, shared with runtime/

Traffic = dict[str, dict[str, float]]


def _add(traffic: Traffic, axis: str, op: str, payload: float, n: int, times: float = 1) -> None:
    wire = ring_bytes(op, payload, n) * times
    if wire:
        axis_ops = traffic.setdefault(axis, {})
        axis_ops[op] = axis_ops.get(op, 0.0) + wire


def dp_traffic(params: int, layout: Workload, experts: int = 0) -> Traffic:
    """Data-parallel traffic for a rank holding `params` parameters.

    Plain DP and ZeRO-1 sync once per optimizer step: accumulation runs the other
    micro-batches under no_sync, which keeps gradients whole and unreduced; DP all-reduces
    them, ZeRO-1 reduce-scatters them and all-gathers the updated weights. ZeRO-2 and -3
    exist not to hold whole gradients, so they reduce-scatter every micro-batch into the
    shard (m times per step); ZeRO-3 also gathers each unit's weights before its forward
    and again before its backward, every micro-batch: 3(n-1)/n·Ψ·b when m = 1; with
    --reshard-after-forward false the forward's gather serves the backward too: 2(n-1)/n·Ψ·b.
    `experts` of the `params` (an ep rank's routed experts) sync over the dp / ep ranks
    that hold the same ones (the axis "edp").
    """
    out: Traffic = {}
    n, axis = layout.zero_ranks, layout.shard_axis  # the dp × cp ranks, or a --dp-shard group
    _sync_traffic(out, params - experts, layout, axis, n)
    if layout.replicas > 1:  # --dp-shard: each reduced shard summed over its replicas, every reduce-scatter
        _add(out, "dp_replicate", "all_reduce", shard(params - experts, n) * layout.reduce_bytes, layout.replicas,
             times=layout.grad_accum if layout.zero >= 2 else 1)
    if experts:
        _sync_traffic(out, experts, layout, "edp", n // layout.ep)
    return out


def _sync_traffic(out: Traffic, params: int, layout: Workload, axis: str, n: int) -> None:
    m, per = layout.grad_accum, state_bytes(layout.precision)
    grads, weights = params * layout.reduce_bytes, params * per.param
    if layout.zero == 0:
        _add(out, axis, "all_reduce", grads, n)
        return
    _add(out, axis, "reduce_scatter", grads, n, times=m if layout.zero >= 2 else 1)
    _add(out, axis, "all_gather", weights, n, times=zero3_gathers(layout) * m if layout.zero == 3 else 1)


def ep_traffic(config: GPTConfig, layout: Workload, stage: StageShare) -> Traffic:
    """Expert parallelism's all-to-alls on one rank of `stage`, per step, with uniform
    routing: every MoE block's dispatch, forward (again when recomputed) and backward,
    every micro-batch (estimate/experts.py)."""
    if layout.ep == 1 or not stage.moe_layers:
        return {}
    per = layer_alltoall(config, layout)
    wire = stage.moe_runs * layout.grad_accum * (forward_passes(layout.recompute) * per["forward"] + per["backward"])
    return {"ep": {"all_to_all": wire}}


def cp_traffic(config: GPTConfig, layout: Workload, stage: StageShare) -> Traffic:
    """Context parallelism's traffic on one rank of `stage`, per step: every layer's
    attention, forward (again when recomputed) and backward, every micro-batch
    (estimate/context.py: the ring's sends and receives, or Ulysses' all-to-alls)."""
    out: Traffic = {}
    if layout.cp == 1:
        return out
    per = layer_bytes(config, layout)
    wire = stage.runs * layout.grad_accum * (forward_passes(layout.recompute) * per["forward"] + per["backward"])
    for op in (("send", "recv") if layout.cp_kind == "ring" else ("all_to_all",)):
        out.setdefault("cp", {})[op] = wire
    return out


def plan_collectives(config: GPTConfig, layout: Workload, stage: StageShare, ends: bool,
                     whole_ends: bool) -> dict[str, float]:
    """`tp_collectives` of a model as its shape says its plan splits it: its regions, its
    experts, its attentions without a row layer, MLA's kept input (`ends` and `whole_ends` as
    there: the overlapping stack's path asks for the blocks alone)."""
    attention = config.tp_attention_share if config.tp_attention else 0.0
    ends = (ends and config.embedding_split, ends and config.vocab_split)  # a head summing whole logits: tp_traffic's
    passes = read_whole_passes(config, layout, stage) if whole_ends else 0.0
    if whole_ends and sp_blocks_whole(config, layout):  # SP splits nothing in the blocks
        full = layout.recompute == "full"
        gathers = sum(config.sp_read_whole_count[i] * config.runs_of(i) for i in stage_blocks(config, layout, stage))
        return {"all_gather": gathers * sp_region_collectives(False, full, reruns_exit=True)[0] + passes,
                "all_reduce": int(ends[0] and stage.first) + int(ends[1] and stage.last)}
    out = tp_collectives(layout, stage, ends, whole_ends, split_moe_calls(config, layout),
                         (attention, config.tp_mlp), bool(config.mla_down_params) and not config.attention_reads_input,
                         config.tp_attention_entries,
                         config.sp_mlp_read_whole, config.sp_whole_mixers, config.moe_dense_mlps)
    return {**out, "all_gather": out["all_gather"] + passes} if passes else out


def read_whole_passes(config: GPTConfig, layout: Workload, stage: StageShare) -> float:
    """All-gathers of b·s·h a micro-batch under SP, beyond `sp_region_collectives`' one tensor in
    and one out, of the children `stage`'s blocks read whole (GPTConfig.sp_read_whole_passes):
    each further input on the sequence slice is gathered entering (again in full recompute's
    rerun), and each further output over the whole sequence is cut to the slice leaving, its
    gradient gathered back (DBRX's norm-attention-norm hands on its residual: one a block)."""
    passes = config.sp_read_whole_passes
    if not layout.sp or layout.tp == 1 or len(passes) != config.n_layers:
        return 0.0
    reruns = 2 if layout.recompute == "full" else 1
    return sum((passes[i][0] * reruns + passes[i][1]) * config.runs_of(i)  # again each run of a looped block
               for i in stage_blocks(config, layout, stage))


def tp_collectives(layout: Workload, stage: StageShare, ends: tuple[bool, bool] = (True, True),
                   whole_ends: bool = False, split_moe: tuple[int, int] = (0, 0),
                   regions: tuple[float, bool] = (1.0, True), kept_input: bool = False,
                   entries: float = 0.0, mlp_read_whole: bool = False, whole_mixers: float = 0.0,
                   dense_beside: int = 0) -> dict[str, float]:
    """Collectives of b·s·h activations per micro-batch on one rank of `stage` (its blocks'
    alone without `ends`, the embedding's and the head's: what an overlapping stack hides,
    time.tp_s).

    Per block: two all-reduces forward (leaving attention's and the MLP's row-parallel
    layers) and two backward (entering the column-parallel ones). Sequence parallelism
    turns each into an all-gather plus a reduce-scatter (same bytes), and all-gathers each
    region's saved input sequence shard again in backward (two more per block).
    Full recompute reruns the block's forward in backward only as far as the last tensor
    backward needs (torch's checkpoint stops there): attention's region and the MLP's
    entry, not the MLP's exit. That is one more all-reduce per block; under SP two more
    all-gathers and one more reduce-scatter (the backward re-gathers stay: the rerun keeps
    sequence shards too). Around the blocks: the vocab-parallel embedding leaves a region
    (first stage), the head enters one (last stage, whose saved input SP gathers again too).
    An MoE block's MLP stays whole on every tp rank: its attention's collectives only, under SP
    too (a transformers MoE, `whole_ends`: the MoE block runs whole on its sequence slice, its
    weights' gradients summed over tp, as a norm's are).
    With `whole_ends` (GPTConfig.whole_sequence_ends) the embedding and the head read the
    whole sequence under SP too: one all-reduce each, as without SP (the sequence's own cut
    and gather around the blocks are `sequence_ends`).
    Where tp splits an MoE block's experts (`split_moe`, from `split_moe_calls`), the block
    adds its experts' all-reduces; under SP it runs whole on the gathered sequence: one more
    region, entered by an all-gather (again in full recompute's rerun) whose backward
    reduce-scatters, and left by keeping this rank's slice, whose gradient is gathered back.
    `regions` says which of a block's regions the plan splits (GPTConfig.tp_attention, tp_mlp),
    the attention's as the share of blocks where it does (GPTConfig.tp_attention_share: a
    hybrid's): without SP, each split region is entered and left once, and full recompute
    reruns the attention's exit where the attention is split (whatever the MLP keeps stops the
    rerun after it); nothing for a region left whole. Under SP, with `whole_ends`, each region's
    count is `sp_region_collectives`' (a whole attention is read whole: gathered, not split;
    `kept_input`: whole layers inside the split attention keep its gathered input, MLA's
    down-projections, GPTConfig.mla_down_params, so backward does not gather it again).
    `entries`: a block's all-reduces, as a mean, from attentions split with no row layer closing
    them (GPTConfig.tp_attention_entries), with or without SP (under which they are read whole,
    their layers split inside). `mlp_read_whole` (GPTConfig.sp_mlp_read_whole): under SP a split
    MLP gathers as a split region does but reduce-scatters nothing, its layers summing as
    without SP (two all-reduces). `whole_mixers` (GPTConfig.sp_whole_mixers): under SP a block's
    token-mixing layers beside its attention that the plan leaves whole, each read whole as a
    whole attention is. `dense_beside` (GPTConfig.moe_dense_mlps): without SP an MoE block runs
    the two all-reduces of each split dense MLP beside its experts (Gemma 4's one, LongCat's two).
    """
    first, last = int(ends[0] and stage.first), int(ends[1] and stage.last)
    blocks = stage.runs  # a looped model's blocks run their collectives again each run
    full = layout.recompute == "full"
    moe = round(stage.moe_runs)
    experts = moe * sum(split_moe)
    entered = blocks * entries
    if not layout.sp:  # an MoE block's MLP stays whole on every tp rank: its attention's two (three) only
        attention, mlp = regions
        rerun = full * attention
        dense = 2 * (attention + mlp) + rerun
        beside = 2 * dense_beside
        return {"all_reduce": (blocks - moe) * dense + moe * (2 * attention + rerun + beside) + experts + first + last
                + entered}
    if whole_ends:  # a transformers model's plan: its regions split or read whole (sp_region_collectives)
        attention, mlp = regions
        split_a, whole_a = (sp_region_collectives(split, full, reruns_exit=True) for split in (True, False))
        gather_a = attention * (split_a[0] - kept_input) + (1 - attention) * whole_a[0]
        gather_a += whole_mixers * whole_a[0]  # the other mixers the plan leaves whole, read whole too
        scatter_a = attention * split_a[1] + (1 - attention) * whole_a[1]
        gather_m, scatter_m = sp_region_collectives(mlp, full, reruns_exit=False, mixes_tokens=False)
        inside_m = 0
        if mlp and mlp_read_whole:  # gathered, not reduce-scattered: its layers sum as without SP
            scatter_m, inside_m = 0, 2
        region = moe if split_moe[0] else 0  # an MoE block: its attention's region, and its experts' where split
        return {"all_gather": blocks * gather_a + (blocks - moe) * gather_m + region * (3 if full else 2),
                "reduce_scatter": blocks * scatter_a + (blocks - moe) * scatter_m + region,
                "all_reduce": experts + first + last + entered + (blocks - moe) * inside_m}
    return {"all_gather": blocks * (8 if full else 6) + first + 2 * last,
            "reduce_scatter": blocks * (5 if full else 4) + first + last}


def sp_region_collectives(split: bool, full: bool, reruns_exit: bool,
                          mixes_tokens: bool = True) -> tuple[int, int]:
    """(all-gathers, reduce-scatters) of b·s·h one block region runs per micro-batch under SP
    in a transformers model's plan (models/hf/styles.for_sequence_parallel).

    A split region enters by gathering its sequence slice and leaves by reduce-scattering;
    backward reduce-scatters the entry's gradient, gathers the exit's, and gathers the saved
    slice again (3 and 2). Full recompute reruns its entry, and its exit where the block's
    last saved tensor comes after it (the attention's: the MLP's input; `reruns_exit`).
    A region the plan leaves whole that mixes tokens (an attention: "gathered") is read whole
    on every rank: its entry gathers, and the rerun gathers again, but its input's gradient
    is whole and alike on every rank, so entering keeps this rank's chunk of it; leaving keeps
    this rank's chunk of the output, whose gradient is gathered back (2; full 3). A whole
    region that does not mix tokens (an MLP) runs on the slice: nothing, its weights'
    gradients summed as a norm's are (tp_traffic, under SP)."""
    if split:
        return (4 if full else 3), (2 + (full and reruns_exit))
    return ((3 if full else 2), 0) if mixes_tokens else (0, 0)


def split_moe_calls(config: GPTConfig, layout: Workload) -> tuple[int, int]:
    """The all-reduces one MoE block's experts run per micro-batch where tp splits them
    (GPTConfig.tp_expert_rows, without ep): (the routed experts', the shared experts'); each
    routed one carries `tp_expert_rows` rows a token, a shared one one row. (0, 0) where tp
    keeps the MoE MLP whole, but for shared experts the plan splits beside routed ones kept
    whole (tp_shared_experts: entered and left without SP, under which the block runs whole).

    Without SP each is left (forward) and entered (backward) as a dense MLP is; under SP the
    block runs whole on the gathered sequence, whose region's gather and scatter stand for
    the entries (tp_collectives), so only the exits sum. Full recompute reruns the routed
    experts' exit: they run before the shared experts (Llama 4's order), whose last saved input
    ends the rerun, before their own exit."""
    if layout.tp == 1:
        return 0, 0
    if not config.routed_split_by_tp(layout.ep):  # routed experts whole; shared ones split beside them
        return 0, (2 if config.shared_split_by_tp(layout.ep) and config.shared_width and not layout.sp else 0)
    passes = 1 if layout.sp else 2
    shared = passes if config.shared_width else 0
    rerun = 1 if layout.recompute == "full" and shared else 0
    return passes + rerun, shared


def expert_entries(config: GPTConfig, layout: Workload) -> float:
    """Floats per token one MoE block's split experts modules enter with beside the tokens, as
    tp splits them in `layout` (GPTConfig.tp_expert_entries: the routed experts' where
    routed_split_by_tp, the shared experts' where shared_split_by_tp); 0 under SP, where the
    block runs whole in its region and they are made inside it."""
    if layout.tp == 1 or layout.sp:
        return 0.0
    routed, shared = config.tp_expert_entries
    return (routed if config.routed_split_by_tp(layout.ep) else 0.0) \
        + (shared if config.shared_split_by_tp(layout.ep) else 0.0)


def sequence_ends(config: GPTConfig, layout: Workload, stage: StageShare) -> int:
    """All-gathers of b·s·h per micro-batch where SP cuts the sequence at the blocks alone
    (`whole_sequence_ends`): the first block keeps its slice of the input (gathered again in
    backward), the last gathers its output whole (nothing in backward: each rank keeps its
    slice of the gradient). Once per forward, full recompute or not: the hooks sit on the
    blocks' calls, outside the recomputed forward (parallel/recompute.py)."""
    if not (layout.sp and config.whole_sequence_ends):
        return 0
    return int(stage.first) + int(stage.last)


def gathered_passes(layout: Workload) -> tuple[int, int]:
    """How often a fused projection the plan gathers whole (GPTConfig.tp_gathered) is gathered
    per micro-batch: its output forward, again in full recompute's rerun (the saved inputs after
    it come after the gather); its split input's gradient backward, once."""
    return (2 if layout.recompute == "full" else 1), 1


def gathered_calls(config: GPTConfig, layout: Workload, stage: StageShare) -> int:
    """All-gathers one micro-batch runs on `stage` where the plan gathers fused projections
    whole (GPTConfig.tp_gathered_calls, `gathered_passes` each; under SP too, inside the region
    the sequence's gather entered); tp_traffic counts their bytes."""
    if not any(config.tp_gathered_calls):
        return 0
    return round(stage.runs * sum(n * times for n, times in zip(config.tp_gathered_calls, gathered_passes(layout))))


def tp_traffic(config: GPTConfig, layout: Workload, stage: StageShare) -> Traffic:
    """Megatron tensor-parallel traffic on one rank of `stage`, per step.

    Besides `tp_collectives` (without the embedding's and the head's where they stay whole,
    `vocab_split` false) and `sequence_ends`: the vocab-parallel cross-entropy all-reduces three fp32
    numbers per token (max, sum of exponentials, target logit); q/k norms (a transformers
    family's `qk_norm`) sum their per-head weights' gradients, or, over every head, have q, k
    and v gathered whole in forward and o_proj's input gradient gathered in backward (its
    slice of a whole input); and
    under SP the norm weights' gradients, which each rank computed from its own sequence
    shard, are summed (as each micro-batch's backward produces them): the final norm's too,
    unless it runs on the whole sequence (`whole_sequence_ends`).
    """
    out: Traffic = {}
    t, m = layout.tp, layout.grad_accum
    act = layout.hidden_bytes(config.d_model)
    split_ends = config.vocab_split  # else whole on every tp rank (plait's GPT-2 adapter: tied, models/hf/gpt2.py)
    split_moe = split_moe_calls(config, layout)
    for op, count in plan_collectives(config, layout, stage, True, config.whole_sequence_ends).items():
        _add(out, "tp", op, act, t, times=m * count)
    if any(config.tp_gathered):  # a plan that gathers fused projections whole (under SP too: inside its region)
        width = sum(w * n for w, n in zip(config.tp_gathered, gathered_passes(layout)))
        _add(out, "tp", "all_gather", layout.tokens_per_micro_batch * width * layout.compute_bytes,
             t, times=m * stage.runs)
    if split_moe[0] and config.tp_expert_rows:  # the routed experts' all-reduces carry tp_expert_rows rows a token
        _add(out, "tp", "all_reduce", act * (config.tp_expert_rows - 1), t,
             times=m * round(stage.moe_runs) * split_moe[0])
    entries = expert_entries(config, layout)
    if entries:  # routing weights and shared gates entering split experts: their gradients summed
        _add(out, "tp", "all_reduce", layout.tokens_per_micro_batch * entries * layout.compute_bytes, t,
             times=m * round(stage.moe_runs))
    if stage.last and layout.tp > 1 and any(config.tp_last_rows):  # a layer after the blocks split by its input
        outputs, inputs = config.tp_last_rows
        _add(out, "tp", "all_reduce", layout.tokens_per_micro_batch * outputs * layout.compute_bytes, t, times=m)
        _add(out, "tp", "all_gather", layout.tokens_per_micro_batch * inputs * layout.compute_bytes, t, times=m)
    if stage.first and config.embedding_split and config.embedding_summed_params and not layout.sp:
        _add(out, "tp", "all_reduce", config.embedding_summed_params * state_bytes(layout.precision).grad, t,
             times=m)
    # the blocks' input and output: as many hidden-wide streams as the residual holds
    _add(out, "tp", "all_gather", act * config.residual_streams, t, times=m * sequence_ends(config, layout, stage))
    if stage.last and split_ends:
        _add(out, "tp", "all_reduce", layout.tokens_per_micro_batch * 4, t, times=3 * m)
    if stage.last and config.head_sums_logits:  # partial logits over the whole vocabulary, summed
        _add(out, "tp", "all_reduce", layout.tokens_per_micro_batch * config.vocab_size * layout.compute_bytes, t,
             times=m)
        _add(out, "tp", "all_gather", layout.tokens_per_micro_batch * config.d_model * layout.compute_bytes, t,
             times=m)
    counted = counted_sp_sum(config, layout, stage)  # SP with blocks it splits nothing in: what they hold, summed
    whole_blocks = sp_blocks_whole(config, layout)
    if config.sp_sliced_inputs and layout.sp:  # each block's slice of its per-layer inputs: gradient gathered
        _add(out, "tp", "all_gather", layout.tokens_per_micro_batch * config.sp_sliced_inputs * layout.compute_bytes,
             t, times=m * stage.runs)
    if config.qk_norm == "head" and counted is None:  # per-head q and k norm weights: their gradients summed
        # (where SP leaves some blocks whole, the blocks' count holds them)
        grad_bytes = state_bytes(layout.precision).grad
        _add(out, "tp", "all_reduce", 2 * config.head_dim * grad_bytes, t,
             times=m * stage.layers * config.qk_norm_share)
    elif config.qk_norm == "full" and not whole_blocks:  # q, k, v gathered whole; o_proj's input gradient gathered back
        width = 2 * config.n_heads * config.head_dim + 2 * config.kv_dim
        _add(out, "tp", "all_gather", layout.tokens_per_micro_batch * width * layout.compute_bytes, t,
             times=m * stage.runs * config.qk_norm_share)
    entered = config.tp_entered_tail + config.tp_entry_extra  # MLA's rotary key, and its latents' own entries
    if entered and not layout.sp:  # their gradients summed in backward (the hidden's entry is plan_collectives')
        _add(out, "tp", "all_reduce", layout.tokens_per_micro_batch * entered * layout.compute_bytes, t,
             times=m * stage.runs)
    if config.tp_summed_params and counted is None:  # whole layers the plan sums the gradients of, SP or not
        _add(out, "tp", "all_reduce", config.tp_summed_params * state_bytes(layout.precision).grad, t,
             times=m * stage.layers)
    if config.split_mlp_scalars and not layout.sp:  # summed every micro-batch; under SP with the norms' below
        _add(out, "tp", "all_reduce", config.split_mlp_scalars * state_bytes(layout.precision).grad, t,
             times=m * stage.layers)
    if layout.sp:
        grad_bytes = state_bytes(layout.precision).grad
        whole = final_norm_params(config) if stage.last and config.whole_sequence_ends else 0
        # shared experts split beside whole routed ones run whole under SP (plans.whole_beside_experts)
        beside = (round(3 * config.d_model * config.shared_width * stage.moe_layers)
                  if config.tp_shared_experts and not config.routed_split_by_tp(layout.ep) else 0)
        # an attention the plan leaves whole is read whole on every rank (sp_region_collectives):
        # its weights' gradients are alike there, not summed
        read_whole = round(stage.layers) * config.attention_params \
            if config.whole_sequence_ends and not config.tp_attention else 0
        # MLA's down-projections run on the gathered sequence inside the split attention: summed too
        # (their gradients carry the rotary key's, which then enters with them)
        down = round(stage.layers) * config.mla_down_params
        norms = round(stage.layers * config.sp_norm_extra)  # the norms the first block's count misses
        summed = stage.replicated_params - whole + beside - read_whole + down + norms
        if counted is not None:  # what the blocks hold, less what SP reads whole; the final norm where on a slice
            summed = counted + final_norm_params(config) * stage.last - whole
        _add(out, "tp", "all_reduce", summed * grad_bytes, t, times=m)
    return out


def counted_sp_sum(config: GPTConfig, layout: Workload, stage: StageShare) -> int | None:
    """The parameters of `stage`'s blocks whose gradients SP sums, from the model's count, where
    its plan splits nothing under SP in some blocks (DBRX's, Gemma 4's, whose blocks hold
    experts kept whole, in all of them; Nemotron-H's MoE, mamba and MLP blocks beside its split
    attention, as transformers 5.25 declares it): all of each block's (its routed experts this
    ep rank's), less what SP splits there, those of the children it reads whole and those
    without a gradient (GPTConfig.sp_read_whole). Blocks of different kinds (Nemotron-H's
    attention, mamba, MoE or MLP alone) each count as they are, where the formulas' mean block
    would not. None where every block is split under SP, and without SP: the formulas' sum,
    with its corrections, stands."""
    tally = _sp_tally(config, layout)
    if not tally or all(split_sp for _, _, _, split_sp in tally):
        return None
    return sum(tally[i][0] + tally[i][1] + tally[i][2] // layout.ep - tally[i][3] - config.sp_read_whole[i]
               for i in stage_blocks(config, layout, stage))


def sp_blocks_whole(config: GPTConfig, layout: Workload) -> bool:
    """SP with nothing split in any block (DBRX's, Gemma 4's): each block whole on every tp
    rank, its only gathers those of the children it reads whole."""
    tally = _sp_tally(config, layout)
    return bool(tally) and not any(split_sp for _, _, _, split_sp in tally)


def _sp_tally(config: GPTConfig, layout: Workload) -> tuple:
    """The model's count a block at a time, under SP, where it has one for every block and
    what SP reads whole in each; () elsewhere."""
    tally = config.block_tally
    return tally if layout.sp and tally and len(config.sp_read_whole) == len(tally) else ()


def stage_blocks(config: GPTConfig, layout: Workload, stage: StageShare) -> list[int]:
    """The blocks `stage`'s pipeline rank holds."""
    return rank_blocks(config, layout.pp, layout.virtual_stages, layout.stage_layers)[stage.index]


def pp_messages(layout: Workload, stage: StageShare) -> int:
    """Activations sent (forward) plus gradients sent (backward) per micro-batch.

    With v chunks per rank every chunk sends forward unless it is the model's last and
    backward unless it is the model's first; a rank receives as many messages as it sends.
    """
    v = layout.virtual_stages
    return (v - (1 if stage.last else 0)) + (v - (1 if stage.first else 0))


def pp_traffic(config: GPTConfig, layout: Workload, stage: StageShare) -> Traffic:
    """Point-to-point traffic between pipeline stages: b·s·h·bytes per message, h times the
    residual streams (a sequence shard of it under SP). With tied embeddings the first and last rank each hold
    a copy of the embedding and swap their gradients once per step (a send and a recv):
    the whole gradient, or under ZeRO the dp rank's shard of it (padded to a multiple of dp)."""
    out: Traffic = {}
    if layout.pp == 1:
        return out
    message = layout.stage_message_bytes(config.stream_width)
    count = pp_messages(layout, stage) * layout.grad_accum
    if config.tie_embeddings and (stage.first or stage.last):
        table = vocab_shard(config, layout.tp) * config.d_model
        table = -(-table // layout.zero_ranks) if layout.zero else table
        tied = table * state_bytes(layout.precision).grad
        _add(out, "pp", "send", tied, 2)
        _add(out, "pp", "recv", tied, 2)
    _add(out, "pp", "send", message, 2, times=count)
    _add(out, "pp", "recv", message, 2, times=count)
    return out


def merge_max(parts: list[Traffic]) -> Traffic:
    """Per (axis, op), the largest figure over the parts (ranks)."""
    out: Traffic = {}
    for part in parts:
        for axis, ops in part.items():
            for op, wire in ops.items():
                axis_ops = out.setdefault(axis, {})
                axis_ops[op] = max(axis_ops.get(op, 0.0), wire)
    return out


def estimate_comm(config: GPTConfig, layout: Workload) -> Traffic:
    """`{axis: {op: bytes}}` per rank per optimizer step, largest over ranks."""
    return merge_max([rank_traffic(config, layout, stage) for stage in layout_stages(config, layout)])


def rank_traffic(config: GPTConfig, layout: Workload, stage: StageShare, clipped: bool = True) -> Traffic:
    """One rank of `stage`: `{axis: {op: bytes}}` per optimizer step, every axis; `clipped`: with
    the gradient norm's sums (plait train clips; a loop of one's own may not)."""
    traffic = dp_traffic(zero3_packed(config, layout, stage), layout, stage.expert_params)
    looped_gathers(traffic, layout, stage)
    for extra in (tp_traffic(config, layout, stage), pp_traffic(config, layout, stage),
                  cp_traffic(config, layout, stage), ep_traffic(config, layout, stage)):
        traffic.update(extra)
    if clipped:
        clip_traffic(traffic, config, layout)
    routing_traffic(traffic, config, layout, stage)
    return traffic


def looped_gathers(out: Traffic, layout: Workload, stage: StageShare) -> None:
    """ZeRO-3 gathers a looped block's unit (GPTConfig.block_runs) again before each further
    run's forward, where the forward before resharded it; backward finds it gathered, and its
    gradient is reduce-scattered once. Measured on 2 ranks, Dory's recurrent block run twice:
    one gather of its unit beyond the estimate's a micro-batch (213,504 bytes a step against
    192,512), none with --reshard-after-forward false (96,256, as estimated). A unit is the
    block's trained parameters (memory.zero3_units): its routed experts, when ep cuts them,
    are the unit's second shard, gathered over the edp ranks that hold the same experts, as
    `dp_traffic` syncs them."""
    if not (layout.zero == 3 and stage.rerun_params and layout.reshard_after_forward):
        return
    param_bytes, times = state_bytes(layout.precision).param, layout.grad_accum
    dense = stage.rerun_params - stage.rerun_experts
    _add(out, layout.shard_axis, "all_gather", dense * param_bytes, layout.zero_ranks, times=times)
    _add(out, "edp", "all_gather", stage.rerun_experts * param_bytes, layout.zero_ranks // layout.ep, times=times)


def routing_traffic(out: Traffic, config: GPTConfig, layout: Workload, stage: StageShare) -> None:
    """Once per step, plait's MoE blocks sum the tokens each expert received over the data ranks,
    with the assignments dropped (plait.parallel.expert.plan.after_step: E + 1 int64 numbers
    a block of the stage), so every rank balances on the whole batch's routing. A transformers
    MoE's blocks count theirs alike where each has a router plait can hook, and else nothing
    (GPTConfig.counts_routing: Mixtral's 2 blocks of 4 experts, 80 bytes a step)."""
    blocks = round(stage.moe_layers)
    if config.counts_routing and blocks:
        _add(out, layout.sync_axis, "all_reduce", 8 * (config.experts + 1) * blocks, layout.dp * layout.cp)


def clip_traffic(out: Traffic, config: GPTConfig | None, layout: Workload) -> None:
    """The gradient norm's sums, once per step in fp64 (plait.parallel.clip.global_norm): one
    number per axis that splits parameters outside the data ranks (tp) plus the rest; those
    all summed over ZeRO's shard ranks and over pp; the tp-split one over tp; without ZeRO,
    the experts' over ep. `config` None: a model known only by its size (no experts)."""
    numbers = 2 if layout.tp > 1 else 1
    if layout.zero and layout.zero_ranks > 1:
        _add(out, layout.shard_axis, "all_reduce", 8 * numbers, layout.zero_ranks)
    if layout.tp > 1:
        _add(out, "tp", "all_reduce", 8, layout.tp)
    if layout.pp > 1:
        _add(out, "pp", "all_reduce", 8 * numbers, layout.pp)
    if not layout.zero and config is not None and config.is_moe and layout.ep > 1:
        _add(out, "ep", "all_reduce", 8, layout.ep)


def naive_comm(config: GPTConfig | None, layout: Workload,
               params: int | None = None) -> dict[str, dict[str, object]]:
    """The seeds' totals beside plait's, per step, summed over one group of each axis.

    The seeds count a naive exchange in which every one of N workers sends its whole
    tensor to each of the others: Ψ·b·N·(N-1) for the gradients of data parallelism,
    out·b·N·(N-1) per tensor-parallel layer (out = the layer's b·s·h output, once per
    micro-batch), and Σ out_i·b over the stage boundaries for a pipeline (forward only).
    `plait_bytes` is what the same group puts on the wire per step in plait's accounting.
    """
    out: dict[str, dict[str, object]] = {}
    if config is not None:
        all_stages = layout_stages(config, layout)
        params = max(s.trained_params for s in all_stages)
        mine = estimate_comm(config, layout)
    else:
        mine = dp_traffic(params or 0, layout)
    if layout.sync > 1:  # all N data ranks, however --dp-shard groups them (both its axes counted)
        n, grad = layout.sync, layout.reduce_bytes
        axes = dict.fromkeys((layout.shard_axis, layout.sync_axis, "dp_replicate"))
        sent = sum(_group_total(mine, axis, n) for axis in axes)
        out[layout.shard_axis] = _naive("Ψ·b·N·(N−1)", (params or 0) * grad * n * (n - 1), sent)
    if config is None:
        return out
    m = layout.grad_accum
    act = layout.hidden_bytes(config.d_model)
    if layout.tp > 1:
        n, layers = layout.tp, all_stages[0].runs
        out["tp"] = _naive("Σ_layers out·b·N·(N−1), once per micro-batch",
                           layers * act * n * (n - 1) * m, _group_total(mine, "tp", n))
    if layout.pp > 1:
        message = layout.stage_message_bytes(config.stream_width)
        boundaries = layout.pp * layout.virtual_stages - 1
        out["pp"] = _naive("Σ_i out_i·b over stage boundaries, forward, per micro-batch",
                           (layout.pp - 1) * act * m, 2 * boundaries * m * message)
    return out


def _group_total(mine: Traffic, axis: str, n: int) -> float:
    """Bytes sent by all n (symmetric) ranks of one group."""
    return n * sum(mine.get(axis, {}).values())


def _naive(formula: str, naive: float, plait: float) -> dict[str, object]:
    return {"formula": formula, "naive_bytes": naive, "plait_bytes": plait}


def zero3_gathers(layout: Workload) -> int:
    """How often ZeRO-3 gathers a unit per micro-batch: before forward and again before
    backward, or once when it stays gathered between them (--reshard-after-forward false)."""
    return 2 if layout.reshard_after_forward else 1
