"""`--recompute selective` under `--compile`: one graph per block, the same gradients, and
the attention core's log-sum-exp still not saved (its output is o_proj's input, kept by
o_proj as a view whether or not the core reruns).

One block of the tiny GPT, compiled as plait compiles blocks (the instance's forward), with
and without selective recomputation, against the eager block without it. The fast row uses
the aot_eager backend: Dynamo's trace and AOTAutograd's forward/backward partition, which
are where a graph breaks and where recomputation is decided, without Inductor's C++ build
(~30 s cold here); the slow row runs Inductor through `apply_compile` itself.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import pytest
import torch

from plait.bench.meter import ActivationMeter
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.parallel.compiled import apply_compile, compile_stats
from plait.parallel.recompute import apply_recompute
from plait.runtime.env import set_cpu_threads

TINY = get_preset("tiny")
BATCH, SEQ = 2, 32


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


@contextlib.contextmanager
def as_one_of_two_ranks() -> Iterator[None]:
    """torch's threads as plait sets them for each rank of a 2-rank world. Inductor keys a
    compiled graph by that count among the rest, so the block compiled here without
    recomputation is, key for key, the compiled dp 2 row's (tests/matrix.py, gpt/n2+compile):
    on a cold cache one compile serves both (the row's two misses, about 20 s of CPU here,
    become hits)."""
    threads = torch.get_num_threads()
    set_cpu_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _block(selective: bool) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model = build_gpt(TINY, 0)
    if selective:
        apply_recompute(model, "selective")
    return copy.deepcopy(model.blocks[0]), model.rope_cos[:SEQ], model.rope_sin[:SEQ]


def _step(selective: bool, backend: str | None) -> tuple[list[torch.Tensor], int, dict]:
    """Input and weight gradients of one forward and backward, the bytes saved for backward,
    and Dynamo's counts (graph breaks, graphs) for this block alone."""
    block, cos, sin = _block(selective)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if backend == "inductor":
        apply_compile([block], torch.device("cpu"))
    elif backend is not None:
        block.forward = torch.compile(block.forward, backend=backend)  # as apply_compile does
    x = torch.randn(BATCH, SEQ, TINY.d_model, generator=torch.Generator().manual_seed(0), requires_grad=True)
    meter = ActivationMeter()
    with meter.track(block):
        out = block(x, cos, sin)
    out.square().sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())], meter.last, compile_stats()


def _core_only_bytes() -> int:
    """What SDPA keeps for its backward that nothing else keeps: its fp32 log-sum-exp (its
    output is o_proj's input, a view of the same storage)."""
    return 4 * BATCH * TINY.n_heads * SEQ


def test_eager_selective_recompute_is_bit_identical_and_drops_the_core_log_sum_exp():
    grads, saved, _ = _step(selective=False, backend=None)
    grads_s, saved_s, _ = _step(selective=True, backend=None)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_s))
    assert saved_s == saved - _core_only_bytes()


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_block_with_selective_recompute_is_one_graph_with_the_same_gradients(
        backend):
    with as_one_of_two_ranks():
        reference, _, _ = _step(selective=False, backend=None)
        _, saved, _ = _step(selective=False, backend=backend)
        grads, saved_s, stats = _step(selective=True, backend=backend)
    assert stats["graph_breaks"] == 0, stats["break_reasons"]
    assert stats["graphs"] == 1
    for got, want in zip(grads, reference):
        torch.testing.assert_close(got, want)  # fp32's default tolerances: compiled kernels round differently
    # The core's log-sum-exp is recomputed, not saved. AOTAutograd keeps the CPU generator's
    # state (5,056 bytes) to rerun SDPA, an op it counts as seeded.
    assert saved_s <= saved - _core_only_bytes() + torch.get_rng_state().numel()
