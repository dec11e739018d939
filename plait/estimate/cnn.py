"""A ResNet's activation memory, FLOPs and compute time per micro-batch: torch-free arithmetic.

**What autograd saves** in one training forward (plait/models/resnet/model.py, listed with
saved_tensors_hooks and checked against plait.bench.meter.ActivationMeter, which counts
each storage once and leaves the model's parameters and buffers out):

    conv2d           its input (and the weight, a parameter)           -
    batch_norm       its input (the convolution's output), save_mean
                     and save_invstd: C values each, in the model's
                     dtype (bf16 too, on CPU); and, by reference, the
                     layer's running_mean and running_var, buffers
                     resident whatever runs                             N + 2C elements
    relu             its output (which the next convolution saves too)  N elements
    residual add     nothing (its backward passes the gradient on)      -
    avg-pool, flatten nothing (mean's backward needs only the shape)    -
    linear           its input, the pooled (b, C) features              b·C elements

So a block keeps, per convolution of its main path, the BatchNorm input and a ReLU output
(the last ReLU follows the add), plus the shortcut's BatchNorm input when the shape changes;
its own input is its producer's ReLU output, counted there. Outside the blocks: the images
(saved by the stem), the stem's BatchNorm input and ReLU output, and the head's input.
Every element is e bytes, e = 4 in fp32 and 2 in bf16/fp16 (the model held in that dtype).

Full recompute (plait/parallel/recompute.py) checkpoints every block: the meter then sees
only what checkpoint saves outside, each block's input. The first block's input is the
stem's ReLU output, kept anyway; the last block's output is kept by nobody (the pooling
saves nothing), so the blocks add the inputs of blocks 2..L.

**FLOPs** per sample: 2·Cin·Cout·k²·Ho·Wo per convolution (padded taps included, as torch's
FlopCounterMode counts), 2·C·classes for the head; backward twice that, except the stem,
whose input (the images) needs no gradient. Element-wise work is small and no counter
agrees on it; by convention BatchNorm 7 FLOPs per element forward (sum, square, sum;
subtract, scale, weight, bias), ReLU, add and pooling 1, backward twice forward.

**Time**: a convolution is the GEMM it lowers to (im2col: M = b·Ho·Wo, K = Cin·k², N = Cout;
backward ops.Gemm.backward's two, the stem's weight gradient only) on ops.gemm_s's roofline,
plus per library call a fixed cost (CONV_CALL_OPS) and its layout changes (reorder_s). The
rest are memory-bound passes with the machine's `op_overhead_us` each, as in ops.py. Full
recompute runs the blocks' forward a second time, in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from plait.estimate.hardware import Hardware
from plait.estimate.ops import Gemm, dtype_bytes, gemm_s, host_overlapped
from plait.models.resnet.config import ResNetConfig

BN_STATS = 2  # save_mean, save_invstd: C values each (the running statistics it saves are buffers)
# Elements read plus written per output element, (forward, backward). BatchNorm reads its
# input for the statistics, again to normalise, and writes; backward reads dy and x for its
# two sums, then both again to write dx. ReLU: x in, y out; backward dy and y in, dx out.
# The add: two in, one out; its backward hands dy on uncopied. A gradient arriving from two
# consumers (a block's input feeds conv1 and the shortcut) is summed: 3 per element.
BN_PASS, RELU_PASS, ADD_PASS, SUM_PASS = (3, 5), (2, 3), (3, 0), 3
BN_OPS = (3, 2)  # forward: num_batches_tracked += 1, an empty, batch_norm; backward ~14 µs, 2 ops
BN_FLOPS, POINTWISE_FLOPS = 7, 1
OUTER_OPS = (3, 5)  # mean, log-softmax, nll; backward ones_like, their two, mean's div, bias sum
RESTORE_OPS = 6  # recompute puts 3 buffers per BatchNorm back: a clone and a copy each
# torch.utils.checkpoint's bookkeeping, in Python: a frame per block, a pack in forward and
# a pack and unpack in the recomputation per saved tensor. Timed on blocks of k tiny
# multiplications: ~105 µs per block and ~12 µs per saved tensor, 16 and 2 ops of 6.6 µs.
CHECKPOINT_OPS, SAVED_OPS = 16, 2
# A CPU convolution is not one GEMM call: torch hands it (batch >= 2) to oneDNN via ideep,
# which builds a primitive descriptor and reorders source, weights and destination on every
# call (backward: one call for the data, one for the weights). oneDNN's kernels ran near the
# GEMM roofline (ONEDNN_VERBOSE, resnet18,width=16, b=32: 138 MFLOP forward in 0.53 ms), the
# calls around them did not: a convolution with almost no work (b=2, 16 channels, 2×2) took
# 60-65 µs forward and ~160 µs backward on the 2-core EPYC (torch 2.13), against 6.6 µs per
# eager op (`plait calibrate`): 1 + 8 ops and 2·(1 + 11) (gemm_s counts the 1). In op
# overheads, it follows a calibrated machine and is zero on the GPU presets.
CONV_CALL_OPS = (8, 11)  # (forward call, each backward call) in units of op_overhead_us


@dataclass(frozen=True)
class Conv:
    """One bias-free convolution, padding k // 2, on an h×w input (per sample)."""

    cin: int
    cout: int
    k: int
    stride: int
    h: int
    w: int

    @property
    def in_elements(self) -> int:
        return self.cin * self.h * self.w

    @property
    def out_hw(self) -> tuple[int, int]:
        return (self.h - 1) // self.stride + 1, (self.w - 1) // self.stride + 1

    @property
    def out_elements(self) -> int:
        ho, wo = self.out_hw
        return self.cout * ho * wo

    @property
    def flops(self) -> float:
        """Forward FLOPs per sample: 2·Cin·Cout·k²·Ho·Wo."""
        return 2.0 * self.cin * self.k * self.k * self.out_elements

    def gemm(self, batch: int) -> Gemm:
        """The GEMM im2col lowers it to: (b·Ho·Wo × Cin·k²) · (Cin·k² × Cout)."""
        ho, wo = self.out_hw
        return Gemm(batch * ho * wo, self.cin * self.k * self.k, self.cout)


@dataclass(frozen=True)
class Block:
    """A residual block: its main path's convolutions and the shortcut's, if the shape changes."""

    convs: tuple[Conv, ...]
    shortcut: Conv | None

    @property
    def in_elements(self) -> int:
        return self.convs[0].in_elements

    @property
    def all_convs(self) -> tuple[Conv, ...]:
        return self.convs + ((self.shortcut,) if self.shortcut else ())


def stem(config: ResNetConfig, height: int, width: int) -> Conv:
    return Conv(config.in_channels, config.width, 3, 1, height, width)


def blocks(config: ResNetConfig, height: int, width: int) -> list[Block]:
    """Every block with its shapes, as plait.models.resnet.model.ResNet builds them."""
    out, cin, (h, w) = [], config.width, (height, width)
    for stage, count in enumerate(config.layers):
        planes = config.width * 2**stage
        for i in range(count):
            block = _block(config.block, cin, planes, 2 if stage > 0 and i == 0 else 1, h, w)
            out.append(block)
            cin, (h, w) = planes * config.expansion, block.convs[-1].out_hw
    return out


def _block(kind: str, cin: int, width: int, stride: int, h: int, w: int) -> Block:
    """Basic: 3×3 (stride), 3×3. Bottleneck: 1×1, 3×3 (stride), 1×1 to 4·width."""
    if kind == "basic":
        first = Conv(cin, width, 3, stride, h, w)
        convs, cout = (first, Conv(width, width, 3, 1, *first.out_hw)), width
    else:
        reduce = Conv(cin, width, 1, 1, h, w)
        middle = Conv(width, width, 3, stride, h, w)
        convs, cout = (reduce, middle, Conv(width, 4 * width, 1, 1, *middle.out_hw)), 4 * width
    shortcut = None if stride == 1 and cin == cout else Conv(cin, cout, 1, stride, h, w)
    return Block(convs, shortcut)


def block_params(block: Block) -> int:
    """A block's parameters: its convolutions' weights (bias-free) and each one's BatchNorm
    scale and shift."""
    return sum(c.cin * c.cout * c.k * c.k + 2 * c.cout for c in block.all_convs)


def final_channels(config: ResNetConfig) -> int:
    return config.width * 2 ** (len(config.layers) - 1) * config.expansion


# -- activations ------------------------------------------------------------------------------


def _block_saved(block: Block, micro_batch: int) -> int:
    """Elements one block adds without recompute: per convolution the BatchNorm input, per
    main convolution a ReLU output, and four statistics per BatchNorm channel."""
    per_sample = sum(2 * c.out_elements for c in block.convs)
    per_sample += block.shortcut.out_elements if block.shortcut else 0
    return micro_batch * per_sample + BN_STATS * sum(c.cout for c in block.all_convs)


def block_activation_bytes(config: ResNetConfig, height: int, width: int, micro_batch: int,
                           precision: str, recompute: str = "none") -> list[float]:
    """Bytes each block adds to what autograd saves for one micro-batch (module docstring)."""
    e, shapes = dtype_bytes(precision), blocks(config, height, width)
    if recompute == "full":
        return [0.0] + [float(e * micro_batch * b.in_elements) for b in shapes[1:]]
    return [float(e * _block_saved(b, micro_batch)) for b in shapes]


def outer_activation_bytes(config: ResNetConfig, height: int, width: int, micro_batch: int,
                           precision: str) -> float:
    """Outside the blocks: the images, the stem's BatchNorm input, statistics and ReLU output,
    and the head's pooled input."""
    s = stem(config, height, width)
    elements = micro_batch * (s.in_elements + 2 * s.out_elements + final_channels(config)) + BN_STATS * s.cout
    return float(dtype_bytes(precision) * elements)


def activation_bytes(config: ResNetConfig, height: int, width: int, micro_batch: int,
                     precision: str, recompute: str = "none") -> float:
    """What ActivationMeter measures around one training forward of one micro-batch."""
    inside = block_activation_bytes(config, height, width, micro_batch, precision, recompute)
    return sum(inside) + outer_activation_bytes(config, height, width, micro_batch, precision)


# -- FLOPs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Flops:
    """Forward FLOPs of one sample, by kind."""

    conv: float
    head: float
    elementwise: float

    @property
    def total(self) -> float:
        return self.conv + self.head + self.elementwise


def forward_flops(config: ResNetConfig, height: int, width: int) -> Flops:
    """Per sample: every convolution, the head's matmul, and the element-wise work (module docstring)."""
    s, shapes = stem(config, height, width), blocks(config, height, width)
    conv = s.flops + sum(c.flops for b in shapes for c in b.all_convs)
    normed = s.out_elements + sum(c.out_elements for b in shapes for c in b.all_convs)
    relu = s.out_elements + sum(c.out_elements for b in shapes for c in b.convs)
    adds = sum(b.convs[-1].out_elements for b in shapes)
    pooled = shapes[-1].convs[-1].out_elements
    elementwise = BN_FLOPS * normed + POINTWISE_FLOPS * (relu + adds + pooled)
    return Flops(conv, 2.0 * final_channels(config) * config.num_classes, elementwise)


def training_flops(config: ResNetConfig, height: int, width: int) -> float:
    """Forward + backward per sample: backward twice forward, less the stem's input gradient."""
    f = forward_flops(config, height, width)
    return 3 * f.total - stem(config, height, width).flops


# -- time -------------------------------------------------------------------------------------


def conv_gemms(conv: Conv, micro_batch: int, backward: bool, input_grad: bool = True) -> list[Gemm]:
    """Forward: the lowered GEMM. Backward: the input's gradient (unless not needed) and the weight's."""
    g = conv.gemm(micro_batch)
    if not backward:
        return [g]
    data, weight = g.backward()
    return [data, weight] if input_grad else [weight]


def training_gemms(config: ResNetConfig, height: int, width: int, micro_batch: int) -> list[Gemm]:
    """Every GEMM of one micro-batch's forward and backward, convolutions lowered and head
    (the shapes a calibration would measure)."""
    convs = [stem(config, height, width)] + [c for b in blocks(config, height, width) for c in b.all_convs]
    head = Gemm(micro_batch, final_channels(config), config.num_classes)
    out = [g for i, c in enumerate(convs)  # the stem (i = 0) computes no input gradient
           for bwd in (False, True) for g in conv_gemms(c, micro_batch, bwd, input_grad=i > 0)]
    return out + [head, *head.backward()]


def conv_s(conv: Conv, micro_batch: int, precision: str, hw: Hardware, backward: bool,
           input_grad: bool = True) -> float:
    """One convolution's forward or backward: each lowered GEMM on ops.gemm_s, plus, per
    library call (one per GEMM), the call's fixed cost and its layout changes."""
    fixed = CONV_CALL_OPS[backward] * hw.op_overhead_us * 1e-6 + reorder_s(conv, micro_batch, precision, hw)
    return sum(gemm_s(g, precision, hw) + fixed for g in conv_gemms(conv, micro_batch, backward, input_grad))


def reorder_s(conv: Conv, micro_batch: int, precision: str, hw: Hardware) -> float:
    """One library call's layout changes: its two activations (read and written once each)
    at the activations' bandwidth, and the weights at the update's streaming rate, since
    like the update they pass over parameter-sized memory that has left the caches."""
    e = dtype_bytes(precision)
    activations = 2 * e * micro_batch * (conv.in_elements + conv.out_elements)
    weights = 2 * e * conv.cin * conv.cout * conv.k * conv.k
    return activations / hw.memory_bytes_per_s + weights / hw.stream_bytes_per_s


def pass_s(elements: float, ops: float, precision: str, hw: Hardware) -> float:
    """Memory-bound work: elements read plus written over bandwidth, plus each op's fixed cost."""
    return elements * dtype_bytes(precision) / hw.memory_bytes_per_s + ops * hw.op_overhead_us * 1e-6


def block_elementwise_s(block: Block, micro_batch: int, precision: str, hw: Hardware, backward: bool) -> float:
    """A block's BatchNorms, ReLUs, add (and, backward, the sum of its input's two gradients)."""
    normed = sum(c.out_elements for c in block.all_convs)
    relu = sum(c.out_elements for c in block.convs)
    out = block.convs[-1].out_elements
    elements = BN_PASS[backward] * normed + RELU_PASS[backward] * relu + ADD_PASS[backward] * out
    ops = BN_OPS[backward] * len(block.all_convs) + len(block.convs) + (0 if backward else 1)
    if backward:
        elements, ops = elements + SUM_PASS * block.in_elements, ops + 1
    return pass_s(micro_batch * elements, ops, precision, hw)


def blocks_s(shapes: list[Block], micro_batch: int, precision: str, hw: Hardware, backward: bool) -> float:
    convs = sum(conv_s(c, micro_batch, precision, hw, backward) for b in shapes for c in b.all_convs)
    return convs + sum(block_elementwise_s(b, micro_batch, precision, hw, backward) for b in shapes)


def outer_s(config: ResNetConfig, height: int, width: int, micro_batch: int, precision: str,
            hw: Hardware, backward: bool) -> float:
    """The stem (convolution, BatchNorm, ReLU), the pooling, the head and the loss."""
    s, b = stem(config, height, width), micro_batch
    c, pooled = final_channels(config), b * blocks(config, height, width)[-1].convs[-1].out_elements
    head = Gemm(b, c, config.num_classes)
    gemms = head.backward() if backward else (head,)
    elementwise = b * s.out_elements * (BN_PASS[backward] + RELU_PASS[backward]) + pooled + b * c
    ops = BN_OPS[backward] + 1 + OUTER_OPS[backward]
    return (conv_s(s, b, precision, hw, backward, input_grad=False)
            + sum(gemm_s(g, precision, hw) for g in gemms) + pass_s(elementwise, ops, precision, hw))


def checkpoint_s(shapes: list[Block], precision: str, hw: Hardware) -> float:
    """Full recompute's fixed costs beside the second forward: checkpoint's bookkeeping per
    block and per saved tensor (2 per convolution and 6 per BatchNorm: 8 per convolution;
    1 per ReLU), and the BatchNorms' buffers put back."""
    norms = sum(len(b.all_convs) for b in shapes)
    saved = sum(8 * len(b.all_convs) + len(b.convs) for b in shapes)
    return pass_s(0, RESTORE_OPS * norms + CHECKPOINT_OPS * len(shapes) + SAVED_OPS * saved, precision, hw)


def micro_batch_compute_s(config: ResNetConfig, height: int, width: int, micro_batch: int,
                          precision: str, hw: Hardware, recompute: str = "none") -> float:
    """Seconds of forward + backward of one micro-batch (the blocks' forward twice under
    recompute="full"; any other policy recomputes nothing in a ResNet), without the update.
    On a GPU the host's launches overlap the device's work, the longer counting, as for a
    transformer (plait.estimate.ops.host_overlapped)."""
    return host_overlapped(hw, lambda profile: _work_and_dispatch_s(config, height, width, micro_batch, precision,
                                                                    profile, recompute))


def _work_and_dispatch_s(config: ResNetConfig, height: int, width: int, micro_batch: int,
                         precision: str, hw: Hardware, recompute: str) -> float:
    """micro_batch_compute_s's sum of every op's work and fixed cost."""
    shapes = blocks(config, height, width)
    forward = blocks_s(shapes, micro_batch, precision, hw, False)
    again = forward + checkpoint_s(shapes, precision, hw) if recompute == "full" else 0.0
    total = forward + again + blocks_s(shapes, micro_batch, precision, hw, True)
    return total + sum(outer_s(config, height, width, micro_batch, precision, hw, bwd) for bwd in (False, True))
