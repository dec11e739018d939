"""Search the layouts of a model on a number of GPUs, keep those that fit, rank them.

What it searches, every option `plait train` runs (plait.rules and the model's own checks,
`Workload.check_model`, decide what is valid, as they do for training):
* tp dividing the heads, the KV heads, the vocabulary and the MLP width, inside one node;
  pp up to the layers (or the stages of a given cut); cp where 2·cp divides the sequence
  (ring, and Ulysses where cp divides the heads per tp rank); for a mixture of experts, ep
  dividing dp and the experts (without cp); dp what they leave, dividing the global batch.
* the schedule: 1f1b, interleaved with 2 and 4 virtual stages (at most a layer a chunk:
  equal chunks where pp·v divides the layers, else balanced; at any micro-batch count,
  plait.interleave), zb-h1 (no recomputation, ZeRO 0-1); gpipe only when asked, since it
  idles as 1f1b does and holds m micro-batches instead of p. One schedule without a
  pipeline, where all of them run alike.
* the micro-batch (dividing a replica's share of the batch, at most 64), sequence
  parallelism on and off, recomputation none, selective and full.
* ZeRO 0-3 (0 alone with one dp·cp rank); for ZeRO >= 1 hybrid sharding (`dp_shard`) off or
  over the dp·cp ranks of 1, 2, 4 and 8 nodes (a node holds gpus_per_node / tp of them);
  with --offload, each ZeRO layout with and without it.
The survivors are ranked by predicted step time, then memory (then the layout's fields).

How it prunes. A *shape* is every choice but ZeRO's stage, dp_shard and offload (its
*tails*). None of those three changes a micro-batch's time on any stage or the schedule's
ends, so a shape fixes the *core* of the step, m × the slowest stage's micro-batch + the
bubble and the messages (time.assemble's latest schedule end), and the assembly only adds
non-negative terms to it: the step is at least the latest end plus that rank's tail (the
exposed dp sync before the clip; offload and the update after it, where the slowest update
is at least that rank's), then the clip and the loop. Each rule below drops only layouts that cannot rank in the top k:
1. Shapes are taken in increasing core; once a core exceeds the k-th best step found, no
   layout of that shape or of any later one can be faster: the search ends.
2. A shape whose first or last stage's activations and buffers (which no ZeRO option
   changes), with the fragmentation allowance, already exceed the device is skipped:
   every tail's memory includes them.
3. A tail's step is bounded below before its memory is estimated: the core plus the least,
   over the kinds of stage, of a rank's tail (the gradient accumulation, ZeRO-2/3 adding
   into shards; the dp sync that no overlap hides; offload; the update), then the clip and
   the loop. Above the k-th best, it is dropped.
4. A tail whose first stage alone exceeds the device does not fit.
The bounds are checked against estimate_time and estimate_memory on every layout of small
requests (tests/test_planner.py); the layouts that reach an estimate are assembled by
time.estimate_time itself, from the search's cached parts, and the rows returned are
estimated afresh by it.

Claims it does not rely on: heavier recomputation (none -> selective -> full) only adds to
the core, but without a pipeline a longer backward hides more of the dp sync (ZeRO-3's
gathers most), so it is not always slower in this time model: rule 1 drops it when its
core is too slow. ZeRO's stages are not ordered in time either: stage 1 shards the update
(faster than 0), and stage 3 hides gathers behind compute that stages 1 and 2 expose.

What is costed once (class Costs): a stage's compute depends on tp, cp and its kind (ring
attention's own rate, Ulysses' reorderings), sp, the micro-batch, the recomputation and its
blocks, not on pp, the schedule, dp or ZeRO; pipeline stages alike (the middle ones) are
costed once per layout.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from plait.errors import PlaitError
from plait.estimate.activations import stage_activation_bytes
from plait.estimate.hardware import GIB, Hardware, resolve_hardware
from plait.estimate.layout import StageShare, Workload, layout_stages, stages
from plait.estimate.memory import Memory, device_total, estimate_memory, stage_buffers, stage_memory
from plait.estimate.exposed import clip_s, message_s, micro_batch_axes_s, overhead_s
from plait.estimate.network import inter_node
from plait.estimate.ops import micro_batch_compute_s, splits_backward
from plait.estimate.pipeline import lower_bound
from plait.estimate.time import (MicroBatchParts, RankCost, chunk_weights, crowd_of, estimate_time,
                                 forward_share, rank_tail)
from plait.layout import Layout
from plait.models.gpt.config import GPTConfig
from plait.estimate.stacks import check_stack_name
from plait.rules import (BUCKET_MB, CP_KINDS, RECOMPUTE, SCHEDULES, check_bucket_mb, check_choice, check_pipeline_cut,
                         given_or)

MAX_MICRO_BATCH = 64  # larger micro-batches only add memory once the GPU is saturated
SEARCHED_SCHEDULES = ("1f1b", "interleaved", "zb-h1")  # gpipe: 1f1b's bubble in more memory
VIRTUAL_STAGES = (2, 4)  # chunks per rank under the interleaved schedule
SHARD_NODES = (1, 2, 4, 8)  # dp_shard groups: the dp·cp ranks of this many nodes
SLACK = 1e-9  # relative: bounds and estimates may differ in the last bits of their sums
HIDDEN = 1e30  # seconds of compute: enough to hide every transfer that overlap can hide

Keep = Callable[[Workload], bool]


def _any(layout: Workload) -> bool:
    return True


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for: a model, a cluster and a batch, and what the search may use."""

    config: GPTConfig
    gpus: int
    gpus_per_node: int
    hardware: Hardware
    global_batch: int
    seq_len: int
    precision: str = "bf16"
    schedules: tuple[str, ...] = SEARCHED_SCHEDULES
    recompute: tuple[str, ...] = RECOMPUTE
    offload: bool = False
    stage_layers: tuple[int, ...] = ()  # a fixed cut: only layouts with that many pipeline stages
    bucket_mb: float = BUCKET_MB  # the gradient buckets the run will use (--bucket-mb)
    stack: str = "plait"  # the framework every layout is priced as running on (--stack)
    compiled: bool = False  # every layout's blocks compiled (--compile)
    doc_mask: str = ""  # packed documents' attention mask, every layout's (--doc-mask: Workload.doc_mask)

    def __post_init__(self) -> None:
        for name in ("gpus", "gpus_per_node", "global_batch", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = name.replace("_", "-")
                raise PlaitError(f"--{flag} must be a whole number of at least 1, got {value!r}",
                                 hint=f"pass --{flag} 1 or more")
        check_bucket_mb(self.bucket_mb)
        check_stack_name(self.stack)
        if not self.schedules:
            raise PlaitError("--schedule names no schedule", hint=f"choose among: {', '.join(SCHEDULES)}")
        for schedule in self.schedules:
            check_choice("schedule", schedule, SCHEDULES)


def schedules_of(schedule: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """--schedule as a restriction: "1f1b" or "1f1b,zb-h1" (or a tuple); None or "": the
    searched three."""
    if not schedule:
        return SEARCHED_SCHEDULES
    names = schedule.split(",") if isinstance(schedule, str) else schedule
    return tuple(dict.fromkeys(name.strip() for name in names))


MAX_GPUS = 1 << 20  # a planned job's largest GPU count: above it a typo, not a cluster
MAX_GLOBAL_BATCH = 1 << 24  # ... and its largest global batch in sequences


def divisors(n: int) -> list[int]:
    """Every divisor of n, ascending, by trial division up to √n."""
    low = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return low + [n // d for d in reversed(low) if d * d != n]


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


def pipelines(request: PlanRequest, pp: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) to try at `pp`: one schedule without a pipeline (1f1b where
    allowed); interleaving at each of VIRTUAL_STAGES that leaves every chunk a layer, except
    under a given cut, which fixes one chunk per rank."""
    if pp == 1:
        return [("1f1b" if "1f1b" in request.schedules else request.schedules[0], 1)]
    out: list[tuple[str, int]] = []
    for schedule in request.schedules:
        if schedule != "interleaved":
            out.append((schedule, 1))
        elif not request.stage_layers:
            out += [(schedule, v) for v in VIRTUAL_STAGES if pp * v <= request.config.n_layers]
    return out


def _grids(request: PlanRequest) -> Iterator[tuple[int, int, int, str, int, int]]:
    """(tp, pp, cp, cp kind, ep, dp) whose product is the GPU count and whose dp divides the batch."""
    for tp in tp_degrees(request):
        for pp in divisors(request.gpus // tp):
            if (pp != len(request.stage_layers) if request.stage_layers else pp > request.config.n_layers):
                continue  # a given cut fixes pp (its end stages may hold no block); else a block per stage
            for cp in divisors(request.gpus // (tp * pp)):
                dp = Layout.fill(request.gpus, tp=tp, pp=pp, cp=cp).dp  # the one home of dp = world / (tp·pp·cp)
                if request.global_batch % dp:
                    continue
                experts = request.config.experts
                eps = [e for e in divisors(dp) if experts % e == 0] if experts and cp == 1 else [1]
                for kind in CP_KINDS if cp > 1 else CP_KINDS[:1]:
                    for ep in eps:
                        yield tp, pp, cp, kind, ep, dp


def shapes(request: PlanRequest) -> Iterator[Workload]:
    """Every valid layout with ZeRO 0, no dp_shard and no offload: one per shape."""
    for tp, pp, cp, kind, ep, dp in _grids(request):
        per_replica = request.global_batch // dp
        micro_batches = [b for b in divisors(per_replica) if b <= MAX_MICRO_BATCH]
        sps = (False, True) if tp > 1 else (False,)
        for schedule, v in pipelines(request, pp):
            for micro_batch in micro_batches:
                for recompute in request.recompute:
                    for sp in sps:
                        try:  # what plait train refuses (zb-h1 with recompute, a cut the layers do not allow)
                            layout = Workload(
                                dp=dp, tp=tp, pp=pp, cp=cp, cp_kind=kind, ep=ep, precision=request.precision,
                                micro_batch=micro_batch, grad_accum=per_replica // micro_batch,
                                seq_len=request.seq_len, recompute=recompute, schedule=schedule,
                                virtual_stages=v, sp=sp, stage_layers=request.stage_layers,
                                bucket_mb=request.bucket_mb, stack=request.stack, compiled=request.compiled,
                                doc_mask=request.doc_mask)
                            layout.check_model(request.config)  # Ulysses' heads, SP's share of the sequence
                        except PlaitError:
                            continue
                        yield layout


def shard_groups(request: PlanRequest, shape: Workload) -> tuple[int, ...]:
    """dp_shard sizes to try: the dp·cp ranks of SHARD_NODES nodes (tp varies fastest, so a
    node holds gpus_per_node / tp of them), where such a group divides them and leaves two
    replicas or more. None with expert parallelism (plait.rules.check_dp_shard)."""
    if shape.ep > 1:
        return ()
    node = max(1, request.gpus_per_node // shape.tp)
    return tuple(n for n in (node * k for k in SHARD_NODES) if 2 <= n < shape.sync and shape.sync % n == 0)


def tails(request: PlanRequest, shape: Workload) -> Iterator[Workload]:
    """The shape with each ZeRO stage, dp_shard and offload plait train runs."""
    for zero in zero_stages(request.precision, shape.sync):
        for dp_shard in (0, *shard_groups(request, shape)) if zero else (0,):
            for offload in (False, True) if request.offload and zero else (False,):
                try:  # zb-h1 runs ZeRO 0-1 only
                    yield replace(shape, zero=zero, dp_shard=dp_shard, offload=offload)
                except PlaitError:
                    continue


def candidates(request: PlanRequest) -> Iterator[Workload]:
    """Every valid layout for the request (before asking whether it fits)."""
    for shape in shapes(request):
        yield from tails(request, shape)


@dataclass(frozen=True)
class Core:
    """A shape's step without its tail: m micro-batches of the slowest stage and the bubble.
    `s` is exact without a pipeline, and with one a lower bound (pipeline.lower_bound): the
    schedule itself runs only for the layouts that reach an estimate."""

    s: float
    stages: tuple[StageShare, ...]  # one of each kind of stage: the tails' bound is the least of theirs


class Costs:
    """The bounds the search prunes with, from time.py's and exposed.py's own functions, each
    computed once per distinct input: a stage's compute keyed by what
    ops.micro_batch_compute_s reads (tp, cp and its kind, sp, micro-batch, recomputation,
    blocks, last stage or not, a split backward), its tp, cp and ep time by those and the stage's share. The
    layouts that reach an estimate are assembled by time.estimate_time from the same cached parts;
    tests/test_planner.py holds every bound to estimate_time and estimate_memory."""

    def __init__(self, request: PlanRequest) -> None:
        self.request = request
        self._compute: dict[tuple, float] = {}
        self._comm: dict[tuple, tuple[float, float, float]] = {}

    def core(self, shape: Workload) -> Core:
        """m micro-batches of the slowest stage, and with a pipeline a lower bound of the
        schedule's span, its messages included."""
        config, hw = self.request.config, self.request.hardware
        links = inter_node(shape, self.request.gpus_per_node)
        kinds = alike_stages(config, shape.tp, shape.pp, shape.virtual_stages, shape.ep, shape.stage_layers, shape.sp)
        parts = self.parts(shape, links)
        if shape.pp == 1:
            return Core(shape.grad_accum * RankCost(*parts(kinds[0])).micro_batch, kinds)
        by_key = {_stage_key(stage): RankCost(*parts(stage)).micro_batch for stage in kinds}
        shares = stages(config, shape.tp, shape.pp, shape.virtual_stages, shape.ep, shape.stage_layers, shape.sp)
        floor = lower_bound(shape.schedule, shape.pp, shape.grad_accum, shape.virtual_stages,
                            [by_key[_stage_key(share)] for share in shares], forward_share(shape, hw),
                            [chunk_weights(shape, share) for share in shares],
                            message_s(config, shape, hw, links["pp"]), crowd_of(hw))
        return Core(floor, kinds)

    def parts(self, shape: Workload, links: dict[str, int]) -> MicroBatchParts:
        """time.micro_batch_parts for `shape`, each part cached across the shapes that share it."""
        config, hw = self.request.config, self.request.hardware

        def cached(stage: StageShare) -> tuple[float, float, float, float]:
            kind = shape.cp_kind if shape.cp > 1 else ""
            # ep and the stack change the compute too (ep, the routed experts tp splits; the
            # stack, its kernels), cp's kind where cp > 1, and ZB-H1's split backward (what W makes again)
            key = (shape.tp, shape.cp, kind, shape.ep, shape.stack, shape.sp, shape.micro_batch, shape.recompute,
                   splits_backward(shape), stage.layers, stage.reruns, stage.moe_reruns, stage.last)
            if key not in self._compute:
                self._compute[key] = micro_batch_compute_s(config, shape, stage, hw)
            comm = (*key, _stage_key(stage))
            if comm not in self._comm:
                self._comm[comm] = micro_batch_axes_s(config, shape, stage, hw, links, self._compute[key])
            return (self._compute[key], *self._comm[comm])
        return cached

    def step_bound(self, tail: Workload, core: Core) -> float:
        """The core plus the least tail any rank may add (rule 3), and the clip and the loop:
        the step is at least the latest schedule end plus that rank's tail (its path to the
        clip, then an update no shorter than its own). A tail's dp sync is taken behind HIDDEN
        seconds of compute: dp_exposed_s only falls as the compute it overlaps grows (each term
        is max(floor, transfer - compute)), so that is its least."""
        hw, gpn = self.request.hardware, self.request.gpus_per_node
        links = inter_node(tail, gpn)
        least = min(sum(rank_tail(tail, stage, hw, links, HIDDEN, 0.5).values()) for stage in core.stages)
        if tail.pp > 1:  # a pipeline's tail may run while the other ranks wait (a crowded host's)
            least /= crowd_of(hw).fastest
        return core.s + least + clip_s(tail, hw, links) + overhead_s(tail, hw, gpn)

    def memory_bound(self, shape: Workload) -> float:
        """The first and the last stage's activations and pipeline/loss buffers, with the
        fragmentation allowance: bytes no ZeRO option removes (the shape's ZeRO 0 adds no
        gradient buffer)."""
        ends = layout_stages(self.request.config, shape)
        return max(device_total(Memory(activations=stage_activation_bytes(self.request.config, shape, stage),
                                       buffers=stage_buffers(self.request.config, shape, stage))).total
                   for stage in {ends[0], ends[-1]})


def _stage_key(stage: StageShare) -> tuple:
    """What sets a stage's costs, its index aside (beyond being the first or the last)."""
    return (stage.layers, stage.params, stage.replicated_params, stage.expert_params, stage.moe_layers,
            stage.frozen_params, stage.reruns, stage.moe_reruns, stage.first, stage.last)


@functools.lru_cache(maxsize=4096)
def alike_stages(config: GPTConfig, tp: int, pp: int, v: int, ep: int,
                 stage_layers: tuple[int, ...], sp: bool = False) -> tuple[StageShare, ...]:
    """One of each kind of the layout's stages (grouped by `_stage_key`), in stage order:
    what the core's parts and the tails' bound are costed on, once per kind."""
    kinds: dict[tuple, StageShare] = {}
    for stage in stages(config, tp, pp, v, ep, stage_layers, sp):
        kinds.setdefault(_stage_key(stage), stage)
    return tuple(kinds.values())


class Search:
    """The request's shapes in increasing core, and what is known of the layouts met so far."""

    def __init__(self, request: PlanRequest) -> None:
        self.request, self.costs = request, Costs(request)
        cored = [(self.costs.core(shape), i, shape) for i, shape in enumerate(shapes(request))]
        self.shapes = sorted(cored, key=lambda row: (row[0].s, row[1]))
        self._bound: dict[Workload, float] = {}
        self._step: dict[Workload, float | None] = {}
        self._memory: dict[Workload, float] = {}
        self._tails: dict[Workload, tuple[Workload, ...]] = {}

    def tails(self, shape: Workload) -> tuple[Workload, ...]:
        """`tails` of `shape`, made once: every search (the ranking, each of --explain's) walks
        the same shapes, and making a Workload runs plait.rules' checks."""
        if shape not in self._tails:
            self._tails[shape] = tuple(tails(self.request, shape))
        return self._tails[shape]

    def best(self, k: int, shape_ok: Keep = _any, tail_ok: Keep = _any) -> list[Workload]:
        """Every layout that may be among the k fastest that fit, ties at the k-th included
        (rules 1-4 of the module docstring), of those `shape_ok` and `tail_ok` keep."""
        found: list[tuple[float, Workload]] = []
        kth: list[float] = []  # the k smallest steps found, negated: a max-heap
        bound = math.inf
        for core, _, shape in self.shapes:
            if core.s > bound * (1 + SLACK):
                break
            if not shape_ok(shape) or self._shape_memory(shape) > self.request.hardware.usable_bytes:
                continue
            for tail in filter(tail_ok, self.tails(shape)):
                step = self._fits_in(tail, core, bound)
                if step is not None:
                    found.append((step, tail))
                    heapq.heappush(kth, -step)
                    if len(kth) > k:
                        heapq.heappop(kth)
                    bound = -kth[0] if len(kth) == k else bound
        return [tail for step, tail in found if step <= bound * (1 + SLACK)]

    def counts(self) -> dict[str, int]:
        """How much of the space the searches so far have touched: shapes costed, layouts bounded
        (rule 3), layouts whose memory was estimated."""
        return {"shapes": len(self.shapes), "bounded": len(self._bound), "estimated": len(self._step)}

    def _shape_memory(self, shape: Workload) -> float:
        if shape not in self._memory:
            self._memory[shape] = self.costs.memory_bound(shape)
        return self._memory[shape]

    def _fits_in(self, tail: Workload, core: Core, bound: float) -> float | None:
        """`tail`'s step if it may beat `bound` (rule 3) and fits (rule 4, then the estimate)."""
        if tail not in self._bound:
            self._bound[tail] = self.costs.step_bound(tail, core)
        if self._bound[tail] > bound * (1 + SLACK):
            return None
        if tail not in self._step:
            self._step[tail] = self._evaluate(tail, core)
        return self._step[tail]

    def _evaluate(self, tail: Workload, core: Core) -> float | None:
        """None if it does not fit; else its step, estimate_time's own assembly of the
        search's cached parts."""
        config, usable, hw = self.request.config, self.request.hardware.usable_bytes, self.request.hardware
        if _first_stage_bytes(config, tail) > usable or estimate_memory(config, tail).total > usable:
            return None
        links = inter_node(tail, self.request.gpus_per_node)
        return estimate_time(config, tail, hw, self.request.gpus_per_node, self.costs.parts(tail, links)).step_s

    def smallest(self, shape_ok: Keep = _any, tail_ok: Keep = _any) -> float | None:
        """The least memory a layout needs (None: there is none), shapes in the order of rule 2's
        bound, up to the first whose bound is above the least found."""
        least, config = math.inf, self.request.config
        bounded = sorted((self._shape_memory(shape), i, shape) for _, i, shape in self.shapes if shape_ok(shape))
        for lower, _, shape in bounded:
            if lower >= least:
                break
            for tail in filter(tail_ok, self.tails(shape)):
                if _first_stage_bytes(config, tail) < least:
                    least = min(least, estimate_memory(config, tail).total)
        return None if least == math.inf else least


def _first_stage_bytes(config: GPTConfig, layout: Workload) -> float:
    """The first pipeline rank's memory: at most the busiest rank's (rule 4)."""
    return stage_memory(config, layout, layout_stages(config, layout)[0]).total


@functools.lru_cache(maxsize=2)
def search_for(request: PlanRequest) -> Search:
    """One search per request, shared by the ranking and its explanation."""
    return Search(request)


def row_of(layout: Workload, request: PlanRequest, memory: float | None = None,
           parts: MicroBatchParts | None = None) -> dict[str, object]:
    """A layout's line of the plan, from estimate_memory and estimate_time themselves (`parts`:
    its micro-batch's, cached by a search's Costs, the same to the bit)."""
    step = estimate_time(request.config, layout, request.hardware, request.gpus_per_node, parts)
    memory = estimate_memory(request.config, layout).total if memory is None else memory
    return {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "cp": layout.cp, "cp_kind": layout.cp_kind,
            "ep": layout.ep, "zero": layout.zero, "dp_shard": layout.dp_shard, "micro_batch": layout.micro_batch,
            "grad_accum": layout.grad_accum, "recompute": layout.recompute, "sp": layout.sp,
            "offload": layout.offload, "schedule": layout.schedule, "virtual_stages": layout.virtual_stages,
            "stack": layout.stack,
            "memory_bytes": memory, "step_s": step.step_s, "tokens_per_s": step.tokens_per_s, "mfu": step.mfu}


ROW_PRICES = ("memory_bytes", "step_s", "tokens_per_s", "mfu")  # a plan row's fields that are not its layout


def row_layout(row: dict[str, object]) -> tuple:
    """A plan row's layout, without its prices: the same layout in two plans (from two
    calibrations of the machine) has the same one."""
    return tuple(value for key, value in row.items() if key not in ROW_PRICES)


def rank_key(row: dict[str, object]) -> tuple:
    """Step time, then memory, then the layout's fields: equal rows sort alike however found."""
    return row["step_s"], row["memory_bytes"], tuple(str(value) for value in row.values())


def ranked(request: PlanRequest, layouts: list[Workload]) -> list[tuple[dict[str, object], Workload]]:
    """(row, layout) pairs, fastest first by `rank_key`."""
    return sorted(((row_of(layout, request), layout) for layout in layouts), key=lambda pair: rank_key(pair[0]))


def plan_layouts(request: PlanRequest, top: int | None = None, exhaustive: bool = False) -> list[dict[str, object]]:
    """The `top` fastest layouts that fit (every one for top None or 0); PlaitError if none
    does. `exhaustive` estimates every candidate: the reference the pruning is held to."""
    if exhaustive or not top:
        usable, rows, costs = request.hardware.usable_bytes, [], Costs(request)
        for layout in candidates(request):
            memory = estimate_memory(request.config, layout).total
            if memory <= usable:  # ZeRO's, dp_shard's and offload's options share a shape's micro-batch
                parts = costs.parts(layout, inter_node(layout, request.gpus_per_node))
                rows.append(row_of(layout, request, memory, parts))
        rows.sort(key=rank_key)
    else:
        rows = [row for row, _ in ranked(request, search_for(request).best(top))]
    if not rows:
        raise _nothing_fits(request, search_for(request))
    return rows[:top] if top else rows


def _nothing_fits(request: PlanRequest, search: Search) -> PlaitError:
    smallest = search.smallest()
    if smallest is None:
        return PlaitError(
            f"no layout of {request.gpus} GPUs fits this model and a global batch of {request.global_batch}",
            hint="make the global batch a multiple of the data-parallel degree, or change --gpus")
    usable = request.hardware.usable_bytes
    return PlaitError(
        f"nothing fits: the smallest layout needs {smallest / GIB:.1f} GiB per GPU "
        f"and {request.hardware.name} has {usable / GIB:.1f} GiB usable",
        hint="use more GPUs, GPUs with more memory, --offload, or a shorter --seq-len")


def plan_request(config: GPTConfig, *, gpus: int, global_batch: int, hardware: str | Hardware = "h100-sxm",
                 gpus_per_node: int | None = None, seq_len: int | None = None, precision: str = "bf16",
                 schedule: str | tuple[str, ...] | None = None, offload: bool = False,
                 stage_layers: tuple[int, ...] = (), bucket_mb: float = BUCKET_MB,
                 stack: str = "plait", compiled: bool = False, doc_mask: str = "") -> PlanRequest:
    """The request `plan` answers, checked (`schedule` restricts the search: `schedules_of`)."""
    hw = resolve_hardware(hardware)
    for flag, value, most in (("--gpus", gpus, MAX_GPUS), ("--global-batch", global_batch, MAX_GLOBAL_BATCH)):
        if value > most:
            raise PlaitError(f"{flag} {value:,} is more than plait plans for ({most:,})",
                             hint=f"plan the job you will run, e.g. {flag} 1024")
    if stage_layers:
        check_pipeline_cut(config.n_layers, len(stage_layers), 1, stage_layers, config.block_runs)
    return PlanRequest(config=config, gpus=gpus, gpus_per_node=given_or(gpus_per_node, hw.gpus_per_node,
                                                                        "--gpus-per-node"),
                       hardware=hw, global_batch=global_batch,
                       seq_len=given_or(seq_len, config.max_seq_len, "--seq-len"),
                       precision=precision, schedules=schedules_of(schedule), offload=offload,
                       stage_layers=tuple(stage_layers), bucket_mb=bucket_mb, stack=stack, compiled=compiled,
                       doc_mask=doc_mask)


def plan(config: GPTConfig, *, gpus: int, global_batch: int, hardware: str | Hardware = "h100-sxm",
         gpus_per_node: int | None = None, seq_len: int | None = None, precision: str = "bf16",
         schedule: str | tuple[str, ...] | None = None, offload: bool = False, top: int | None = None,
         stage_layers: tuple[int, ...] = (), bucket_mb: float = BUCKET_MB,
         stack: str = "plait") -> list[dict[str, object]]:
    """Rank the layouts of `config` on `gpus` GPUs that fit; see `plan_layouts`. `schedule`
    restricts the schedules searched ("1f1b", "1f1b,zb-h1"; default: 1f1b, interleaved and
    zb-h1); `stage_layers` fixes the pipeline cut (and so pp: one number per stage)."""
    request = plan_request(config, gpus=gpus, global_batch=global_batch, hardware=hardware,
                           gpus_per_node=gpus_per_node, seq_len=seq_len, precision=precision, schedule=schedule,
                           offload=offload, stage_layers=stage_layers, bucket_mb=bucket_mb, stack=stack)
    return plan_layouts(request, top)


@dataclass(frozen=True)
class Without:
    """One distinctive choice of the best layout: the search restricted to layouts without it
    (`shape_ok` judges the shape, `tail_ok` its ZeRO options)."""

    label: str
    shape_ok: Keep = _any
    tail_ok: Keep = _any


def distinctive(best: Workload) -> list[Without]:
    """What sets `best` apart from the simplest layout, each as a restriction to its absence."""
    choices = [
        (best.pp > 1, Without("pp = 1", lambda w: w.pp == 1)),
        (best.tp > 1, Without("tp = 1", lambda w: w.tp == 1)),
        (best.cp > 1, Without("cp = 1", lambda w: w.cp == 1)),
        (best.ep > 1, Without("ep = 1", lambda w: w.ep == 1)),
        (best.virtual_stages > 1, Without("no interleaving", lambda w: w.virtual_stages == 1)),
        (best.pp > 1 and best.schedule == "zb-h1", Without("no zb-h1", lambda w: w.pp == 1 or w.schedule != "zb-h1")),
        (best.recompute != "none", Without("no recompute", lambda w: w.recompute == "none")),
        (best.sp, Without("no sp", lambda w: not w.sp)),
        (best.zero == 3, Without("ZeRO 0-2", tail_ok=lambda w: w.zero < 3)),
        (0 < best.zero < 3, Without("no ZeRO", tail_ok=lambda w: w.zero == 0)),
        (best.dp_shard > 0, Without("ZeRO over all dp·cp ranks", tail_ok=lambda w: w.dp_shard == 0)),
        (best.offload, Without("no offload", tail_ok=lambda w: not w.offload)),
    ]
    return [without for applies, without in choices if applies]


def explain(request: PlanRequest) -> dict[str, object]:
    """Why the best layout wins: its step's parts (the bubble, the communication it waits
    for by axis, what recomputation adds), its memory headroom, and the best layout without
    each of its distinctive choices (how much slower, or the memory the smallest would need)."""
    search = search_for(request)
    found = search.best(1)
    if not found:
        raise _nothing_fits(request, search)
    row, best = ranked(request, found)[0]
    step = estimate_time(request.config, best, request.hardware, request.gpus_per_node)
    plain = estimate_time(request.config, replace(best, recompute="none"), request.hardware, request.gpus_per_node)
    usable = request.hardware.usable_bytes
    return {
        "layout": row, "time": step.as_dict(), "bubble_share": step.bubble_s / step.step_s,
        "exposed_s": {"tp": step.tp_s, "pp": step.pp_s, "cp": step.cp_s, "ep": step.ep_s, "dp": step.dp_s,
                      "offload": step.offload_s},
        "recompute_s": step.compute_s - plain.compute_s,
        "memory_bytes": row["memory_bytes"], "usable_bytes": usable, "headroom_bytes": usable - row["memory_bytes"],
        "without": [other for other in (_compare(request, search, without, step.step_s)
                                        for without in distinctive(best)) if other is not None],
    }


def _compare(request: PlanRequest, search: Search, without: Without, best_s: float) -> dict[str, object] | None:
    """The best layout under `without`'s restriction and how much slower it is; or, when
    none fits, the least memory one would need; None when the request allows no such layout
    (a given cut fixes pp, a --schedule names one)."""
    found = search.best(1, without.shape_ok, without.tail_ok)
    if not found:
        smallest = search.smallest(without.shape_ok, without.tail_ok)
        return None if smallest is None else {"label": without.label, "layout": None, "slower": None,
                                              "smallest_bytes": smallest}
    row = ranked(request, found)[0][0]
    return {"label": without.label, "layout": row, "slower": row["step_s"] / best_s - 1, "smallest_bytes": None}
