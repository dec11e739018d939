"""The framework that runs a layout, as far as its cost depends on it (`--stack`).

Two runs of one layout on one machine differ in time when their frameworks launch other
kernels or overlap other work. The time model reads these facts:

* `attention`: "fused", one kernel that never writes the a·s·s scores (SDPA, FlashAttention;
  plait's GPT); or "eager", QKᵀ, the softmax, its dropout and ·V as separate kernels, each
  pass over the scores a memory-bound read or write (GPT-2 and Megatron-LM before
  FlashAttention).
* `dropout`: whether attention and hidden dropout run: their masks are written and read.
* `elementwise`: whose norms, activations and residual adds. "plait" counts plait's own GPT
  op by op (ops.py, measured with a dispatch hook); "megatron" counts Megatron-LM's GPT,
  whose LayerNorm, bias-GeLU and bias-dropout-add are each one fused kernel.
* `dp_overlap`: whether gradients are reduced behind backward, bucket by bucket (plait,
  PyTorch DDP, Megatron-Core's --overlap-grad-reduce), or in one collective after it
  (Megatron-LM of 2021: `allreduce_gradients()` after the schedule, in megatron/training.py).
  Without it, data parallelism overlaps nothing: ZeRO-3's gathers are exposed too.
* `gather_overlap`: whether ZeRO-1/2's updated weights are all-gathered behind the next
  step's forward, bucket by bucket (Megatron-Core's --overlap-param-gather), or after the
  step (plait).
* `tp_overlap`: whether tensor parallelism's all-gathers and reduce-scatters (with sequence
  parallelism) run beside the GEMMs they feed, each cut in pieces so that one moves while
  the GEMM works on another (Transformer Engine's userbuffers: NeMo's ub_tp_comm_overlap,
  Megatron-LM's --tp-comm-overlap), or between them (plait; Megatron-Core by default).
* `accumulate_bytes`: what adding each further micro-batch's gradient into the kept one
  moves, per parameter. None is autograd's `+=` in the gradient's own dtype (read both,
  write one, for every micro-batch but the first: plait); Megatron-LM of 2021 adds each
  micro-batch's fp16 gradients into fp16 `main_grad` (6); DeepSpeed's bf16 optimizer adds
  bf16 gradients into fp32 (2 + 4 + 4 = 10); Megatron-Core fuses the addition into the
  weight-gradient GEMM (0).

plait's own is the default. The others are there so that a published run is priced as it
ran (benchmarks/gpu_presets.py), and so that a user can ask what a layout costs elsewhere.
Each also says what it can run (`Reach`): a layout it cannot is refused in one line, so an
estimate never prices, and `plait plan --stack` never proposes, what that framework could
not train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plait.errors import PlaitError
from plait.rules import CP_KINDS, RECOMPUTE, SCHEDULES, ZERO_STAGES, check_choice


@dataclass(frozen=True)
class Reach:
    """What a framework runs, of what plait's layouts name (plait runs all of it)."""

    schedules: tuple[str, ...] = SCHEDULES
    zero: tuple[int, ...] = ZERO_STAGES
    recompute: tuple[str, ...] = RECOMPUTE
    sp: bool = True
    cp_kinds: tuple[str, ...] = CP_KINDS
    ep: bool = True
    dp_shard: bool = True
    offload: bool = True
    compiled: bool = True  # plait's --compile: its blocks' element-wise work as the compiler fuses it


@dataclass(frozen=True)
class Stack:
    name: str
    attention: str  # "fused" or "eager"
    dropout: bool
    elementwise: str  # "plait" or "megatron"
    dp_overlap: bool
    gather_overlap: bool
    accumulate_bytes: float | None
    source: str
    reach: Reach = field(default_factory=Reach)
    tp_overlap: bool = False
    # "plait": the loss keeps the logits in the compute dtype, their fp32 copy and the fp32
    # log-softmax (torch's cross_entropy on upcast logits); "fused": a fused cross-entropy
    # kernel that keeps the logits alone and writes their gradient in place (flash-attn's)
    loss: str = "plait"


# Megatron-LM of 2021 had neither a distributed optimizer, sequence parallelism nor selective
# recompute (all 2022), nor context or expert parallelism; DeepSpeed's pipeline engine runs
# 1F1B, and BLOOM's bf16 optimizer is its ZeRO-1; Megatron-Core adds the distributed optimizer
# (ZeRO-1), SP, selective recompute, ring context parallelism and experts.
_MEGATRON_2021 = Reach(schedules=("1f1b", "interleaved"), zero=(0,), recompute=("none", "full"), sp=False,
                       cp_kinds=(), ep=False, dp_shard=False, offload=False, compiled=False)
_MEGATRON_DEEPSPEED = Reach(schedules=("1f1b",), zero=(0, 1), recompute=("none", "full"), sp=False, cp_kinds=(),
                            ep=False, dp_shard=False, offload=False, compiled=False)
_MEGATRON_CORE = Reach(schedules=("1f1b", "interleaved"), zero=(0, 1), cp_kinds=("ring",), dp_shard=False,
                       offload=False, compiled=False)
# llm-foundry trains under Composer's FSDP: NO_SHARD, SHARD_GRAD_OP and FULL_SHARD (ZeRO 0, 2, 3),
# activation checkpointing of whole blocks, HYBRID_SHARD; no pipeline, sequence, context or expert split.
_LLM_FOUNDRY = Reach(schedules=(), zero=(0, 2, 3), recompute=("none", "full"), sp=False, cp_kinds=(), ep=False,
                     offload=False, compiled=False)


STACKS: dict[str, Stack] = {s.name: s for s in (
    Stack("plait", "fused", False, "plait", True, False, None,
          "plait's GPT: SDPA, no dropout, buckets reduced behind backward"),
    Stack("megatron-2021", "eager", True, "megatron", False, False, 6.0,
          "Megatron-LM as of Narayanan et al. 2021 (commit a8d172b, April 2021): baddbmm, the fused "
          "scale-mask-softmax, dropout 0.1 (its default), bmm; apex LayerNorm, bias-GeLU and "
          "bias-dropout-add fused; gradients added into fp16 main_grad; the local DDP all-reduces "
          "that buffer after the schedule", _MEGATRON_2021),
    Stack("megatron-deepspeed", "eager", True, "megatron", False, False, 10.0,
          "BigScience's Megatron-DeepSpeed (BLOOM, 2022): Megatron-LM's GPT of 2021 (no dropout "
          "flags in tr11's script: its default 0.1) under DeepSpeed's pipeline engine, which "
          "reduces gradients after the schedule; its bf16 optimizer adds them into fp32", _MEGATRON_DEEPSPEED),
    Stack("megatron-core", "fused", False, "megatron", True, True, 0.0,
          "Megatron-Core with Transformer Engine: fused attention, fused norms and activations, "
          "no dropout, gradient accumulation fused into the GEMMs, --overlap-grad-reduce and "
          "--overlap-param-gather", _MEGATRON_CORE),
    Stack("nemo", "fused", False, "megatron", True, True, 0.0,
          "NeMo on Megatron-Core and Transformer Engine, as NVIDIA's launcher trains Nemotron-4 15B "
          "(NeMo-Framework-Launcher, conf/training/nemotron/nemotron_15b.yaml: mcore_gpt, "
          "transformer_engine, ub_tp_comm_overlap, overlap_grad_sync, overlap_param_sync, "
          "distributed_fused_adam): megatron-core's kernels and overlaps, and tp's collectives "
          "overlapped with the GEMMs they feed (with sequence parallelism)", _MEGATRON_CORE, tp_overlap=True),
    Stack("llm-foundry", "fused", False, "plait", True, False, None,
          "llm-foundry's MPT (ComposerMPTCausalLM) under Composer's FSDP: flash attention, no dropout, "
          "and flash-attn's fused cross-entropy, its default loss_fn 'fused_crossentropy', which keeps "
          "the logits alone (its element-wise time priced as plait's loss)", _LLM_FOUNDRY, loss="fused"),
)}


def check_stack_name(name: str) -> None:
    """--stack names one of STACKS."""
    check_choice("stack", name, tuple(STACKS))


def check_stack(layout: Any) -> None:
    """A known stack, and a layout its framework can run, each refused in one line otherwise
    (Workload runs this)."""
    check_stack_name(layout.stack)
    stack = STACKS[layout.stack]
    reach = stack.reach
    lacks = [what for what, runs in (
        (f"the {layout.schedule} schedule" if reach.schedules else "pipeline parallelism",
         layout.pp == 1 or layout.schedule in reach.schedules),
        (f"ZeRO stage {layout.zero}", layout.zero in reach.zero),
        (f"{layout.recompute} recomputation", layout.recompute in reach.recompute),
        ("sequence parallelism", reach.sp or not layout.sp),
        (f"{layout.cp_kind} context parallelism", layout.cp == 1 or layout.cp_kind in reach.cp_kinds),
        ("expert parallelism", reach.ep or layout.ep == 1),
        ("--dp-shard", reach.dp_shard or not layout.dp_shard),
        ("--offload", reach.offload or not layout.offload),
        ("--compile (plait's compiled blocks)", reach.compiled or not layout.compiled)) if not runs]
    if lacks:
        raise PlaitError(f"--stack {stack.name} has no {lacks[0]}",
                         hint="price this layout on --stack plait, or change it to one that framework runs")


# Megatron-LM's GPT block, elements read plus written per token on one tensor-parallel rank
# (each 2 bytes in 16-bit), as (replicated h, h/t, kv/t, f/t) coefficients like ops.EW_FWD:
#   forward: LayerNorm ×2 (2h each), bias-dropout-add ×2 (x, residual, out, and a one-byte
#     mask: 3.5h each; 3h without dropout); the QKV bias added after the GEMM (2(h + 2kv)/t);
#     the attention output's permute to [s, b, h] (2h/t); bias-GeLU (2f/t).
#   backward: bias-dropout-add ×2 (grad, mask, out and the bias's sum: 3.5h; 2h without
#     dropout), the residual's two gradients summed ×2 (3h), LayerNorm ×2 (grad, input, out,
#     then both again for the weight's: 5h); the QKV bias's sum ((h + 2kv)/t), the split's
#     backward writing q, k, v's gradients into one tensor (2(h + 2kv)/t), the permute's
#     (2h/t); bias-GeLU's (grad, input, out, the bias's sum: 4f/t).
MEGATRON_EW = {True: ((11.0, 4, 4, 2), (23.0, 5, 6, 4)), False: ((10.0, 4, 4, 2), (20.0, 5, 6, 4))}

# Passes over the a·s·s scores per token of eager attention, in score elements of the
# activation dtype (a/t heads × s keys per query): forward, the baddbmm's write, the
# softmax's read and write, dropout's read, write and one-byte mask, the ·V's read (6.5; 4
# without dropout); backward, the ·V's two products (the scores' gradient written, the
# probabilities read), dropout's backward (2.5), the softmax's (grad, output, its gradient:
# 3), QKᵀ's two products reading the gradient (2): 9.5, 7 without dropout.
EAGER_SCORE_PASSES = {True: (6.5, 9.5), False: (4.0, 7.0)}
