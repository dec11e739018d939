"""Memory formulas against the ZeRO paper, Korthikanti et al., the seed's rule, and a
measurement of what autograd really saves on plait's own model."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Iterator
from dataclasses import replace

import pytest

from plait.errors import PlaitError
from plait.estimate import estimate_layout
from plait.estimate.activations import (
    in_flight,
    korthikanti_layer_bytes,
    layer_bytes,
    llama_layer_bytes,
    rmsnorm_bytes,
    loss_bytes,
    stage_activation_bytes,
    stage_extra_bytes,
)
from plait.balance import balanced_counts
from plait.estimate.layout import Workload, stages
from plait.estimate.memory import (
    BUCKET_BYTES,
    StateBytes,
    estimate_memory,
    memory_per_stage,
    model_states,
    seed_rule_bytes,
    state_bytes,
)
from plait.models.gpt.config import GPTConfig, get_preset
from plait.rules import RECOMPUTE

HAS_GPT = importlib.util.find_spec("plait.models.gpt.model") is not None


# -- model states: ZeRO (Rajbhandari et al. 2019), Figure 1 / Table 1 --------------------------
pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


@pytest.mark.parametrize("zero, expected_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.88)])
def test_zero_paper_7_5b_on_64_gpus(zero: int, expected_gb: float) -> None:
    """Ψ = 7.5 B, N_d = 64, K = 12 (mixed-precision Adam): the paper's memory column."""
    states = model_states(7_500_000_000, 0, Workload(dp=64, zero=zero, precision="bf16"))
    total_gb = (states.params + states.grads + states.optim) / 1e9
    assert total_gb == pytest.approx(expected_gb, abs=0.05)


def test_zero_paper_exact_terms() -> None:
    psi, n = 7_500_000_000, 64
    os_ = model_states(psi, 0, Workload(dp=n, zero=1, precision="bf16"))
    assert (os_.params, os_.grads, os_.optim) == (2 * psi, 2 * psi, 12 * psi // n)
    osgp = model_states(psi, 0, Workload(dp=n, zero=3, precision="bf16"))
    assert osgp.params + osgp.grads + osgp.optim == 16 * psi // n


def test_pure_fp32_adam_is_16_bytes_per_param() -> None:
    assert state_bytes("fp32") == StateBytes(4, 4, 8)
    assert state_bytes("bf16") == state_bytes("fp16") == StateBytes(2, 2, 12)
    states = model_states(1000, 0, Workload(precision="fp32"))
    assert states.params + states.grads + states.optim == 16_000


def test_zero3_holds_a_gathered_unit() -> None:
    states = model_states(64_000, 1_000, Workload(dp=64, zero=3, precision="bf16"))
    assert states.params == 2 * (1_000 + 1_000)  # own shard + gathered unit, 16-bit


def test_offload_moves_optimizer_to_host() -> None:
    cfg = get_preset("llama-7b")
    on = estimate_layout(cfg, dp=8, zero=2, offload=True, precision="bf16", seq_len=512)
    off = estimate_layout(cfg, dp=8, zero=2, precision="bf16", seq_len=512)
    assert on["memory"]["optim"] == off["memory"]["optim"]
    shard_params = off["memory"]["optim"] / 12  # master + m + v, fp32: the host also keeps the gradient's fp32 copy
    assert on["memory"]["host"] == pytest.approx(off["memory"]["optim"] + 4 * shard_params)
    device_gap = off["memory"]["total"] - on["memory"]["total"]
    assert device_gap == pytest.approx(1.1 * off["memory"]["optim"])  # plus its 10% allowance


# -- the seed's rule ------------------------------------------------------------------------------
def test_seed_rule_is_twelve_bytes_per_param() -> None:
    """"1 M params ≈ 12 MB, 1 B params ≈ 12 GB" in fp32."""
    assert seed_rule_bytes(1_000_000) == 12_000_000
    assert seed_rule_bytes(1_000_000_000) == 12_000_000_000


def test_seed_rule_is_sgd_with_momentum() -> None:
    """12 bytes = fp32 weight + grad + one momentum buffer: what torch's SGD(momentum) keeps
    (Adam keeps two buffers: 16 bytes, the ZeRO paper's fp32 figure)."""
    torch = pytest.importorskip("torch")
    from plait.bench.meter import storage_bytes

    def bytes_after_step(make_opt) -> int:
        layer = torch.nn.Linear(100, 100)
        opt = make_opt(layer.parameters())
        layer(torch.ones(1, 100)).sum().backward()
        opt.step()
        params = list(layer.parameters())
        states = [v for s in opt.state.values() for v in s.values() if v.ndim > 0]
        return storage_bytes(params) + storage_bytes([p.grad for p in params]) + storage_bytes(states)

    n = 100 * 100 + 100
    assert bytes_after_step(lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)) == seed_rule_bytes(n)
    assert bytes_after_step(lambda p: torch.optim.Adam(p)) == 16 * n


# -- activations: Korthikanti et al. 2022 ---------------------------------------------------------
GPT2_LIKE = GPTConfig(vocab_size=1000, n_layers=4, d_model=1024, n_heads=16, n_kv_heads=16,
                      ffn_hidden=4096, max_seq_len=2048, arch="gpt2")


def _korthikanti(t: int = 1, sp: bool = False, recompute: str = "none") -> float:
    return korthikanti_layer_bytes(GPT2_LIKE, Workload(tp=t, sp=sp, precision="bf16", micro_batch=2,
                                                     seq_len=2048, recompute=recompute))


def test_korthikanti_coefficients() -> None:
    s, b, h, a = 2048, 2, 1024, 16
    sbh = s * b * h
    assert _korthikanti() == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert _korthikanti(t=4) == pytest.approx(sbh * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    assert _korthikanti(t=4, sp=True) == pytest.approx(sbh * (34 + 5 * a * s / h) / 4)
    assert _korthikanti(recompute="full") == pytest.approx(2 * sbh)
    if "selective" in RECOMPUTE:  # the formula is ready; the policy is not trained yet (plait.rules)
        assert _korthikanti(recompute="selective") == pytest.approx(34 * sbh)
        assert _korthikanti(t=4, sp=True, recompute="selective") == pytest.approx(34 * sbh / 4)


def test_our_block_formula() -> None:
    """e·(6h + 2kv + 2f) + 8 + 4a bytes per token for plait's lean block (each norm's input and
    fp32 reciprocal rms; K/V grouped; o_proj reading SDPA's output as a view; gate and up, whose
    product down's backward makes again); TP splits all but the norms'
    8 + 4eh. A transformers block (lean_blocks false) keeps autograd's intermediates:
    e·(9h + 4f) + 8(h + 1) + 4a, the norms' fp32 copies and silu's output."""
    cfg = get_preset("llama-7b")
    h, f, a, kv, tokens = cfg.d_model, cfg.ffn_hidden, cfg.n_heads, cfg.kv_dim, 4096
    bf16 = Workload(precision="bf16", seq_len=4096)
    assert llama_layer_bytes(cfg, bf16) == tokens * (2 * (6 * h + 2 * kv + 2 * f) + 8 + 4 * a)
    assert llama_layer_bytes(cfg, replace(bf16, precision="fp32")) == tokens * (4 * (6 * h + 2 * kv + 2 * f) + 8 + 4 * a)
    tp4 = replace(bf16, tp=4)
    assert llama_layer_bytes(cfg, tp4) == tokens * (8 + 2 * 4 * h + (2 * (2 * h + 2 * kv + 2 * f) + 4 * a) / 4)
    sp4 = replace(tp4, sp=True)
    assert llama_layer_bytes(cfg, sp4) == pytest.approx(llama_layer_bytes(cfg, bf16) / 4)
    assert llama_layer_bytes(cfg, replace(bf16, recompute="full")) == tokens * 2 * h
    eager = replace(cfg, lean_blocks=False)
    assert llama_layer_bytes(eager, bf16) == tokens * (2 * (9 * h + 4 * f) + 8 * (h + 1) + 4 * a)
    assert llama_layer_bytes(eager, replace(bf16, precision="fp32")) == tokens * (4 * (11 * h + 4 * f + 2) + 4 * a)
    assert llama_layer_bytes(eager, tp4) == tokens * (8 * (h + 1) + 2 * 4 * h + (2 * (5 * h + 4 * f) + 4 * a) / 4)
    grouped = replace(cfg, n_kv_heads=8)  # 4 query heads to a K/V head: K and V a quarter as wide
    assert llama_layer_bytes(cfg, bf16) - llama_layer_bytes(grouped, bf16) == tokens * 2 * 2 * (h - h // 4)
    assert layer_bytes(GPT2_LIKE, bf16) == korthikanti_layer_bytes(GPT2_LIKE, bf16)


@contextlib.contextmanager
def _saves_counted(model: object) -> Iterator[dict[int, int]]:
    """While inside, the bytes autograd saves for backward by storage, the model's parameters
    and buffers excluded (as plait's ActivationMeter counts them)."""
    import torch

    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params and storage.nbytes():
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield saved


def _measure_saved(config: GPTConfig, batch: int, seq: int, dtype_name: str, with_loss: bool) -> int:
    """Bytes autograd saves in one forward, distinct storages, the model's parameters and
    buffers excluded (as plait's ActivationMeter counts them)."""
    import torch
    import torch.nn.functional as F

    from plait.models.gpt.model import build_gpt

    model = build_gpt(config, seed=0).to(getattr(torch, dtype_name))
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    with _saves_counted(model) as saved:
        logits = model(ids)
        if with_loss:
            F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
    return sum(saved.values())


SHAPES = {
    "tiny": get_preset("tiny"),  # grouped-query attention: 4 heads, 2 key/value heads
    "wide-mlp": GPTConfig(n_layers=3, d_model=96, n_heads=6, n_kv_heads=6, ffn_hidden=320),
    "one-head": GPTConfig(n_heads=1, n_kv_heads=1),  # SDPA's output reshapes as a view
}


def _step_keeping(config: GPTConfig, product_kept: bool, checkpointed: bool = False) -> tuple[int, list]:
    """(bytes saved for backward, the gradients) of one forward and backward of plait's GPT, its
    gated product kept for down's backward (the block before `gated_down`) or made again; each
    block under torch's checkpoint with `checkpointed` (--recompute full's)."""
    import unittest.mock

    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from plait.models.gpt import lean, model as gpt_model, moe
    from plait.models.gpt.model import build_gpt

    patched = (unittest.mock.patch.object(gpt_model, "gated_down", lean.product_kept),
               unittest.mock.patch.object(moe, "gated_down", lean.product_kept))
    with contextlib.ExitStack() as stack:
        for patch in patched if product_kept else ():
            stack.enter_context(patch)
        net = build_gpt(config, seed=0)
        if checkpointed:
            for block in net.blocks:
                block.forward = (lambda forward: lambda *a: checkpoint(forward, *a, use_reentrant=False))(block.forward)
        ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
        with _saves_counted(net) as saved:
            loss = F.cross_entropy(net(ids).flatten(0, 1), ids.flatten())
        loss.backward()
    return sum(saved.values()), [p.grad for p in net.parameters() if p.grad is not None]


@pytest.mark.skipif(not HAS_GPT, reason="plait/models/gpt/model.py not written yet")
def test_down_gets_the_gated_product_made_again() -> None:
    """plait's block keeps gate and up, not their product, for the down projection's weight
    gradient (models/gpt/lean.gated_down): exactly f values a token a block fewer (a routed
    expert's rows and a shared expert's too), the same gradients bit for bit, whatever else
    down saves still reaching the hooks outside (these counted its input's other saves).
    Under torch's checkpoint the block keeps its input alone either way."""
    import torch

    dense, routed = get_preset("tiny"), get_preset("tiny-moe")
    for config in (dense, routed):
        made, made_grads = _step_keeping(config, product_kept=False)
        kept, kept_grads = _step_keeping(config, product_kept=True)
        assert all(torch.equal(a, b) for a, b in zip(made_grads, kept_grads)) and len(made_grads) == len(kept_grads)
        if config is dense:
            assert kept - made == config.n_layers * 2 * 32 * config.ffn_hidden * 4
        else:
            assert kept > made
    made, made_grads = _step_keeping(dense, product_kept=False, checkpointed=True)
    kept, kept_grads = _step_keeping(dense, product_kept=True, checkpointed=True)
    assert made == kept and all(torch.equal(a, b) for a, b in zip(made_grads, kept_grads))


@pytest.mark.skipif(not HAS_GPT, reason="plait/models/gpt/model.py not written yet")
def test_the_gated_product_is_let_go_not_only_uncounted() -> None:
    """What a meter counts is what autograd holds; the product must also be gone from memory
    once the forward has run, with hooks outside or none. (While the hook that makes it again
    held it strongly, every save made inside held it until its backward: the meter read a
    fifth less, and the memory was the same.)"""
    import contextlib
    import unittest.mock
    import weakref

    import torch
    import torch.nn.functional as F

    from plait.models.gpt import lean
    from plait.models.gpt.model import build_gpt

    config = get_preset("tiny")
    made: list[weakref.ref] = []

    def noted(gate, up, slot=None):  # noqa: ANN001, ANN202 - the product, watched
        product = lean._GatedSiLU.apply(gate, up, slot)
        made.append(weakref.ref(product.untyped_storage()))
        return product

    net = build_gpt(config, seed=0)
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    for outside in (contextlib.nullcontext(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)):
        made.clear()
        with unittest.mock.patch.object(lean, "gated_silu", noted), outside:
            loss = F.cross_entropy(net(ids).flatten(0, 1), ids.flatten())
        assert len(made) == config.n_layers and not any(ref() is not None for ref in made)
        loss.backward()


def test_the_meter_counts_what_the_graph_still_holds() -> None:
    """A branch nothing reads frees what it saved before the forward ends; a buffer is
    resident. ActivationMeter counts neither: of three saves, x·w's input x (a fresh leaf, 4 KiB)
    and the kept branch's exp output (4 KiB) remain, and the dropped branch's 4 KiB sigmoid
    output is freed with it (counted by address at save time, it stayed in the sum)."""
    import torch
    from torch import nn

    from plait.bench.meter import ActivationMeter

    class Branches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1024))
            self.register_buffer("scale", torch.ones(1024))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * self.w  # saves x (and w, a weight)
            torch.sigmoid(y)  # saves its output; nothing reads it: freed at once
            return (y * self.scale).exp()  # saves scale (a buffer) and exp's output

    meter = ActivationMeter()
    with meter.track(model := Branches()):
        out = model(torch.randn(1024))
    assert out.requires_grad and meter.last == 2 * 4096


@pytest.mark.skipif(not HAS_GPT, reason="plait/models/gpt/model.py not written yet")
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("precision, dtype", [("fp32", "float32"), ("bf16", "bfloat16")])
@pytest.mark.parametrize("batch, seq", [(2, 64), (3, 100)])
def test_our_block_matches_saved_tensors(name: str, precision: str, dtype: str, batch: int,
                                         seq: int) -> None:
    """The prediction for the whole forward must be within 10% of what autograd saves."""
    config = SHAPES[name]
    layout = Workload(precision=precision, micro_batch=batch, seq_len=seq)
    predicted = stage_activation_bytes(config, layout, stages(config, 1, 1)[0])
    measured = _measure_saved(config, batch, seq, dtype, with_loss=False)
    assert predicted == pytest.approx(measured, rel=0.10)
    assert predicted == measured  # in fact the count is exact


@pytest.mark.skipif(not HAS_GPT, reason="plait/models/gpt/model.py not written yet")
def test_loss_keeps_fp32_log_softmax() -> None:
    """The loss adds its fp32 log-softmax (4 bytes per logit); memory.py books the loss
    (with the logits and their fp32 copy) as a buffer on the last stage."""
    config, layout = get_preset("tiny"), Workload(precision="bf16", micro_batch=2, seq_len=64)
    without = _measure_saved(config, 2, 64, "bfloat16", with_loss=False)
    with_loss = _measure_saved(config, 2, 64, "bfloat16", with_loss=True)
    log_softmax = 2 * 64 * config.vocab_size * 4
    assert with_loss - without == pytest.approx(log_softmax, abs=16)
    assert loss_bytes(config, layout) == 2 * 64 * config.vocab_size * (2 + 4 + 4)


def test_tp_and_sp_split_our_block_as_theory_says() -> None:
    """TP alone divides what lives inside the regions, TP + SP divides everything (the
    region inputs saved as sequence chunks, all-gathered again in backward)."""
    config = replace(get_preset("tiny"), n_heads=8, n_kv_heads=4)
    b, s, h, f, a = 2, 16, config.d_model, config.ffn_hidden, config.n_heads

    def block(t: int = 1, sp: bool = False, of: GPTConfig = config) -> float:
        return llama_layer_bytes(of, Workload(tp=t, sp=sp, precision="fp32", micro_batch=b, seq_len=s))

    outside = s * b * (2 * rmsnorm_bytes(h, 4))
    assert block() == s * b * (4 * (6 * h + 2 * config.kv_dim + 2 * f) + 8 + 4 * a)
    for t in (2, 4, 8):
        assert block(t) == pytest.approx(outside + (block() - outside) / t)
        assert block(t, sp=True) == pytest.approx(block() / t)
    # A transformers block copies SDPA's output for o_proj, but not where a rank holds one head
    # (a view then): one sbh/t fewer.
    eager = replace(config, lean_blocks=False)
    eager_outside = s * b * 2 * rmsnorm_bytes(h, 4, lean=False)
    assert block(8, of=eager) == pytest.approx(eager_outside + (block(of=eager) - eager_outside) / 8 - 4 * s * b * h / 8)


# -- pipelines ---------------------------------------------------------------------------------
def _stage(index: int, pp: int):
    return stages(get_preset("llama-7b"), 1, pp)[index]


def test_in_flight_micro_batches() -> None:
    assert in_flight(Workload(pp=4, grad_accum=8, schedule="gpipe"), _stage(0, 4)) == 8
    assert in_flight(Workload(pp=4, grad_accum=8), _stage(0, 4)) == 4  # 1F1B: p on stage 0
    assert in_flight(Workload(pp=4, grad_accum=8), _stage(3, 4)) == 1
    assert in_flight(Workload(pp=4, grad_accum=2), _stage(0, 4)) == 2  # never more than m
    inter = Workload(pp=4, grad_accum=8, schedule="interleaved", virtual_stages=2)
    assert in_flight(inter, _stage(0, 4)) == pytest.approx(4 * (1 + 3 / (4 * 2)))
    assert in_flight(Workload(grad_accum=8, schedule="gpipe"), _stage(0, 1)) == 1
    # m = 5 on 4 ranks, 3 chunks a rank: one round of 5 (plait.interleave), so each rank's
    # warm-up fills two later chunks of 5, 2 more chunk-forwards than rounds of 4 would hold
    three = stages(replace(get_preset("llama-7b"), n_layers=24), 1, 4, 3)
    one_round = Workload(pp=4, grad_accum=5, schedule="interleaved", virtual_stages=3)
    assert [in_flight(one_round, stage) * 3 for stage in three] == pytest.approx([15, 15, 13, 11])


def test_gradients_count_from_each_chunks_first_backward_under_interleaving() -> None:
    """plait makes a chunk's gradients at its first backward and drops them after the update
    (tests/test_pipeline_worlds.py holds the runner to it). With m = p every chunk-forward of
    the step runs before the rank's first backward: the activations peak beside one chunk's
    gradients, the last chunk's (its backward comes first: two blocks, and the head on the
    last stage), not the stage's. With many micro-batches every chunk's backward has begun
    inside the steady phase, and the peak holds every gradient, as under 1F1B."""
    cfg = get_preset("llama-7b")
    short = Workload(pp=4, virtual_stages=4, schedule="interleaved", precision="bf16", seq_len=4096, zero=1, dp=2,
                     grad_accum=4)
    per_param = state_bytes("bf16").grad
    for memory, stage in zip(memory_per_stage(cfg, short), stages(cfg, 1, 4, 4)):
        head = stage.params - stage.layers * cfg.layer_params() if stage.last else 0
        assert memory.grads - memory.grads_unmade == pytest.approx((2 * cfg.layer_params() + head) * per_param)
        device = memory.params + memory.grads - memory.grads_unmade + memory.optim + memory.buffers
        assert memory.total == pytest.approx(1.1 * (device + memory.activations))
    assert all(m.grads_unmade == 0 for m in memory_per_stage(cfg, replace(short, grad_accum=32)))
    assert all(m.grads_unmade == 0 for m in memory_per_stage(cfg, replace(short, schedule="1f1b", virtual_stages=1,
                                                                           grad_accum=8)))


def test_one_chunk_peaks_inside_its_first_backward_where_no_forward_follows_it() -> None:
    """Without a pipeline and with one micro-batch, the activations peak as backward starts,
    beside the head's gradients alone; backward then makes the rest as it frees the
    micro-batch: its end holds every gradient and no activation. What is not made at the
    peak is the lower of the two. At 4,096 tokens (16.1 GiB of activations) it is every
    gradient but the head's, 12.3 of 12.6 GiB; at 256 tokens, the micro-batch's activations,
    1.0 GiB. Accumulation's second forward runs beside every gradient, and so does 1F1B's
    steady phase (stage 3 of 4 with 2 micro-batches), where stage 0 runs both forwards first."""
    cfg = get_preset("llama-7b")
    long = Workload(dp=8, zero=1, precision="bf16", seq_len=4096)
    memory = estimate_memory(cfg, long)
    head = cfg.vocab_size * cfg.d_model * 2
    assert memory.grads_unmade == pytest.approx(memory.grads - head)
    assert memory.total == pytest.approx(1.1 * (memory.params + memory.grads - memory.grads_unmade + memory.optim
                                                + memory.buffers + memory.activations))
    short = replace(long, seq_len=256)
    stage = stages(cfg, 1, 1)[0]
    per_micro_batch = stage.layers * layer_bytes(cfg, short) + stage_extra_bytes(cfg, short, stage)
    assert estimate_memory(cfg, short).grads_unmade == pytest.approx(per_micro_batch)
    assert per_micro_batch < memory.grads - head
    assert estimate_memory(cfg, replace(long, grad_accum=2)).grads_unmade == 0
    piped = memory_per_stage(cfg, Workload(pp=4, grad_accum=2, precision="bf16", seq_len=4096))
    assert piped[0].grads_unmade > 0 and piped[3].grads_unmade == 0


def test_first_stage_is_busiest_under_1f1b() -> None:
    memory = estimate_memory(get_preset("llama-7b"),
                             Workload(pp=4, grad_accum=8, precision="bf16", seq_len=4096))
    assert memory.stage == 0


def test_stage_cut_balances_parameters() -> None:
    assert balanced_counts([1] * 32, 4) == [8, 8, 8, 8]
    # llama-1b: a 263 M-parameter tied embedding on both ends pushes blocks to the middle.
    cfg = get_preset("llama-1b")
    assert [s.layers for s in stages(cfg, 1, 4)] == [2, 6, 6, 2]


def test_zero2_buckets_and_accumulation() -> None:
    cfg = get_preset("llama-7b")
    one = estimate_memory(cfg, Workload(dp=8, zero=2, precision="bf16", seq_len=256))
    acc = estimate_memory(cfg, Workload(dp=8, zero=2, precision="bf16", seq_len=256, grad_accum=4))
    # the loss, and the rope tables: the model's buffers, cos and sin of max_seq_len x head_dim / 2
    loss = loss_bytes(cfg, Workload(precision="bf16", seq_len=256)) + cfg.max_seq_len * cfg.head_dim * 2
    assert one.buffers - loss == 2 * BUCKET_BYTES
    # Each backward reduce-scatters and drops its whole gradients (no_sync holds ZeRO-1's only)
    assert acc.buffers == one.buffers
    unit = estimate_memory(cfg, Workload(dp=8, zero=3, precision="bf16", seq_len=256, grad_accum=4))
    # ZeRO-3: two blocks' bf16 gradients in flight, and the root's (the final norm) through the whole backward
    assert unit.buffers - loss == (2 * cfg.layer_params() + cfg.d_model) * 2
    tied = dataclasses.replace(cfg, tie_embeddings=True)
    table = cfg.vocab_size * cfg.d_model
    held = estimate_memory(tied, Workload(dp=8, zero=3, precision="bf16", seq_len=256, grad_accum=4))
    assert held.buffers - loss == (2 * cfg.layer_params() + cfg.d_model + table) * 2  # a tied table is the root's


def test_params_only_leaves_activations_unknown() -> None:
    result = estimate_layout(None, params=7e9, dp=8, zero=1, precision="bf16")
    assert result["memory"]["activations"] is None
    assert result["memory"]["params"] == 14e9
    assert result["time"] is None
    with pytest.raises(PlaitError, match="tensor, pipeline and context parallelism need the model's shape"):
        estimate_layout(None, params=7e9, tp=2)


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(zero=4), "--zero must be 0, 1, 2 or 3"),
    (dict(offload=True), "--offload needs a ZeRO stage"),
    (dict(sp=True), "--sp splits the sequence across tensor-parallel ranks, and --tp is 1"),
    (dict(precision="fp4"), "unknown --precision 'fp4'"),
    (dict(dp=0), "--dp must be a whole number of at least 1"),
    (dict(tp=3), "n_heads = 32 is not divisible by tp=3"),
    (dict(pp=33), "is more than the model's 32 layers"),
    (dict(tp=2, model="gpt2-124m"), "vocab_size = 50257 is not divisible by tp=2"),  # train does not pad it
    (dict(precision="bf16", dp=8, reduce_dtype="fp64"), "unknown --reduce-dtype 'fp64'"),
    (dict(recompute="full", pp=2, schedule="zb-h1", grad_accum=2), "cannot run the zb-h1 schedule"),
    (dict(virtual_stages=2), "--virtual-stages > 1 needs --schedule interleaved"),
])
def test_bad_layouts_say_what_to_change(kwargs: dict, message: str) -> None:
    with pytest.raises(PlaitError) as err:
        kwargs = dict(kwargs)
        estimate_layout(get_preset(kwargs.pop("model", "llama-7b")), **kwargs)
    assert message in err.value.message
    assert err.value.hint


def test_model_or_params_not_both() -> None:
    with pytest.raises(PlaitError, match="not both"):
        estimate_layout(get_preset("tiny"), params=1000)
    with pytest.raises(PlaitError, match="nothing to estimate"):
        estimate_layout(None)
    with pytest.raises(PlaitError, match="--params must be a positive number"):
        estimate_layout(None, params=-5)


def test_the_peak_adds_the_largest_transient_of_setup_or_of_the_outputs() -> None:
    """tiny (vocabulary 256 × width 64, tied, two blocks of 49,280 parameters): the largest
    tensor is the embedding, 16,384 elements. Without a split, setup draws it whole in fp32
    and keeps it (2 × 4 bytes each), more than the outputs' group and one rank's pieces of
    it (2 × 4 in fp32). Under tp 2 the split check's copy (the embedding and both blocks,
    115,008 parameters, fp32) comes on top; in bf16 the copy is 2 bytes a parameter."""
    from plait.estimate.memory import largest_tensor, stand_in_params, transient_bytes

    config = get_preset("tiny")
    assert largest_tensor(config) == 256 * 64
    assert stand_in_params(config) == 16_448 + 2 * 49_280
    assert transient_bytes(config, Workload(dp=2)) == 2 * 4 * 16_384
    assert transient_bytes(config, Workload(tp=2)) == 2 * 4 * 16_384 + 4 * 115_008
    assert transient_bytes(config, Workload(tp=2, precision="bf16")) == 2 * 4 * 16_384 + 2 * 115_008
    memory = estimate_layout(config, Workload(tp=2, seq_len=64), hardware="cpu")["memory"]
    assert memory["peak"] == memory["total"] + memory["transient"] == memory["total"] + 2 * 4 * 16_384 + 4 * 115_008


def test_the_copy_keeps_one_block_of_each_kind_and_at_least_two() -> None:
    """An MoE every second block: one dense and one MoE block; all MoE: two MoE blocks."""
    from plait.estimate.memory import stand_in_params

    mixed = get_preset("tiny-moe,n_layers=4,moe_every=2")
    assert stand_in_params(mixed) == mixed.embedding_params() + mixed.block_params(0) + mixed.block_params(1)
    every = get_preset("tiny-moe,n_layers=4")
    assert stand_in_params(every) == every.embedding_params() + 2 * every.block_params(0)


def test_shared_experts_split_beside_whole_routed_ones_keep_a_tp_share_of_their_activations() -> None:
    """dots1's plan splits its shared experts by tp and leaves the routed ones whole: the shared
    SwiGLU keeps its gate and up (plait's lean block makes their product again) on a tp-th of
    its width on each rank (its GEMMs and bytes on the wire were priced so; its activations were
    counted whole)."""
    whole = GPTConfig(n_layers=2, d_model=64, n_heads=4, n_kv_heads=4, ffn_hidden=128, experts=4, top_k=2,
                      shared_experts=1, expert_hidden=32)
    split = replace(whole, tp_shared_experts=True)
    layout = Workload(tp=2, micro_batch=2, seq_len=16)
    shared_saved = 4 * 2 * whole.shared_width  # fp32, gate + up, a token (every block is MoE)
    assert layer_bytes(whole, layout) - layer_bytes(split, layout) == shared_saved / 2 * 32
    assert layer_bytes(whole, Workload(tp=1, micro_batch=2, seq_len=16)) == layer_bytes(split, Workload(
        tp=1, micro_batch=2, seq_len=16))


def test_interleaving_whose_chunks_do_not_divide_the_layers_is_priced_as_the_cut_it_makes() -> None:
    """30 layers in pp 4 × 2 chunks: plait cuts 8 stages balanced by parameters (the
    pipeline's cut, plait.estimate.layout.uneven_cut), and the estimate is that cut's, given
    as --stage-layers: each rank's blocks, its chunks' unequal activations walked over the
    schedule, its memory."""
    config = replace(get_preset("llama-7b"), n_layers=30)
    layout = Workload(pp=4, virtual_stages=2, schedule="interleaved", grad_accum=8, precision="bf16", seq_len=2048)
    shares = stages(config, 1, 4, 2)
    cut = [share.chunks for share in shares]
    assert sum(map(sum, cut)) == 30 and len({n for chunks in cut for n in chunks}) == 2  # 3s and 4s
    given = replace(layout, stage_layers=tuple(cut[rank][chunk] for chunk in range(2) for rank in range(4)))
    priced, as_given = memory_per_stage(config, layout), memory_per_stage(config, given)
    assert [m.as_dict() for m in priced] == [m.as_dict() for m in as_given]
