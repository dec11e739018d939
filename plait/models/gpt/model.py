"""A Llama-style decoder: RMSNorm, rotary positions, SwiGLU, causal attention via SDPA.

Small on purpose: every parallel strategy in plait is tested against this model built on
one process, so it must be easy to read and deterministic to initialise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.gpt.config import GPTConfig
from plait.models.gpt.lean import gated_down, rms_norm
from plait.models.gpt.adapter import GPTAdapter
from plait.models.gpt.moe import MoE
from plait.models.gpt.rope import apply_rope, rope_angles, rope_tables
from plait.parallel.packed import document_attention

TEMPERATURE = 0.8  # sampling temperature of the run's closing sample


class RMSNorm(nn.Module):
    """x / rms(x) * weight: a LayerNorm without the mean and the bias.

    The rms runs in fp32 whatever the weights' dtype, as Llama's does: in fp16 the backward
    of rsqrt (mean(x²)^-1.5 for activations of ~0.02) overflows 65504. In fp32 the casts
    are no-ops, the same operations in the same order. Backward recomputes the normalised
    values from the input and the rms (plait.models.gpt.lean): no fp32 copies are kept.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     documents: torch.Tensor | None = None) -> torch.Tensor:
    """The attention core: softmax(q·kᵀ/√d, causal)·v, by SDPA. Grouped K/V heads arrive
    unexpanded (so that context parallelism moves n_kv_heads, not n_heads) and stay so: SDPA
    shares each among its group of query heads (enable_gqa), so backward keeps n_kv_heads too.
    `documents` (batch, seq): packed documents' numbers; a query then sees its own document only
    (FlexAttention's block mask on a GPU, SDPA with a boolean mask elsewhere: plait.parallel.packed)."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return document_attention(q, k, v, documents)


class Attention(nn.Module):
    """Causal self-attention with grouped key/value heads (n_kv_heads <= n_heads)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        # plait.parallel.recompute may wrap this to rerun it in backward (--recompute selective)
        self.attention_core: Callable[..., torch.Tensor] = causal_attention
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.k_proj = nn.Linear(config.d_model, config.kv_dim, bias=False)
        self.v_proj = nn.Linear(config.d_model, config.kv_dim, bias=False)
        self.o_proj = nn.Linear(config.d_model, config.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # Heads are read from the projection's width, so a tensor-parallel shard that holds
        # fewer heads runs this same code.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attention_core(q, k, v) if documents is None else self.attention_core(q, k, v, documents)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)): the gated MLP of Llama, its product made again for down's
    backward rather than kept (plait.models.gpt.lean.gated_down)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(config.d_model, config.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(config.ffn_hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_down(self.down_proj, self.gate_proj(x), self.up_proj(x))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x)); the MLP is a
    mixture of experts in the blocks the config names (GPTConfig.moe_layer)."""

    def __init__(self, config: GPTConfig, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.d_model, config.norm_eps)
        self.mlp: nn.Module = MoE(config) if config.moe_layer(index) else SwiGLU(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: torch.Tensor | None = None) -> torch.Tensor:
        # Only packed documents add an argument: a plan that names the attention's inputs
        # (torch's PrepareModuleInput) sees the three it always had.
        attended = self.attn(self.attn_norm(x), cos, sin) if documents is None else \
            self.attn(self.attn_norm(x), cos, sin, documents)
        x = x + attended
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token ids (batch, seq) -> next-token logits (batch, seq, vocab)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.arch != "llama":
            raise ValueError(f"GPT builds arch='llama' only, not {config.arch!r} (shape-only)")
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        # Not persistent: derived from the config, so checkpoints need not carry them.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # Tensor parallelism sets this: its logits hold a slice of the vocabulary per rank,
        # and sampling needs all of them.
        self.gather_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual outputs scaled by 1/sqrt(2·layers)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith("expert_bias"):
                nn.init.zeros_(param)
            elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                nn.init.normal_(param, std=residual_std)
            else:
                nn.init.normal_(param, std=0.02)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` (1 or batch, seq): the tokens' positions when they are not 0..seq-1 (a
        context-parallel rank holds two chunks of the sequence: plait.parallel.context; packed
        documents restart at 0). `document_ids` (batch, whole seq): packed documents' numbers
        (plait.parallel.packed); attention then stays inside each document."""
        seq = idx.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"sequence of {seq} tokens exceeds max_seq_len {self.config.max_seq_len}")
        cos, sin = rope_angles(self.rope_cos, self.rope_sin, seq, position_ids)
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, cos, sin) if document_ids is None else block(x, cos, sin, document_ids)
        return self.lm_head(self.norm(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = TEMPERATURE,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample `new_tokens` tokens after the prompt `idx` (batch, seq)."""
        for _ in range(new_tokens):
            context = idx[:, -self.config.max_seq_len:]
            logits = self(context)[:, -1, :]  # through __call__, so hooks see it
            if self.gather_vocab is not None:
                logits = self.gather_vocab(logits)
            idx = torch.cat((idx, sample_next(logits, temperature, generator)), dim=1)
        return idx


def sample_next(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """One token id per row, drawn from softmax(logits / temperature): (batch, vocab) -> (batch, 1)."""
    probs = torch.softmax(logits.float() / max(temperature, 1e-6), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


# What the strategies ask of this model (plait.parallel.seam), found on the class.
GPT.plait_adapter = GPTAdapter()  # type: ignore[attr-defined]


def build_gpt(config: GPTConfig, seed: int) -> GPT:
    """Build the full model from a seed, so every layout starts from the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(config)
