"""The time model's element-wise bytes (plait.estimate.ops.EW_*) against a count of what plait's
GPT block really moves, taken by a torch dispatch hook on the CPU.

The estimate prices a block's norms, RoPE, SiLU·mul and residual adds by the bytes they read
and write. Those counts are constants in ops.py; this test recounts them from the model's own
ops, in fp32 and in bf16, so a change to the block (or a wrong constant) fails here rather
than drifting the step-time prediction. In bf16 the norms pass over fp32 copies: that is why
the 16-bit set differs (on an H200 the 1 B GPT's element-wise kernels took 100 ms a step
where the fp32 set, read in 2-byte units, priced 52 ms; benchmarks/RESULTS.md, GPU section).
"""

from __future__ import annotations

import contextlib
import functools
import unittest.mock
from dataclasses import replace
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plait.estimate.layout import Workload
from plait.estimate.ops import elementwise_counts
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt

TOKENS = 64
# Work the estimate prices elsewhere (GEMMs, the attention core) or that moves nothing (views).
PRICED_ELSEWHERE = {"mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention_for_cpu",
                    "_scaled_dot_product_flash_attention_for_cpu_backward"}
VIEWS = {"view", "_unsafe_view", "transpose", "t", "slice", "expand", "as_strided", "permute", "unsqueeze",
         "squeeze", "split", "select", "detach", "alias", "unbind", "split_with_sizes", "_reshape_alias",
         "reshape", "flatten", "lift_fresh", "new_empty", "new_full"}  # an allocation (a let-go placeholder)


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _tensors(values: object) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (list, tuple)):
        return [t for v in values for t in _tensors(v)]
    return []


@contextlib.contextmanager
def zero_float8_products() -> Iterator[None]:
    """torch._scaled_mm, as torchao's float8 linears call it, returning zeros of its result's
    shape and dtype: the count reads the ops around each product, not its values, and on the CPU
    torch runs the product by a reference kernel (~0.1 GFLOP/s here: 9 of the eager fp8
    census's 10 seconds a shape). The product runs inside torchao's tensor subclass, below
    ByteCount, which never counts it either way."""
    real = torch._scaled_mm

    def zeros(a: torch.Tensor, b: torch.Tensor, *args: object, out_dtype: torch.dtype | None = None,
              **kwargs: object) -> torch.Tensor:
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype or torch.bfloat16)

    torch._scaled_mm = zeros
    try:
        yield
    finally:
        torch._scaled_mm = real


class ByteCount(TorchDispatchMode):
    """Bytes read plus written by every element-wise op run under it: each tensor argument
    and each result, whole, in its own dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name not in PRICED_ELSEWHERE and name not in VIEWS:
            moved = _tensors(list(args)) + _tensors(list((kwargs or {}).values())) + _tensors(out)
            self.bytes += sum(t.numel() * t.element_size() for t in moved)
        return out


def census(spec: str, dtype: torch.dtype, fp8: bool = False) -> tuple[float, float]:
    """(forward, backward) bytes per token of one block of `spec` in `dtype` (with `fp8`, its
    linears converted as --precision fp8 converts them)."""
    config = get_preset(spec)
    torch.manual_seed(0)
    model = _block_model(config, dtype, fp8)
    x = torch.randn(1, TOKENS, config.d_model, dtype=dtype, requires_grad=True)
    cos, sin = model.rope_cos[:TOKENS], model.rope_sin[:TOKENS]
    with zero_float8_products() if fp8 else contextlib.nullcontext():
        with ByteCount() as forward:
            y = model.blocks[0](x, cos, sin)
        grad = torch.randn_like(y)
        with ByteCount() as backward:
            y.backward(grad)
    return forward.bytes / TOKENS, backward.bytes / TOKENS


def _block_model(config: object, dtype: torch.dtype, fp8: bool) -> torch.nn.Module:
    model = build_gpt(config, 0).to(dtype)
    if fp8:
        from plait.parallel.fp8 import apply_fp8

        apply_fp8([model.blocks[0]], "tensorwise", torch.device("cpu"))
    return model


def priced(spec: str, precision: str) -> tuple[float, float]:
    """(forward, backward) bytes per token of one block as the estimate counts them: the
    constants are rounded from a fit over shapes like these (within 2.4% of each), so 3%
    catches a coefficient moved by a few units."""
    config = get_preset(spec)
    size = 4 if precision == "fp32" else 2
    work = Workload(seq_len=TOKENS, micro_batch=1, precision=precision)
    h, kv, f = config.d_model, config.kv_dim, config.ffn_hidden
    return tuple(size * (a * h + sliced * h + b * kv + c * f)  # type: ignore[return-value]
                 for a, sliced, b, c in elementwise_counts(config, work))


SHAPES = ("small,vocab_size=256,n_layers=1,d_model=256,n_heads=4,n_kv_heads=1,ffn_hidden=1024,max_seq_len=128",
          "small,vocab_size=256,n_layers=1,d_model=512,n_heads=8,n_kv_heads=8,ffn_hidden=1024,max_seq_len=128",
          "small,vocab_size=256,n_layers=1,d_model=384,n_heads=6,n_kv_heads=2,ffn_hidden=2048,max_seq_len=128")


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_block_bytes_match_the_hook_count(precision: str, dtype: torch.dtype) -> None:
    for spec in SHAPES:
        counted, estimated = census(spec, dtype), priced(spec, precision)
        for label, real, model in zip(("forward", "backward"), counted, estimated):
            assert model == pytest.approx(real, rel=0.03), f"{precision} {label} of {spec}: {model} vs {real}"


def test_bf16_block_moves_half_again_the_fp32_count_in_2_byte_units() -> None:
    """The reason for a 16-bit set: read in 2-byte units, the fp32 constants would miss a
    quarter of what a bf16 block moves."""
    spec = SHAPES[0]
    forward, backward = census(spec, torch.bfloat16)
    fp32_forward, fp32_backward = (b / 2 for b in priced(spec, "fp32"))
    assert fp32_forward < 0.8 * forward and fp32_backward < 0.8 * backward


def _runs_as_nothing(*args: object) -> None:
    """A compiled kernel that is not built: what it would have written stays unwritten."""


@functools.lru_cache(maxsize=None)  # a compile costs seconds; the bf16 counts serve two tests
def compiled_census(spec: str, dtype: torch.dtype, fp8: bool = False
                    ) -> tuple[tuple[float, float], tuple[int, int]]:
    """((forward, backward) bytes per token, (forward, backward) kernels) of one block of `spec`
    compiled as plait train --compile compiles it (its forward): what the compiler's own
    kernels read and write, by its count of each kernel's buffers (GEMMs and the attention
    core, which run as library calls, left out)."""
    import torch._inductor.config as inductor_config
    import torch._inductor.metrics as metrics
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    def kernels() -> tuple[float, int]:
        own = [(node, elements) for node, elements in metrics.nodes_num_elem
               if not isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode))]
        return sum(4 * elements for _, elements in own) / TOKENS, len(own)  # the count is in 4-byte units

    config = get_preset(spec)
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _block_model(config, dtype, fp8)
    model.blocks[0].forward = torch.compile(model.blocks[0].forward)
    x = torch.randn(1, TOKENS, config.d_model, dtype=dtype, requires_grad=True)
    cos, sin = model.rope_cos[:TOKENS], model.rope_sin[:TOKENS]
    torch._logging.set_logs(inductor_metrics=True)  # the compiler counts buffers only when asked
    # The count is the scheduler's, made as the kernels' code is written: their C++ is never
    # built (they run as nothing), which on a cold cache saved 10 s of the 33 for three shapes.
    unbuilt = contextlib.ExitStack()
    for name, kernel in (("cpp", lambda self, source: _runs_as_nothing),
                         ("cpp_pybinding", lambda self, argtypes, source: _runs_as_nothing)):
        unbuilt.enter_context(unittest.mock.patch.object(AsyncCompile, name, kernel))
    try:
        with unbuilt, inductor_config.patch(fx_graph_cache=False):  # a cached graph is not counted again
            metrics.reset()
            y = model.blocks[0](x, cos, sin)
            forward = kernels()
            metrics.reset()
            y.backward(torch.randn_like(y))
            backward = kernels()
    finally:
        torch._logging.set_logs()
        torch._dynamo.reset()
    return (forward[0], backward[0]), (forward[1], backward[1])


@pytest.mark.slow
@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_compiled_block_bytes_match_the_compilers_count(precision: str, dtype: torch.dtype) -> None:
    """plait estimate --compile (ops.EW_COMPILED, OPS_COMPILED) against the compiler's own count.
    At the 1.04 B GPT's shape the compiled set is 3.6x fewer bytes than eager's 16-bit one: on an
    H200 its compiled step measured 0.2215-0.2251 s, which the eager set predicted at 0.2693
    (h200 preset) and the compiled set at 0.2303 (benchmarks/RESULTS.md, GPU section)."""
    from plait.estimate.ops import OPS_COMPILED

    for spec in SHAPES:
        config = get_preset(spec)
        (forward, backward), launched = compiled_census(spec, dtype)
        work = Workload(seq_len=TOKENS, micro_batch=1, precision=precision, compiled=True)
        size = 4 if precision == "fp32" else 2
        h, kv, f = config.d_model, config.kv_dim, config.ffn_hidden
        for label, real, (a, sliced, b, c) in zip(("forward", "backward"), (forward, backward),
                                                  elementwise_counts(config, work)):
            assert size * (a * h + sliced * h + b * kv + c * f) == pytest.approx(real, rel=0.03), (label, spec)
        assert launched[0] <= OPS_COMPILED[0][0] and launched[1] <= OPS_COMPILED[1][0], launched


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_casts_match_the_count(compiled: bool) -> None:
    """What --precision fp8 moves beyond bf16 in one block (ops.fp8_cast_bytes: its inputs',
    output gradients' and weights' amaxes and casts), against the same counts as above, eager
    and compiled. Eager it is 6.6x what the compiled kernels move at the 1 B GPT's shape.
    Compiled, one shape (its kv narrower than h, its MLP 4h wide): a cold float8 compile took
    27 s here (2026-12-02); eager, all three hold how the count grows with h, kv and f."""
    pytest.importorskip("torchao", reason="fp8 needs the optional torchao")
    from plait.estimate.ops import fp8_cast_bytes

    for spec in SHAPES[:1] if compiled else SHAPES:
        config = get_preset(spec)
        count = (lambda fp8: compiled_census(spec, torch.bfloat16, fp8)[0]) if compiled else (
            lambda fp8: census(spec, torch.bfloat16, fp8))
        extra = [(cast - plain) * TOKENS for cast, plain in zip(count(True), count(False))]
        work = Workload(seq_len=TOKENS, micro_batch=1, precision="fp8", zero=1, compiled=compiled)
        for backward, real in enumerate(extra):
            assert fp8_cast_bytes(config, work, 1, bool(backward)) == pytest.approx(real, rel=0.03), (spec, backward)


@pytest.mark.parametrize("kv_heads", [8, 4, 2, 1])
def test_ulysses_reorderings_match_the_hook_count(kv_heads: int, monkeypatch) -> None:
    """Ulysses' copies around one attention (ops.ULYSSES_EW) against the hook's count, cp 2 in
    one process (the all-to-all a plain copy the hook does not see), less what the rank's own
    attention moves alone: K/V heads cp divides, and one K/V head repeated up to the query
    heads (priced as if cp divided them: 11% under forward). Within 12%: the backward's copies
    are not linear in the K/V heads (the attention's backward copies strided inputs)."""
    import torch.nn.functional as F
    from torch.utils._python_dispatch import _disable_current_modes

    import plait.parallel.context.ulysses as ulysses
    from plait.estimate.ops import ulysses_units
    from plait.models.gpt.config import GPTConfig
    from plait.runtime.comm import Axis, Ledger

    def exchange(out: torch.Tensor, full: torch.Tensor, axis: Axis, **_: object) -> None:
        with _disable_current_modes():
            out.copy_(full)

    def counted(attend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
        with ByteCount() as forward:
            out = attend(q, k, v)
        with ByteCount() as backward:
            out.backward(torch.randn_like(out))
        return forward.bytes, backward.bytes

    def tensors(heads: int, kv: int, tokens: int) -> list[torch.Tensor]:
        return [torch.randn(batch, n, tokens, head_dim, requires_grad=True) for n in (heads, kv, kv)]

    monkeypatch.setattr(ulysses.comm, "all_to_all", exchange)
    batch, local, head_dim, heads, cp = 2, 32, 16, 8, 2
    axis = Axis("cp", cp, 0, None, Ledger(), 0)
    whole = counted(lambda q, k, v: ulysses.ulysses_attention(q, k, v, axis), *tensors(heads, kv_heads, local))
    kept = (kv_heads if kv_heads % cp == 0 else heads) // cp  # the K/V heads the rank's attention sees
    alone = counted(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                    enable_gqa=kept != heads // cp),
                    *tensors(heads // cp, kept, cp * local))
    config = GPTConfig(d_model=heads * head_dim, n_heads=heads, n_kv_heads=kv_heads, max_seq_len=cp * local)
    work = Workload(cp=cp, cp_kind="ulysses", seq_len=cp * local, micro_batch=batch)
    for backward in (False, True):
        priced = 4 * ulysses_units(config, work, backward) * batch * local
        assert priced == pytest.approx(whole[backward] - alone[backward], rel=0.12), (backward, kv_heads)


class _OneBlock(torch.nn.Module):
    """A stage of one block, its rotary tables held: what StageWork runs."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.block, self.cos, self.sin = model.blocks[0], model.rope_cos[:TOKENS], model.rope_sin[:TOKENS]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, self.cos, self.sin)


def split_census(spec: str, dtype: torch.dtype) -> float:
    """Bytes a token one block's backward moves more as ZB-H1's I then W than as one backward."""
    from plait.parallel.pipeline.execute import StageWork

    config = get_preset(spec)
    moved = []
    for split in (False, True):
        torch.manual_seed(0)
        work = StageWork(_OneBlock(_block_model(config, dtype, False)), split_backward=split)
        y, state = work.forward(torch.randn(1, TOKENS, config.d_model, dtype=dtype), grad_input=True)
        grad = torch.randn_like(y)
        with ByteCount() as count:
            if split:
                work.backward_input(state, grad)
                work.backward_weight(state)
            else:
                work.backward(state, grad)
        moved.append(count.bytes / TOKENS)
    return moved[1] - moved[0]


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_the_split_backward_moves_what_is_priced(precision: str, dtype: torch.dtype) -> None:
    """ZB-H1's W makes again what one backward makes once: each norm's normalised values and
    the gated product, with its silu (ops.EW_SPLIT_NORM, EW_REMADE_W). A norm's backward asked
    for the input's gradient alone (I) or the scale's alone (W) computes that one
    (lean.asked): it ran whole in both, 34h more a block in fp32 (74h in bf16's 2-byte units)."""
    for spec in SHAPES:
        config = get_preset(spec)
        work = Workload(seq_len=TOKENS, micro_batch=1, precision=precision, pp=2, schedule="zb-h1")
        size, h, kv, f = (4 if precision == "fp32" else 2), config.d_model, config.kv_dim, config.ffn_hidden
        split, whole = (elementwise_counts(config, layout)[1] for layout in (work, replace(work, schedule="1f1b")))
        priced = size * sum(c * w for c, w in zip((a - b for a, b in zip(split, whole)), (h, h, kv, f)))
        counted = split_census(spec, dtype)
        assert priced == pytest.approx(counted, rel=0.01), f"{precision} {spec}: {priced} vs {counted}"


class OpCount(TorchDispatchMode):
    """Compute ops (not views, not the products priced elsewhere) run under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__.split(".")[0]
        self.ops += name not in PRICED_ELSEWHERE and name not in VIEWS
        return func(*args, **(kwargs or {}))


def test_each_product_made_again_is_an_op_priced() -> None:
    """Backward runs one op more for each gated product made again (ops.OPS_REMADE: the
    multiplication; its silu is the one the gate's backward would make), and an MoE block of
    plait's makes two, its routed experts' and its shared experts' (ops.remade_calls)."""
    from plait.estimate.ops import OPS_REMADE, remade_calls
    from plait.models.gpt import lean, moe
    from plait.models.gpt import model as gpt_model

    dense = SHAPES[0]
    for spec in (dense, f"{dense},experts=4,top_k=2,shared_experts=1"):
        config = get_preset(spec)
        counted = []
        for keep in (False, True):
            torch.manual_seed(0)
            with contextlib.ExitStack() as patches:
                if keep:
                    for module in (gpt_model, moe):
                        patches.enter_context(unittest.mock.patch.object(module, "gated_down", lean.product_kept))
                model = _block_model(config, torch.float32, False)
                x = torch.randn(1, TOKENS, config.d_model, requires_grad=True)
                y = model.blocks[0](x, model.rope_cos[:TOKENS], model.rope_sin[:TOKENS])
            with OpCount() as count:
                y.backward(torch.randn_like(y))
            counted.append(count.ops)
        assert counted[0] - counted[1] == remade_calls(config) * OPS_REMADE[1][0] * config.n_layers, (spec, counted)
