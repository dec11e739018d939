"""BatchNorm traffic per rank per optimizer step: what a CNN adds to data parallelism.

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

from plait.estimate.traffic import Traffic, ring_bytes


def batchnorm_traffic(channels: Sequence[int], dp: int, grad_accum: int, sync_bn: bool) -> Traffic:
    """{"dp": {op: wire bytes}} of the BatchNorm layers with `channels` features each."""
    if dp <= 1 or not channels:
        return {}
    if sync_bn:
        per_micro = sum(ring_bytes("all_reduce", (2 * c + 1) * 4, dp) + ring_bytes("all_reduce", 2 * c * 4, dp)
                        for c in channels)
        return {"dp": {"all_reduce": per_micro * grad_accum}}
    return {"dp": {"broadcast": sum(ring_bytes("broadcast", 8 * c + 8, dp) for c in channels)}}
