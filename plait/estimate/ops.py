"""Seconds of compute per micro-batch, operation by operation: a roofline per GEMM, the
attention core, element-wise work by the bytes it moves, and the optimizer step by bytes.

Every cost is max(FLOPs / rate, bytes / memory bandwidth) + a fixed cost per launched op
(eager PyTorch's dispatch on a CPU, a kernel launch on a GPU, which hides behind work there):
* GEMM (M×K·K×N): rate = the measured TFLOP/s of that very shape and dtype when the hardware
  file has it (`plait calibrate` measures the model's own), else peak · compute_efficiency,
  the fraction large GEMMs reach. Backward runs the two GEMMs (M×N·N×K for the input's
  gradient, K×M·M×N for the weight's). Bytes: A, B and C once.
* Attention core (QKᵀ, softmax, ·V, fused as torch's scaled_dot_product_attention is):
  2·T·s·(w_q + w_o)/t FLOPs forward (4·T·s·h where q and the output are h wide; a latent
  attention's q wider, its output narrower: `attention_core_flops`), as many times as a block
  calls its attention, twice that backward, at the measured attention rate, else
  peak · attention_efficiency.
* Element-wise (norms, RoPE, SiLU·mul, residual adds, the loss's softmax): memory-bound, at
  the bandwidth measured for an op of one activation's size (small ops reach less of it).
  Elements read plus written per token per block, counted over plait's GPT with a torch
  dispatch hook (fp32, small variants): forward 31h + 8kv + 5f, backward 69h + 13kv + 11f
  (the norms' and SwiGLU's backward recompute what their forward did not keep:
  plait/models/gpt/lean.py); around the blocks 8h + 3.25V forward, 23h + 6.5V backward. In
  16-bit the norms run in fp32 (x.float(), x², the mean, the scaling, back to 16-bit), so a
  block moves more: counted in 2-byte units, forward 53h + 8kv + 5f, backward 119h + 13kv + 11f
  (tests/test_elementwise_census.py holds both sets to the hook's count). Forward launches 31 compute
  ops and 36 views per block (backward 49 and 69); around the blocks 9 + 9 and 19 + 13. Where
  the block's down projection gets its input, SwiGLU's gated product, made again in backward
  rather than kept (plait's lean block, eager: models/gpt/lean.gated_down), backward moves 3f
  more (the product; the gate's backward reads the silu made for it) in 1 more op, and each
  pass 3 more views, for each product made again (`activations.remakes_product`; an MoE block
  of plait's with shared experts makes two: `remade_calls`). Under ZB-H1, whose W makes again what
  one backward makes once, backward moves 5f more where the product is made again (its silu
  too: I's gate backward spent the one made for it) and each of plait's norms 2h more in fp32
  (7h in 16-bit: the normalised values for the scale's gradient).
* Gradient accumulation: each micro-batch after the first adds its gradients into the kept
  ones (autograd's +=: 3 × the gradient's bytes a parameter, m - 1 times a step; or the
  stack's figure, m times, into its own buffer), over what the rank keeps between
  micro-batches, counted in the step's compute.
* The update, as the step guard runs it: one read of every gradient (4 bytes per fp32
  parameter) gives each piece's fp64 sum of squares, which serves both the finite check and
  the clipping norm; clipping scales the gradients in place (8); torch's AdamW (per-tensor
  loop) moves 84; zeroing writes 4.
  Bytes over the update's rate, which `plait calibrate` measures on this very update at the
  model's size (up to a cap past the caches) and keys by that size, so the rate also pays for
  what the byte count leaves out (temporaries).
  Fixed costs: `optimizer_tensor_us` per tensor AdamW steps, `grad_tensor_us` per gradient
  piece checked and clipped (under ZeRO the optimizer steps a flat shard, but the checks
  walk each parameter's owned piece). On a GPU these host costs overlap the device's pass
  (the longer of the two counts); on a CPU they add. The verdict and the norm are
  all-reduced (time.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from plait.estimate.activations import products_remade_at, remakes_product
from plait.estimate.experts import dense_width, expert_units_on_rank, routed_and_shared_widths, routed_rows
from plait.estimate.hardware import Hardware, relative_line
from plait.estimate.layout import Workload, StageShare
from plait.estimate.stacks import EAGER_SCORE_PASSES, MEGATRON_EW
from plait.models.gpt.config import GPTConfig
from plait.rules import FLOAT8_TILE

EW_FWD = (31, 8, 5)  # elements per token per block: coefficients of h, kv, f
EW_BWD = (69, 13, 11)
EW_FWD_16 = (53, 8, 5)  # the same in 16-bit, in 2-byte units: the norms' fp32 passes included
EW_BWD_16 = (119, 13, 11)
EW_REMADE = 3  # backward elements a token per MLP unit where down's input is made again: silu(gate) · up,
# its silu then spared the gate's backward
OPS_REMADE = ((0, 3), (1, 3))  # its ops and views a block: forward, backward
# ZB-H1's W (parallel/pipeline/execute.py) makes again what a whole backward makes once, in
# plait's block: each norm's normalised values, for its scale's gradient (x·rstd: 2h elements
# a norm in fp32; 7h 2-byte units in 16-bit, with x's fp32 copy), two norms a block and the
# final one around them; and, where the block makes the gated product again (EW_REMADE, in I),
# the product once more for down's weight gradient, silu(gate) with it, which I's gate backward
# has spent (5f: silu reads and writes f, the product reads 2f and writes f).
EW_SPLIT_NORM = {4: 2, 2: 7}  # elements (bytes a value: 2-byte units in 16-bit) a norm, coefficients of h
EW_REMADE_W = 5
OPS_SPLIT_NORM = {4: 1, 2: 2}  # its ops a norm (the multiplication; in 16-bit the fp32 copy too)
OPS_REMADE_W = (2, 1)  # silu and the product, and the product's view
EW_OUTER = ((8, 3.25), (23, 6.5))  # around the blocks: (h, V) forward, backward
OPS_BLOCK = ((31, 36), (49, 69))  # (compute ops, views) per block: forward, backward
OPS_OUTER = ((9, 9), (19, 13))
# A block whose forward is compiled (plait train --compile): elements of the run's dtype per
# token that the compiler's own kernels read and write (fused norms, RoPE, SiLU·mul, residual
# adds; the inductor's count of each kernel's buffers, tests/test_elementwise_census.py), as
# (replicated h, h/t, kv/t, f/t) coefficients, the same in fp32 and 16-bit (a kernel keeps
# its fp32 intermediates in registers); and the kernels it launches (7 each way, no views).
EW_COMPILED = ((12, 0, 1.3, 3), (22, 0, 1.3, 5))
OPS_COMPILED = ((7, 0), (7, 0))
# fp8's casts (torchao's Float8Linear, tensorwise), beyond bf16's element-wise work, by whether
# the block is compiled: ((forward, backward) 2-byte elements a token as (h, kv, f)
# coefficients, (forward, backward) bytes a weight element of the linears it converts). Counted
# on the CPU (tests/test_elementwise_census.py): eager, each cast of an element moves 33 bytes
# (its amax, scale, clamp and cast as separate ops) and q, k and v cast their one input three
# times; compiled, the amaxes and casts fuse with the work beside them.
FP8_CASTS = {False: (((99, 0, 16.5), (198, 66, 82.5)), (33, 33)),
             True: (((6.5, 0, 1.5), (18.5, 8, 10)), (5, 3))}
# Ulysses' reorderings around each attention (plait.parallel.context.ulysses): q, k, v and the
# output each made contiguous for its all-to-all, put back in heads' layout and in sequence
# order, and the reverse in backward. Elements of the run's dtype a token of this rank, as
# (h/t, kv/t) coefficients, forward and backward (tests/test_elementwise_census.py counts them);
# kv is h where cp does not divide a rank's K/V heads (repeated up to the query heads first).
ULYSSES_EW = ((16.3, 16), (21, 7.4))
ADAM_BYTES = 84  # per fp32 parameter
NORM_BYTES, CLIP_BYTES, ZERO_GRAD_BYTES = 4, 8, 4
UPDATE_BYTES = NORM_BYTES + CLIP_BYTES + ADAM_BYTES  # what the calibrated update moves
TENSORS_PER_BLOCK = 9


@dataclass(frozen=True)
class Gemm:
    m: int
    k: int
    n: int
    float8: bool = True  # under --precision fp8, a product fp8 runs in float8 (`linear`); else bf16

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n

    def backward(self) -> tuple["Gemm", "Gemm"]:
        """Input gradient (M×N·N×K) and weight gradient (K×M·M×N)."""
        return Gemm(self.m, self.n, self.k, self.float8), Gemm(self.k, self.m, self.n, self.float8)


def linear(tokens: int, k: int, n: int, converted: bool = True) -> Gemm:
    """The forward product of a (k -> n) linear layer on `tokens` rows: float8 under --precision
    fp8 where fp8 converts the layer (a plain linear, `converted`, whose weight fits the float8
    tile, rules.FLOAT8_TILE), bf16 otherwise, its backward products alike."""
    return Gemm(tokens, k, n, converted and k % FLOAT8_TILE == 0 and n % FLOAT8_TILE == 0)


def gemm_precision(g: Gemm, precision: str) -> str:
    """The dtype `g` runs in under `precision`: fp8's products where fp8 converts their layer
    (Gemm.float8), bf16 for the rest of an fp8 run."""
    return precision if precision != "fp8" or g.float8 else outer_precision(precision)


def dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def gemm_key(g: Gemm, precision: str) -> str:
    """How a measured GEMM is named in a hardware file: 'fp32 2048x384x1152' (fp8's products
    have their own rates: a bf16 measurement does not stand for them)."""
    return f"{precision if precision in ('fp32', 'fp8') else 'bf16'} {g.m}x{g.k}x{g.n}"


def outer_precision(precision: str) -> str:
    """The precision of what `--precision fp8` leaves in bf16 (the head, attention, norms)."""
    return "bf16" if precision == "fp8" else precision


def block_gemms(config: GPTConfig, tokens: int, tp: int, moe: bool = False, ep: int = 1) -> list[Gemm]:
    """One block's forward GEMMs on one tensor-parallel rank (columns or rows split by t): a
    dense block's, or with `moe` an MoE block's (`moe_gemms`)."""
    h, kv, f = config.d_model, config.kv_dim, config.ffn_hidden
    if config.arch == "gpt2":
        return [linear(tokens, h, (h + 2 * kv) // tp), linear(tokens, h // tp, h),
                linear(tokens, h, f // tp), linear(tokens, f // tp, h)]
    a = config.attention_tp(tp)  # a region the model's plan leaves whole runs whole
    q, k, v, out = config.attention_widths  # q, k, v and the output as the attention is handed them
    attention = [linear(tokens, h, q // a), linear(tokens, h, k // a), linear(tokens, h, v // a),
                 linear(tokens, out // a, h)]
    if moe:
        return attention + moe_gemms(config, tokens, tp, ep)
    m = tp if config.tp_mlp else 1
    up = [linear(tokens, h, f // m)] * (config.mlp_params // (h * f) - 1)  # gate and up, or up alone (relu², GELU)
    return attention + [*up, linear(tokens, f // m, h)]


def moe_gemms(config: GPTConfig, tokens: int, tp: int, ep: int = 1) -> list[Gemm]:
    """An MoE block's MLP: the router, then the rows its routed experts compute (top_k a token,
    or every expert on every token: experts.routed_rows; under ep, uniform routing brings a
    rank as many rows as its own tokens make) as one grouped SwiGLU, and its shared experts'
    SwiGLU on every token. Whole on every tp rank, unless the model's plan splits the experts
    (GPTConfig.tp_expert_rows, without ep). The routed experts are grouped weights, not
    linears: fp8 leaves them bf16."""
    h, width = config.d_model, config.expert_width
    split = tp if config.routed_split_by_tp(ep) else 1
    rows = tokens * routed_rows(config)
    gemms = [linear(tokens, h, config.experts)] + [linear(rows, h, width // split, converted=False)] * 2 + [
        linear(rows, width // split, h, converted=False)]
    if config.shared_width:
        shared = config.shared_width // (tp if config.shared_split_by_tp(ep) else 1)
        gemms += [linear(tokens, h, shared), linear(tokens, h, shared), linear(tokens, shared, h)]
    return gemms


def head_gemm(config: GPTConfig, tokens: int, tp: int) -> Gemm:
    return Gemm(tokens, config.d_model, -(-config.vocab_size // tp), float8=False)  # fp8 leaves the head bf16


ROWS = 0  # a forward product's tokens are its M rows (`linear`), and its input gradient's
WEIGHT_ROWS = 1  # its weight gradient's are its K (Gemm.backward)


def gemm_s(g: Gemm, precision: str, hw: Hardware, rows_axis: int | None = None) -> float:
    """One GEMM: measured rate of its shape if known, else the roofline, in the dtype it runs
    in (`gemm_precision`). `rows_axis`: which dimension (ROWS: M, WEIGHT_ROWS: K) holds the
    micro-batch's tokens; its measured rate is then read off its family's line
    (`Hardware.rows_tflops`)."""
    precision = gemm_precision(g, precision)
    key = gemm_key(g, precision)
    measured = hw.gemm_tflops(key) if rows_axis is None else hw.rows_tflops(key, rows_axis)
    if measured:  # a CPU's timing holds its dispatch; a GPU's queued one does not: its host launch is added
        return g.flops / (measured * 1e12) + (hw.op_overhead_us * 1e-6 if hw.queues_kernels else 0.0)
    moved = (g.m * g.k + g.k * g.n + g.m * g.n) * dtype_bytes(precision)
    compute = g.flops / (hw.peak_flops(precision) * hw.compute_efficiency) + hw.gemm_fixed_us * 1e-6
    return max(compute, moved / hw.memory_bytes_per_s) + hw.op_overhead_us * 1e-6


def fit_gemm_line(measured: dict[str, float]) -> tuple[float, float] | None:
    """(TFLOP/s, fixed µs) of the line time = fixed + FLOPs / rate through measured GEMMs
    ({"bf16 MxKxN": TFLOP/s}), by least squares on their relative errors: what a shape no one
    measured is charged, so that a calibration read for another model's GEMMs interpolates
    between the sizes it saw instead of handing the largest one's rate to every shape.

    None where no line can be trusted: fewer than FIT_SPAN between the smallest and the
    largest product's FLOPs (a model's launch-bound GEMMs, all of a size, set a rate by their
    noise: 0.8 to 374 TFLOP/s over six seeds of 3% noise on `tiny`'s shapes), or a fit with
    no positive rate or a negative fixed part."""
    points = []
    for key, tflops in measured.items():
        m, k, n = (int(x) for x in key.split()[1].split("x"))
        flops = 2.0 * m * k * n
        points.append((flops, flops / (tflops * 1e12)))
    if not points or max(f for f, _ in points) < FIT_SPAN * min(f for f, _ in points):
        return None
    slope, fixed = relative_line(points)
    if slope <= 0 or fixed < 0:
        return None
    return 1.0 / slope / 1e12, fixed * 1e6


FIT_SPAN = 10.0  # the largest measured GEMM's FLOPs over the smallest's, at least, to fit a line


def activation_op_bytes(d_model: int, tokens: int, tp: int, sp: bool, precision: str) -> float:
    """What one element-wise op on an activation writes on a rank (tokens this rank computes,
    the hidden width, cut by tp under sp): the size memory_rate is read at, and the size the
    calibration measures the bandwidth at."""
    return tokens * (d_model / tp if sp else d_model) * dtype_bytes(precision)


def attention_key(config: GPTConfig, micro_batch: int, seq: int, tp: int, precision: str) -> str:
    """How a measured attention core is named: 'attn fp32 b8 a3 s128 d64' (heads per rank)."""
    dtype = "fp32" if precision == "fp32" else "bf16"
    return f"attn {dtype} b{micro_batch} a{config.n_heads // tp} s{seq} d{config.head_dim}"


def ring_key(config: GPTConfig, seq: int, tp: int, cp: int, precision: str) -> str:
    """How one rank's compute of ring attention over cp ranks is named (its calls on blocks of
    s/(2cp) tokens, their merges and accumulations; the transfers are priced apart), by what
    sets its rate, the blocks' shape, not the batch: 'ring fp32 a3 s128 d64 cp2'."""
    dtype = "fp32" if precision == "fp32" else "bf16"
    return f"ring {dtype} a{config.n_heads // tp} s{seq} d{config.head_dim} cp{cp}"


def attention_core_flops(config: GPTConfig, queries: float, seq: int) -> float:
    """Forward FLOPs of a mean block's attention core for `queries` queries, each against `seq`
    keys, on one rank holding every head: QKᵀ at q's width and ·V at the output's, 2·s·(w_q + w_o)
    a query (4·h·s where both are h: GPTConfig.attention_widths), as many times as a mean block
    calls its attention (GPTConfig.block_attention_calls: DiffLlama's two, a hybrid's share of
    blocks that run softmax attention). The causal mask is not discounted. The one home of the
    count: the model's FLOPs (time.flops_per_token) and the attention's time both read it."""
    q, _, _, out = config.attention_widths
    return 2.0 * queries * seq * (q + out) * config.block_attention_calls


def attention_s(config: GPTConfig, layout: Workload, passes: float) -> tuple[float, float]:
    """(FLOPs, key) of the attention core for `passes` forward-equivalents on one block (a mean
    block: a hybrid's blocks without softmax attention have none, GPTConfig.attention_share)."""
    tokens = layout.tokens_per_micro_batch  # this rank's queries, each against the whole sequence
    flops = attention_core_flops(config, tokens, layout.seq_len) / config.attention_tp(layout.tp) * passes
    return flops, attention_key(config, layout.micro_batch, layout.seq_len, layout.tp,
                                outer_precision(layout.precision))


def attention_time(config: GPTConfig, layout: Workload, hw: Hardware, forwards: float,
                   backwards: float = 0.0) -> float:
    """The attention core of one block, run `forwards` times forward (a recompute's included)
    and `backwards` times backward (two forwards' FLOPs each): fused, at its measured rate or
    attention_efficiency of peak; eager (`--stack`), its products as GEMMs plus its passes over
    the scores."""
    flops, key = attention_s(config, layout, forwards + 2 * backwards)
    peak = hw.peak_flops(outer_precision(layout.precision))
    if layout.software.attention == "eager":
        return flops / (peak * hw.compute_efficiency) + eager_scores_s(config, layout, hw, forwards, backwards)
    if layout.cp > 1 and layout.cp_kind == "ring":  # its small calls and merges, at their measured rate
        ring = hw.gemm_tflops(ring_key(config, layout.seq_len, layout.tp, layout.cp, outer_precision(layout.precision)))
        if ring:
            return flops / (ring * 1e12)
    return flops / (hw.gemm_tflops(key) * 1e12 or peak * hw.attention_efficiency)


def eager_scores_s(config: GPTConfig, layout: Workload, hw: Hardware, forwards: float, backwards: float) -> float:
    """Eager attention's memory-bound passes over one block's a·s·s scores on one rank:
    stacks.EAGER_SCORE_PASSES for each forward and each backward."""
    forward, backward = EAGER_SCORE_PASSES[layout.software.dropout]
    scores = layout.tokens_per_micro_batch * (config.n_heads // config.attention_tp(layout.tp)) * layout.seq_len
    size = scores * dtype_bytes(layout.precision)
    passes = forward * forwards + backward * backwards
    return size * passes / hw.memory_rate(size) * config.block_attention_calls


def elementwise_s(config: GPTConfig, layout: Workload, hw: Hardware, layers: float,
                  outer: bool, backward: bool) -> float:
    """Memory-bound work: bytes moved over bandwidth, plus each op's fixed cost."""
    h, kv, t = config.d_model, config.kv_dim, layout.tp
    tokens = layout.tokens_per_micro_batch
    a, sliced, b, c = elementwise_counts(config, layout)[backward]
    replicated = h / t if layout.sp else h  # norms and residuals run on every tp rank
    units = mlp_units(config, layout)
    # c holds the remade product's elements over every MLP unit where the block remakes it
    # (`remakes_product`); the units it is made again over are `remade_units`
    remade = remade_elements(layout) * (remade_units(config, layout) - units * remakes_product(config, layout))
    per_token = layers * (a * replicated + sliced * h / t + b * kv / t + c * units + remade * backward
                          + ulysses_units(config, layout, backward))
    ops, views = block_ops(config, layout, backward)
    count, cheap = layers * ops, layers * views
    if outer:
        oh, ov = EW_OUTER[backward]
        norm = split_norm_elements(config, layout) if backward else 0
        per_token += (oh + norm) * h + ov * config.vocab_size / t
        count = count + OPS_OUTER[backward][0] + (OPS_SPLIT_NORM[dtype_bytes(layout.precision)] if norm else 0)
        cheap = cheap + OPS_OUTER[backward][1]
    moved = per_token * tokens * dtype_bytes(layout.precision)
    if layout.precision == "fp8":
        moved += fp8_cast_bytes(config, layout, layers, backward)
    op_bytes = activation_op_bytes(h, tokens, t, layout.sp, layout.precision)  # the typical op's write
    return moved / hw.memory_rate(op_bytes) + count * hw.op_overhead_us * 1e-6 + cheap * hw.view_overhead_us * 1e-6


def ulysses_units(config: GPTConfig, layout: Workload, backward: bool) -> float:
    """Elements a token of this rank Ulysses' reorderings move in one block (ULYSSES_EW), 0
    without it: measured on 2 CPU ranks, cp 2 with Ulysses ran 10% slower than predicted, its
    copies about twice dp 2's bytes (benchmarks/RESULTS.md, "planner-measured")."""
    if layout.cp == 1 or layout.cp_kind != "ulysses":
        return 0.0
    heads, kv_heads = config.n_heads // layout.tp, max(1, config.n_kv_heads // layout.tp)
    kv = config.kv_dim if kv_heads % layout.cp == 0 else config.d_model  # repeated up to the heads
    q_coef, kv_coef = ULYSSES_EW[backward]
    return (q_coef * heads * config.head_dim + kv_coef * kv / layout.tp)


def mlp_units(config: GPTConfig, layout: Workload) -> float:
    """Hidden units of the MLP a token's element-wise work runs over on one tp rank, averaged
    over the blocks: a dense block's ffn_hidden split by tp; an MoE block's routed rows' and
    shared experts' widths, each whole on every tp rank unless the plan splits it
    (experts.expert_units_on_rank), as the activations count them. Mixtral's two experts a
    token, each ffn_hidden wide, were priced as one."""
    whole, split = expert_units_on_rank(config, layout)
    return dense_width(config) / layout.tp + whole + split / layout.tp


def fp8_cast_bytes(config: GPTConfig, layout: Workload, layers: float, backward: bool) -> float:
    """Bytes fp8's casts move in `layers` blocks of one micro-batch (FP8_CASTS), forward or
    backward: each converted linear's input, output gradient and weight, taken to float8 by
    its own amax. The linears fp8 converts: attention's four and a dense MLP's, an MoE block's
    shared experts' (its routed experts are grouped weights, not linears: they stay bf16).
    tp is refused under fp8, so nothing here is split."""
    (forward, back), weight_bytes = FP8_CASTS[layout.compiled]
    a, b, c = back if backward else forward
    h, kv = config.d_model, config.kv_dim
    f = dense_width(config) + routed_and_shared_widths(config)[1]  # the routed experts stay bf16
    weights = 2 * h * h + 2 * h * kv + config.dense_mlp_matrices * h * f
    per_token = 2 * (a * h + b * kv + c * f)
    return layers * (per_token * layout.tokens_per_micro_batch + weight_bytes[backward] * weights)


def splits_backward(layout: Workload) -> bool:
    """Whether the schedule runs each backward as I and W (ZB-H1 over pp > 1)."""
    return layout.schedule == "zb-h1" and layout.pp > 1


def measured_split(layout: Workload, hw: Hardware) -> float:
    """A split micro-batch over a whole one as `hw` measured it at the layout's micro-batch
    (Hardware.split_backward); 0.0 where nothing is split or nothing was measured."""
    return hw.split_backward(layout.micro_batch) if splits_backward(layout) else 0.0


def split_norm_elements(config: GPTConfig, layout: Workload) -> float:
    """h coefficient of what ZB-H1's W makes again for one of plait's norms (EW_SPLIT_NORM), 0
    where nothing is split, or its norms are not plait's lean ones (a transformers norm is plain
    ops: the engine runs only the nodes each of I and W asks for)."""
    plain = layout.compiled or layout.software.elementwise == "megatron" or not config.lean_blocks
    return 0.0 if plain or not splits_backward(layout) else EW_SPLIT_NORM[dtype_bytes(layout.precision)]


def block_ops(config: GPTConfig, layout: Workload, backward: bool) -> tuple[float, float]:
    """(compute ops, views) one block launches, forward or backward: OPS_BLOCK (OPS_COMPILED
    compiled), plus OPS_REMADE for each gated product made again (`remade_calls`), and under
    ZB-H1 what W makes again in backward: each product once more (OPS_REMADE_W) and each of
    plait's norms' normalised values (OPS_SPLIT_NORM, two a block)."""
    ops, views = (OPS_COMPILED if layout.compiled else OPS_BLOCK)[backward]
    calls = remade_calls(config) if products_remade_at(layout) else 0
    ops, views = ops + calls * OPS_REMADE[backward][0], views + calls * OPS_REMADE[backward][1]
    if backward and splits_backward(layout):
        ops, views = ops + calls * OPS_REMADE_W[0], views + calls * OPS_REMADE_W[1]
        if split_norm_elements(config, layout):
            ops += 2 * OPS_SPLIT_NORM[dtype_bytes(layout.precision)]
    return ops, views


def remade_calls(config: GPTConfig) -> float:
    """The gated products a block makes again, averaged over the blocks: a dense block's one;
    an MoE block of plait's its routed experts' and, where it has them, its shared experts'
    (each its own gated_down call). A transformers model's dense MLPs and its MoE blocks'
    shared experts where plait gives them the remaking (GPTConfig.remade_products,
    remade_shared); its grouped experts keep their product."""
    moe = config.moe_layers / config.n_layers
    if config.lean_blocks:
        return (1 + (config.shared_width > 0) * moe) if config.dense_mlp_matrices == 3 else 0.0
    return (1 - moe) * config.remade_products + moe * config.remade_shared


def remade_elements(layout: Workload) -> float:
    """Backward's elements a token a unit of the products made again (EW_REMADE; under ZB-H1
    W makes each again, EW_REMADE_W)."""
    return EW_REMADE + EW_REMADE_W * splits_backward(layout)


def remade_units(config: GPTConfig, layout: Workload) -> float:
    """Hidden units a token's backward makes the gated product again over on one tp rank,
    averaged over the blocks: plait's lean block every MLP's (`mlp_units`: its dense MLP, its
    routed and its shared experts, gated_down each); a transformers model's dense MLPs and its
    MoE blocks' shared experts where plait gives them the remaking (GPTConfig.remade_products,
    remade_shared), not its grouped routed experts, which keep their product. Where the first
    dense block's MLP was remade, every unit had been priced so (DeepSeek's routed experts), and
    an MoE model without a dense block (Qwen2-MoE) had none priced. 0 where this layout runs no
    remade product."""
    if not products_remade_at(layout):
        return 0.0
    if config.lean_blocks:
        return mlp_units(config, layout) if config.dense_mlp_matrices == 3 else 0.0
    shared = routed_and_shared_widths(config)[1] / (layout.tp if config.shared_split_by_tp(layout.ep) else 1)
    dense = dense_width(config) / layout.tp if config.remade_products and config.dense_mlp_matrices == 3 else 0.0
    return dense + shared * config.remade_shared


def elementwise_counts(config: GPTConfig, layout: Workload) -> tuple[tuple[float, float, float, float], ...]:
    """(forward, backward) elements per token per block as (replicated h, h/t, kv/t, f/t)
    coefficients: plait's GPT (EW_FWD, EW_BWD; in 16-bit EW_FWD_16, EW_BWD_16, whose norms
    pass over fp32 copies), its compiled block's (EW_COMPILED: --compile, 3.6x fewer bytes at
    the 1 B GPT's shape), or the stack's (stacks.MEGATRON_EW, whose fused norms do not); backward's
    f term holds the gated product made again where `config`'s block makes it (EW_REMADE), and
    under ZB-H1 what its W makes again (EW_SPLIT_NORM, EW_REMADE_W)."""
    if layout.compiled:
        return EW_COMPILED
    software = layout.software
    if software.elementwise == "megatron":
        return MEGATRON_EW[software.dropout]
    forward, backward = (EW_FWD_16, EW_BWD_16) if dtype_bytes(layout.precision) == 2 else (EW_FWD, EW_BWD)
    remade = remade_elements(layout) if remakes_product(config, layout) else 0
    norms = 2 * split_norm_elements(config, layout)
    return ((forward[0], 0, *forward[1:]), (backward[0] + norms, 0, backward[1], backward[2] + remade))


def micro_batch_compute_s(config: GPTConfig, layout: Workload, stage: StageShare, hw: Hardware) -> float:
    """Forward + backward (+ recompute) of one micro-batch on one rank of `stage`.

    On a CPU the ops' fixed costs add to their work. A GPU's host queues kernels while the
    device runs earlier ones, so the pass takes the longer of the device's work and the
    host's dispatch: a large model's launches hide, a tiny one is bound by its host.

    ZB-H1's split backward on a host that measured it (Hardware.split_backward): the whole
    micro-batch's, times the measured ratio. What W makes again (`block_ops`) priced `small`'s
    micro-batch 2% over 1F1B's on a CPU; in a 4-rank pipeline each stage's micro-batch took 7-10%
    more CPU time (its I + W 10-14% over B): W's many small calls, not its bytes."""
    split = measured_split(layout, hw)
    priced = replace(layout, schedule="1f1b") if split else layout
    return (split or 1.0) * host_overlapped(hw, lambda profile: _work_and_dispatch_s(config, priced, stage, profile))


def host_overlapped(hw: Hardware, cost: Callable[[Hardware], float]) -> float:
    """`cost(hw)`, a pass's work plus each op's fixed cost, as the device runs it: summed on a
    CPU; on a GPU (queues_kernels) the longer of the device's work (the cost with no fixed
    costs) and the host's dispatch (the rest). The rule for every model's micro-batch."""
    total = cost(hw)
    if not hw.queues_kernels or not (hw.op_overhead_us or hw.view_overhead_us):
        return total
    device = cost(replace(hw, op_overhead_us=0.0, view_overhead_us=0.0))
    return max(device, total - device)


def block_gemm_s(config: GPTConfig, layout: Workload, hw: Hardware, moe: bool = False) -> tuple[float, float]:
    """(forward, backward) seconds of one block's GEMMs (an MoE block's with `moe`) in one
    micro-batch on one tp rank."""
    return _block_gemm_s(config, layout.tokens_per_micro_batch, layout.tp, layout.precision, hw, moe, layout.ep)


@functools.lru_cache(maxsize=4096)
def _block_gemm_s(config: GPTConfig, tokens: int, tp: int, precision: str, hw: Hardware, moe: bool = False,
                  ep: int = 1) -> tuple[float, float]:
    """block_gemm_s, remembered: a plan prices thousands of layouts that share a few shapes
    (every argument is a frozen value, so equal arguments give equal seconds)."""
    # math.fsum, not sum: Python 3.12's sum compensates and 3.10's does not, and the torch-free
    # estimate must print the same digits on both.
    gemms = block_gemms(config, tokens, tp, moe, ep)
    fwd = math.fsum(gemm_s(g, precision, hw, ROWS) for g in gemms)
    bwd = math.fsum(products_back_s(g, precision, hw) for g in gemms)
    return fwd, bwd


def products_back_s(g: Gemm, precision: str, hw: Hardware) -> float:
    """Seconds of the two backward products of `g`, a forward product on a micro-batch's
    tokens, each read along the dimension that holds the tokens."""
    into_input, into_weight = g.backward()
    return gemm_s(into_input, precision, hw, ROWS) + gemm_s(into_weight, precision, hw, WEIGHT_ROWS)


def blocks_rerun(layout: Workload) -> float:
    """Forwards of the blocks' GEMMs run again in backward: one under full recomputation."""
    return {"none": 0.0, "selective": 0.0, "full": 1.0}[layout.recompute]


def stage_gemm_s(config: GPTConfig, layout: Workload, layers: float, hw: Hardware) -> float:
    """Seconds of `layers` blocks' GEMMs in one micro-batch on one tp rank: forward, the
    recomputed forward, backward; MoE blocks in the model's share of them."""
    moe = config.moe_layers / config.n_layers
    fwd, bwd = block_gemm_s(config, layout, hw)
    if moe:
        moe_fwd, moe_bwd = block_gemm_s(config, layout, hw, moe=True)
        fwd, bwd = (1 - moe) * fwd + moe * moe_fwd, (1 - moe) * bwd + moe * moe_bwd
    return layers * ((1 + blocks_rerun(layout)) * fwd + bwd)


def _work_and_dispatch_s(config: GPTConfig, layout: Workload, stage: StageShare, hw: Hardware) -> float:
    """micro_batch_compute_s's sum of every op's work and fixed cost."""
    tokens = layout.tokens_per_micro_batch
    again = blocks_rerun(layout)
    attn_forwards = 1 + {"none": 0, "selective": 1, "full": 1}[layout.recompute]
    layers = stage.runs  # a looped model's blocks compute again each run
    total = stage_gemm_s(config, layout, layers, hw) + layers * attention_time(config, layout, hw, attn_forwards, 1)
    # The loss's softmax and the final norm: counted on the last stage, where they run.
    total += elementwise_s(config, layout, hw, layers * (1 + again), stage.last, False)
    total += elementwise_s(config, layout, hw, layers, stage.last, True)
    if stage.last:
        head = head_gemm(config, tokens, layout.tp)
        total += gemm_s(head, layout.precision, hw, ROWS) + products_back_s(head, layout.precision, hw)
    return total


def accumulate_s(layout: Workload, stage: StageShare, hw: Hardware) -> float:
    """A step's additions of each micro-batch's gradients into those kept between them, on a
    rank holding `stage`: over the gradients it keeps (its shard under ZeRO-2/3, whose hooks
    reduce-scatter each backward). A step-level term, not a micro-batch's: it depends on the
    ZeRO stage, which no micro-batch's time does (the planner's bounds rest on that)."""
    kept = -(-stage.trained_params // layout.zero_ranks) if layout.zero >= 2 else stage.trained_params
    return accumulate_params_s(layout, kept, stage_tensors(stage, layout), hw)


def accumulate_params_s(layout: Workload, kept: int, tensors: int, hw: Hardware) -> float:
    """The additions of a step's micro-batches' gradients into `kept` kept ones in `tensors`
    tensors (m - 1 under autograd, m into a framework's own buffer): memory-bound, at the
    stack's bytes per parameter (stacks.Stack.accumulate_bytes), plus one op per tensor."""
    per = layout.software.accumulate_bytes
    # autograd's first micro-batch writes the gradient, later ones add to it; a framework's
    # own buffer (Megatron's main_grad, DeepSpeed's fp32 gradients) takes every micro-batch's
    adds = layout.grad_accum - 1 if per is None else layout.grad_accum
    per = 3 * dtype_bytes(layout.precision) if per is None else per
    if not adds or not per:
        return 0.0
    launches = tensors * hw.op_overhead_us * 1e-6
    return adds * (kept * per / hw.memory_rate(kept * per / 3) + launches)


def optimizer_s(params: int, tensors: int, hw: Hardware, pieces: int | None = None) -> float:
    """The guarded update and zeroing over the parameters this rank updates (fp32 states):
    bytes over bandwidth, plus the fixed costs of `tensors` optimizer tensors and of
    `pieces` gradient pieces checked and clipped (as many as the tensors unless told)."""
    moved = params * (UPDATE_BYTES + ZERO_GRAD_BYTES)
    pieces = tensors if pieces is None else pieces
    fixed = (tensors * hw.optimizer_tensor_us + pieces * hw.grad_tensor_us) * 1e-6
    streamed = moved / hw.stream_rate(params)
    return max(streamed, fixed) if hw.queues_kernels else streamed + fixed


def model_tensors(stage: StageShare) -> int:
    """Parameter tensors of one stage of the model, as it is written."""
    return TENSORS_PER_BLOCK * stage.layers + int(stage.first) + 2 * int(stage.last)


def stage_tensors(stage: StageShare, layout: Workload) -> int:
    """Parameter tensors the optimizer loops over on one rank (ZeRO: flat shards, few)."""
    if layout.zero:
        return 2 * max(1, stage.layers) if layout.zero == 3 else 2
    return model_tensors(stage)


def stage_pieces(stage: StageShare, layout: Workload) -> int:
    """Gradient pieces one rank checks and clips: every tensor, or under ZeRO the pieces of
    the parameters its shard overlaps (about 1/dp of them, plus one cut at each end)."""
    tensors = model_tensors(stage)
    return -(-tensors // layout.zero_ranks) + 1 if layout.zero else tensors
