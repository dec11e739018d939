"""What tensor and sequence parallelism cost: bytes on the wire and activations saved.

Pure arithmetic, no torch, so `estimate/` and the tests can use it without processes. The
world tests prove the implementation moves and saves exactly these numbers.

Notation: s sequence, b micro-batch, h d_model, a heads, f ffn_hidden, L layers, t = tp,
p bytes per activation element.

Activations saved by one of our Llama blocks (RMSNorm, RoPE, grouped-query SDPA, SwiGLU),
counted the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", section 4) count a GPT block, in elements (docs/tensor.md derives each):

    outside the TP regions (split by t only with sequence parallelism)
      two RMSNorms: input x, x·rsqrt(mean x²), rsqrt      2·(2sbh + sb)
      attention input, MLP input (the norms' outputs)      2·sbh
    inside the TP regions (split by t)
      SDPA: q, k, v (k, v after the GQA repeat), output    4·sbh
      SDPA: log-sum-exp per head and token                 a·sb
      o_proj input (a view of SDPA's output if a/t = 1)     sbh
      SwiGLU: gate out, silu(gate), up out, down input     4·sbf

Total sb·(11h + 4f + a + 2). TP alone keeps sb·(6h + 2) + sb·(5h + 4f + a)/t per rank;
TP + SP keeps all of it /t, because the two region inputs are saved as sequence chunks and
all-gathered again in backward (`regather`). CPU and flash SDPA never store the a·s² scores,
so the paper's 5as/h term is absent; our block has no dropout.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Protocol


class BlockShape(Protocol):
    """The shapes this arithmetic reads: any model config with these fields (plait's GPTConfig)."""

    d_model: int
    ffn_hidden: int
    n_heads: int
    n_layers: int
    max_seq_len: int
    head_dim: int


@dataclass(frozen=True)
class BlockActivations:
    """Elements one block saves on one rank, split by where they sit relative to TP regions."""

    outside: float  # norms and the regions' inputs: replicated unless sequence-parallel
    inside: float  # attention and MLP internals: always split over tp

    @property
    def total(self) -> float:
        return self.outside + self.inside


def block_activations(config: BlockShape, batch: int, seq: int, tp: int = 1, sp: bool = False,
                      regather: bool = True) -> BlockActivations:
    """Elements saved for backward by one block on one rank (times p for bytes).

    With SP but without `regather`, the two region inputs are saved whole (2·sbh).
    """
    sb, h, f, a = seq * batch, config.d_model, config.ffn_hidden, config.n_heads
    norms, region_inputs = 2 * (2 * sb * h + sb), 2 * sb * h
    # With one head per rank, SDPA's output (b, 1, s, d) is already laid out as (b, s, d):
    # the reshape for o_proj is a view, so its input is not a second tensor.
    o_proj_input = 0 if a // tp == 1 else sb * h
    inside = 4 * sb * h + a * sb + o_proj_input + 4 * sb * f
    if not sp or tp == 1:
        outside = norms + region_inputs
    else:
        outside = norms / tp + (region_inputs / tp if regather else region_inputs)
    return BlockActivations(outside, inside / tp)


def rope_table_elements(config: BlockShape) -> int:
    """cos and sin tables saved by RoPE's multiplications: shared by all blocks, counted once."""
    return config.max_seq_len * config.head_dim


def korthikanti_gpt_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """The paper's bytes per GPT layer (16-bit activations, 1-byte dropout masks).

    sbh(34 + 5as/h) on one rank; sbh(10 + 24/t + 5as/(ht)) with TP; sbh(34 + 5as/h)/t with TP+SP.
    """
    sbh = s * b * h
    if sp:
        return sbh * (34 + 5 * a * s / h) / t
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def layer_collectives(tp: int, sp: bool, regather: bool = True) -> dict[str, int]:
    """Collectives of b·s·h elements per layer per micro-batch, forward plus backward.

    TP: 2 all-reduces forward (leaving attention and MLP), 2 backward (entering them).
    SP: each all-reduce becomes a reduce-scatter + an all-gather (same bytes), plus, with
    `regather`, one all-gather per region in backward to rebuild its saved input.
    """
    if tp == 1:
        return {}
    if not sp:
        return {"all_reduce": 4}
    return {"all_gather": 4 + (2 if regather else 0), "reduce_scatter": 4}


def step_traffic(config: BlockShape, batch: int, seq: int, tp: int, sp: bool = False,
                 regather: bool = True, p: int = 4) -> dict[str, float]:
    """Wire bytes per rank on the tp axis for one forward + backward of the GPT (ring costs).

    Besides the layers: the vocab-parallel embedding leaves a region and the output head
    enters one (one collective of b·s·h each way, like half a layer); the loss all-reduces a
    max and [Σexp, target logit] per token (3·b·s fp32); with SP the norms' weight gradients
    are summed over tp ((2L + 1)·h·p).
    """
    if tp == 1:
        return {}
    full, tokens = batch * seq * config.d_model * p, batch * seq
    ring, reduce_ring = (tp - 1) / tp, 2 * (tp - 1) / tp
    layers = {op: n * config.n_layers for op, n in layer_collectives(tp, sp, regather).items()}
    loss = 3 * tokens * 4
    if not sp:
        return {"all_reduce": reduce_ring * ((layers["all_reduce"] + 2) * full + loss)}
    head_gathers = 3 if regather else 2
    norms = (2 * config.n_layers + 1) * config.d_model * p
    return {"all_gather": ring * (layers["all_gather"] + head_gathers) * full,
            "reduce_scatter": ring * (layers["reduce_scatter"] + 2) * full,
            "all_reduce": reduce_ring * (loss + norms)}
