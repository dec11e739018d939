"""Each sharded layer against the dense layer it was cut from (same seed): outputs and grads.

Every check returns the largest relative error; the test asks for < 1e-5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.parallel.tensor.plan import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                   apply_tensor_parallel, gather_full_params, tp_loss_fn,
                                   vocab_parallel_cross_entropy)
from plait.parallel.tensor import regions
from plait.runtime.comm import Axis


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def column(axis: Axis, sp: bool, b: int = 2, h: int = 8) -> dict[str, float]:
    t, r, s = axis.size, axis.rank, 2 * axis.size
    dense = nn.Linear(h, 4 * t)
    layer = ColumnParallelLinear.from_dense(dense, axis, {}, sequence_parallel=sp)
    x, w = torch.randn(b, s, h), torch.randn(b, s, 4 * t)
    xd = _leaf(x)
    yd = dense(xd)
    (yd * w).sum().backward()
    xt = _leaf(x.chunk(t, 1)[r] if sp else x)
    yt = layer(xt)
    (yt * w.chunk(t, -1)[r]).sum().backward()
    grad_x = xd.grad.chunk(t, 1)[r] if sp else xd.grad
    return {"y": rel(yt, yd.chunk(t, -1)[r]), "dx": rel(xt.grad, grad_x),
            "dw": rel(layer.weight.grad, dense.weight.grad.chunk(t, 0)[r]),
            "db": rel(layer.bias.grad, dense.bias.grad.chunk(t, 0)[r])}


def row(axis: Axis, sp: bool, b: int = 2, h: int = 8) -> dict[str, float]:
    t, r, s = axis.size, axis.rank, 2 * axis.size
    dense = nn.Linear(4 * t, h)
    layer = RowParallelLinear.from_dense(dense, axis, {}, sequence_parallel=sp)
    x, w = torch.randn(b, s, 4 * t), torch.randn(b, s, h)
    xd = _leaf(x)
    yd = dense(xd)
    (yd * w).sum().backward()
    xt = _leaf(x.chunk(t, -1)[r])
    yt = layer(xt)
    (yt * (w.chunk(t, 1)[r] if sp else w)).sum().backward()
    return {"y": rel(yt, yd.chunk(t, 1)[r] if sp else yd), "dx": rel(xt.grad, xd.grad.chunk(t, -1)[r]),
            "dw": rel(layer.weight.grad, dense.weight.grad.chunk(t, 1)[r]),
            "db": rel(layer.bias.grad, dense.bias.grad)}


def embedding(axis: Axis, sp: bool, b: int = 2, h: int = 8) -> dict[str, float]:
    t, r, s = axis.size, axis.rank, 2 * axis.size
    dense = nn.Embedding(6 * t, h)
    layer = VocabParallelEmbedding.from_dense(dense, axis, {}, sequence_parallel=sp)
    ids, w = torch.randint(0, 6 * t, (b, s)), torch.randn(b, s, h)
    yd = dense(ids)
    (yd * w).sum().backward()
    yt = layer(ids)
    (yt * (w.chunk(t, 1)[r] if sp else w)).sum().backward()
    return {"y": rel(yt, yd.chunk(t, 1)[r] if sp else yd),
            "dw": rel(layer.weight.grad, dense.weight.grad.chunk(t, 0)[r])}


def cross_entropy(axis: Axis, tokens: int = 10) -> dict[str, float]:
    t, r = axis.size, axis.rank
    logits, targets = torch.randn(tokens, 5 * t) * 3, torch.randint(0, 5 * t, (tokens,))
    dense = _leaf(logits)
    loss_d = F.cross_entropy(dense, targets)
    loss_d.backward()
    local = _leaf(logits.chunk(t, -1)[r])
    loss_t = vocab_parallel_cross_entropy(local, targets, axis)
    loss_t.backward()
    return {"loss": rel(loss_t, loss_d), "dlogits": rel(local.grad, dense.grad.chunk(t, -1)[r])}


def sequence_round_trip(axis: Axis, b: int = 2, h: int = 3) -> dict[str, float]:
    """scatter then gather is the identity; its gradient is t·w (t ranks' identical grads summed)."""
    x, w = torch.randn(b, 2 * axis.size, h), torch.randn(b, 2 * axis.size, h)
    xt = _leaf(x)
    y = regions.gather_from_sequence(regions.scatter_to_sequence(xt, axis), axis)
    (y * w).sum().backward()
    return {"y": rel(y, x), "dx": rel(xt.grad, axis.size * w)}


class TinyLM(nn.Module):
    """A user model: embedding, one residual MLP with biases, an untied output head."""

    def __init__(self, vocab: int = 32, width: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(x)


USER_PLAN = {"embed": "vocab", "up": "column", "down": "row", "head": "vocab"}


def user_model(axis: Axis, sp: bool) -> dict[str, float]:
    """The plan from docs/tensor.md on TinyLM: loss and every gathered gradient vs dense."""
    torch.manual_seed(4)
    dense, ids = TinyLM(), torch.randint(0, 32, (2, 2 * axis.size + 1))
    model = TinyLM()
    model.load_state_dict(dense.state_dict())
    apply_tensor_parallel(model, axis, plan=USER_PLAN, sp=sp)
    loss_d = F.cross_entropy(dense(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss_d.backward()
    loss_t = tp_loss_fn(model)(model(ids[:, :-1]), ids[:, 1:])
    loss_t.backward()
    for param in model.parameters():  # gather the gradients through the parameters' slots
        param.data = param.grad
    grads = gather_full_params(model)
    out = {"loss": rel(loss_t, loss_d)}
    out.update({name: rel(grads[name], p.grad) for name, p in dense.named_parameters()})
    return out


def all_layer_errors(axis: Axis) -> dict[str, float]:
    torch.manual_seed(3)  # every rank draws the same dense layers and inputs
    out: dict[str, float] = {}
    for sp in (False, True):
        tag = "sp" if sp else "tp"
        for name, check in (("column", column), ("row", row), ("embedding", embedding)):
            out.update({f"{tag}.{name}.{k}": v for k, v in check(axis, sp).items()})
    out.update({f"loss.{k}": v for k, v in cross_entropy(axis).items()})
    out.update({f"seq.{k}": v for k, v in sequence_round_trip(axis).items()})
    for sp in (False, True):
        out.update({f"user{'.sp' if sp else ''}.{k}": v for k, v in user_model(axis, sp).items()})
    return out
