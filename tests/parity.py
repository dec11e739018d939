"""How parity tests compare numbers, in one place so every strategy is held to the same bar.

- Losses: elementwise rtol 1e-5.
- Gradients: max |a - b| <= rtol · max |b| per tensor (scale-relative), since a gradient
  component that is ~0 has no meaningful relative error.
- Parameters after AdamW: rtol 1e-5 plus atol 5e-6. Adam divides each update by sqrt(v):
  for components whose gradient is near zero, a last-bit difference in the gradient (from
  summing micro-batches in another order: a ring all-reduce vs a sequential accumulation)
  moves the update by up to ~lr·δg/(|g| + eps). Torch's own DDP differs from one process
  by the same ~1e-6 on the same runs; the tests assert that too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5
PARAM_RTOL, PARAM_ATOL = 1e-5, 5e-6


def assert_losses_close(actual: Sequence[float], expected: Sequence[float], rtol: float = LOSS_RTOL) -> None:
    assert len(actual) == len(expected), (len(actual), len(expected))
    torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64),
                               torch.tensor(expected, dtype=torch.float64), rtol=rtol, atol=0.0)


def assert_grad_norms_close(actual: Sequence[float], expected: Sequence[float], rtol: float) -> None:
    """Each step's whole-gradient norm, before the clip. Every parity row compares it besides
    losses and weights: clipping and AdamW's division by sqrt(v) hide a gradient's scale from
    both (a reduction that sums where it should average trains the same losses), the norm
    does not. `rtol` is the row's: 16-bit gradients summed in another order differ more."""
    assert_losses_close(actual, expected, rtol=rtol)


def assert_scale_close(actual: Sequence[float], expected: Sequence[float], rtol: float = GRAD_RTOL) -> None:
    a, b = torch.tensor(actual, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    worst = (a - b).abs().max().item()
    assert worst <= rtol * b.abs().max().item(), f"max diff {worst:.3g} > {rtol} × max |expected| {b.abs().max():.3g}"


def assert_params_close(actual: dict[str, list[float]], expected: dict[str, list[float]],
                        rtol: float = PARAM_RTOL, atol: float = PARAM_ATOL) -> None:
    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    for name in expected:
        torch.testing.assert_close(torch.tensor(actual[name]), torch.tensor(expected[name]), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"parameter {name}: {m}")


def weight_excess(weights: dict[str, "torch.Tensor"], reference: dict[str, "torch.Tensor"],
                  rtol: float = PARAM_RTOL, atol: float = 0.0) -> float:
    """max(|a − b| − atol − rtol·|b|) over every element of every weight: <= 0 when they are
    allclose, at most the parity atol when they agree as AdamW allows. Elementwise, since
    Adam turns a gradient that is exactly 0 in theory (GPT-2's key bias: softmax ignores a
    shift shared by every key) into ±lr-sized noise either way. A world computes it where
    the weights are and reports the number; the test holds it to the bar."""
    assert weights.keys() == reference.keys(), sorted(set(weights) ^ set(reference))
    return max(((weights[k] - v).abs() - atol - rtol * v.abs()).max().item() for k, v in reference.items())
