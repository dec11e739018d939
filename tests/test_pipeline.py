"""Pipeline executor without processes: stage cuts, bad input, and the runner on one rank.

With pp = 1 the runner still walks the schedule action by action (chunks hand their
activations over locally), so the F/B/I/W machinery is checked here against a plain
backward; tests/test_pipeline_worlds.py does the same across processes.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import plait
from plait.errors import PlaitError
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.balance import balanced_counts
from plait.parallel.pipeline.runner import PipelineRunner, apply_pipeline, check_pipeline, split_stages
from plait.parallel.pipeline.execute import let_go_of_values
from plait.parallel.pipeline.p2p import delivery_proofs, send_order
from plait.parallel.pipeline.split import rank_stages
from plait.schedule.build import build_schedule, simulate
from plait.runtime.comm import Axis, Ledger


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def config(layers: int = 8, tied: bool = True):
    return dataclasses.replace(get_preset("tiny"), n_layers=layers, tie_embeddings=tied)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def micro_batches(m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    rows = torch.randint(0, 256, (m, 2, 13), generator=torch.Generator().manual_seed(m))
    return [r[:, :-1] for r in rows], [r[:, 1:] for r in rows]


# -- stage split ---------------------------------------------------------------------------------
def test_default_split_balances_blocks_by_parameter_count():
    counts = lambda layers, pp: [len(s.blocks) for s in split_stages(build_gpt(config(layers), 0), pp)]  # noqa: E731
    assert counts(2, 2) == [1, 1]
    assert counts(8, 4) == [2, 2, 2, 2]
    assert counts(8, 2) == [4, 4]


def test_a_heavy_first_stage_gets_fewer_blocks():
    counts = balanced_counts([10] * 6, 3, first_extra=25)
    assert counts[0] == 1 and sum(counts) == 6
    stage_costs = [10 * c + (25 if i == 0 else 0) for i, c in enumerate(counts)]
    assert max(stage_costs) == 35  # the best any cut can do


def test_explicit_balance_and_global_names():
    first, second = split_stages(build_gpt(config(8), 0), 2, balance=[3, 5])
    assert (len(first.blocks), len(second.blocks)) == (3, 5)
    assert first.embed is not None and first.lm_head is None and second.embed is None
    assert second.global_name("blocks.0.attn.q_proj.weight") == "blocks.3.attn.q_proj.weight"
    assert second.global_name("lm_head.weight") == "lm_head.weight"


@pytest.mark.parametrize("pp,v", [(1, 1), (2, 1), (4, 1), (2, 2), (2, 4), (4, 2)])
def test_stages_in_a_row_are_the_model(pp, v):
    model = build_gpt(config(8), 0)
    tokens = torch.randint(0, 256, (2, 12))
    x = tokens
    for stage in split_stages(model, pp, virtual_stages=v):
        x = stage(x)
    assert torch.equal(x, model(tokens))


def test_tied_head_is_its_own_copy_only_when_stages_are_on_two_ranks():
    first, *_, last = split_stages(build_gpt(config(8), 0), 2)
    assert last.lm_head.weight is not first.embed.weight
    assert torch.equal(last.lm_head.weight, first.embed.weight)
    assert first.shares_tied_weight and last.shares_tied_weight
    first, *_, last = split_stages(build_gpt(config(8), 0), 1, virtual_stages=2)
    assert last.lm_head.weight is first.embed.weight and not last.shares_tied_weight


def test_interleaved_placement_is_round_robin():
    stages = split_stages(build_gpt(config(8), 0), 2, virtual_stages=2)
    assert [s.index for s in rank_stages(stages, 1, 2)] == [1, 3]
    assert [len(s.blocks) for s in stages] == [2, 2, 2, 2]


def test_send_order_lists_every_message_once_in_the_senders_order():
    order = send_order(build_schedule("interleaved", 2, 4, 2), 2, 2)
    # Rank 0 -> 1 carries stage 0's and stage 2's activations and stage 2's input gradients.
    kinds = {(kind, stage) for kind, _, stage in order[(0, 1)]}
    assert kinds == {("act", 1), ("act", 3), ("grad", 1)}
    assert all(len(keys) == len(set(keys)) for keys in order.values())
    assert sum(map(len, order.values())) == 2 * 4 * 3  # m messages each way over 3 boundaries


def test_delivery_proofs_let_1f1b_hold_two_messages_where_the_step_sends_m():
    """Rank 0 of a 2-rank 1F1B learns acts 0..i are delivered from grad i; rank 1 learns
    grads 0..i are delivered from act i + 2, sent once rank 0 had grad i (B i before F i + 2)."""
    proofs = delivery_proofs(build_schedule("1f1b", 2, 4), 2, 1)
    assert proofs[0] == {("grad", i, 0): i + 1 for i in range(4)}
    assert proofs[1] == {("act", 2, 1): 1, ("act", 3, 1): 2}


def test_a_sent_output_keeps_its_graph_and_drops_its_values():
    """Once F has sent a stage's output the rank keeps its graph for B, not its values: the
    backward is the same, and the output's storage holds one element. A view keeps its own."""
    torch.manual_seed(0)
    layer, x, grad = torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    kept, sent = layer(x).tanh() + x, layer(x).tanh() + x
    let_go_of_values(sent)
    assert sent.shape == kept.shape and sent.untyped_storage().nbytes() == 4
    torch.autograd.backward(kept, grad)
    expected, x.grad = x.grad.clone(), None
    torch.autograd.backward(sent, grad)
    assert torch.equal(x.grad, expected)
    view = (layer(x) * 2)[1:]
    let_go_of_values(view)
    assert view.untyped_storage().nbytes() == 4 * 8 * 4


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,words", [
    ({"pp": 4}, "more than the model's 2 layers"),
    ({"pp": 2, "virtual_stages": 2}, "more than the model's 2 layers"),
    ({"pp": 2, "balance": [2]}, "1 block counts, and the layout has pp=2 × virtual stages 1 = 2 stages"),
    ({"pp": 3, "balance": [1, 0, 1]}, "leaves a middle stage without a block"),
    ({"pp": 2, "balance": [1, 2]}, "gives 3 blocks, and the model has 2"),
])
def test_bad_splits_say_what_to_change(kwargs, words):
    with pytest.raises(PlaitError, match=words) as info:
        split_stages(build_gpt(config(2), 0), **kwargs)
    assert info.value.hint


@pytest.mark.parametrize("layers, pp, v, cut", [(6, 2, 2, [1, 2, 2, 1]), (5, 2, 2, [1, 1, 2, 1]),
                                                 (10, 2, 4, [1, 1, 1, 1, 1, 2, 2, 1]), (8, 2, 2, [2, 2, 2, 2])])
def test_interleaving_balances_chunks_where_the_layers_do_not_divide_into_them(layers, pp, v, cut):
    """Equal chunks where pp·v divides the layers (Megatron's cut); else the pp·v stages
    balanced by parameters as pp stages are, the embedding on the first and the head on the
    last, which the estimator's cut is too (plait.estimate.layout.uneven_cut)."""
    from plait.estimate.layout import uneven_cut

    stages = split_stages(build_gpt(config(layers), 0), pp, virtual_stages=v)
    assert [len(stage.blocks) for stage in stages] == cut
    assert list(uneven_cut(config(layers), pp, v, ())) == (cut if layers % (pp * v) else [])


def test_one_rank_runner_gives_the_plain_gradients_over_unequal_chunks():
    """Six blocks in four chunks on one rank (1, 2, 2, 1): the same loss and gradients as the
    whole model."""
    m, mesh = 4, plait.init_mesh()
    model = build_gpt(config(6), 0)
    stages = apply_pipeline(model, mesh, virtual_stages=4)
    assert [len(stage.blocks) for stage in stages] == [1, 2, 2, 1]
    runner = PipelineRunner(stages, mesh, "interleaved")
    inputs, targets = micro_batches(m)
    loss = runner.step(inputs, targets, loss_fn)
    expected_loss, expected = reference_grads(m, tied=True, layers=6)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    for stage in stages:
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.grad, expected[stage.global_name(name)], rtol=1e-5, atol=1e-7)


def fake_mesh(pp: int) -> SimpleNamespace:
    """Enough of a Mesh for the checks that run before any message is sent."""
    axis = Axis("pp", pp, 0, None, Ledger())
    return SimpleNamespace(axis=lambda name: axis, device=torch.device("cpu"))


def test_unknown_schedule_and_chunks_without_interleaving_are_refused():
    stages = rank_stages(split_stages(build_gpt(config(8), 0), 2, virtual_stages=2), 0, 2)
    with pytest.raises(PlaitError, match="unknown --schedule 'pipedream'"):
        PipelineRunner(stages, fake_mesh(2), "pipedream")
    with pytest.raises(PlaitError, match="--virtual-stages > 1 needs --schedule interleaved"):
        PipelineRunner(stages, fake_mesh(2), "1f1b")


def test_check_pipeline_needs_no_model_or_processes():
    check_pipeline(8, 2, "interleaved", 4, virtual_stages=2)
    for m in (2, 6):  # fewer micro-batches than ranks (one round of 2), or one round of 6: both run
        check_pipeline(8, 4, "interleaved", m, virtual_stages=2)
    with pytest.raises(PlaitError, match="more than the model's 2 layers"):
        check_pipeline(2, 4, "1f1b", 8)
    with pytest.raises(PlaitError, match="unknown --schedule '1f2b'"):
        check_pipeline(8, 2, "1f2b", 8)


def test_split_backward_refuses_a_weight_shared_inside_one_stage():
    stages = apply_pipeline(build_gpt(config(2, tied=True), 0), plait.init_mesh())
    with pytest.raises(PlaitError, match="one tensor") as info:
        PipelineRunner(stages, plait.init_mesh(), "zb-h1")
    assert "untie" in info.value.hint


def test_micro_batches_of_different_shapes_are_refused():
    mesh = plait.init_mesh()
    runner = PipelineRunner(apply_pipeline(build_gpt(config(2), 0), mesh), mesh, "gpipe")
    inputs, targets = micro_batches(2)
    with pytest.raises(PlaitError, match="one shape"):
        runner.step([inputs[0], inputs[1][:1]], targets, loss_fn)


# -- the runner on one process --------------------------------------------------------------------
def reference_grads(m: int, tied: bool, layers: int = 4) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_gpt(config(layers, tied), 0)
    inputs, targets = micro_batches(m)
    total = 0.0
    for x, y in zip(inputs, targets):
        loss = loss_fn(model(x), y)
        (loss / m).backward()
        total += loss.item() / m
    return total, {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("schedule,v,tied", [("gpipe", 1, True), ("1f1b", 1, True), ("zb-h1", 1, False),
                                              ("interleaved", 2, True), ("interleaved", 4, False)])
def test_one_rank_runner_gives_the_plain_gradients(schedule, v, tied):
    m, mesh = 4, plait.init_mesh()
    stages = apply_pipeline(build_gpt(config(4, tied), 0), mesh, virtual_stages=v)
    runner = PipelineRunner(stages, mesh, schedule)
    inputs, targets = micro_batches(m)
    loss = runner.step(inputs, targets, loss_fn)
    expected_loss, expected = reference_grads(m, tied)
    assert loss == pytest.approx(expected_loss, rel=1e-6)
    for stage in stages:
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.grad, expected[stage.global_name(name)], rtol=1e-5, atol=1e-7)
    assert runner.eval_loss(inputs, targets, loss_fn) == pytest.approx(runner_eval_reference(stages, inputs, targets))
    timeline = runner.last_timeline
    assert [len(row) for row in timeline.rows] == [len(build_schedule(schedule, 1, m, v)[0])]
    assert all(s.start <= s.end for s in timeline.rows[0])


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_step_leaves_no_activation_alive(schedule):
    """Every output a stage's modules made in a step is freed by its end. zb-h1's I and W
    keep the graph (retain_graph); a tensor autograd saved as an op's own output
    (attention's) that the saved-tensor hook handed back as itself held its own grad_fn, a
    cycle through C++ no collector sees: every micro-batch's activations stayed, 80 MB a
    step a rank on `small` (2 GB in 16 steps)."""
    import gc
    import weakref

    mesh = plait.init_mesh()
    stages = apply_pipeline(build_gpt(config(2, tied=False), 0), mesh)
    runner = PipelineRunner(stages, mesh, schedule)
    outputs: list[weakref.ref] = []

    def keep(module, args, output):  # noqa: ANN001, ANN202
        if isinstance(output, torch.Tensor) and output.requires_grad:
            outputs.append(weakref.ref(output))

    hooks = [m.register_forward_hook(keep) for stage in stages for m in stage.modules()]
    inputs, targets = micro_batches(4)
    runner.step(inputs, targets, loss_fn)
    for hook in hooks:
        hook.remove()
    gc.collect()
    assert outputs and not [ref for ref in outputs if ref() is not None]


def runner_eval_reference(stages, inputs, targets) -> float:
    """Mean loss of the (already stepped-on, not updated) stages run back to back."""
    total = 0.0
    with torch.no_grad():
        for x, y in zip(inputs, targets):
            for stage in stages:
                x = stage(x)
            total += loss_fn(x, y).item()
    return total / len(inputs)


def test_a_stage_counts_a_views_storage_and_a_batch_slice_as_itself():
    """What an op made is held whole while a view of it is saved (Phi-3's V slices its fused
    q|k|v output: counted as the slice, pp 2 read 0.93 of the estimate); a leaf the stage is
    handed, a slice of the batch, counts as the slice; a freed branch's save, nothing."""
    from plait.parallel.pipeline.execute import StageWork

    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(8, 24, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.qkv(x).split(8, dim=-1)  # the fused output: 4 x 24 floats
            torch.sigmoid(q * 2)  # a branch nothing reads: its saves are freed
            return (v * x).sum(-1)  # saves v (a view of the fused output) and x (a leaf)

    batch = torch.randn(16, 8)
    out, state = StageWork(Fused(), split_backward=False).forward(batch[:4], grad_input=True)
    assert out.requires_grad and state.saved_bytes == 4 * 24 * 4 + 4 * 8 * 4


def test_the_split_backward_holds_no_more_than_the_block_saves():
    """ZB-H1's W reads each Linear's input. The down projection's, SwiGLU's product, plait's
    block makes again for its backward rather than keep (models/gpt/lean.gated_down): W makes
    it again too (parallel/saved.REMADE), so no capture holds it. The modules' outputs, which I
    and W read only as graphs, hold no values once the forward has run (they held q's and k's
    projections before RoPE, o_proj's and down's outputs: 27% more than the blocks' keep on
    `tiny`). I + W still give B's gradients bit for bit."""
    from plait.parallel.pipeline.execute import StageWork

    cfg = config(2, tied=False)  # one stage holds both ends here
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for split in (False, True):
        model = build_gpt(cfg, 0)
        work = StageWork(model, split_backward=split)
        out, state = work.forward(ids, grad_input=False)
        loss = F.cross_entropy(out.flatten(0, 1), ids.flatten())
        if split:
            downs = [c for c in state.captured if c.module in {b.mlp.down_proj for b in model.blocks}]
            assert len(downs) == cfg.n_layers and not any(isinstance(c.x, torch.Tensor) for c in downs)
            assert all(c.y.untyped_storage().nbytes() <= c.y.element_size() for c in state.captured if c.y is not out)
            # read after all (a loss reading what a hook kept), they fail the step's finite check
            assert all(torch.isnan(c.y).all() for c in state.captured if c.y is not out)
            state.output = loss
            work.backward_input(state, None)
            work.backward_weight(state)
        else:
            loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_held_activations_are_counted_and_freed():
    mesh = plait.init_mesh()
    inputs, targets = micro_batches(4)
    held = {}
    for schedule in ("gpipe", "1f1b"):
        runner = PipelineRunner(apply_pipeline(build_gpt(config(2), 0), mesh), mesh, schedule)
        runner.step(inputs, targets, loss_fn)
        held[schedule] = runner.last_stats
    per_micro_batch = held["gpipe"].saved_bytes[0]
    assert set(held["gpipe"].saved_bytes) == {per_micro_batch} and per_micro_batch > 0
    assert (held["gpipe"].peak_inflight, held["gpipe"].peak_saved_bytes) == (4, 4 * per_micro_batch)
    assert (held["1f1b"].peak_inflight, held["1f1b"].peak_saved_bytes) == (1, per_micro_batch)
    assert simulate(build_schedule("gpipe", 1, 4), 1).peak_inflight == (4,)


def test_the_split_backward_lets_the_loss_go_at_i():
    """On the last stage the loss's graph is I's alone: W starts at the modules' outputs. I runs
    it first without retaining it, so what the loss saved (its softmax) and the logits go at I,
    where each pending W held them until it ran (the last rank holds up to p micro-batches so).
    A loss that reads the stage elsewhere too (here a block's MLP output) keeps the one retained
    graph. Either way I + W give B's gradients bit for bit. A loss that reads a weight itself,
    whose gradient no W would make, is refused."""
    import weakref

    from plait.parallel.pipeline.execute import StageWork

    cfg = config(2, tied=False)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    for aux in (False, True):
        grads, alive, logits_left = [], [], 0
        for split in (False, True):
            model = build_gpt(cfg, 0)
            inner = []
            model.blocks[0].mlp.register_forward_hook(lambda module, args, out: inner.append(out.square().mean()))
            work = StageWork(model, split_backward=split)
            out, state = work.forward(ids, grad_input=False)
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(weakref.ref(t)) or t, lambda t: t):
                loss = F.cross_entropy(out.flatten(0, 1), ids.flatten())
            if aux:
                loss = loss + 1e-3 * inner[0]  # made in the forward, as a router's balancing loss is
            if split:
                state.output, state.loss_input = loss, out
                work.backward_input(state, None)
                alive = [ref for ref in saved if ref() is not None]
                logits_left = out.untyped_storage().nbytes()
                work.backward_weight(state)
            else:
                loss.backward()
            grads.append([p.grad for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads)), aux
        if aux:
            assert alive and logits_left == out.numel() * 4  # kept for W, as before
        else:
            assert not alive and logits_left <= out.element_size()
    model = build_gpt(cfg, 0)
    work = StageWork(model, split_backward=True)
    out, state = work.forward(ids, grad_input=False)
    state.output = F.cross_entropy(out.flatten(0, 1), ids.flatten()) + model.norm.weight.square().sum()
    state.loss_input = out
    with pytest.raises(PlaitError, match="reads a weight of shape"):
        work.backward_input(state, None)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_the_runner_runs_the_loss_apart_only_when_it_splits(schedule, monkeypatch):
    """The runner hands I the stage output the loss read only where the backward is split:
    under 1F1B a state holding the logits beside the loss would keep them from F until B."""
    from plait.parallel.pipeline import execute

    took, real = [], execute._through_the_loss
    monkeypatch.setattr(execute, "_through_the_loss", lambda state, grad: took.append(state.loss_input is not None)
                        or real(state, grad))
    held = []
    monkeypatch.setattr(execute.MicroState, "__setattr__", lambda self, name, value: (
        held.append(name) if name == "loss_input" and value is not None else None) or object.__setattr__(self, name, value))
    mesh = plait.init_mesh()
    inputs, targets = micro_batches(4)
    runner = PipelineRunner(apply_pipeline(build_gpt(config(2, tied=False), 0), mesh), mesh, schedule)
    runner.step(inputs, targets, loss_fn)
    assert took == ([True] * 4 if schedule == "zb-h1" else [])
    assert len(held) == (4 if schedule == "zb-h1" else 0)
