"""Bytes per rank: model states (ZeRO accounting), activations, buffers, allowance.

Model states follow Rajbhandari et al. 2019 (ZeRO). Per parameter, a rank keeps
  mixed precision (bf16/fp16): 2 (16-bit weights) + 2 (16-bit grads) + K = 12 (fp32
      master weights, Adam m and v)                                     = 16 bytes
  pure fp32 Adam: 4 (weights) + 4 (grads) + 8 (Adam m and v)           = 16 bytes
and stage 1 divides the optimizer term by N_d, stage 2 the gradients too, stage 3 the
weights too, plus what it holds gathered at once in the compute dtype (the paper's one
unit; plait's ZeRO-3 keeps the root unit and two units, see `gathered_params`). CPU
offload moves the optimizer term (master weights included) to host memory.

The seed's rule "1 M params ≈ 12 MB, 1 B params ≈ 12 GB" in fp32 is 4 bytes of weight,
4 of gradient and 4 of one momentum buffer: SGD with momentum, not Adam (see
`seed_rule_bytes`).

Everything here is per rank and for the busiest rank: the pipeline stage whose device
total is largest (the first under 1F1B, which holds p micro-batches of activations and the
embedding; sometimes the last, which holds the head and the loss).
"""

from __future__ import annotations

import functools

from dataclasses import asdict, dataclass

from plait.estimate.activations import (chunk_forward_bytes, loss_bytes, rope_table_bytes, stage_block_bytes,
                                        stage_activation_bytes, stage_extra_bytes)
from plait.interleave import held_frontier
from plait.estimate.layout import (Workload, StageShare, chunk_ends, chunk_layers, embedding_rows, head_weight,
                                   layout_stages, vocab_shard)
from plait.models.gpt.config import GPTConfig
from plait.rules import BUCKET_MB

ADAM_K = 12  # fp32 master weights + Adam m + Adam v, bytes per parameter
FRAGMENTATION = 0.10  # allowance on device bytes, see `device_total`
BUCKET_BYTES = int(BUCKET_MB * 2**20)  # plait's default gradient bucket (--bucket-mb; Workload.bucket_mb)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model state, before any sharding."""

    param: int
    grad: int
    optim: int


def state_bytes(precision: str) -> StateBytes:
    """(2 + 2 + 12) for mixed precision, (4 + 4 + 8) for pure fp32 Adam."""
    if precision == "fp32":
        return StateBytes(4, 4, 8)
    return StateBytes(2, 2, ADAM_K)


def seed_rule_bytes(params: int) -> int:
    """The seed's 12 bytes per parameter: fp32 weight + fp32 grad + one fp32 momentum."""
    return 12 * params


def shard(count: int, n: int) -> int:
    """Elements one of n ranks holds of a flat buffer padded to a multiple of n."""
    return -(-count // n)


@dataclass
class Memory:
    """Bytes on one rank. `host` is what offload keeps in CPU memory: all of `optim`, plus
    the fp32 copy of the gradient shard the host steps on."""

    params: float = 0.0
    grads: float = 0.0
    grads_unmade: float = 0.0  # of `grads`, what is not made yet when activations and gradients peak together
    optim: float = 0.0
    activations: float | None = 0.0
    buffers: float = 0.0
    fragmentation: float = 0.0
    host: float = 0.0
    total: float = 0.0  # what must fit on the device
    stage: int = 0
    transient: float = 0.0  # the largest short-lived bytes of setup or of writing the outputs (`transient_bytes`)
    peak: float = 0.0  # total + transient: at most this on the rank, at any moment, where the device is the host
    host_peak: float = 0.0  # beside a GPU (which holds `total`): host + transient, in the rank's host memory

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def model_states(params: int, unit_params: int, layout: Workload, per: StateBytes | None = None,
                 experts: int = 0) -> Memory:
    """Weights, gradients and optimizer state of `params` parameters under ZeRO: the ZeRO
    paper's (p + g + K)Ψ, each term / dp once its stage shards it (a shard is a flat buffer's
    1/dp, rounded up). `per` gives other bytes per parameter (another optimizer's K);
    by default Adam's at the layout's precision (`state_bytes`). `experts` of the `params`
    are an ep rank's routed experts, which ZeRO shards over the dp / ep ranks holding them."""
    per = per or state_bytes(layout.precision)
    n, zero = layout.zero_ranks, layout.zero
    sharded = shard(params - experts, n) + (shard(experts, n // layout.ep) if experts else 0)
    weights = params * per.param
    grads = params * per.grad
    optim = params * per.optim
    if zero >= 1:
        optim = sharded * per.optim
    if zero >= 2:
        grads = sharded * per.grad
    if zero >= 3:
        weights = sharded * per.param + unit_params * per.param
    if layout.offload and layout.precision == "fp32":
        # The step runs on the host, on its own fp32 copy of the shard (the device keeps its
        # weights): plait's ZeRO offload holds master + m + v there, 12 bytes, as in 16-bit.
        optim += sharded * 4
    # Offload: the optimizer lives on the host, which steps on an fp32 copy of the gradient
    # shard (plait/parallel/zero/optim.py keeps it between steps).
    host = optim + sharded * 4 if layout.offload else 0.0
    return Memory(params=weights, grads=grads, optim=optim, host=host)


def buffers(params: int, layout: Workload) -> float:
    """Gradient scratch space outside the sharded state (model known by size alone).

    Plain DP and ZeRO-1 reduce gradients in place in their buckets (plait's .grad tensors
    are views into them), so they need nothing extra. ZeRO-2/3 keep only a gradient shard,
    so whole gradients exist a bucket at a time during backward: one being filled while
    one is reduced (parallel/zero/hooks.py: IN_FLIGHT). Every backward reduce-scatters and
    drops them, accumulating or not: no_sync holds only ZeRO-1's.
    """
    if layout.sync == 1 or layout.zero < 2:
        return 0.0
    return min(2 * layout.bucket_bytes, params * state_bytes(layout.precision).grad)


def stage_buffers(config: GPTConfig, layout: Workload, stage: StageShare) -> float:
    """`buffers` (for ZeRO-3 whole gradients a unit at a time, not two buckets), plus the
    pipeline's receive buffers, the loss on the last stage and plait's GPT's rope tables.

    A stage keeps one receive buffer for activations and one for gradients (b·s·h each, h
    times the residual streams, a sequence shard under SP); the last stage's loss holds
    logits, their fp32 copy and the fp32 log-softmax for one micro-batch. Frozen parameters
    have no gradient to buffer. The rope tables are the model's buffers, resident on every
    rank; what its blocks save of them are views, which the activations do not count
    (activations.rope_table_bytes).
    """
    total = buffers(stage.trained_params, layout)
    if layout.zero == 3 and layout.sync > 1 and stage.block_params:
        total = zero3_grad_buffers(stage.trained_params, zero3_units(config, layout, stage), layout)
    if layout.pp > 1:
        total += 2 * layout.stage_message_bytes(config.stream_width)
    if stage.last:
        total += loss_bytes(config, layout)
    if config.lean_blocks:
        total += rope_table_bytes(config, layout)  # plait's GPT: its rope tables, buffers on every rank
    return total


def zero3_units(config: GPTConfig, layout: Workload, stage: StageShare) -> list[list[int]]:
    """The parameters of each ZeRO-3 unit on `stage`, in run order, chunk by chunk
    (plait/parallel/zero/shard.py: find_units and with_edges).

    Units are the blocks (their trained parameters, each its own where counted: ZeRO leaves the
    frozen whole), and the embedding and the head when each is its own matrix: untied, or tied
    and cut apart by a pipeline (the first stage's table, the last stage's copy); an untied head's unit holds its
    vectors (GPTConfig.head_vectors: a bias, Dory's scale a logit), a tied copy's none (they join the root:
    zero/stages._copy_alone). A tied table on one rank, an
    embedding ZeRO-3 takes for no unit (GPTConfig.embedding_unit), the final norm and anything
    else is the root; the other matrices outside the blocks are units of their own, run before
    the blocks on the first stage (GPTConfig.edge_units: Gemma 3n's per-layer embedding and its
    projection) or after them on the last, a tp rank's share each (edge_units_last: Qwen4-Exp's
    hyper-connection mixer). A rank's chunks (v > 1) each run their own units.
    """
    table = embedding_rows(config, layout.tp) * config.d_model  # whole where the plan keeps it whole (DBRX's)
    vectors = vocab_shard(config, layout.tp) * config.head_vectors  # its bias: in a tied copy's unit, the root's
    head = head_weight(config, layout.tp) + (0 if config.tie_embeddings else vectors)
    apart = not config.tie_embeddings or layout.pp > 1
    after = [whole + split // layout.tp for whole, split in config.edge_units_last]
    chunks, start = [], 0
    for chunk, blocks in enumerate(chunk_layers(layout, stage)):
        first, last = chunk_ends(layout, stage, chunk)
        chunks.append(([table] if first and apart and config.embedding_unit else [])
                      + (list(config.edge_units) if first else []) + stage.unit_sizes(blocks, start)
                      + (after if last else []) + ([head] if last and apart else []))
        start += blocks
    return chunks


def gathered_params(config: GPTConfig, layout: Workload, stage: StageShare) -> int:
    """What plait's ZeRO-3 holds whole at once on `stage`: the root unit for the whole
    forward and backward, plus the unit running and the `prefetch` units gathered ahead of
    it (`zero3_units`); with --reshard-after-forward false, every unit at the turn from
    forward to backward. The prefetch does not reach across chunks."""
    return gathered_at_once(stage.trained_params, zero3_units(config, layout, stage), layout)


def gathered_at_once(params: int, chunks: list[list[int]], layout: Workload) -> int:
    """ZeRO-3's whole parameters at the peak, for a model of `params` whose units (in run
    order, chunk by chunk) hold `chunks` of them: the root (what no unit holds) throughout,
    plus the unit running and the `prefetch` after it in its chunk; everything with
    --reshard-after-forward false. Each as its padded flat buffer (`packed`)."""
    n = pad_ranks(layout)
    if not layout.reshard_after_forward:
        return packed(params, chunks, n)
    return _root_and_window(params, chunks, 1 + layout.prefetch, n)


def zero3_grad_buffers(params: int, chunks: list[list[int]], layout: Workload) -> float:
    """ZeRO-3's whole gradients at the peak: the root's, accumulated over the whole backward,
    and two adjacent units' (one filling while the one before it is reduced:
    plait/parallel/zero/hooks.py, IN_FLIGHT), each its padded flat buffer's gradient."""
    return float(_root_and_window(params, chunks, 2, pad_ranks(layout)) * state_bytes(layout.precision).grad)


def pad_ranks(layout: Workload) -> int:
    """The ranks each ZeRO-3 flat buffer is padded to a multiple of: its shard ranks; 1 (no
    padding priced) with ep > 1, where a unit's experts are a group of their own over fewer."""
    return layout.zero_ranks if layout.zero == 3 and layout.ep == 1 else 1


def packed(params: int, chunks: list[list[int]], n: int) -> int:
    """`params` as ZeRO-3 packs them: the root (what no unit of `chunks` holds) and each unit
    one flat buffer padded to a multiple of the `n` ranks it is sharded over
    (parallel/zero/shard.pack). A root or unit the ranks do not divide holds up to n - 1 more
    (HY-V4's hyper-connection head, Inkling's: a few bytes a rank the ledger measured)."""
    if n == 1:
        return params
    root, padded = _padded(params, chunks, n)
    return root + sum(map(sum, padded))


def zero3_packed(config: GPTConfig, layout: Workload, stage: StageShare) -> int:
    """`stage`'s trained parameters as ZeRO-3 packs them (`packed`); as counted otherwise."""
    n = pad_ranks(layout)
    return packed(stage.trained_params, zero3_units(config, layout, stage), n) if n > 1 else stage.trained_params


def _padded(params: int, chunks: list[list[int]], n: int) -> tuple[int, list[list[int]]]:
    """The root (what no unit of `chunks` holds) and each unit, as ZeRO-3's flat buffers padded
    to a multiple of the `n` ranks they are sharded over (each unit's count rounded first)."""
    units = [[round(unit) for unit in chunk] for chunk in chunks]
    root = params - sum(map(sum, units))
    return shard(root, n) * n, [[shard(unit, n) * n for unit in chunk] for chunk in units]


def _root_and_window(params: int, chunks: list[list[int]], window: int, n: int = 1) -> int:
    """The root (what no unit holds) plus the most `window` neighbouring units of one chunk hold,
    each padded to a multiple of `n` (`packed`)."""
    if n > 1:
        root, chunks = _padded(params, chunks, n)
    else:
        root = params - sum(map(sum, chunks))
    return root + max((sum(units[i:i + window]) for units in chunks
                       for i in range(max(1, len(units) - window + 1))), default=0)


def device_total(memory: Memory) -> Memory:
    """Fill in `fragmentation` and `total`.

    The allowance is 10% of the device bytes: the caching allocator rounds each block up
    and cannot always reuse a freed activation block for a differently sized tensor, so
    reserved memory runs a few to ~20% above what tensors occupy; 10% is a middle guess.
    """
    device = memory.params + memory.grads - memory.grads_unmade + (0.0 if memory.host else memory.optim)
    device += memory.buffers
    device += memory.activations or 0.0
    memory.fragmentation = FRAGMENTATION * device
    memory.total = device + memory.fragmentation
    memory.peak = memory.total + memory.transient
    memory.host_peak = memory.host + memory.transient  # setup draws and the outputs pass through the host
    return memory


def stage_memory(config: GPTConfig, layout: Workload, stage: StageShare) -> Memory:
    """Every kind of bytes on one rank of one pipeline stage."""
    memory = model_states(zero3_packed(config, layout, stage), gathered_params(config, layout, stage), layout,
                          experts=stage.expert_params)
    memory.params += stage.frozen_params * state_bytes(layout.precision).param  # weights alone, whole
    # plait's own MoE blocks: a balancing bias an expert, fp32 in any precision (MoE._apply), trained
    # by no optimizer, so never sharded: a frozen parameter as above, kept outside the counted ones
    if config.balancing_bias:
        memory.params += stage.moe_layers * config.experts * 4
    memory.activations = stage_activation_bytes(config, layout, stage)
    memory.grads_unmade = grads_unmade(config, layout, stage, memory.grads)
    memory.buffers = stage_buffers(config, layout, stage)
    memory.transient = transient_bytes(config, layout)
    memory.stage = stage.index
    return device_total(memory)


def grads_unmade(config: GPTConfig, layout: Workload, stage: StageShare, grads: float) -> float:
    """Of the rank's `grads` bytes, those not made yet when its activations and gradients
    peak together.

    plait makes a gradient at the first backward that reaches it and drops it after the
    update (parallel/data/sync.py, parallel/zero/), so where every forward of a step runs
    before the rank's first backward, its activations peak beside none of its gradients:
    - An interleaved rank is walked over its own order (plait.interleave), a chunk's
      gradients made at its first backward: with m·v chunk-forwards in the warm-up the peak
      holds one chunk's.
    - A rank of one chunk (no pipeline and one micro-batch, GPipe, or 1F1B with no more
      micro-batches than the stage holds) peaks inside its first backward, which makes
      gradients as it frees that micro-batch's activations, from the head (or the stage's
      last block) down: at its start beside the first gradients made, at its end beside
      them all and one micro-batch fewer. The lower of those two is what is not made.
    Any later forward (accumulation, 1F1B's steady phase, ZB-H1's deferred weight
    gradients) runs beside every gradient: nothing is subtracted.
    """
    if layout.pp > 1 and layout.schedule == "interleaved" and layout.virtual_stages > 1:
        return interleaved_unmade(config, layout, stage, grads)
    if not forwards_before_first_backward(layout, stage) or not stage.trained_params:
        return 0.0
    first = head_weight(config, layout.tp) if stage.last else stage.trained_block_params
    one_micro_batch = stage_block_bytes(config, layout, stage) + stage_extra_bytes(config, layout, stage)
    return max(0.0, min(grads * (1 - min(1.0, first / stage.trained_params)), one_micro_batch))


def forwards_before_first_backward(layout: Workload, stage: StageShare) -> bool:
    """Whether a one-chunk rank runs every forward of its step before its first backward."""
    if layout.pp == 1:
        return layout.grad_accum == 1
    if layout.schedule == "gpipe":
        return True
    return layout.schedule == "1f1b" and layout.grad_accum <= layout.pp - stage.index


def interleaved_unmade(config: GPTConfig, layout: Workload, stage: StageShare, grads: float) -> float:
    """`grads_unmade` walked over an interleaved rank's order, a chunk at a time: the most
    activations held, against the most held beside the gradients of the chunks whose first
    backward has run (a backward makes its chunk's gradients before freeing its activations),
    read off the states that can set either (plait.interleave.held_frontier)."""
    chunk_bytes = chunk_forward_bytes(config, layout, stage)
    shares = chunk_grad_shares(layout, stage)
    activations_alone = together = 0.0
    for held, begun in held_frontier(layout.pp, layout.grad_accum, layout.virtual_stages, stage.index):
        activations = sum(n * b for n, b in zip(held, chunk_bytes))
        made = grads * sum(share for share, on in zip(shares, begun) if on)
        activations_alone, together = max(activations_alone, activations), max(together, activations + made)
    return max(0.0, activations_alone + grads - max(together, grads))


def chunk_grad_shares(layout: Workload, stage: StageShare) -> list[float]:
    """Each of the rank's chunks' part of its trained parameters: its blocks, and the
    embedding or head on the chunk that holds that end of the model."""
    blocks = chunk_layers(layout, stage)
    params, start = [], 0
    for count in blocks:
        params.append(sum(stage.unit_sizes(count, start)))
        start += count
    outside = max(0.0, stage.trained_params - sum(params))
    ends = [chunk for chunk in range(len(blocks)) if any(chunk_ends(layout, stage, chunk))] or [0]
    for chunk in ends:
        params[chunk] += outside / len(ends)
    total = sum(params)
    return [p / total if total else 1.0 / len(params) for p in params]


def largest_tensor(config: GPTConfig) -> int:
    """Elements of the model's largest single tensor: the embedding (or head), a dense MLP's
    or attention's matrix, GPT-2's fused q|k|v, or an MoE block's experts (one 3-D tensor)."""
    h = config.d_model
    sizes = [config.vocab_size * h, h * config.ffn_hidden, h * h, h * (h + 2 * config.kv_dim)]
    if config.is_moe:
        sizes.append(config.experts * 2 * config.expert_width * h)
    return max(sizes)


@functools.lru_cache(maxsize=64)
def stand_in_params(config: GPTConfig) -> int:
    """The probe's copy of a model no rank holds whole (plait/parallel/probe_copy.py): the
    embedding and head, and the first block of each kind, at least two. Cached: the planner
    asks it of one config for every layout it prices, and it walks every block."""
    kinds = {config.moe_layer(i): config.block_params(i) for i in range(config.n_layers)}
    blocks = sorted(kinds.values(), reverse=True) + [max(kinds.values())] * max(0, 2 - len(kinds))
    return config.embedding_params() + sum(blocks[:max(len(kinds), min(2, config.n_layers))])


def transient_bytes(config: GPTConfig, layout: Workload) -> float:
    """The largest short-lived bytes beyond a rank's steady state (on the host, where a GPU's
    rank keeps them), the most of:

    - setup (plait/parallel/materialize.py): one tensor drawn whole in fp32, and the part of
      it the rank keeps; with tp, cp or ep, also the split check's copy (`stand_in_params`) in
      the weights' dtype;
    - the outputs: the main rank holds one other rank's block of a tensor, at most the
      largest tensor (plait/train/loop/run.py: write_weights writes each block in place).
    """
    largest = largest_tensor(config)
    setup = 2 * 4 * largest
    if layout.tp > 1 or layout.cp > 1 or layout.ep > 1:
        setup += stand_in_params(config) * state_bytes(layout.precision).param
    return float(max(setup, largest * state_bytes(layout.precision).param))


def estimate_memory(config: GPTConfig, layout: Workload) -> Memory:
    """The busiest rank's memory: the stage with the largest device total."""
    return busiest(memory_per_stage(config, layout))


def busiest(per_rank: list[Memory]) -> Memory:
    """The rank with the largest device total."""
    return max(per_rank, key=lambda m: m.total)


def memory_per_stage(config: GPTConfig, layout: Workload) -> list[Memory]:
    """Each pipeline rank's memory, in stage order (one entry without a pipeline)."""
    return [stage_memory(config, layout, s) for s in layout_stages(config, layout)]


def estimate_memory_params_only(params: int, layout: Workload) -> Memory:
    """Model states for a model known only by its size: no activations, no gathered unit."""
    memory = model_states(params, 0, layout)
    memory.activations = None
    memory.buffers = buffers(params, layout)
    return device_total(memory)
