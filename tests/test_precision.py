"""Mixed precision in one process: the loss scaler, selective recompute, and the estimator's bytes.

The multi-process proofs (parity per layout, the all-ranks verdict, resume) are in
tests/test_precision_worlds.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from plait.errors import PlaitError
from plait.estimate import estimate_layout
from plait.estimate.activations import stage_activation_bytes
from plait.estimate.layout import Workload, stages
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.parallel.compose import build_optimizer
from plait.parallel.masters import MasterOptimizer
from plait.parallel.precision import LossScaler, scale_grad
from plait.parallel.recompute import apply_recompute
from plait.estimate.memory import StateBytes
from tests.worlds.zero_common import paper_states
from plait.bench.meter import ActivationMeter, model_state_bytes

pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


TINY = get_preset("tiny")


def test_the_scale_halves_on_overflow_and_doubles_after_n_clean_steps():
    scaler = LossScaler(1024.0, growth_interval=3, dynamic=True)
    for _ in range(2):
        scaler.update(True)
    assert scaler.scale == 1024.0
    scaler.update(True)
    assert scaler.scale == 2048.0
    scaler.update(False)
    assert (scaler.scale, scaler.skipped, scaler.clean_steps) == (1024.0, 1, 0)
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale == 2048.0
    restored = LossScaler.for_precision("fp16")
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()
    fixed = LossScaler.for_precision("bf16")
    fixed.update(False)
    assert (fixed.scale, fixed.skipped) == (1.0, 1)


def test_an_fp32_or_bf16_checkpoints_scale_does_not_reset_fp16s():
    fp16 = LossScaler.for_precision("fp16", 4096.0)
    fp16.load_state_dict({"scale": 1.0, "clean_steps": 5, "skipped": 2})
    assert (fp16.scale, fp16.skipped) == (4096.0, 2)


def test_fp16_stops_when_the_scale_cannot_go_lower(monkeypatch):
    """At scale 1 an inf is no overflow of the scale's making: fp16 stops as fp32 does."""
    import plait.parallel.precision as precision
    from plait.runtime.comm import Axis, Ledger

    world = Axis("world", 1, 0, None, Ledger())
    monkeypatch.setattr(precision, "first_nonfinite", lambda model, squares=None: "the gradient of w")
    guard = precision.StepGuard("fp16", world, torch.device("cpu"), loss_scale=2.0)
    assert guard.step(0, torch.nn.Linear(1, 1), None, 1.0, math.inf) == (pytest.approx(math.nan, nan_ok=True), False)
    assert guard.scaler.scale == 1.0
    with pytest.raises(PlaitError, match="step 2: the gradient of w went non-finite on rank 0"):
        guard.step(1, torch.nn.Linear(1, 1), None, 1.0, math.inf)


def test_scale_grad_scales_backward_only():
    x = torch.tensor([3.0], requires_grad=True)
    loss = scale_grad((x * 2).sum(), 512.0)
    assert loss.item() == 6.0
    loss.backward()
    assert x.grad.item() == 1024.0


def _run(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, list[torch.Tensor], int]:
    meter = ActivationMeter()
    with meter.track(model):
        logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()], meter.last


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_selective_recompute_changes_no_number_and_saves_what_the_estimator_says(dtype):
    """Bit-identical loss and gradients; the attention core's log-sum-exp is not kept (its output
    is o_proj's input, kept as a view either way)."""
    plain = build_gpt(TINY, 0).to(dtype)
    selective = copy.deepcopy(plain)
    assert apply_recompute(selective, "selective") == TINY.n_layers
    tokens = torch.randint(0, TINY.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    loss, grads, saved = _run(plain, tokens)
    loss_s, grads_s, saved_s = _run(selective, tokens)
    assert loss_s == loss
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_s))
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    for policy, measured in (("none", saved), ("selective", saved_s)):
        layout = Workload(precision=precision, micro_batch=2, seq_len=32, recompute=policy)
        predicted = stage_activation_bytes(TINY, layout, stages(TINY, 1, 1)[0])
        assert measured == pytest.approx(predicted, rel=0.10), policy
    assert saved_s < saved


def test_selective_recompute_needs_an_attention_core():
    with pytest.raises(PlaitError, match="offers no attention core"):
        apply_recompute(torch.nn.Linear(2, 2), "selective")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_memory_report_matches_the_estimator_per_precision(precision):
    """One process, no ZeRO: (4 + 4 + 8) bytes in fp32, (2 + 2 + 12) with 16-bit weights."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model = build_gpt(TINY, 0).to(dtype)
    optimizer = build_optimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    assert isinstance(optimizer, MasterOptimizer) == (precision != "fp32")
    _run(model, torch.randint(0, TINY.vocab_size, (1, 8)))
    optimizer.step()
    measured = model_state_bytes(model, optimizer)
    predicted = estimate_layout(TINY, precision=precision, seq_len=8)["memory"]
    for kind in ("params", "grads", "optim"):
        assert measured[kind] == predicted[kind], kind
    psi = TINY.num_params()
    wide = precision == "fp32"
    assert measured == {**measured, **paper_states(0, psi, 1, StateBytes(4, 4, 8) if wide else StateBytes(2, 2, 12))}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_16_bit_states_follow_the_zero_formulas(zero):
    """2 + 2 + 12 bytes per parameter, each term divided by dp once ZeRO shards it."""
    psi, n = 10**9, 8
    memory = estimate_layout(None, params=psi, dp=n, zero=zero, precision="fp16")["memory"]
    for kind, share in (("params", 2 / (n if zero >= 3 else 1)), ("grads", 2 / (n if zero >= 2 else 1)),
                        ("optim", 12 / (n if zero >= 1 else 1))):  # (2 + 2 + 12)Ψ, each /dp once sharded
        assert memory[kind] == pytest.approx(share * psi, rel=1e-6), kind


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_reduce_dtype_sets_the_gradient_wire_bytes(zero):
    """bf16 gradients reduced in fp32 cost twice the bytes; the weights' all-gather does not change."""
    psi, n = 10**9, 4
    ring = {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n}
    op = "all_reduce" if zero == 0 else "reduce_scatter"
    for reduce_dtype, size in (("", 2), ("bf16", 2), ("fp16", 2), ("fp32", 4)):
        comm = estimate_layout(None, params=psi, dp=n, zero=zero, precision="bf16", reduce_dtype=reduce_dtype)["comm"]
        assert comm["dp"][op] == pytest.approx(ring[op] * psi * size), reduce_dtype
    with pytest.raises(PlaitError, match="unknown --reduce-dtype 'fp8'"):
        Workload(precision="bf16", reduce_dtype="fp8")


def test_master_optimizer_skipped_state_and_masters_stay_fp32():
    model = build_gpt(TINY, 0).half()
    optimizer = build_optimizer(model, torch.optim.AdamW, lr=1e-2)
    _run(model, torch.randint(0, TINY.vocab_size, (1, 8)))
    optimizer.grad_scale = 0.5
    optimizer.step()
    assert optimizer.grad_scale == 1.0  # used once
    for param, master in optimizer.masters.items():
        assert master.dtype == torch.float32 and torch.equal(param, master.half())
    assert set(optimizer.state[next(iter(optimizer.masters))]) >= {"exp_avg", "exp_avg_sq", "master"}
    assert all(torch.isfinite(p.detach()).all() for p in model.parameters())


def test_one_read_of_the_gradients_gives_the_finite_check_and_the_norm():
    """Each piece's fp64 sum of squares: non-finite exactly when an element is (the largest
    finite fp32 values must not read as overflow), and the clipping norm torch computes."""
    from plait.parallel.clip import clip_grad_norm, gradient_squares
    from plait.parallel.precision import first_nonfinite

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    squares = gradient_squares(model)
    assert squares.names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    expected = torch.tensor([p.grad.double().pow(2).sum() for p in model.parameters()])
    assert torch.allclose(squares.values, expected, rtol=1e-12)
    assert first_nonfinite(model, squares) is None
    reference = copy.deepcopy(model)
    for p, r in zip(model.parameters(), reference.parameters()):
        r.grad = p.grad.clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    assert clip_grad_norm(model, 0.5, squares) == pytest.approx(float(torch_norm), rel=1e-6)
    for p, r in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, r.grad, rtol=1e-6)
    model[1].weight.grad.fill_(3e38)  # finite, and its fp32 square would overflow
    assert first_nonfinite(model) is None
    model[1].weight.grad[0, 1] = float("nan")
    assert first_nonfinite(model) == "the gradient of 1.weight"
    model[0].bias.grad[2] = float("-inf")
    assert first_nonfinite(model) == "the gradient of 0.bias"


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_the_clip_factor_is_applied_once_inside_the_fused_kernel_or_by_one_multiply(kernel, monkeypatch):
    """masters.step_scaled: fused AdamW divides by 1/factor as it reads each gradient (no pass
    of its own); the foreach kernel gets one multi-tensor multiply. Both step the masters as
    an fp32 AdamW stepped on the scaled gradients does."""
    from plait.parallel import masters

    torch.manual_seed(0)
    weights = [torch.randn(16, 8), torch.randn(8)]
    grads = [torch.randn_like(w) for w in weights]
    factor = 0.37
    params = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    optimizer = MasterOptimizer([{"params": params}], torch.optim.AdamW, lr=1e-2, **{kernel: True})
    reference = [torch.nn.Parameter(p.detach().float()) for p in params]
    plain = torch.optim.AdamW(reference, lr=1e-2)
    multiplies = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a: multiplies.append(a[1]) or real(*a))
    for _ in range(3):
        for p, r, g in zip(params, reference, grads):
            p.grad, r.grad = g.to(torch.bfloat16), g.to(torch.bfloat16).float() * factor
        optimizer.grad_scale = factor
        optimizer.step()
        plain.step()
    assert multiplies.count(factor) == (0 if kernel == "fused" else 3)  # foreach AdamW multiplies by its own too
    for master, r in zip(optimizer.masters.values(), reference):
        torch.testing.assert_close(master, r, rtol=1e-6, atol=1e-7)
    assert masters._folds_grad_scale(optimizer.inner) == (kernel == "fused")


@pytest.mark.parametrize("compiled", [False, True])
def test_the_compiled_update_steps_as_torchs_fused_adamw_in_one_pass(compiled):
    """--optimizer-kernel compiled (plait.parallel.compiled_update): bf16 weights, fp32
    masters, a decayed and an undecayed group, the clip factor read with the gradient. Torch's
    fused kernel takes the first step (it makes the state); from then on the one pass does,
    eagerly and compiled by Inductor (C++ here), and steps the masters as torch's fused AdamW
    does (within fp32 rounding) and writes each weight as its master rounded to bf16."""
    from plait.parallel import compiled_update

    torch.manual_seed(0)
    weights = [torch.randn(16, 8), torch.randn(8), torch.randn(24)]
    groups = lambda ps: [{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}]  # noqa: E731
    ours = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    theirs = [torch.nn.Parameter(w.to(torch.bfloat16)) for w in weights]
    kwargs = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    optimizer = MasterOptimizer(groups(ours), torch.optim.AdamW, compiled_update=True, **kwargs)
    if not compiled:
        optimizer.compiled.compiled = compiled_update.adamw_pass
    reference = MasterOptimizer(groups(theirs), torch.optim.AdamW, **kwargs)
    for _ in range(4):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        optimizer.grad_scale = reference.grad_scale = 0.37
        optimizer.step()
        reference.step()
        assert all(master.grad is None for master in optimizer.masters.values())  # no fp32 gradient kept
    assert optimizer.compiled.steps == 3 and optimizer.grad_scale == 1.0
    for (param, master), ref in zip(optimizer.masters.items(), reference.masters.values()):
        torch.testing.assert_close(master, ref, rtol=1e-6, atol=1e-7)
        assert torch.equal(param, master.to(torch.bfloat16))
    steps = [float(s["step"]) for s in optimizer.inner.state.values()]
    assert steps == [4.0] * 3  # torch's state, stepped: checkpoints read it as ever


def test_the_compiled_update_cuts_its_runs_again_when_a_state_is_replaced():
    """step_flat keeps its runs while the shards, groups and states are the tensors they were
    cut from. A piece whose moments are replaced by new tensors (a state loaded as new
    tensors) gets its runs cut again at the next step: the new moment is the one stepped, and
    the piece is now a run of its own."""
    from plait.api import parallelize
    from plait.parallel import compiled_update
    from plait.parallel.compose import ParallelConfig
    from plait.runtime.env import ProcessEnv
    from plait.runtime.mesh import init_mesh

    mesh = init_mesh(zero=1, env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
    tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    model = parallelize(build_gpt(TINY, 0).to(torch.bfloat16), mesh, ParallelConfig())
    optimizer = build_optimizer(model, torch.optim.AdamW, lr=1e-2, compiled_update=True)
    optimizer.compiled.compiled = compiled_update.adamw_pass

    def step() -> None:
        model(tokens[:, :-1]).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    step()
    runs = optimizer.compiled.tensors
    piece = optimizer.slices[0].pieces[1]  # within a run of several pieces
    old = optimizer.state[piece]["exp_avg"]
    new = old.clone()
    optimizer.state[piece]["exp_avg"] = new
    kept = old.clone()
    step()
    assert optimizer.compiled.plans_made == 2
    assert optimizer.compiled.tensors > runs
    assert torch.equal(old, kept) and not torch.equal(new, kept)


def test_the_compiled_update_is_refused_where_nothing_is_fused():
    from plait.rules import check_optimizer_kernel

    with pytest.raises(PlaitError, match="16-bit weights"):
        check_optimizer_kernel("compiled", "fp32", False)
    with pytest.raises(PlaitError, match="--offload steps them on the host"):
        check_optimizer_kernel("compiled", "bf16", True)
    check_optimizer_kernel("compiled", "fp8", False)
    with pytest.raises(PlaitError, match="fp32 masters of 16-bit weights"):
        build_optimizer(build_gpt(TINY, 0), torch.optim.AdamW, compiled_update=True, lr=1e-3)
    # the library's own call, with an optimizer the pass cannot stand in for: one line, no ValueError
    sixteen_bit = build_gpt(TINY, 0).to(torch.bfloat16)
    with pytest.raises(PlaitError, match="the optimizer is SGD"):
        build_optimizer(sixteen_bit, torch.optim.SGD, compiled_update=True, lr=1e-3)
    with pytest.raises(PlaitError, match="the optimizer is AdamW with amsgrad"):
        build_optimizer(sixteen_bit, torch.optim.AdamW, compiled_update=True, lr=1e-3, amsgrad=True)


@pytest.mark.parametrize("frozen", [False, True])
def test_the_compiled_update_under_zero_steps_runs_of_pieces_as_torchs_kernel_does(frozen):
    """ZeRO-1 in one process, bf16: the compiled pass (run eagerly here) over runs of
    consecutive pieces of a group, its moments one flat pair made with the optimizer, trains
    the weights torch's fused AdamW does, within a bf16 rounding; a frozen block's pieces
    get no state and no step, as under torch's kernel."""
    from plait.api import parallelize
    from plait.parallel import compiled_update
    from plait.parallel.compose import ParallelConfig
    from plait.runtime.env import ProcessEnv
    from plait.runtime.mesh import init_mesh

    mesh = init_mesh(zero=1, env=ProcessEnv("single", 0, 1, 0, "127.0.0.1", 29500))
    tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))

    def trained(compiled: bool) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        gpt = build_gpt(TINY, 0).to(torch.bfloat16)
        if frozen:
            gpt.blocks[0].requires_grad_(False)
        model = parallelize(gpt, mesh, ParallelConfig())
        optimizer = build_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1, fused=True,
                                    compiled_update=compiled)
        if compiled:
            optimizer.compiled.compiled = compiled_update.adamw_pass
        for _ in range(3):
            model(tokens[:, :-1]).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        return [p.detach().float() for p in model.parameters()], optimizer

    theirs, reference = trained(False)
    ours, optimizer = trained(True)
    assert (optimizer.compiled.steps, optimizer.compiled.plans_made) == (3, 1)  # runs cut once, kept
    pieces = sum(len(part.pieces) for part in optimizer.slices)
    # each block's norm, attention, norm, MLP: 4 runs for 9 parameters (the frozen block none)
    assert (optimizer.compiled.tensors, pieces) == ((6, 11) if frozen else (10, 20))
    assert len(optimizer.state) == len(reference.state)  # no state for a frozen piece
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=2.5e-4)  # a bf16 ulp at these weights' size, at most
