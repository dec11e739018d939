"""What the estimator reads: a layout with the work of one step, and each rank's slice of the model.

`Workload` is the layout record (plait.layout.Layout: degrees, ZeRO, SP, schedule) with
the batch, the sequence and the precision beside it, so every estimator takes one object
and a `GPTConfig`. Everything a layout must satisfy runs in `__post_init__` through
plait.rules (the same rules `plait train` and the API apply, so an estimate is never of a
layout training would refuse); a model's own limits (tp dividing its heads and vocabulary,
the pipeline cut dividing its layers) run in `check_model`, the family's checks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from plait.balance import balanced_counts
from plait.errors import PlaitError
from plait.layout import Layout
from plait.models.gpt.config import GPTConfig
from plait.estimate.stacks import STACKS, Stack, check_stack
from plait.rules import BUCKET_MB, check_bucket_mb, check_experts_split
from plait.rules import (DTYPE_BYTES, PRECISIONS, RECOMPUTE, REDUCE_DTYPES, SCHEDULES,  # noqa: F401
                         check_context_split, check_fp8, check_pipeline_cut, check_precision, check_recompute,
                         check_whole,
                         default_reduce_dtype)


DOC_MASKS = ("", "dense", "blocks")  # Workload.doc_mask
DEVICES = ("cuda", "cpu")  # Workload.device


@dataclass(frozen=True)
class Workload(Layout):
    """A layout (plait.layout.Layout) and the per-step shape of the work it runs."""

    precision: str = "fp32"
    micro_batch: int = 1
    grad_accum: int = 1  # micro-batches per optimizer step (the pipeline's m)
    seq_len: int = 1024
    recompute: str = "none"
    reduce_dtype: str = ""  # "" = default_reduce_dtype(precision)
    bucket_mb: float = BUCKET_MB  # a gradient bucket (--bucket-mb): one all-reduce or reduce-scatter each
    stack: str = "plait"  # the framework that runs it (--stack): plait.estimate.stacks
    compiled: bool = False  # each block's forward compiled (plait train --compile): ops.EW_COMPILED
    # Packed documents' attention mask (--doc-mask): "" none; "dense", SDPA's additive b·s² mask (a
    # CPU); "blocks", FlexAttention's block tables (a GPU): plait.estimate.activations.document_mask_bytes
    doc_mask: str = ""
    # The ranks' device: "cuda", or "cpu", whose SDPA runs in its math form some calls a GPU's
    # fused kernel takes (plait.estimate.activations.cpu_attention_bytes)
    device: str = "cuda"

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("micro_batch", "grad_accum", "seq_len"):
            check_whole(name.replace("_", "-"), getattr(self, name))
        check_bucket_mb(self.bucket_mb)
        check_precision(self.precision, self.reduce_dtype)
        if self.precision == "fp8":
            check_fp8(self)
        check_recompute(self, self.recompute)
        if self.doc_mask not in DOC_MASKS:
            raise PlaitError(f"unknown document mask {self.doc_mask!r}", hint=f"one of {', '.join(map(repr, DOC_MASKS))}")
        if self.device not in DEVICES:
            raise PlaitError(f"unknown device {self.device!r}", hint=f"one of {', '.join(map(repr, DEVICES))}")
        check_stack(self)  # last: a value no framework knows gets its own message first

    @classmethod
    def of(cls, layout: Layout, **work: Any) -> "Workload":
        """`layout` (a run's, or the mesh's) with the work of one step."""
        return cls(**{f.name: getattr(layout, f.name) for f in fields(Layout)}, **work)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def software(self) -> Stack:
        """The framework's facts the time model reads (plait.estimate.stacks)."""
        return STACKS[self.stack]

    @property
    def bucket_bytes(self) -> float:
        return self.bucket_mb * 2**20

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, across all data-parallel replicas."""
        return self.dp * self.micro_batch * self.grad_accum

    @property
    def tokens_per_micro_batch(self) -> int:
        """Tokens one rank computes per micro-batch: under context parallelism, its 2 of each
        sequence's 2·cp chunks (attention alone still reads the whole sequence's keys)."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def sync(self) -> int:
        """Ranks that average gradients and split ZeRO's shards: the dp ranks and the cp ranks
        (which hold other tokens of the same samples)."""
        return self.dp * self.cp

    @property
    def sync_axis(self) -> str:
        """The ledger's name for that group (plait.runtime.mesh.SYNC when cp > 1)."""
        return "dp_cp" if self.cp > 1 else "dp"

    @property
    def shard_axis(self) -> str:
        """The ledger's name for the ranks splitting ZeRO's shards: a --dp-shard group
        (plait.runtime.mesh.SHARD), or the whole sync group."""
        return "dp_shard" if self.replicas > 1 else self.sync_axis

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of parameters, activations and gradients on the device."""
        return 4 if self.precision == "fp32" else 2

    def hidden_bytes(self, d_model: int) -> int:
        """One micro-batch's hidden states on one rank, b·s/cp·h in the compute dtype: what a
        tensor-parallel collective moves for a block's input or output."""
        return self.tokens_per_micro_batch * d_model * self.compute_bytes

    def stage_message_bytes(self, width: int) -> float:
        """What a pipeline stage sends per micro-batch, each way: its hidden states, `width`
        values a token (GPTConfig.stream_width: every residual stream), a tp-th of them under
        sequence parallelism (each tp rank sends its own slice)."""
        whole = self.hidden_bytes(width)
        return whole / self.tp if self.sp else whole

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of a gradient on the data-parallel wire."""
        return DTYPE_BYTES[self.reduce_dtype or default_reduce_dtype(self.precision)]

    def check_model(self, config: GPTConfig) -> None:
        """Raise unless plait can train `config` in this layout: its family's checks (tp
        across heads, KV heads, vocabulary and MLP; the sequence too under SP) and the
        pipeline cut of its layers, as `plait train` checks them."""
        check_context_split(self.seq_len, self.cp, self.tp, self.sp, config.n_heads, self.cp_kind)
        config.check_split(self.tp, self.sp, self.seq_len)
        check_pipeline_cut(config.n_layers, self.pp, self.virtual_stages, self.stage_layers, config.block_runs)
        check_experts_split(config.experts, self.ep)


@dataclass(frozen=True)
class StageShare:
    """What one rank of one pipeline stage holds, after tensor parallelism."""

    index: int
    pp: int
    layers: int
    block_params: int  # one transformer block's parameters on this rank (an average, with experts / ep)
    params: int  # everything this rank holds: blocks, plus embedding or head
    replicated_params: int  # not sharded by tp (norms): their grads need a tp sync under SP (summed_whole)
    expert_params: int = 0  # of `params`, the routed experts this ep rank holds (synced over dp / ep)
    moe_layers: float = 0.0  # MoE blocks among its layers (moe_every spreads them evenly)
    frozen_params: int = 0  # of `params`, those no optimizer trains (GPTConfig.frozen_block_params)
    reruns: float = 0.0  # runs of its blocks beyond one each (GPTConfig.block_runs: a looped model's)
    moe_reruns: float = 0.0  # the same of its MoE blocks
    rerun_params: float = 0.0  # trained parameters of those further runs' blocks, each run's (ZeRO-3 gathers them)
    rerun_experts: float = 0.0  # of `rerun_params`, the routed experts this ep rank holds (synced over edp)
    block_units: tuple[float, ...] = ()  # a counted model's: each block's trained parameters, in run order
    frozen_outside: int = 0  # of `frozen_params`, those outside the blocks (GPTConfig.frozen_extra_params)
    chunks: tuple[int, ...] = ()  # blocks of each of its chunks where they may differ (`uneven_cut`); (): equal
    blocks: tuple[int, ...] = ()  # the blocks it holds, in run order (its chunks' in turn)

    def unit_sizes(self, blocks: int, start: int = 0) -> list[float]:
        """The trained parameters of `blocks` blocks from the `start`-th held (ZeRO-3's units):
        each its own where the model is counted (a hybrid's blocks differ), else the mean."""
        if self.block_units:
            return list(self.block_units[start:start + blocks])
        return [self.trained_block_params] * blocks

    @property
    def runs(self) -> float:
        """Block runs one forward makes on this rank: what compute, activations and the tp, cp
        and ep traffic count, where `layers` (the blocks held) counts the parameters."""
        return self.layers + self.reruns

    @property
    def moe_runs(self) -> float:
        """MoE block runs one forward makes on this rank: the experts' dispatches."""
        return self.moe_layers + self.moe_reruns

    @property
    def trained_params(self) -> int:
        """What has a gradient and optimizer state, synced and sharded: `params` less the frozen."""
        return self.params - self.frozen_params

    @property
    def trained_block_params(self) -> int:
        """One block's trained parameters (a mean, as `block_params`): a ZeRO-3 unit's, gathered
        and reduced; the frozen stay whole on every rank."""
        return self.block_params - round((self.frozen_params - self.frozen_outside) / max(1, self.layers))

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.pp - 1


def block_split(config: GPTConfig, ep: int = 1, sp: bool = False) -> tuple[int, int]:
    """(parameters a tp shard divides, parameters every tp rank keeps whole) of one block,
    averaged over the blocks.

    Megatron splits q/k/v, gate/up by columns and o/down by rows; norms (and the biases of
    row-parallel layers in GPT-2) are replicated. An MoE block's MLP stays whole, but where
    the model's tp plan splits its experts (`tp_expert_rows`, without ep): then its routed and
    shared experts split as a dense MLP does, and only its router (and a shared-expert gate)
    stays whole.
    """
    h, f, kv = config.d_model, config.ffn_hidden, config.kv_dim
    if config.arch == "gpt2":
        sharded = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 2 * h * f + f
        return sharded, config.layer_params() - sharded
    average = round(sum(config.block_params(i) for i in range(config.n_layers)) / config.n_layers)
    if config.block_tally:  # counted: the split and the routed experts as the model holds them
        split, _, routed, split_sp = (sum(column) / config.n_layers for column in zip(*config.block_tally))
        sharded = round((split_sp if sp else split) + (routed if config.routed_split_by_tp(ep) else 0))
        return sharded, average - sharded
    moe = config.moe_layers / config.n_layers
    # a region the model's plan leaves whole (GPTConfig.tp_attention, tp_mlp) stays on every tp rank
    sharded = config.attention_params * config.tp_attention + round(config.mlp_params * (1 - moe)) * config.tp_mlp
    routed = config.experts * config.expert_params() if config.routed_split_by_tp(ep) else 0
    shared = 3 * h * config.shared_width if config.shared_split_by_tp(ep) else 0
    if routed or shared:
        sharded += round((routed + shared) * moe)
    return sharded, average - sharded


def block_share(config: GPTConfig, index: int, tp: int, ep: int, sp: bool) -> float:
    """Block `index`'s parameters on one tp (and ep) rank, as counted (GPTConfig.block_tally):
    its split ones over tp (under SP, those SP splits), its routed experts over tp where tp
    splits them, else over ep, the rest whole."""
    split, whole, routed, split_sp = config.block_tally[index]
    if sp:  # what SP keeps whole of the split (DeepSeek's MoE blocks) is whole
        split, whole = split_sp, whole + split - split_sp
    if config.routed_split_by_tp(ep):
        return (split + routed) / tp + whole
    return split / tp + whole + routed / ep


def rank_blocks(config: GPTConfig, pp: int, virtual_stages: int,
                stage_layers: tuple[int, ...]) -> list[list[int]]:
    """The blocks each pipeline rank holds, in order: its chunks' (stage c·pp + r is rank r's),
    stages cut as `uneven_cut` says, in equal chunks when interleaved, else as plait's pipeline
    balances them (`balanced_stages`)."""
    n, stages_n = config.n_layers, pp * virtual_stages
    cut = uneven_cut(config, pp, virtual_stages, stage_layers)
    if cut:
        counts = list(cut)
    elif stages_n > 1 and virtual_stages == 1:
        counts = balanced_stages(config, pp)
    else:
        counts = [n // stages_n] * stages_n
    return blocks_of_ranks(counts, pp)


def blocks_of_ranks(counts: list[int], pp: int) -> list[list[int]]:
    """The blocks each of `pp` ranks holds, in order, where the pp·v stages hold `counts` blocks
    each in turn (stage c·pp + r is rank r's c-th chunk)."""
    starts = [sum(counts[:stage]) for stage in range(len(counts))]
    return [[block for stage in range(rank, len(counts), pp)
             for block in range(starts[stage], starts[stage] + counts[stage])]
            for rank in range(pp)]


def balanced_stages(config: GPTConfig, stages_n: int) -> list[int]:
    """Blocks per stage as plait's pipeline balances them (parallel/pipeline/split.py:
    default_balance): by each block's whole parameters, the embedding's on the first stage and
    the final norm's and head's on the last, which a counted model's blocks give."""
    h, rows = config.d_model, config.vocab_size
    first = rows * h + (config.max_seq_len * h if config.arch == "gpt2" else 0) + config.extra_params
    last = final_norm_params(config) + config.extra_last_params + rows * h + rows * config.head_vectors
    return balanced_counts([config.block_params(i) for i in range(config.n_layers)], stages_n,
                           first_extra=first, last_extra=last)


def uneven_cut(config: GPTConfig, pp: int, virtual_stages: int, stage_layers: tuple[int, ...]) -> tuple[int, ...]:
    """The blocks of each of the pp·v stages where a rank's chunks may differ: --stage-layers's
    cut, or, where interleaving's pp·v stages do not divide the layers, the balanced cut
    plait's pipeline makes of them; () where the chunks are equal (or there is one a rank)."""
    if stage_layers:
        return tuple(stage_layers)
    if virtual_stages > 1 and config.n_layers % (pp * virtual_stages):
        return tuple(balanced_stages(config, pp * virtual_stages))
    return ()


def counted_stage(config: GPTConfig, index: int, pp: int, blocks: list[int], shares: list[float], ep: int,
                  replicated: int, ends: int, ends_whole: int) -> StageShare:
    """Pipeline rank `index`'s share of a counted model (GPTConfig.block_tally): its own blocks'
    parameters (a hybrid's stages differ, DeepSeek's dense first blocks are lighter), its MoE
    blocks, and `ends` (the embedding's or the head's parameters on this rank)."""
    held = sum(shares[i] for i in blocks)
    experts_of = [config.block_tally[i][2] / ep if ep > 1 else 0 for i in range(config.n_layers)]
    frozen_of = config.frozen_block_params or (0,) * config.n_layers
    outside = config.frozen_extra_params if index == 0 else 0
    again = {i: config.runs_of(i) - 1 for i in blocks if config.runs_of(i) > 1}
    return StageShare(index, pp, len(blocks), round(held / max(1, len(blocks))), round(held) + ends,
                      len(blocks) * replicated + ends_whole, round(sum(experts_of[i] for i in blocks)),
                      sum(map(config.moe_layer, blocks)), sum(frozen_of[i] for i in blocks) + outside,
                      *block_reruns(config, blocks),
                      rerun_params=sum(extra * (shares[i] - frozen_of[i]) for i, extra in again.items()),
                      rerun_experts=sum(extra * experts_of[i] for i, extra in again.items()),
                      block_units=tuple(shares[i] - frozen_of[i] for i in blocks), frozen_outside=outside,
                      blocks=tuple(blocks))


def block_reruns(config: GPTConfig, blocks: Iterable[int]) -> tuple[int, int]:
    """(runs beyond one each, those of MoE blocks) of `blocks` (GPTConfig.block_runs)."""
    again = [(config.runs_of(i) - 1, config.moe_layer(i)) for i in blocks]
    return sum(extra for extra, _ in again), sum(extra for extra, moe in again if moe)


def mean_reruns(config: GPTConfig, layers: int) -> tuple[float, float]:
    """(reruns, MoE reruns) of `layers` blocks of an uncounted model: the model's, spread evenly."""
    reruns, moe = block_reruns(config, range(config.n_layers))
    return layers * reruns / config.n_layers, layers * moe / config.n_layers


def summed_whole(config: GPTConfig, ep: int) -> int:
    """The parameters a block keeps whole on every tp rank by the formulas (block_split without
    a tally), with this ep rank's experts: what the wire model (traffic.tp_collectives' SP sum)
    adds its own corrections to. A counted model's whole parameters hold more the wire prices
    apart (q/k norms, MLA's down-projections, blocks SP keeps whole)."""
    formula = replace(config, block_tally=()) if config.block_tally else config
    _, whole = block_split(formula, ep)
    return whole + round(held_experts(formula, ep)) - round(held_experts(formula, 1))


def final_norm_params(config: GPTConfig) -> int:
    """The final norm's weights (and GPT-2's LayerNorm biases), on the last stage, whole on every tp rank."""
    return config.final_norm_weights


def vocab_shard(config: GPTConfig, tp: int) -> int:
    """Rows of the embedding (and head) on one rank: V/tp split by vocabulary (check_model makes
    tp divide the vocabulary), all V where they stay whole on every tp rank (`vocab_split` false)."""
    return config.vocab_size // tp if config.vocab_split else config.vocab_size


def embedding_rows(config: GPTConfig, tp: int) -> int:
    """Rows of the token embedding on one rank: split by vocabulary with the head (vocab_split),
    or on its own beside a head split by its input features (Inkling's) or kept whole
    (Nemotron-H's); all V where the plan keeps it whole (DBRX's, Inkling-2's: embedding_split
    false) and where it is the table of a head left whole (GPT-2's tied one)."""
    split = config.embedding_split and (not config.tie_embeddings or config.vocab_split or config.head_sums_logits)
    return config.vocab_size // tp if split else config.vocab_size


def head_weight(config: GPTConfig, tp: int) -> int:
    """The output head's weight on one tp rank, as its own matrix: its vocabulary's rows
    (`vocab_shard`), or all V rows of h/tp input features where it sums partial logits
    (Inkling's: head_sums_logits)."""
    if config.head_sums_logits:
        return config.vocab_size * config.d_model // tp
    return vocab_shard(config, tp) * config.d_model


def held_experts(config: GPTConfig, ep: int) -> float:
    """Routed-expert parameters one ep rank holds per block, averaged over the blocks (as
    counted, where the model's blocks were: GPTConfig.block_tally)."""
    if config.block_tally:
        return sum(block[2] for block in config.block_tally) / ep / config.n_layers
    return config.moe_layers * config.experts // ep * config.expert_params() / config.n_layers


def rank_chunks(stage_layers: tuple[int, ...], pp: int, virtual_stages: int, rank: int) -> list[int]:
    """The blocks of each of pipeline rank `rank`'s chunks under the cut `stage_layers`:
    chunk c of rank r is stage c·pp + r (the schedule's round robin)."""
    return [stage_layers[chunk * pp + rank] for chunk in range(virtual_stages)]


def chunk_layers(layout: Layout, stage: StageShare) -> list[int]:
    """The blocks of each of `stage`'s chunks, in chunk order: as `stages` recorded them from
    the cut (`uneven_cut`: --stage-layers's, or interleaving's balanced one), else equal."""
    if stage.chunks:
        return list(stage.chunks)
    return [stage.layers // layout.virtual_stages] * layout.virtual_stages


def chunk_ends(layout: Layout, stage: StageShare, chunk: int) -> tuple[bool, bool]:
    """Whether `stage`'s chunk `chunk` is the model's first stage (the embedding) and its last
    (the final norm and head)."""
    return stage.first and chunk == 0, stage.last and chunk == layout.virtual_stages - 1


def layout_stages(config: GPTConfig, layout: Layout) -> tuple[StageShare, ...]:
    """`stages` of the layout's cut."""
    return stages(config, layout.tp, layout.pp, layout.virtual_stages, layout.ep, layout.stage_layers, layout.sp)


@functools.lru_cache(maxsize=4096)
def stages(config: GPTConfig, tp: int, pp: int, virtual_stages: int = 1, ep: int = 1,
           stage_layers: tuple[int, ...] = (), sp: bool = False) -> tuple[StageShare, ...]:
    """Every pipeline rank's share of the model on one of its tp ranks.

    The first rank holds the token embedding (and GPT-2's learned positions); the last
    holds the final norm and the output head. With tied embeddings and pp > 1 the last
    rank keeps its own copy of the embedding matrix for the head, as plait's pipeline does.
    With --stage-layers, or interleaving's chunks unequal (`uneven_cut`), a rank holds the
    blocks of its chunks (stage c·pp + r is rank r's), which it records (`chunks`). A cut
    `plait train` refuses (a stage without a block) is refused here too: priced, it would
    leave blocks out.
    """
    check_pipeline_cut(config.n_layers, pp, virtual_stages, stage_layers, config.block_runs)
    cut = uneven_cut(config, pp, virtual_stages, stage_layers)
    chunks = [tuple(rank_chunks(cut, pp, virtual_stages, rank)) if cut else () for rank in range(pp)]
    replicated = summed_whole(config, ep)
    h = config.d_model
    embedding = embedding_rows(config, tp) * h
    first = embedding + (config.max_seq_len * h if config.arch == "gpt2" else 0) + config.extra_params
    norm = final_norm_params(config) + config.extra_last_params - config.extra_last_split \
        + config.extra_last_split // tp
    head = head_weight(config, tp) if (not config.tie_embeddings or pp > 1) else 0
    head += vocab_shard(config, tp) * config.head_vectors
    if config.block_tally:  # counted: each rank its own blocks
        shares = [block_share(config, i, tp, ep, sp) for i in range(config.n_layers)]
        ends = [first * (i == 0) + (norm + head) * (i == pp - 1) for i in range(pp)]
        return tuple(replace(counted_stage(config, i, pp, blocks, shares, ep, replicated, ends[i],
                                           final_norm_params(config) * (i == pp - 1)), chunks=chunks[i])
                     for i, blocks in enumerate(rank_blocks(config, pp, virtual_stages, cut)))
    sharded, whole = block_split(config, ep, sp)
    experts = held_experts(config, ep)  # MoE blocks: experts / ep each, whole on every tp rank
    whole += round(experts) - round(held_experts(config, 1))  # all experts -> ours
    block = sharded // tp + whole
    if cut:
        counts = [sum(rank) for rank in chunks]
    elif virtual_stages > 1 or pp == 1:  # interleaving cuts equal chunks, v per rank
        counts = [config.n_layers // pp] * pp
    else:  # the cut plait's pipeline makes (parallel/pipeline/split.py: default_balance)
        counts = balanced_counts([block] * config.n_layers, pp, first_extra=first, last_extra=norm + head)
    # equal chunks where uncut, so the stages' order is the ranks' (v = 1) or any
    ranks_blocks = blocks_of_ranks(list(cut) if cut else [count // virtual_stages for count in counts
                                                          for _ in range(virtual_stages)], pp)
    out = []
    for index, layers in enumerate(counts):
        params, repl = layers * block, layers * replicated
        if index == 0:
            params += first
        if index == pp - 1:
            params, repl = params + norm + head, repl + norm
        moe = layers * config.moe_layers / config.n_layers
        held = round(layers * experts) if ep > 1 else 0  # ep 1: the experts sync with the rest, over dp
        reruns, moe_reruns = mean_reruns(config, layers)
        outside = config.frozen_extra_params if index == 0 else 0
        out.append(StageShare(index, pp, layers, block, params, repl, held, moe, outside, reruns, moe_reruns,
                              rerun_params=reruns * block,
                              rerun_experts=moe_reruns * held / moe if held else 0.0, frozen_outside=outside,
                              chunks=chunks[index], blocks=tuple(ranks_blocks[index])))
    return tuple(out)
