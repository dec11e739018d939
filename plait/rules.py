"""What a layout may be: every choice and every rule between options, in one place.

Torch-free and model-free: `plait.layout.Layout` runs `check_layout` when it is made, so
`plait train`, the Python API, `plait estimate` and `plait plan` refuse the same layouts
with the same words; the pipeline runner asks `check_split_backward` of the schedule it is
given. A model's own limits (heads that tp must divide, layers that the pipeline cuts) are
its family's, checked with the numbers passed in here (`check_pipeline_cut`). A new
precision, recompute policy or schedule becomes available everywhere by adding it to its
tuple here, once the training code runs it; a new axis is one field of the Layout and its
rules here.
"""

from __future__ import annotations

import math

from typing import Any

from plait.errors import PlaitError

# The pipeline schedules (plait.schedule.build builds each one).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
# Schedules that split each backward into I (input grad) and W (weight grad).
SPLIT_BACKWARD = ("zb-h1",)
# Parameter and gradient dtypes training runs (16-bit ones keep fp32 masters: plait.parallel.precision).
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# fp8: the blocks' linear layers multiply in float8 (torchao's float8 training), scaled per
# tensor or per row; everything else is bf16 with fp32 masters (plait.parallel.fp8).
FP8_SCALINGS = ("tensorwise", "rowwise", "tensorwise-fast")
# A linear fp8 converts has both dimensions of its weight in multiples of this (the float8
# kernels' tile); any other stays bf16.
FLOAT8_TILE = 16
AUGMENTS = ("none", "crop", "crop,flip")  # --augment, besides "auto" (plait/train/data/images.py)
# The oldest CUDA devices with float8 matrix units (Ada and Hopper: compute capability 8.9).
FP8_MIN_CAPABILITY = (8, 9)
# Activation recomputation policies training runs (plait.parallel.recompute).
RECOMPUTE = ("none", "selective", "full")
# The dtypes data parallelism may reduce gradients in (--reduce-dtype), and their sizes.
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# 0: replicate everything (DDP); 1: shard optimizer states; 2: + gradients; 3: + parameters.
ZERO_STAGES = (0, 1, 2, 3)
# AdamW's kernels: one fused kernel over every tensor (where torch has one for the device),
# torch's multi-tensor foreach path, or its per-tensor loop.
OPTIMIZER_KERNELS = ("fused", "foreach", "loop", "compiled")
# Axes the layout names but training does not run yet: refused, never ignored.
# Context parallelism's attention kinds (plait.parallel.context): K/V passed round a ring of
# send/recv, or all-to-all from sequence shards to head shards (DeepSpeed-Ulysses).
CP_KINDS = ("ring", "ulysses")
# How documents become training sequences (plait.train.data.packing): windows over the stream,
# or whole documents placed by best-fit decreasing; and what `plait data prepare --format` reads.
PACKINGS = ("concat", "best-fit")
DATA_FORMATS = ("text", "completion", "chat")
# A gradient bucket's default size, MiB (--bucket-mb): one all-reduce or reduce-scatter each.
BUCKET_MB = 25.0


FLEX_OFF = False  # True: SDPA's dense mask on a GPU too (plait.parallel.packed.document_attention)


def doc_mask_on(device_type: str) -> str:
    """The packed documents' mask a run builds on a device of `device_type` ("cuda", "cpu"), as
    plait.estimate.layout.Workload.doc_mask names it: FlexAttention's block tables on a GPU
    (its CPU form has no backward), SDPA's dense mask elsewhere. The one home of that choice:
    the attention that builds the mask, the run's estimate and --memory-limit's price before
    launch all ask it."""
    return "blocks" if device_type == "cuda" and not FLEX_OFF else "dense"


def estimate_device(device_type: str) -> str:
    """plait.estimate.layout.Workload.device of ranks on `device_type` ("cuda", "cpu", or a
    hardware preset's name): "cpu", whose SDPA runs some calls in its math form, or "cuda" for
    any GPU. The one home of that choice: a run's estimate, --memory-limit's price before launch
    and `plait estimate --device`'s default all ask it."""
    return "cpu" if device_type == "cpu" else "cuda"


def check_choice(flag: str, value: object, choices: tuple) -> None:
    """`--flag value` must be one of `choices`; the hint lists them."""
    if value not in choices:
        raise PlaitError(f"unknown --{flag} {value!r}", hint=f"choose one of: {', '.join(map(str, choices))}")


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_whole(flag: str, value: Any) -> None:
    """A degree or a count: a whole number of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlaitError(f"--{flag} must be a whole number of at least 1, got {value!r}",
                         hint=f"pass --{flag} 1 or more")


def check_bucket_mb(bucket_mb: Any) -> None:
    """A gradient bucket is a positive, finite number of MiB."""
    if (not isinstance(bucket_mb, (int, float)) or isinstance(bucket_mb, bool) or not math.isfinite(bucket_mb)
            or bucket_mb <= 0):
        raise PlaitError(f"--bucket-mb must be a positive number, got {bucket_mb!r}",
                         hint="plait's default is 25 (MiB); Megatron-Core's is max(40M, 1M x dp) parameters")


def given_or(value: int | None, default: int, flag: str) -> int:
    """A count the caller may leave out (None: `default`), never 0 or negative, which would
    otherwise fall back to the default without a word."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PlaitError(f"{flag} must be at least 1, got {value!r}", hint=f"leave {flag} out for {default}")
    return value


def check_context_split(seq_len: int, cp: int, tp: int = 1, sp: bool = False, heads: int | None = None,
                        kind: str = "ring") -> None:
    """Context parallelism's cuts: 2·cp equal chunks of each sequence; under SP, each cp rank's
    tokens split again over tp; Ulysses' heads (per tp rank) over cp."""
    if cp == 1:
        return
    if seq_len % (2 * cp):
        raise PlaitError(f"--seq-len {seq_len} is not divisible by 2·cp = {2 * cp}: each cp rank holds two of "
                         f"{2 * cp} equal chunks of every sequence (the head-tail balance of causal attention)",
                         hint=f"use a --seq-len that is a multiple of {2 * cp}")
    if sp and (seq_len // cp) % tp:
        raise PlaitError(f"--sp splits each cp rank's {seq_len // cp} tokens over tp={tp}, which does not divide them",
                         hint=f"use a --seq-len that is a multiple of {2 * cp * tp // math.gcd(2, tp)}")
    if kind == "ulysses" and heads is not None and (heads // tp) % cp:
        raise PlaitError(f"--cp-kind ulysses splits attention heads over cp: {heads // tp} heads per tp rank are not "
                         f"divisible by cp={cp}", hint="use --cp-kind ring, or a cp that divides the heads")


def check_layout(layout: Any) -> None:
    """Everything a `plait.layout.Layout` must satisfy on its own (no model, no batch)."""
    for axis in ("dp", "tp", "pp", "cp", "ep", "virtual_stages"):
        check_whole(axis.replace("_", "-"), getattr(layout, axis))
    check_choice("schedule", layout.schedule, SCHEDULES)
    check_choice("cp-kind", layout.cp_kind, CP_KINDS)
    check_expert_axis(layout)
    if layout.zero not in ZERO_STAGES or isinstance(layout.zero, bool):
        raise PlaitError(f"--zero must be 0, 1, 2 or 3, got {layout.zero!r}",
                         hint="0 is plain data parallelism; 1-3 shard more and more state")
    check_dp_shard(layout)
    if layout.offload and layout.zero == 0:
        raise PlaitError("--offload needs a ZeRO stage: it moves the sharded optimizer to the CPU",
                         hint="add --zero 1 (or 2 or 3)")
    if layout.sp and layout.tp == 1:
        raise PlaitError("--sp splits the sequence across tensor-parallel ranks, and --tp is 1",
                         hint="add --tp 2 (or more)")
    if layout.pp > 1:
        check_split_backward(layout.schedule, zero=layout.zero)
    check_zero3_gathers(layout.zero, layout.prefetch, layout.reshard_after_forward, layout.pp)
    check_virtual_stages(layout.pp, layout.schedule, layout.virtual_stages)
    check_stage_layers(layout.stage_layers, layout.pp, layout.virtual_stages)


def check_dp_shard(layout: Any) -> None:
    """--dp-shard N (hybrid sharding): ZeRO inside groups of N of the dp·cp ranks, whole
    replicas across the groups. 0 (the default) shards over all of them."""
    if layout.dp_shard == 0 and not isinstance(layout.dp_shard, bool):
        return
    check_whole("dp-shard", layout.dp_shard)
    if layout.zero == 0:
        raise PlaitError(f"--dp-shard {layout.dp_shard} shards ZeRO's states inside groups of data ranks, and --zero is 0",
                         hint="add --zero 1, 2 or 3 (or drop --dp-shard: plain data parallelism replicates everything)")
    ranks = layout.dp * layout.cp
    if ranks % layout.dp_shard:
        raise PlaitError(f"--dp-shard {layout.dp_shard} does not divide the {ranks} data-parallel ranks (dp × cp)",
                         hint=f"choose one of {divisors(ranks)}")
    if layout.ep > 1:
        raise PlaitError(f"--dp-shard with --ep {layout.ep}: expert parameters are sharded over their own edp "
                         "ranks, which --dp-shard does not group",
                         hint="drop --dp-shard (plain ZeRO shards experts over edp), or --ep")


def parse_stage_layers(text: Any) -> tuple[int, ...]:
    """"3,4,4,3" (the flag) -> (3, 4, 4, 3); "" -> () (plait's own cut)."""
    if not isinstance(text, str):
        raise PlaitError(f"--stage-layers must be comma-separated block counts, got {text!r}",
                         hint='e.g. --stage-layers 3,4,4,3 (in TOML: stage_layers = "3,4,4,3")')
    if not text.strip():
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise PlaitError(f"--stage-layers must be comma-separated block counts, got {text!r}",
                         hint="e.g. --stage-layers 3,4,4,3") from None


def check_stage_layers(counts: tuple[int, ...], pp: int, virtual_stages: int) -> None:
    """--stage-layers: the blocks of each of the pp·v chunks, in the order stages are numbered
    (chunk c of rank r is stage c·pp + r). A chunk at either end may hold none, so that the
    first holds only the embedding and the last only the head and the loss; a chunk between
    them holding none would only pass activations on, and is refused."""
    if not isinstance(counts, (tuple, list)):
        raise PlaitError(f"--stage-layers must be a list of block counts, got {counts!r}",
                         hint='e.g. --stage-layers 3,4,4,3 (in Python: stage_layers=(3, 4, 4, 3))')
    if not counts:
        return
    stages = pp * virtual_stages
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts):
        raise PlaitError(f"--stage-layers must be whole numbers of blocks, 0 or more, got {','.join(map(str, counts))}",
                         hint="e.g. --stage-layers 3,4,4,3")
    if pp == 1:
        raise PlaitError("--stage-layers cuts the blocks into pipeline stages, and there is one",
                         hint="give two or more stages (--pp 2 or more), or drop --stage-layers")
    if len(counts) != stages:
        raise PlaitError(f"--stage-layers gives {len(counts)} block counts, and the layout has pp={pp} × "
                         f"virtual stages {virtual_stages} = {stages} stages", hint=f"give {stages} numbers")
    if 0 in counts[1:-1]:
        raise PlaitError(f"--stage-layers {','.join(map(str, counts))} leaves a middle stage without a block",
                         hint="only the first stage (the embedding alone) or the last (the head alone) may hold 0")
    if sum(counts) == 0:
        raise PlaitError("--stage-layers gives no stage a block", hint="give the model's layers to the stages")


def check_expert_axis(layout: Any) -> None:
    """ep folds into dp: ep consecutive dp ranks split the experts, so ep must divide dp.
    ZeRO shards expert parameters over edp; context parallelism is not built with experts
    yet (its ranks would share the experts' gradients), and is refused by name."""
    if layout.ep == 1:
        return
    if layout.dp % layout.ep:
        raise PlaitError(f"--ep {layout.ep} does not divide dp = {layout.dp}: expert parallelism is carved out "
                         "of the data-parallel ranks", hint=f"choose --ep among {divisors(layout.dp)}")
    if layout.cp > 1:
        raise PlaitError(f"--ep {layout.ep} with --cp {layout.cp}: expert parallelism with context parallelism "
                         "is not built yet", hint="drop --cp, or use --ep 1 (the experts replicated)")


def check_experts_split(experts: int, ep: int) -> None:
    """Each ep rank holds experts / ep whole experts."""
    if experts == 0 and ep > 1:
        raise PlaitError(f"--ep {ep} splits the experts, and the model has none",
                         hint="train a mixture of experts (e.g. --model tiny-moe), or drop --ep")
    if experts and experts % ep:
        raise PlaitError(f"experts = {experts} is not divisible by --ep {ep}",
                         hint=f"each ep rank holds experts / ep whole experts: choose --ep among {divisors(experts)}")


def check_zero3_gathers(zero: int, prefetch: Any, reshard_after_forward: bool, pp: int) -> None:
    """--prefetch and --reshard-after-forward tune ZeRO-3's gathers, and only those."""
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise PlaitError(f"--prefetch must be a whole number of units, 0 or more, got {prefetch!r}",
                         hint="1 (the default) gathers the next unit while one computes; 0 gathers on demand")
    changed = [flag for flag, on in (("--prefetch", prefetch != 1),
                                     ("--reshard-after-forward false", not reshard_after_forward)) if on]
    if changed and zero != 3:
        raise PlaitError(f"{' and '.join(changed)} tune ZeRO-3's weight gathers, and --zero is {zero}",
                         hint="add --zero 3, or drop them")
    if not reshard_after_forward and pp > 1:
        raise PlaitError("--reshard-after-forward false is for pp = 1: a pipeline interleaves micro-batches, so "
                         "units kept from forward would pile up across them",
                         hint="keep the default (true) with --pp, or drop --pp")


def check_virtual_stages(pp: int, schedule: str, virtual_stages: int) -> None:
    """Model chunks per rank go with the interleaved schedule, and it needs two or more."""
    if virtual_stages > 1 and schedule != "interleaved":
        raise PlaitError(f"--virtual-stages > 1 needs --schedule interleaved (v={virtual_stages} with {schedule})",
                         hint="add --schedule interleaved, or drop --virtual-stages")
    if pp > 1 and schedule == "interleaved" and virtual_stages < 2:
        raise PlaitError(f"the interleaved schedule needs --virtual-stages 2 or more (v={virtual_stages})",
                         hint="add --virtual-stages 2, or use --schedule 1f1b")


def check_split_backward(schedule: str, *, zero: int = 0, recompute: str = "none") -> None:
    """zb-h1 computes weight gradients (W) outside autograd's hooks, from saved activations."""
    if schedule not in SPLIT_BACKWARD:
        return
    if recompute != "none":
        raise PlaitError(f"--recompute {recompute} cannot run the {schedule} schedule: W reads the activations "
                         "recomputation drops", hint="use --schedule 1f1b with --recompute, or drop --recompute")
    if zero >= 2:
        raise PlaitError(f"--zero {zero} cannot run the {schedule} schedule: it reduces gradients from "
                         "autograd's hooks, and zb-h1 computes weight gradients outside them",
                         hint="use --zero 1 with zb-h1, or another --schedule")


def check_compile(schedule: str, pp: int) -> None:
    """--compile and a split backward: zb-h1's W step captures each linear's input with a
    forward hook inside the block, which a compiled block's graph does not run as eager does."""
    if pp > 1 and schedule in SPLIT_BACKWARD:
        raise PlaitError(f"--compile cannot run the {schedule} schedule: its W step captures each linear's input "
                         "with a hook inside the block, and the compiled block does not run it",
                         hint="use --schedule 1f1b (or gpipe, interleaved) with --compile, or drop --compile")


def check_recompute(layout: Any, recompute: str) -> None:
    """A recompute policy training runs, and one the layout's schedule can run."""
    check_choice("recompute", recompute, RECOMPUTE)
    if layout.pp > 1:
        check_split_backward(layout.schedule, zero=layout.zero, recompute=recompute)


def check_precision(precision: str, reduce_dtype: str = "") -> None:
    """A precision training runs ("" reduce dtype: the gradients' own)."""
    check_choice("precision", precision, PRECISIONS)
    if reduce_dtype:
        check_choice("reduce-dtype", reduce_dtype, REDUCE_DTYPES)


def check_optimizer_kernel(kernel: str, precision: str, offload: bool) -> None:
    """AdamW's kernel; `compiled` fuses the 16-bit weights' three update passes into one
    (plait.parallel.compiled_update), so it needs 16-bit weights with masters on the device."""
    check_choice("optimizer-kernel", kernel, OPTIMIZER_KERNELS)
    if kernel == "compiled":
        check_compiled_update(precision != "fp32", offload)


def check_compiled_update(sixteen_bit: bool, offload: bool) -> None:
    """The compiled update's needs, checked where a run is configured and where an optimizer
    is built (plait.build_optimizer takes no precision flag)."""
    if not sixteen_bit:
        raise PlaitError("--optimizer-kernel compiled steps fp32 masters of 16-bit weights",
                         hint="use it with --precision bf16, fp16 or fp8; fp32 weights take one fused pass already")
    if offload:
        raise PlaitError("--optimizer-kernel compiled steps the masters on the device; --offload steps them on the host",
                         hint="drop one of the two")


def check_fp8(layout: Any, scaling: str = FP8_SCALINGS[0]) -> None:
    """fp8's scaling, and the splits it trains exactly: a tensor-parallel shard would scale by
    its own amax, not the whole tensor's, so tp (± sp) with fp8 is refused rather than run
    as another model (dp, ZeRO, pp and ep see whole weights and whole rows)."""
    check_choice("fp8-scaling", scaling, FP8_SCALINGS)
    if layout.tp > 1:
        raise PlaitError(f"--precision fp8 with --tp {layout.tp}: each tp rank would scale its shard by the shard's "
                         "own largest value, not the whole tensor's, and train another model than one process",
                         hint="use --tp 1 with fp8 (dp, --zero, --pp and --ep compose with it), or --precision bf16")


def check_fp8_device(device: str, capability: tuple[int, int] | None, have_torchao: bool,
                     scaling: str = FP8_SCALINGS[0], torch_release: tuple[int, int] | None = None) -> None:
    """fp8 needs torchao (the optional extra plait[fp8]) and a device with float8 matrix
    products: a CUDA device of compute capability 8.9 or more, or the CPU, where torch runs
    them exactly but slowly (for tests). Row-wise scales on the CPU need torch 2.13: torch
    2.11's CPU product takes one scale per tensor and fails mid-step. Said in one line, before
    spawning."""
    if not have_torchao:
        raise PlaitError("--precision fp8 needs torchao, which is not installed",
                         hint="pip install 'plait[fp8]' (torchao), or use --precision bf16")
    if device == "cpu" and scaling == "rowwise" and torch_release is not None and torch_release < (2, 13):
        raise PlaitError(f"--fp8-scaling rowwise on the CPU needs torch 2.13 or later: torch "
                         f"{torch_release[0]}.{torch_release[1]} multiplies float8 on the CPU with one scale per tensor",
                         hint="use --fp8-scaling tensorwise on this torch, or install torch 2.13")
    check_float8_units(device, capability)


def check_float8_units(device: str, capability: tuple[int, int] | None) -> None:
    """A CUDA device multiplies float8 from compute capability 8.9 (Ada, Hopper); the CPU
    always can. Training in fp8 and calibrating its products both need it."""
    if device == "cuda" and capability is not None and capability < FP8_MIN_CAPABILITY:
        major, minor = capability
        raise PlaitError(f"--precision fp8: this GPU (compute capability {major}.{minor}) has no float8 matrix units",
                         hint="fp8 needs compute capability 8.9 or more (Ada, Hopper); use --precision bf16")


def default_reduce_dtype(precision: str) -> str:
    """The gradients' own dtype: fp32 sums of 16-bit gradients double the wire bytes and, at
    the dp sizes measured (docs/precision.md), change the loss less than the layouts'
    own summation order does. fp8's gradients are bf16 (only the products are float8)."""
    return "bf16" if precision == "fp8" else precision


def check_sync_bn_accumulation(sync_bn: bool, dp: int, grad_accum: int) -> None:
    """SyncBN normalises each global micro-batch as one: under accumulation on dp ranks that is
    every rank's k-th micro-batch together, which the one-process run (its micro-batch k a
    contiguous slice of the global batch) never normalises; so that split is refused."""
    if sync_bn and dp > 1 and grad_accum > 1:
        raise PlaitError(f"--sync-bn with --grad-accum {grad_accum} on dp={dp} would normalise each rank's k-th "
                         "micro-batch together, a grouping no one-process run has, so it would not train the "
                         "one-process model", hint=f"give --grad-accum 1 with a {grad_accum}× larger --micro-batch, "
                                                   "or use fewer data ranks")


def check_pipeline_cut(n_layers: int, pp: int, virtual_stages: int = 1, stage_layers: tuple[int, ...] = (),
                       block_runs: tuple[int, ...] = ()) -> None:
    """pp·v stages cut from a model's `n_layers` blocks: each stage needs one (interleaving
    cuts equal chunks where pp·v divides the layers, else balances them as pp stages are
    balanced: plait/parallel/pipeline/split.py); or the cut --stage-layers gives
    (`check_stage_layers`), which must count them all. A looped model (`block_runs`: its
    forward runs some blocks again) has no cut: plait's stages run each block once, in order."""
    v, stages = virtual_stages, pp * virtual_stages
    if stages > 1 and block_runs and max(block_runs) > 1:
        looped = [str(i) for i, runs in enumerate(block_runs) if runs > 1]
        named = f"block {looped[0]}" if len(looped) == 1 else f"blocks {', '.join(looped)}"
        raise PlaitError(f"pp={pp} cuts the blocks into stages run once each in order, and this model's forward runs "
                         f"{named} more than once (a loop)",
                         hint="train it with pp 1 (dp, ZeRO, tp and ep need no cut)")
    if stage_layers:
        check_stage_layers(stage_layers, pp, virtual_stages)
        if sum(stage_layers) != n_layers:
            raise PlaitError(f"--stage-layers {','.join(map(str, stage_layers))} gives {sum(stage_layers)} blocks, "
                             f"and the model has {n_layers}", hint=f"give {stages} numbers that sum to {n_layers}")
        return
    if stages > n_layers:
        raise PlaitError(f"pp={pp} x virtual stages {v} = {stages} stages is more than the model's {n_layers} "
                         "layers: every stage needs a layer", hint=f"use at most {n_layers} pipeline stages")


def check_divides(what: str, size: int, tp: int, why: str, pad: str = "") -> None:
    """`size` (a model's heads, vocabulary, width...) must split evenly over tp ranks."""
    if size % tp:
        raise PlaitError(f"{what} = {size} is not divisible by tp={tp} ({why})",
                         hint=f"choose tp among {divisors(size)}{pad}")


def check_sequence_split(seq_len: int, tp: int, sp: bool) -> None:
    """Sequence parallelism gives each tp rank seq_len / tp positions."""
    if sp and seq_len % tp:
        raise PlaitError(f"--sp needs the sequence length divisible by tp: seq_len = {seq_len}, tp = {tp}",
                         hint=f"use a seq_len that is a multiple of {tp}, or drop --sp")


def check_compile_toolchain(device_type: str, cxx: str, found: bool) -> None:
    """--compile on a CPU: Inductor writes C++ and builds it with `cxx` ($CXX, else g++:
    plait.runtime.env.cxx_compiler); `found` says whether it is on the PATH. Refused at
    once, not in the first step."""
    if device_type == "cpu" and not found:
        raise PlaitError(f"--compile on a CPU needs a C++ compiler, and {cxx} was not found",
                         hint="install g++ (e.g. apt-get install g++) or point $CXX at a compiler, or drop --compile")
