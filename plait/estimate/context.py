"""What context parallelism puts on the wire and how much of it the step waits for.

Per attention layer and micro-batch, on every cp rank (all are alike: the head-tail split
balances them), with b sequences, s tokens, h_kv K/V heads of d values (a latent attention's
V heads narrower, d_v: then d + d_v for 2·d below), e bytes per value: one rank's K/V block
is KV = 2·b·(s/cp)·h_kv·d·e bytes.

Ring (plait.parallel.context.ring):
  forward   (cp−1) sends of KV (and as many receives);
  backward  (cp−1) sends of KV again, plus cp sends of the block's dK, dV accumulators
            (w bytes per value: fp32, or fp64 for fp64) which end at the block's owner.
Ulysses (plait.parallel.context.ulysses): an all-to-all each for q, k, v and the output,
  forward, and the same four backward: (cp−1)/cp·b·(s/cp)·d·e·(2·h + 2·h_kv') bytes each
  way, where h_kv' is h_kv when cp divides it, else h (K/V heads repeated up to the heads).
Recomputation reruns the forward's traffic once more (full: the block; selective: the core).

The ring's sends are posted before each step's attention and waited for after it, so the
step waits only for what the attention does not cover: per pass, the transfer time of the
cp−1 blocks minus the attention compute of the cp−1 steps that overlap them. Ulysses'
all-to-alls sit between the projections and the attention: they are all exposed.
"""

from __future__ import annotations

from typing import Any

from plait.wire import ring_bytes


def kv_block_bytes(batch: int, seq: int, cp: int, kv_heads: int, head_dim: float, v_head_dim: float,
                   bytes_per_value: int) -> float:
    """One rank's K and V for one layer: b·(s/cp)·h_kv·(d_k + d_v)·e (d_v = d_k but for a
    latent attention's narrower V)."""
    return batch * (seq // cp) * kv_heads * (head_dim + v_head_dim) * bytes_per_value


def context_bytes(kind: str, cp: int, *, batch: int, seq: int, heads: int, kv_heads: int, head_dim: float,
                  bytes_per_value: int, wide_bytes: int = 4, v_head_dim: float | None = None) -> dict[str, float]:
    """{"forward", "backward"}: bytes one rank sends (ring: each also receives as much; Ulysses:
    the all-to-all's wire bytes) for one layer and one micro-batch. q and K heads are head_dim
    wide, V heads and the output's v_head_dim (head_dim unless given)."""
    if cp == 1:
        return {"forward": 0.0, "backward": 0.0}
    v_width = head_dim if v_head_dim is None else v_head_dim
    if kind == "ring":
        block = kv_block_bytes(batch, seq, cp, kv_heads, head_dim, v_width, bytes_per_value)
        grads = kv_block_bytes(batch, seq, cp, kv_heads, head_dim, v_width, wide_bytes)
        return {"forward": (cp - 1) * block, "backward": (cp - 1) * block + cp * grads}
    travelling_kv = kv_heads if kv_heads % cp == 0 else heads
    per_value = batch * (seq // cp) * bytes_per_value
    widths = (heads * head_dim, travelling_kv * head_dim, travelling_kv * v_width, heads * v_width)  # q, k, v, out
    one_way = sum(ring_bytes("all_to_all", per_value * width, cp) for width in widths)
    return {"forward": one_way, "backward": one_way}


def layer_bytes(config: Any, layout: Any) -> dict[str, float]:
    """`context_bytes` of one layer of `config` under `layout` (a Workload): its heads and K/V
    heads per tp rank (every head where the plan leaves the attention whole), their widths as
    the attention is handed them (GPTConfig.head_widths_handed), its micro-batch and sequence,
    the layout's dtype; as many times as a mean block calls its attention
    (GPTConfig.block_attention_calls)."""
    tp = config.attention_tp(layout.tp)
    _, k_width, v_width = config.head_widths_handed
    one = context_bytes(layout.cp_kind, layout.cp, batch=layout.micro_batch, seq=layout.seq_len,
                        heads=config.n_heads // tp, kv_heads=max(1, config.n_kv_heads // tp),
                        head_dim=k_width, v_head_dim=v_width, bytes_per_value=layout.compute_bytes)
    calls = config.block_attention_calls  # a mean block's attentions (DiffLlama's two, a hybrid's share)
    return {way: calls * bytes_ for way, bytes_ in one.items()}


def per_layer(config: Any, layout: Any) -> dict[str, Any] | None:
    """What one rank's cp traffic is made of, for the report: the bytes of one layer's forward
    and backward (one micro-batch), and how many of each a step runs on the busiest rank
    (its layers × micro-batches, forwards again under recomputation). None without cp."""
    if layout.cp == 1:
        return None
    from plait.estimate.layout import layout_stages

    per = layer_bytes(config, layout)
    layers = max(stage.runs for stage in layout_stages(config, layout))
    return {"kind": layout.cp_kind, "cp": layout.cp, "op": "send" if layout.cp_kind == "ring" else "all_to_all",
            "forward": per["forward"], "backward": per["backward"], "layers": layers,
            "micro_batches": layout.grad_accum, "forwards": forward_passes(layout.recompute)}


def forward_passes(recompute: str) -> int:
    """How many times each layer's attention forward runs per micro-batch."""
    return 1 if recompute == "none" else 2


def ring_exposed_s(transfer_s: float, attention_s: float, cp: int) -> float:
    """Seconds of one pass's ring transfers the step waits for: `transfer_s` (all cp−1
    blocks) less the attention compute of the cp−1 steps that run while they travel
    (`attention_s` is the whole pass's, over cp steps)."""
    if cp == 1:
        return 0.0
    return max(0.0, transfer_s - attention_s * (cp - 1) / cp)
