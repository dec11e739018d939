"""What a CNN costs beyond its parameter count: BatchNorm's traffic, and the whole estimate.

`estimate_cnn` is `estimate_layout`'s answer for a ResNet (plait/models/resnet/model.py): model
states and DP/ZeRO traffic from its parameter count, activations and compute time from its
convolutions (plait/estimate/cnn.py), and BatchNorm's own traffic (below).

BatchNorm traffic per rank per optimizer step: what a CNN adds to data parallelism.

Pure arithmetic on the channel counts of the model's BatchNorm layers (C each), n dp ranks
and m micro-batches per step; the bytes are the ledger's (ring algorithms, fp32):

- with SyncBatchNorm, every layer all-reduces (2C + 1) values in forward and 2C in backward,
  every micro-batch: m · 2(n−1)/n · (4C + 1) · 4 B per layer;
- without it, rank 0's running statistics are broadcast once per step, as torch DDP's
  `broadcast_buffers` does: running mean and variance (C fp32 each) and the batch counter
  (one int64), 8C + 8 B per layer.

Recomputation reruns the forward of the layers inside recomputed blocks, and with it their
forward all-reduce; that repeat is not counted here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from plait.estimate import cnn
from plait.estimate.hardware import Hardware, resolve_hardware
from plait.estimate.layout import Workload
from plait.estimate.memory import device_total, gathered_at_once, model_states
from plait.estimate.time import estimate_time_measured_compute
from plait.estimate.traffic import Traffic, ring_bytes
from plait.models.resnet.config import ResNetConfig


def batchnorm_traffic(channels: Sequence[int], dp: int, grad_accum: int, sync_bn: bool,
                      recomputed: Sequence[int] = ()) -> Traffic:
    """{"dp": {op: wire bytes}} of the BatchNorm layers with `channels` features each;
    `recomputed` are those whose forward runs again in backward (a block's, under full
    recomputation), all-reducing its statistics again."""
    if dp <= 1 or not channels:
        return {}
    if sync_bn:
        per_micro = sum(ring_bytes("all_reduce", (2 * c + 1) * 4, dp) + ring_bytes("all_reduce", 2 * c * 4, dp)
                        for c in channels)
        per_micro += sum(ring_bytes("all_reduce", (2 * c + 1) * 4, dp) for c in recomputed)
        return {"dp": {"all_reduce": per_micro * grad_accum}}
    return {"dp": {"broadcast": sum(ring_bytes("broadcast", 8 * c + 8, dp) for c in channels)}}


def estimate_cnn(config: ResNetConfig, work: Workload, *, params: int, height: int, width: int,
                 hardware: str | Hardware = "cpu", sync_bn: bool = False, gpus_per_node: int | None = None
                 ) -> dict[str, Any]:
    """Predict one data-parallel layout of a ResNet on `height`×`width` images, per rank.

    Under ZeRO-3 its stem, blocks and head are the units gathered whole (`gathered_at_once`,
    as for any model); under full recomputation each block's SyncBatchNorm forward, run again in
    backward, all-reduces its statistics again.
    """
    from plait.estimate import estimate_by_size

    hw = resolve_hardware(hardware)
    node = gpus_per_node or hw.gpus_per_node
    report = estimate_by_size(params, work, hardware=hw, gpus_per_node=node, seq_len=1)
    memory = report["memory"]
    if work.zero == 3:
        stem, head = cnn.stem(config, height, width), (cnn.final_channels(config) + 1) * config.num_classes
        units = ([stem.cin * stem.cout * stem.k**2]
                 + [cnn.block_params(block) for block in cnn.blocks(config, height, width)] + [head])
        memory["params"] = model_states(params, gathered_at_once(params, [units], work), work).params
    memory["activations"] = cnn.activation_bytes(config, height, width, work.micro_batch, work.precision,
                                                 work.recompute)
    report["memory"] = device_total_of(memory)
    report["fits"] = report["memory"]["total"] <= hw.usable_bytes
    compute = cnn.micro_batch_compute_s(config, height, width, work.micro_batch, work.precision, hw, work.recompute)
    tensors = 3 * sum(len(b.all_convs) for b in cnn.blocks(config, height, width)) + 3 + 2  # conv + BN, stem, head
    report["time"] = estimate_time_measured_compute(params, tensors, compute, cnn.training_flops(config, height, width),
                                                    work, hw, node, batchnorm_collectives(config, work, sync_bn)
                                                    ).as_dict()
    traffic = batchnorm_traffic(batchnorm_channels(config), work.dp, work.grad_accum, sync_bn,
                                recomputed_channels(config, work))
    for op, wire in traffic.get("dp", {}).items():
        ops = report["comm"].setdefault("dp", {})
        ops[op] = ops.get(op, 0.0) + wire
    report["assumptions"] = [a for a in report["assumptions"] if "activations, TP and PP unknown" not in a and
                             "FLOPs per token taken as 6" not in a]
    if work.zero == 3:
        report["assumptions"].insert(0, "ZeRO-3's units are the ResNet's stem, blocks and head: the BatchNorms outside "
                                        "the blocks whole throughout, plus the unit running and the prefetched ones")
    report["assumptions"].insert(0, "a ResNet: activations and compute from its convolutions (plait/estimate/cnn.py), "
                                    "each convolution costed as the GEMM it lowers to plus the library's fixed costs")
    return report


def batchnorm_collectives(config: ResNetConfig, work: Workload, sync_bn: bool) -> list[tuple[str, float, float]]:
    """(op, payload bytes, calls per step) of the BatchNorm collectives the step waits for:
    SyncBatchNorm's two all-reduces per layer and micro-batch, or the running statistics'
    broadcasts once a step (see `batchnorm_traffic` for their bytes)."""
    if work.dp <= 1:
        return []
    if sync_bn:
        again = [("all_reduce", (2 * c + 1) * 4, work.grad_accum) for c in recomputed_channels(config, work)]
        return [(op, size * 4, work.grad_accum) for c in batchnorm_channels(config)
                for op, size in (("all_reduce", 2 * c + 1), ("all_reduce", 2 * c))] + again
    return [("broadcast", 8 * c + 8, 1) for c in batchnorm_channels(config)]


def recomputed_channels(config: ResNetConfig, work: Workload) -> list[int]:
    """The BatchNorm layers whose forward runs again in backward: every block's under full
    recomputation (the stem's is outside the blocks), none otherwise."""
    return batchnorm_channels(config)[1:] if work.recompute == "full" else []


def batchnorm_channels(config: ResNetConfig) -> list[int]:
    """The channels of every BatchNorm layer, in the order the model holds them."""
    out = [config.width]  # the stem's
    for block in cnn.blocks(config, 1, 1):
        out += [conv.cout for conv in block.all_convs]
    return out


def device_total_of(memory: dict[str, Any]) -> dict[str, Any]:
    """The memory dict with its device total recomputed (activations now known)."""
    from plait.estimate.memory import Memory

    fields = {k: v for k, v in memory.items() if k in Memory.__dataclass_fields__}
    return device_total(Memory(**fields)).as_dict()
