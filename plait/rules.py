"""What a layout may be: the choices and the checks that `plait train` and `plait estimate`
(and `plait plan`) share, so that the estimator never accepts a layout training refuses.

Torch-free, like `estimate/`: a rule lives here once, and `parallel/`, `train/config.py`
and `estimate/layout.py` import it. A new precision or recompute policy becomes
available everywhere by adding it to its tuple here, once the training code runs it.
"""

from __future__ import annotations

from plait.errors import PlaitError
from plait.models.config import GPTConfig

# The pipeline schedules (plait.parallel.pipeline.schedule builds each one).
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")
# Schedules that split each backward into I (input grad) and W (weight grad).
SPLIT_BACKWARD = ("zb-h1",)
# Parameter and gradient dtypes training runs (16-bit ones keep fp32 masters: plait.parallel.precision).
PRECISIONS = ("fp32", "bf16", "fp16")
# Activation recomputation policies training runs (plait.parallel.recompute).
RECOMPUTE = ("none", "selective", "full")
# The dtypes data parallelism may reduce gradients in (--reduce-dtype), and their sizes.
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ZERO_STAGES = (0, 1, 2, 3)


def check_choice(flag: str, value: object, choices: tuple) -> None:
    """`--flag value` must be one of `choices`; the hint lists them."""
    if value not in choices:
        raise PlaitError(f"unknown --{flag} {value!r}", hint=f"choose one of: {', '.join(map(str, choices))}")


def divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_tensor_parallel(config: GPTConfig, tp: int, sp: bool = False, seq_len: int | None = None) -> None:
    """The GPT splits whole heads, whole KV heads, the vocabulary and the MLP evenly over tp;
    under SP the sequence too. The vocabulary is not padded: pad it in the model instead
    (`--model NAME,vocab_size=N`)."""
    for what, size, why in (("n_heads", config.n_heads, "each rank holds whole attention heads"),
                            ("n_kv_heads", config.n_kv_heads, "each rank holds whole key/value heads"),
                            ("vocab_size", config.vocab_size, "each rank holds V/tp rows of the vocabulary"),
                            ("ffn_hidden", config.ffn_hidden, "each rank holds ffn_hidden/tp MLP units")):
        if size % tp:
            pad = f", or pad the vocabulary to {size + (-size % tp)}" if what == "vocab_size" else ""
            raise PlaitError(f"{what} = {size} is not divisible by tp={tp} ({why})",
                             hint=f"choose tp among {divisors(size)}{pad}")
    if sp and seq_len is not None and seq_len % tp:
        raise PlaitError(f"--sp needs the sequence length divisible by tp: seq_len = {seq_len}, tp = {tp}",
                         hint=f"use a seq_len that is a multiple of {tp}, or drop --sp")


def check_strategy_choices(*, schedule: str, precision: str, recompute: str, zero: int,
                           reduce_dtype: str = "") -> None:
    """Each option is one the training code implements ("" reduce dtype: the default)."""
    check_choice("schedule", schedule, SCHEDULES)
    check_choice("precision", precision, PRECISIONS)
    check_choice("recompute", recompute, RECOMPUTE)
    if reduce_dtype:
        check_choice("reduce-dtype", reduce_dtype, REDUCE_DTYPES)
    if zero not in ZERO_STAGES:
        raise PlaitError(f"--zero must be 0, 1, 2 or 3, got {zero!r}",
                         hint="0 is plain data parallelism; 1-3 shard more and more state")


def default_reduce_dtype(precision: str) -> str:
    """The gradients' own dtype: fp32 sums of 16-bit gradients double the wire bytes and, at
    the dp sizes measured (docs/precision.md), change the loss less than the layouts'
    own summation order does."""
    return precision


def check_combination(*, tp: int, pp: int, zero: int, offload: bool, sp: bool, recompute: str, schedule: str) -> None:
    """Options that work alone but not together, each refused with what to change."""
    if offload and zero == 0:
        raise PlaitError("--offload needs a ZeRO stage", hint="add --zero 1 (or 2 or 3)")
    if sp and tp == 1:
        raise PlaitError("--sp splits the sequence across tensor-parallel ranks, and --tp is 1",
                         hint="add --tp 2 (or more)")
    if pp > 1 and schedule in SPLIT_BACKWARD and recompute != "none":
        raise PlaitError(f"--recompute {recompute} cannot run the {schedule} schedule: W reads the activations "
                         "recomputation drops", hint="use --schedule 1f1b with --recompute, or drop --recompute")
    if pp > 1 and schedule in SPLIT_BACKWARD and zero >= 2:
        raise PlaitError(f"--zero {zero} cannot run the {schedule} schedule: it reduces gradients from "
                         "autograd's hooks, and zb-h1 computes weight gradients outside them",
                         hint="use --zero 1 with zb-h1, or another --schedule")


def check_pipeline_shape(n_layers: int | None, *, pp: int, virtual_stages: int, schedule: str,
                         microbatches: int) -> None:
    """pp·v stages cut from the model's layers (None: a model known only by its size), and a
    schedule that can run them."""
    v, stages = virtual_stages, pp * virtual_stages
    if v > 1 and schedule != "interleaved":
        raise PlaitError("--virtual-stages > 1 needs --schedule interleaved",
                         hint="add --schedule interleaved, or drop --virtual-stages")
    if pp > 1 and schedule == "interleaved" and v < 2:
        raise PlaitError("the interleaved schedule needs --virtual-stages 2 or more",
                         hint="add --virtual-stages 2, or use --schedule 1f1b")
    if n_layers is not None and stages > n_layers:
        raise PlaitError(f"pp={pp} x virtual stages {v} = {stages} stages is more than the model's {n_layers} "
                         "layers: every stage needs a layer", hint=f"use at most {n_layers} pipeline stages")
    if n_layers is not None and v > 1 and n_layers % stages:
        raise PlaitError(f"interleaving cuts the {n_layers} layers into pp x virtual stages = {stages} equal chunks, "
                         f"and {n_layers} is not divisible by {stages}",
                         hint="choose pp and --virtual-stages whose product divides the layer count")
    if pp > 1 and schedule == "interleaved" and microbatches % pp:
        raise PlaitError(f"the interleaved schedule needs the micro-batch count ({microbatches}) "
                         f"to be a multiple of pp={pp}", hint=f"set --grad-accum to a multiple of {pp}")
