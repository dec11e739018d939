"""The ResNet formulas of plait/estimate/cnn.py against plait's own ResNets: the bytes
ActivationMeter sees, FLOPs by hand and by torch's FlopCounterMode, and the time model's
GEMMs. One process; about 4 s, most of it torch.utils.checkpoint's first call, which
imports torch._dynamo (once per process, and test_recompute.py pays it too)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from plait.bench.meter import ActivationMeter
from plait.estimate.cnn import (
    activation_bytes,
    block_activation_bytes,
    blocks,
    forward_flops,
    micro_batch_compute_s,
    outer_activation_bytes,
    training_flops,
    training_gemms,
)
from plait.estimate.hardware import get_hardware
from plait.models.resnet.model import build_resnet
from plait.models.resnet.config import get_resnet
from plait.parallel.recompute import apply_recompute

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _measured(name: str, size: int, channels: int, batch: int, precision: str, recompute: str) -> int:
    config = get_resnet(name, in_channels=channels, num_classes=10)
    model = build_resnet(config, 0).to(DTYPES[precision])
    if recompute == "full":
        apply_recompute(model, "full")
    images = torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(0))
    meter = ActivationMeter()
    with meter.track(model):
        out = model(images.to(DTYPES[precision]))  # held: the meter reads what the graph still holds
    assert out.requires_grad
    return meter.last


# ResNet-18 at two widths and ResNet-50 (basic and bottleneck blocks), 8×8 digits-sized and
# 16×16 images, one and three channels, micro-batches 4 and 8: each value, not their whole
# product, with and without recompute. 7×7 checks the ceil(H/2) of a strided convolution.
SHAPES = [
    ("resnet18,width=16", 8, 1, 4), ("resnet18,width=16", 16, 3, 8),
    ("resnet18,width=8", 16, 1, 8), ("resnet18,width=8", 8, 3, 4),
    ("resnet50,width=8", 8, 3, 4), ("resnet50,width=8", 16, 1, 8),
    ("resnet18,width=8", 7, 3, 4),
]


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("name, size, channels, batch", SHAPES)
def test_activation_bytes_are_what_the_meter_measures(name, size, channels, batch, recompute):
    """Exact, byte for byte: the formula lists every storage autograd keeps."""
    config = get_resnet(name, in_channels=channels, num_classes=10)
    predicted = activation_bytes(config, size, size, batch, "fp32", recompute)
    assert _measured(name, size, channels, batch, "fp32", recompute) == predicted


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_bf16_saves_half_of_fp32_and_exactly_what_is_predicted(recompute):
    """In bf16 BatchNorm's saved statistics and running buffers are bf16 too (on CPU), so
    every saved byte halves."""
    config = get_resnet("resnet18,width=8", in_channels=1, num_classes=10)
    measured = _measured("resnet18,width=8", 8, 1, 4, "bf16", recompute)
    assert measured == activation_bytes(config, 8, 8, 4, "bf16", recompute)
    assert 2 * measured == activation_bytes(config, 8, 8, 4, "fp32", recompute)


@pytest.mark.parametrize("name", ["resnet18,width=8", "resnet50,width=8"])
def test_each_block_keeps_what_block_activation_bytes_says(name):
    """Run alone, a block also keeps its own input (a fresh tensor here), which in the
    network is its producer's ReLU output and counted there; under recompute that input is
    all it keeps."""
    config = get_resnet(name, in_channels=3, num_classes=10)
    model = build_resnet(config, 0)
    x = torch.relu(model.stem(torch.randn(4, 3, 8, 8)))
    for policy in ("none", "full"):
        predicted = block_activation_bytes(config, 8, 8, 4, "fp32", policy)
        h = x.detach()
        for i, (block, shape) in enumerate(zip(model.blocks, blocks(config, 8, 8))):
            meter = ActivationMeter()
            with meter.track(block):
                out = block(h.requires_grad_())
            own_input = 4 * 4 * shape.in_elements
            expected = own_input if policy == "full" else predicted[i] + own_input
            assert meter.last == expected, (policy, i)
            h = out.detach()
        apply_recompute(model, "full")
    shape = (config, 8, 8, 4, "fp32")
    assert sum(block_activation_bytes(*shape)) + outer_activation_bytes(*shape) == activation_bytes(*shape)


def test_flops_of_resnet18_width_8_by_hand():
    """8×8 one-channel digits, 10 classes. 2·Cin·Cout·k²·Ho·Wo per convolution:
    stem 2·1·8·9·64; stage 1 (8 channels, 8×8) four 2·8·8·9·64; stages 2-4 each one strided
    3×3 from half the channels, three 3×3 and a 1×1 strided shortcut, all on a quarter of the
    pixels and twice the channels, hence the same FLOPs: 36 864 + 3·73 728 + 4096; the head
    2·64·10. Backward doubles all but the stem, whose images need no gradient."""
    config = get_resnet("resnet18,width=8", in_channels=1, num_classes=10)
    stem, stage1, later = 2 * 1 * 8 * 9 * 64, 4 * (2 * 8 * 8 * 9 * 64), 36_864 + 3 * 73_728 + 4096
    flops = forward_flops(config, 8, 8)
    assert flops.conv == stem + stage1 + 3 * later == 1_090_560
    assert flops.head == 2 * 64 * 10
    assert training_flops(config, 8, 8) - 3 * flops.elementwise == 3 * (1_090_560 + 1280) - stem


@pytest.mark.parametrize("name, size, channels", [("resnet18,width=8", 8, 1), ("resnet50,width=8", 16, 3),
                                                  ("resnet18,width=16", 7, 3)])
def test_flops_match_torchs_flop_counter(name, size, channels):
    """FlopCounterMode counts convolutions and matmuls only (not the element-wise work), and
    in backward only the gradients autograd asks for: the stem's input gradient is not."""
    config = get_resnet(name, in_channels=channels, num_classes=10)
    model, batch = build_resnet(config, 0), 2
    with FlopCounterMode(display=False) as forward:
        logits = model(torch.randn(batch, channels, size, size))
    with FlopCounterMode(display=False) as backward:
        logits.sum().backward()
    flops = forward_flops(config, size, size)
    assert forward.get_total_flops() == batch * (flops.conv + flops.head)
    total = forward.get_total_flops() + backward.get_total_flops()
    assert total == batch * (training_flops(config, size, size) - 3 * flops.elementwise)
    assert total == sum(g.flops for g in training_gemms(config, size, size, batch))


def test_compute_time_on_a_gpu_preset_has_no_fixed_costs():
    """A GPU preset has no op overheads (launches hide behind the work): the time is at
    least the lowered GEMMs at peak·efficiency, grows with the micro-batch in proportion
    (less the GEMMs' fixed ramp, set to zero here), and full recompute adds one forward of
    the blocks, less than half the total."""
    config = get_resnet("resnet50,width=64", in_channels=3, num_classes=1000)
    hw = replace(get_hardware("a100-80gb"), gemm_fixed_us=0.0)
    t = micro_batch_compute_s(config, 64, 64, 64, "bf16", hw)
    gemms = sum(g.flops for g in training_gemms(config, 64, 64, 64))
    assert gemms / (hw.peak_flops("bf16") * hw.compute_efficiency) < t
    assert micro_batch_compute_s(config, 64, 64, 128, "bf16", hw) == pytest.approx(2 * t, rel=0.02)
    assert t < micro_batch_compute_s(config, 64, 64, 64, "bf16", hw, "full") < 1.5 * t


def test_cpu_convolutions_pay_a_fixed_cost_per_call():
    """On a CPU profile a tiny network's time is mostly fixed costs, and they scale with
    the machine's op overhead; twice the micro-batch costs well under twice the time."""
    config = get_resnet("resnet18,width=16", in_channels=1, num_classes=10)
    cpu = get_hardware("cpu")
    small, large = (micro_batch_compute_s(config, 8, 8, b, "fp32", cpu) for b in (2, 4))
    assert small < large < 2 * small
    free = micro_batch_compute_s(config, 8, 8, 2, "fp32", replace(cpu, op_overhead_us=0.0))
    assert free < small / 3


def test_a_gpu_overlaps_a_resnets_launches_with_its_work_and_a_cpu_adds_them():
    """The same fixed costs: summed with the work on a CPU profile, the longer of the two on a
    GPU's (queues_kernels), as for a transformer."""
    config = get_resnet("resnet18,width=16", in_channels=1, num_classes=10)
    cpu = replace(get_hardware("cpu"), op_overhead_us=30.0)
    gpu = replace(cpu, queues_kernels=True)
    summed = micro_batch_compute_s(config, 8, 8, 4, "fp32", cpu)
    device = micro_batch_compute_s(config, 8, 8, 4, "fp32", replace(cpu, op_overhead_us=0.0))
    assert micro_batch_compute_s(config, 8, 8, 4, "fp32", gpu) == pytest.approx(max(device, summed - device))
    assert micro_batch_compute_s(config, 8, 8, 4, "fp32", gpu) < summed
