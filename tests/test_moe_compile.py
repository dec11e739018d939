"""A compiled MoE block is one graph and computes what the eager block does.

plait compiles each block's forward (plait.parallel.compiled); here one block of tiny-moe is
compiled the same way with the `aot_eager` backend (dynamo and AOTAutograd, the parts that
break graphs and functionalize the routing counts, without Inductor's C++ build), for both
routers, with and without a capacity, in fp32 (the experts' loop op under compile) and bf16
(torch's grouped matrix product), and under recomputation. Graph breaks are read from
torch's own counter after a reset. The loop op (plait.parallel.expert.ops) is checked by
torch's opcheck and against one product per expert.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters

from plait.models.gpt import moe as moe_module
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.parallel.expert.ops import grouped_mm_loop
from plait.parallel.recompute import apply_recompute

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2)}


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _blocks(router: str, capacity: float, dtype: torch.dtype, recompute: bool = False):
    """(eager block, its compiled copy) of tiny-moe's first block, an MoE block."""
    model = build_gpt(get_preset("tiny-moe", router=router, capacity_factor=capacity), seed=0).to(dtype)
    if recompute:
        apply_recompute(model, "full")
    eager = model.blocks[0]
    assert isinstance(eager.mlp, moe_module.MoE)
    compiled = copy.deepcopy(eager)
    compiled.forward = torch.compile(compiled.forward, backend="aot_eager")
    seq = 16
    return eager, compiled, (model.rope_cos[:seq], model.rope_sin[:seq]), seq


def _step(block, x, rope):
    x = x.detach().clone().requires_grad_()
    out = block(x, *rope)
    out.float().square().mean().backward()
    return out, x.grad, {n: p.grad for n, p in block.named_parameters() if p.grad is not None}


def _assert_compiled_equals_eager(router: str, capacity: float, dtype: torch.dtype, recompute: bool = False):
    eager, compiled, rope, seq = _blocks(router, capacity, dtype, recompute)
    x = torch.randn(2, seq, eager.mlp.gate.in_features, generator=torch.Generator().manual_seed(1), dtype=dtype)
    torch._dynamo.reset()
    counters.clear()
    got = _step(compiled, x, rope)
    breaks = dict(counters["graph_break"])
    assert not breaks, f"{sum(breaks.values())} graph breaks: {list(breaks)}"
    want = _step(eager, x, rope)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], **tol)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], **tol, msg=lambda m: f"{name}: {m}")
    # the routing's counts, kept by a custom op: added once per training forward, as in eager
    assert torch.equal(compiled.mlp.tokens_per_expert, eager.mlp.tokens_per_expert)
    assert eager.mlp.tokens_per_expert.sum() == 2 * seq * eager.mlp.top_k
    assert torch.equal(compiled.mlp.dropped, eager.mlp.dropped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("router, capacity", [("softmax", 0.0), ("sigmoid", 1.0)])
def test_a_compiled_moe_block_has_no_graph_break_and_equals_eager(router: str, capacity: float,
                                                                   dtype: torch.dtype) -> None:
    _assert_compiled_equals_eager(router, capacity, dtype)


def test_the_experts_loop_compiles_whole_and_equals_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch's grouped product does not fit (an older GPU, say), eager and compiled both loop."""
    monkeypatch.setattr(moe_module, "grouped_mm_fits", lambda *tensors: False)
    _assert_compiled_equals_eager("softmax", 1.0, torch.float32)


def test_a_recomputed_compiled_block_counts_its_routing_once() -> None:
    """Recomputation's second forward runs inside backward, and the count op skips it there.
    (The sigmoid router: the softmax one keeps its last loss on the module, which
    torch.compile does not take inside a checkpoint, and breaks the graph there.)"""
    _assert_compiled_equals_eager("sigmoid", 1.0, torch.float32, recompute=True)


def test_the_experts_loop_op_is_one_product_per_expert_and_passes_opcheck() -> None:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(7, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    b = torch.randn(3, 8, 4, dtype=torch.float64, generator=generator, requires_grad=True)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)  # expert 1 has no rows
    expected = torch.cat([a[:2] @ b[0], a[2:2] @ b[1], a[2:] @ b[2]])
    torch.testing.assert_close(grouped_mm_loop(a, b, offs), expected, rtol=0, atol=0)
    grads = torch.autograd.grad((grouped_mm_loop(a, b, offs) ** 2).sum(), (a, b))
    torch.testing.assert_close(grads, torch.autograd.grad((expected ** 2).sum(), (a, b)))
    assert torch.count_nonzero(grads[1][1]) == 0
    torch.testing.assert_close(grouped_mm_loop(a.float(), b.float(), offs),
                               F.grouped_mm(a.float(), b.float(), offs=offs), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(grouped_mm_loop, (a, b, offs))
