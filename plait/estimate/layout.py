"""A layout to estimate, checked once, and the slice of the model each rank holds.

Every estimator takes a `Layout` and a `GPTConfig`; the checks that would otherwise be
repeated in each of them (degrees positive, tp dividing the heads and the vocabulary,
interleaving dividing the layers) run in `Layout.__post_init__` and `check_model`, each with
a hint saying what to change. The choices and checks themselves live in `plait.rules`,
shared with `plait train`, so an estimate is never of a layout training would refuse.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from plait.balance import balanced_counts
from plait.errors import PlaitError
from plait.models.config import GPTConfig
from plait.rules import (DTYPE_BYTES, PRECISIONS, RECOMPUTE, REDUCE_DTYPES, SCHEDULES,  # noqa: F401
                         check_combination, check_pipeline_shape, check_strategy_choices,
                         check_tensor_parallel, default_reduce_dtype)


@dataclass(frozen=True)
class Layout:
    """Degrees of parallelism and the per-step shape of the work."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    offload: bool = False
    precision: str = "fp32"
    micro_batch: int = 1
    grad_accum: int = 1  # micro-batches per optimizer step (the pipeline's m)
    seq_len: int = 1024
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sp: bool = False
    reduce_dtype: str = ""  # "" = default_reduce_dtype(precision)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "micro_batch", "grad_accum", "seq_len", "virtual_stages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = name.replace("_", "-")
                raise PlaitError(f"--{flag} must be a whole number of at least 1, got {value!r}",
                                 hint=f"pass --{flag} 1 or more")
        check_strategy_choices(schedule=self.schedule, precision=self.precision, recompute=self.recompute,
                               zero=self.zero, reduce_dtype=self.reduce_dtype)
        check_combination(tp=self.tp, pp=self.pp, zero=self.zero, offload=self.offload, sp=self.sp,
                          recompute=self.recompute, schedule=self.schedule)
        check_pipeline_shape(None, pp=self.pp, virtual_stages=self.virtual_stages, schedule=self.schedule,
                             microbatches=self.grad_accum)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step, across all data-parallel replicas."""
        return self.dp * self.micro_batch * self.grad_accum

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of parameters, activations and gradients on the device."""
        return 4 if self.precision == "fp32" else 2

    @property
    def reduce_bytes(self) -> int:
        """Bytes per element of a gradient on the data-parallel wire."""
        return DTYPE_BYTES[self.reduce_dtype or default_reduce_dtype(self.precision)]

    def check_model(self, config: GPTConfig) -> None:
        """Raise unless plait can train `config` in this layout: the same checks as
        `plait train` (plait.rules): tp across heads, KV heads, vocabulary and MLP (the
        sequence too under SP), pp x virtual stages across the layers."""
        check_tensor_parallel(config, self.tp, self.sp, self.seq_len)
        check_pipeline_shape(config.n_layers, pp=self.pp, virtual_stages=self.virtual_stages,
                             schedule=self.schedule, microbatches=self.grad_accum)


@dataclass(frozen=True)
class StageShare:
    """What one rank of one pipeline stage holds, after tensor parallelism."""

    index: int
    pp: int
    layers: int
    block_params: int  # one transformer block's parameters on this rank
    params: int  # everything this rank holds: blocks, plus embedding or head
    replicated_params: int  # not sharded by tp (norms): their grads need a tp sync under SP

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.pp - 1


def block_split(config: GPTConfig) -> tuple[int, int]:
    """(parameters a tp shard divides, parameters every tp rank keeps whole) of one block.

    Megatron splits q/k/v, gate/up by columns and o/down by rows; norms (and the biases of
    row-parallel layers in GPT-2) are replicated.
    """
    h, f, kv = config.d_model, config.ffn_hidden, config.kv_dim
    if config.arch == "gpt2":
        sharded = h * (h + 2 * kv) + (h + 2 * kv) + h * h + 2 * h * f + f
        return sharded, config.layer_params() - sharded
    sharded = 2 * h * h + 2 * h * kv + 3 * h * f
    return sharded, config.layer_params() - sharded


def vocab_shard(config: GPTConfig, tp: int) -> int:
    """Rows of a vocab-parallel embedding on one rank (check_model makes tp divide the vocabulary)."""
    return config.vocab_size // tp


@functools.lru_cache(maxsize=4096)
def stages(config: GPTConfig, tp: int, pp: int, virtual_stages: int = 1) -> tuple[StageShare, ...]:
    """Every pipeline rank's share of the model on one of its tp ranks.

    The first rank holds the token embedding (and GPT-2's learned positions); the last
    holds the final norm and the output head. With tied embeddings and pp > 1 the last
    rank keeps its own copy of the embedding matrix for the head, as plait's pipeline does.
    """
    sharded, replicated = block_split(config)
    block = sharded // tp + replicated
    h = config.d_model
    table = vocab_shard(config, tp) * h
    first = table + (config.max_seq_len * h if config.arch == "gpt2" else 0)
    norm = 2 * h if config.arch == "gpt2" else h
    head = table if (not config.tie_embeddings or pp > 1) else 0
    if virtual_stages > 1 or pp == 1:  # interleaving cuts equal chunks, v per rank
        counts = [config.n_layers // pp] * pp
    else:  # the cut plait's pipeline makes (parallel/pipeline/split.py: default_balance)
        counts = balanced_counts([block] * config.n_layers, pp, first_extra=first, last_extra=norm + head)
    out = []
    for index, layers in enumerate(counts):
        params, repl = layers * block, layers * replicated
        if index == 0:
            params += first
        if index == pp - 1:
            params, repl = params + norm + head, repl + norm
        out.append(StageShare(index, pp, layers, block, params, repl))
    return tuple(out)
