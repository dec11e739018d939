"""A mixture-of-experts feed-forward: a router picks top_k experts per token.

    MoE(x) = shared(x) + Σ_k weight_k · expert_{index_k}(x)

The pieces keep transformers' layout (Mixtral, Qwen2-MoE), so one expert-parallel strategy
(plait.parallel.expert) serves both: the router is `gate`, a linear layer to one score per
expert; the routed experts are one module, `experts`, whose weights are 3-D parameters
(`gate_up_proj` (E, 2·hidden, d), `down_proj` (E, d, hidden)) and whose forward takes
(tokens, expert indices, weights). Expert parallelism slices those parameters along their
first dimension and wraps that forward with the all-to-all; nothing here knows about it.

Two routers (`GPTConfig.router`):

- **softmax** (Switch, Mixtral): top_k of softmax(scores), renormalised, plus a
  load-balancing loss E·Σ_e f_e·P_e (f_e: the share of the token's assignments that went to
  expert e, P_e: e's mean probability). It is computed per sequence and averaged, so that it
  is the same sum whatever the layout splits the batch into, and it reaches the gradients
  through `AuxLoss` (the block's output is unchanged; its backward adds the loss's
  gradient), so any layout, pipelines included, needs no second loss to carry.
- **sigmoid** (DeepSeek-V3's auxiliary-loss-free balancing): top_k of sigmoid(scores) +
  bias picks the experts, the unbiased scores weight them; after each optimizer step the
  bias moves by `bias_rate` towards balance, from the tokens each expert received over the
  whole step (every micro-batch, every rank: `after_routing`, which the executor's expert
  hooks call with the counts summed over the data ranks).

Dropless by default. With a capacity factor, an expert takes at most
ceil(factor · tokens · top_k / experts) assignments of a training forward; the rest get weight
0 (they still pass through the expert, and add nothing) and are counted as dropped. In eval
mode every token is routed: which tokens share a forward (the held-out samples dealt over dp,
a short micro-batch's padding) would otherwise change what is dropped, and the score with it.
Training's forwards hold the same samples on every layout (the layout-free sampler), so
their drops are the same.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.models.gpt.config import GPTConfig
from plait.models.gpt.lean import gated_down
from plait.parallel.expert.dispatch import by_expert, combine, tally
from plait.parallel.expert.ops import add_unless_recomputing, grouped_mm_loop


class RoutingCounts(nn.Module):
    """What a routing module keeps for the report and the sigmoid router's bias: the tokens
    each expert received (this rank's, summed over the training forwards since the last
    `take_counts`), dropped assignments, the last balancing loss; and that loss's weight
    (`aux_weight`: its coefficient × the backward's scale, plait.parallel.expert.set_aux_scale)."""

    def __init__(self, experts: int, top_k: int, aux_loss_coef: float):
        super().__init__()
        self.top_k, self.aux_loss_coef, self.aux_weight = top_k, aux_loss_coef, aux_loss_coef
        # integers, which a cast of the model (.to(bfloat16)) leaves as they are: counted in bf16
        # they were exact only up to 256 tokens
        self.register_buffer("tokens_per_expert", torch.zeros(experts, dtype=torch.int64), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        self.last_aux = torch.zeros(())

    def count(self, index: torch.Tensor) -> None:
        """Add one forward's choices (tokens, k) to the counts, if this forward counts."""
        self.add_if_counted(self.tokens_per_expert, tally(index.reshape(-1), len(self.tokens_per_expert)))

    def add_if_counted(self, total: torch.Tensor, amount: torch.Tensor) -> None:
        """total += amount if this forward's routing counts: a training forward, once; not a
        no-grad probe or evaluation, not recomputation's second forward inside backward. That
        last is asked when the addition runs (plait.parallel.expert.ops), not when
        torch.compile traces the block, which it does once for both."""
        if self.training and torch.is_grad_enabled():
            add_unless_recomputing(total, amount)

    def with_balance_loss(self, out: torch.Tensor, index: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """`out`, carrying the balancing loss's gradient (probs (batch, seq, E)) when it has a
        weight and a backward will run; the loss is kept for the report."""
        if self.aux_loss_coef <= 0 or not torch.is_grad_enabled():
            return out
        aux = balance_loss(index, probs, self.top_k)
        self.last_aux = aux.detach()
        return AuxLoss.apply(out, aux, self.aux_weight)

    def take_counts(self) -> torch.Tensor:
        """The tokens each expert received since the last call, and reset them."""
        counts = self.tokens_per_expert.clone()
        self.tokens_per_expert.zero_()
        return counts


class AuxLoss(torch.autograd.Function):
    """Identity on `out`; in backward, `weight` as the gradient of the auxiliary loss.

    `weight` is the loss's coefficient times the scale of this backward (1 / micro-batches,
    the fp16 loss scale), which the trainer sets on each MoE block before a step."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, weight: float) -> torch.Tensor:
        ctx.weight = weight
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.weight, dtype=ctx.aux_dtype, device=grad.device), None


def balance_loss(index: torch.Tensor, probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Mean over sequences of E·Σ_e f_e·P_e, from one forward's routing: `index` (tokens, k)
    the chosen experts, `probs` (batch, seq, E) the router's probabilities."""
    batch, seq, experts = probs.shape
    chosen = F.one_hot(index.reshape(batch, seq * top_k), experts).to(probs.dtype)
    share = chosen.mean(dim=1)  # (batch, E): f_e, the share of each sequence's assignments
    return (experts * (share * probs.mean(dim=1)).sum(dim=-1)).mean()


GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_fits(rows: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped matrix product takes these tensors: on a CPU fp32/bf16/fp16, on a
    Hopper or newer GPU bf16 (where it was measured: benchmarks/moe.py, RESULTS.md "GPU"), every
    row 16-byte aligned; and under torch.compile bf16 only, the one dtype its shape function
    takes in torch 2.13 (any other fails the compilation)."""
    if not hasattr(F, "grouped_mm") or rows.dtype not in GROUPED_DTYPES:
        return False
    if torch.compiler.is_compiling() and rows.dtype != torch.bfloat16:
        return False
    if rows.device.type == "cuda":
        # the properties, not get_device_capability: torch.compile folds them to constants
        if rows.dtype != torch.bfloat16 or torch.cuda.get_device_properties(rows.device).major < 9:
            return False
    elif rows.device.type != "cpu":
        return False
    return all(size * rows.element_size() % 16 == 0 for w in weights for size in w.shape[1:])


class Experts(nn.Module):
    """E SwiGLU experts as two 3-D parameters; forward(x, index, weight) -> (tokens, d).

    Assignments are sorted by expert, each expert runs over its contiguous rows (an expert
    with no tokens has an empty run), and the outputs are weighted and summed per token in a
    fixed order, so the result depends only on the routing."""

    def __init__(self, experts: int, d_model: int, hidden: int):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(experts, d_model, hidden))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """x (tokens, d); index and weight (tokens, k): each token's experts (local numbers) and weights."""
        rows, counts, order = by_expert(x, index, self.gate_up_proj.shape[0])
        return combine(self.grouped(rows, counts), order, weight)

    def grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each expert's SwiGLU over its run of `rows` (sorted by expert, counts[e] rows each):
        two grouped matrix products, torch's where it takes these tensors, else a loop of one
        product per expert (plait.parallel.expert.ops: an empty one too, so that the autograd
        graph stays whole). The runs' ends stay on the device: no host sync for torch's, and
        the loop reads them inside its op, so a compiled block is one graph either way."""
        ends = counts.cumsum(0).to(torch.int32)
        mm = F.grouped_mm if grouped_mm_fits(rows, self.gate_up_proj, self.down_proj) else grouped_mm_loop
        gate, up = mm(rows, self.gate_up_proj.transpose(1, 2), offs=ends).chunk(2, dim=-1)
        return gated_down(lambda product: mm(product, self.down_proj.transpose(1, 2), offs=ends), gate, up)


class SharedExpert(nn.Module):
    """The experts every token passes through, as one SwiGLU of shared·hidden units."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_down(self.down_proj, self.gate_proj(x), self.up_proj(x))


class MoE(RoutingCounts):
    """Router, routed experts, shared experts; (batch, seq, d) -> (batch, seq, d).

    Keeps what the closing report shows: the tokens each expert received (summed over the
    training forwards since the last `take_counts`), the last auxiliary loss, dropped
    assignments. A forward rerun by recomputation inside backward is not counted again."""

    def __init__(self, config: GPTConfig):
        super().__init__(config.experts, config.top_k, config.aux_loss_coef)
        self.router, self.capacity_factor, self.bias_rate = config.router, config.capacity_factor, config.bias_rate
        self.gate = nn.Linear(config.d_model, config.experts, bias=False)
        # The sigmoid router's balancing bias: moved by counts after each step, never by
        # gradients; a parameter so checkpoints carry it whatever the layout.
        self.expert_bias = nn.Parameter(torch.zeros(config.experts), requires_grad=False)
        self.experts = Experts(config.experts, config.d_model, config.expert_width)
        hidden = config.shared_width
        self.shared_expert = SharedExpert(config.d_model, hidden) if hidden else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d = x.shape
        flat = x.reshape(-1, d)
        scores = self.gate(flat)
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32))  # 16-bit weights route in fp32
        index, weight, probs = self.route(scores)
        if self.capacity_factor > 0 and self.training:
            weight = self._drop_over_capacity(index, weight)
        out = self.experts(flat, index, weight.to(x.dtype)).view(batch, seq, d)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        self.count(index)
        return self.with_balance_loss(out, index, probs.view(batch, seq, -1)) if self.router == "softmax" else out

    def route(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(each token's top_k experts, their weights, the router's probabilities), in fp32."""
        if self.router == "sigmoid":
            probs = torch.sigmoid(scores)
            index = torch.topk(probs + self.expert_bias.float(), self.top_k, dim=-1).indices
            weight = probs.gather(-1, index)
        else:
            probs = torch.softmax(scores, dim=-1)
            weight, index = torch.topk(probs, self.top_k, dim=-1)
        return index, weight / weight.sum(dim=-1, keepdim=True), probs

    def _apply(self, fn: Any, recurse: bool = True) -> "MoE":
        """Every cast and move of the module, but the balancing bias stays fp32: it moves by
        `bias_rate` a step (0.001 by default), which a 16-bit bias rounds away once it passes
        0.5 (bf16's spacing there is 0.0039), so a bf16 model's bias would stop balancing.
        No optimizer holds a master copy of it: it is trained by `after_routing` alone."""
        super()._apply(fn, recurse)
        if self.expert_bias.dtype != torch.float32:
            self.expert_bias.data = self.expert_bias.data.float()
        return self

    @torch.no_grad()
    def after_routing(self, seen: torch.Tensor) -> None:
        """After each optimizer step, the tokens each expert received over the whole step
        (every micro-batch and data rank): the sigmoid router's bias moves `bias_rate`
        towards balance, up for the experts below the mean, down for those above it."""
        if self.router == "sigmoid" and self.bias_rate > 0:
            seen = seen.double()
            self.expert_bias.add_(self.bias_rate * torch.sign(seen.mean() - seen).float())

    def _drop_over_capacity(self, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Weight 0 for assignments past an expert's capacity (in token order, first k first)."""
        experts = self.gate.out_features
        capacity = math.ceil(self.capacity_factor * index.numel() / experts)
        flat = index.t().reshape(-1)  # every token's first choice before any second choice
        seen = torch.cumsum(F.one_hot(flat, experts), dim=0).gather(1, flat[:, None]).squeeze(1)
        keep = (seen <= capacity).view(index.shape[1], -1).t()
        self.add_if_counted(self.dropped, (~keep).sum())
        return weight * keep

