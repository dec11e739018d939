"""ZeRO without processes: shard arithmetic, formulas, config errors, and the machinery on one rank.

On a one-rank axis every collective is a local copy, so the hooks, the gathering and freeing,
the sharded optimizer and `full_parameters` can be checked in-process in milliseconds;
tests/test_zero_worlds.py checks the same code across 2 and 4 processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.errors import PlaitError
from plait.models.gpt.config import get_preset
from plait.models.gpt.model import build_gpt
from plait.parallel.clip import clip_grad_norm
from plait.parallel.zero.stages import apply_zero, full_parameters, require_reduce_scatter, zero_of
from plait.estimate.layout import Workload, stages
from plait.estimate.memory import StateBytes, gathered_params, zero3_grad_buffers, zero3_packed, zero3_units
from plait.parallel.zero import optim as zero_optim
from plait.parallel.zero.optim import ZeroOptimizer, zero_state_bytes
from tests.worlds.zero_common import padded_state_bytes, paper_states
from plait.parallel.zero.shard import (edge_units, find_units, owned_pieces, owned_range, pack, shard_size, unit_owners,
                                       with_edges)
from plait.runtime.comm import Axis, Ledger


def one_rank() -> Axis:
    return Axis("dp", 1, 0, None, Ledger())


# -- arithmetic -----------------------------------------------------------------------------------
@pytest.mark.parametrize("numel", [1, 5, 7, 64, 77, 1000])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_shards_partition_the_real_elements_and_never_own_padding(numel: int, n: int) -> None:
    size = shard_size(numel, n)
    assert size * n >= numel > (size - 1) * n
    covered = []
    for rank in range(n):
        lo, hi = owned_range(numel, n, rank)
        assert lo == hi or rank * size <= lo < hi <= min((rank + 1) * size, numel)
        covered += range(lo, hi)
    assert covered == list(range(numel))


def test_pieces_cut_shards_at_parameter_boundaries() -> None:
    sizes = [3, 4, 2]  # 9 elements, n = 2: shards [0, 5) and [5, 9) + one padding element
    assert owned_pieces(sizes, 2, 0) == [(0, 0, 3), (1, 3, 5)]
    assert owned_pieces(sizes, 2, 1) == [(1, 5, 7), (2, 7, 9)]
    assert owned_pieces([1], 4, 3) == []  # a rank may own only padding


def test_padding_adds_to_the_papers_figure_only_where_groups_do_not_divide() -> None:
    """The worlds hold the measured bytes to plait.estimate's (p + g + K)Ψ plus each flat
    buffer's padding (tests/worlds/zero_common.py); here that arithmetic itself."""
    fp32 = StateBytes(4, 4, 8)
    for stage in (1, 2, 3):
        assert padded_state_bytes(stage, [1000, 600], 4, 1, fp32) == paper_states(stage, 1600, 4, fp32)
        padded = padded_state_bytes(stage, [1001, 601], 4, 3, fp32)  # 6 padding elements, of at most 8 bytes
        assert all(abs(padded[k] - v) <= 8 * 6 for k, v in paper_states(stage, 1602, 4, fp32).items())


# -- configuration and errors ------------------------------------------------------------------------
def test_layout_accepts_stages_and_rejects_bad_input() -> None:
    for stage in (0, 1, 2, 3):
        assert plait.Layout(zero=stage).zero == stage
    assert plait.Layout(zero=2, offload=True).offload
    with pytest.raises(PlaitError, match="--zero must be 0, 1, 2 or 3, got 4") as info:
        plait.Layout(zero=4)
    assert "shard more and more state" in info.value.hint
    with pytest.raises(PlaitError, match="--offload needs a ZeRO stage") as info:
        plait.Layout(offload=True)
    assert info.value.hint == "add --zero 1 (or 2 or 3)"


def test_backend_without_reduce_scatter_names_the_fix() -> None:
    require_reduce_scatter("gloo", 2)
    require_reduce_scatter("nccl", 3)
    with pytest.raises(PlaitError, match="--zero 1 needs reduce_scatter, which the mpi backend") as info:
        require_reduce_scatter("mpi", 1)
    assert "--backend gloo" in info.value.hint and "drop --zero" in info.value.hint


def test_apply_zero_rejects_stage_0_and_a_second_application() -> None:
    model = nn.Linear(3, 3)
    with pytest.raises(PlaitError, match="stage 1, 2 or 3"):
        apply_zero(model, one_rank(), stage=0)
    apply_zero(model, one_rank(), stage=1)
    with pytest.raises(PlaitError, match="already"):
        apply_zero(model, one_rank(), stage=2)


# -- units -----------------------------------------------------------------------------------------
def test_units_are_the_children_of_module_lists() -> None:
    gpt = build_gpt(get_preset("tiny"), 0)
    assert find_units(gpt) == list(gpt.blocks)
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert find_units(seq) == [seq[0], seq[2][0], seq[2][1]]
    assert find_units(nn.Linear(2, 2)) == []


def test_tied_and_shared_parameters_belong_to_the_root() -> None:
    gpt = build_gpt(get_preset("tiny"), 0)
    owner, where = unit_owners(gpt, list(gpt.blocks))
    assert owner[gpt.embed.weight] == -1 and owner[gpt.blocks[1].mlp.up_proj.weight] == 1
    tied = [(m, name) for m, name, p in where if p is gpt.embed.weight]
    assert tied == [(gpt.embed, "weight"), (gpt.lm_head, "weight")]
    shared = nn.Linear(2, 2)
    two = nn.ModuleList([nn.Sequential(shared), nn.Sequential(shared)])
    owner, _ = unit_owners(two, list(two))
    assert owner[shared.weight] == -1


def test_untied_matrices_outside_the_lists_are_units_of_their_own() -> None:
    """An untied embedding and head (a CNN's stem and head) are units, around the blocks in run
    order; a tied table and the norms stay in the root."""
    untied = build_gpt(dataclasses.replace(get_preset("tiny"), tie_embeddings=False), 0)
    assert with_edges(untied, list(untied.blocks)) == [untied.embed, *untied.blocks, untied.lm_head]
    tied = build_gpt(get_preset("tiny"), 0)
    assert edge_units(tied, list(tied.blocks)) == []
    from tests.worlds.zero_common import UserMLP
    mlp = UserMLP()
    assert with_edges(mlp, find_units(mlp)) == [mlp.inp, mlp.layers[0], mlp.layers[2], mlp.out]


def test_stage_3_holds_an_untied_table_only_around_its_use_as_the_estimate_says() -> None:
    """The gathered peak is a table and one block (the first, prefetched; or the head and the
    last), not both tables for the whole step; the estimate's gathered weights and whole gradients say the same."""
    config = dataclasses.replace(get_preset("tiny"), n_layers=4, tie_embeddings=False, vocab_size=2048)
    model = build_gpt(config, 0)
    _train(model, 3, steps=1)
    sync = zero_of(model)
    assert sync is not None and sync.root is not None and sync.root.module is model and len(sync.root.params) == 1
    (share,) = stages(config, 1, 1)
    table, block, norm = config.vocab_size * config.d_model, config.layer_params(), config.d_model
    assert sync.peak_gathered_bytes == 4 * (norm + table + block)
    assert sync.peak_gathered_bytes == 4 * gathered_params(config, Workload(zero=3), share)
    assert zero3_grad_buffers(share.params, zero3_units(config, Workload(zero=3), share),
                              Workload(zero=3, precision="fp32")) == 4 * (norm + table + block)


class RunsOutOfOrder(nn.Module):
    """Gemma 3n's order, small: a matrix registered after the blocks and run second (its
    per-layer embedding), and lists run before the blocks and after them (its AltUp projections),
    registered after them; `loops` runs the middle blocks twice (a looped model)."""

    def __init__(self, loops: bool = False) -> None:
        super().__init__()
        self.loops = loops
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
        self.widen, self.narrow = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)]), nn.ModuleList([nn.Linear(8, 8)])
        self.per_layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = [*self.blocks[:3], *self.blocks[1:]] if self.loops else list(self.blocks)
        x = self.per_layer(self.embed(x))
        for layer in [*self.widen, *blocks, *self.narrow]:
            x = layer(x).relu()
        return x


@pytest.mark.parametrize("loops", [False, True])
def test_stage_3_prefetches_only_while_a_forward_runs_as_the_last_one_did(loops: bool) -> None:
    """Before its first forward ZeRO-3 guesses the order from the registration (`with_edges`);
    where the forward leaves the guess, it stops prefetching on it. Prefetching on past the
    first miss held a unit gathered for the end of the forward beside the two the window holds
    (3 units; Gemma 3n's peak came an AltUp projection over the estimate). Each forward then
    gathers each unit once a run, and a looped model's prefetch follows the runs, not the first
    of them (which gathered a block again the loop had done with)."""
    torch.manual_seed(0)
    model = RunsOutOfOrder(loops)
    apply_zero(model, one_rank(), stage=3)
    sync = zero_of(model)
    assert sync is not None and sync.prefetch == 1
    runs = 1 + 1 + 2 + (6 if loops else 4) + 1
    for step in range(2):
        sync.peak_gathered_units, before = 0, len(sync.events)
        with torch.no_grad():
            model(torch.randn(2, 8))
        gathers = [what for what, _ in list(sync.events)[before:] if what == "all_gather"]
        assert (len(gathers), sync.peak_gathered_units) == (runs, 2), step


class Chunk(nn.Module):
    """One pipeline chunk of blocks, for a rank that runs two of them (interleaved)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x).relu()
        return x


def test_stage_3_prefetches_on_each_interleaved_chunks_own_last_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two chunks on one rank, their forwards and backwards taking turns as an interleaved
    schedule runs them. ZeRO-3 keeps each chunk's last order: every forward and backward
    gathers its next unit ahead of the one running (2 units held at once). With one order, the
    last forward's whatever its chunk, a chunk's forward or backward found none to follow after
    the other chunk's forward, and gathered each unit only when it ran (1 held)."""
    from plait.parallel.zero import stages as zero_stages

    monkeypatch.setattr(zero_stages, "is_pipeline", lambda model: isinstance(model, nn.ModuleList))
    torch.manual_seed(0)
    model = nn.ModuleList([Chunk(), Chunk()])
    apply_zero(model, one_rank(), stage=3)
    sync = zero_of(model)
    assert sync is not None and sync.prefetch == 1 and set(sync.chunk.values()) == {0, 1}
    held = []
    for _ in range(2):
        losses = []
        for chunk in model:
            sync.peak_gathered_units = 0
            losses.append(chunk(torch.randn(2, 8)).square().sum())
            held.append(("forward", sync.peak_gathered_units))
        for loss in losses:
            sync.peak_gathered_units = 0
            loss.backward()
            held.append(("backward", sync.peak_gathered_units))
    assert held == [("forward", 2), ("forward", 2), ("backward", 2), ("backward", 2)] * 2


@pytest.mark.parametrize("n", [3, 5])
def test_the_estimate_packs_zero3s_groups_as_the_runtime_pads_them(n: int) -> None:
    """ZeRO-3 packs the root and each unit into a flat buffer padded to a multiple of its n
    shard ranks (shard.pack): shards, gathers, whole gradients and their wire all hold the
    padding. The estimate counted the parameters unpadded, a few bytes a rank under where a
    group is odd (HY-V4's and Inkling's roots: 2-8 bytes in `plait train`'s ledger)."""
    config = dataclasses.replace(get_preset("tiny"), n_layers=3, tie_embeddings=False, vocab_size=257)
    model = build_gpt(config, 0)
    units = with_edges(model, find_units(model))
    owner, _ = unit_owners(model, units)
    groups = [[p for p, k in owner.items() if k == unit] for unit in range(-1, len(units))]
    (share,) = stages(config, 1, 1)
    layout = Workload(zero=3, dp=n)
    padded = sum(pack(group, n).numel() for group in groups if group)
    assert padded > share.trained_params  # the blocks' and the 257-row tables' counts are not multiples of n
    assert zero3_packed(config, layout, share) == padded
    assert zero3_packed(config, dataclasses.replace(layout, zero=2), share) == share.trained_params


# -- the machinery on one rank ---------------------------------------------------------------------
def _train(model: nn.Module, stage: int | None, steps: int = 3, accum: int = 1, clip: float = 0.1,
           **opt: float) -> list[float]:
    if stage is not None:
        apply_zero(model, one_rank(), stage=stage, bucket_mb=0.01, **opt)
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        rows = torch.randint(0, 256, (4, 9), generator=gen)
        for k, micro in enumerate(rows.chunk(accum)):
            with plait.no_sync(model) if k < accum - 1 else contextlib.nullcontext():
                loss = F.cross_entropy(model(micro[:, :-1]).flatten(0, 1).float(), micro[:, 1:].flatten())
                (loss / accum).backward()
        losses.append(loss.item())
        clip_grad_norm(model, clip)
        optimizer.step()
        optimizer.zero_grad()
    return losses


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("accum", [1, 2])
def test_one_rank_zero_trains_exactly_like_plain_torch(stage: int, accum: int) -> None:
    """Bit for bit without clipping (the clipping norm is summed in another order than torch's)."""
    plain, sharded = build_gpt(get_preset("tiny"), 0), build_gpt(get_preset("tiny"), 0)
    assert _train(plain, None, accum=accum, clip=math.inf) == _train(sharded, stage, accum=accum, clip=math.inf)
    with full_parameters(sharded):
        got = sharded.state_dict()
        for name, want in plain.state_dict().items():
            assert torch.equal(got[name], want), name


def test_stage_3_lets_the_model_change_a_units_output_in_place() -> None:
    """A model may scale a unit's output in place (Gemma 3n: `per_layer_projection *= scale`,
    the output of a Linear ZeRO-3 takes for a unit). The unit's outputs come back as aliases, not
    as themselves, which autograd would take for views made inside a custom function and refuse
    to change in place; the step equals plain torch's."""

    class ScaledInPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.layers = nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.proj(x)
            y *= 0.5  # in place, on the unit's output
            for layer in self.layers:
                y = layer(y).relu()
            return y

    torch.manual_seed(0)
    plain = ScaledInPlace()
    sharded = ScaledInPlace()
    sharded.load_state_dict(plain.state_dict())
    apply_zero(sharded, one_rank(), stage=3)
    optimizers = [plait.build_optimizer(m, torch.optim.SGD, lr=0.1) for m in (plain, sharded)]
    x = torch.randn(4, 8)
    for model, optimizer in zip((plain, sharded), optimizers):
        for _ in range(2):
            model(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    with full_parameters(sharded):
        assert all(torch.equal(sharded.state_dict()[name], want) for name, want in plain.state_dict().items())


def test_stage_3_frees_every_unit_and_full_parameters_round_trips() -> None:
    model = build_gpt(get_preset("tiny"), 0)
    names = sorted(model.state_dict())
    _train(model, 3, steps=1)
    sync = zero_of(model)
    assert sync is not None and all(g.flat.untyped_storage().nbytes() == 0 for g in sync.groups)
    shards = sorted(n for n, _ in model.named_parameters())
    assert shards == ["blocks.0.plait_shard", "blocks.1.plait_shard", "plait_shard"]
    assert model.blocks[0].attn.q_proj.weight.numel() == 0  # a placeholder outside forward
    with full_parameters(model):
        assert sorted(model.state_dict()) == names
        model.blocks[0].mlp.up_proj.weight.data.fill_(0.5)  # loading inside the block sticks
    with torch.no_grad():
        out = model.generate(torch.tensor([[1, 2, 3]]), 4)  # no-grad forwards gather and free too
    assert out.shape == (1, 7) and all(g.flat.untyped_storage().nbytes() == 0 for g in sync.groups)
    with full_parameters(model):
        assert (model.blocks[0].mlp.up_proj.weight == 0.5).all()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_keeps_fp32_masters_and_offload_keeps_them_on_the_cpu(stage: int) -> None:
    model = build_gpt(get_preset("tiny"), 0).to(torch.bfloat16)
    _train(model, stage, steps=2, offload=True)
    psi = get_preset("tiny").num_params()
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
    assert isinstance(optimizer, ZeroOptimizer) and isinstance(optimizer, torch.optim.Optimizer)
    assert all(p.master is not None and p.master.dtype == torch.float32 and p.master.device.type == "cpu"
               for p in optimizer.slices)
    _step(model, optimizer)
    assert zero_state_bytes(model, optimizer) == paper_states(stage, psi, 1, StateBytes(2, 2, 12))



def test_offload_steps_on_one_kept_fp32_gradient_copy_and_trains_as_without_it() -> None:
    """Offload copies each step's gradient into one fp32 buffer per shard, made once: a fresh
    host tensor every step paid for its pages (1.7 s per Gi parameters on an H200's host,
    benchmarks/RESULTS.md). The numbers are those of the run without offload."""
    assert _train(build_gpt(get_preset("tiny"), 0).to(torch.bfloat16), 2, offload=True) == \
        _train(build_gpt(get_preset("tiny"), 0).to(torch.bfloat16), 2)
    model = build_gpt(get_preset("tiny"), 0).to(torch.bfloat16)
    apply_zero(model, one_rank(), stage=2, bucket_mb=0.01, offload=True)
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, lr=1e-2)
    copies = []
    for _ in range(2):
        _step(model, optimizer)
        copies.append([part.grad_copy for part in optimizer.slices])
        optimizer.zero_grad()
    assert all(c is not None and c.dtype == torch.float32 for c in copies[0])
    assert all(a is b for a, b in zip(*copies))
    assert [c.numel() for c in copies[0]] == [part.master.numel() for part in optimizer.slices]


def test_offload_copies_convert_whole_in_chunks_and_on_one_device_in_one_copy(monkeypatch) -> None:
    """The chunked copy covers every element across chunk edges (bf16 -> fp32 and back); on
    one device, the CPU's included, offload's copies are one plain copy (a CUDA machine
    training a CPU model must not reach for a CUDA stream)."""
    monkeypatch.setattr(zero_optim, "COPY_CHUNK", 3)
    src = torch.randn(10).to(torch.bfloat16)
    dst = torch.empty(10)
    zero_optim.copy_chunks(dst, src)
    assert torch.equal(dst, src.float())
    back = torch.empty(10, dtype=torch.bfloat16)
    zero_optim.copy_in_chunks(back, dst)
    assert torch.equal(back, src)

def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    rows = torch.randint(0, 256, (2, 9))
    F.cross_entropy(model(rows[:, :-1]).flatten(0, 1).float(), rows[:, 1:].flatten()).backward()
    optimizer.step()


def test_zero_optimizer_acts_like_a_torch_optimizer() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    apply_zero(model, one_rank(), stage=2)
    optimizer = plait.build_optimizer(model, torch.optim.AdamW, lr=0.1, weight_decay=0.1)
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]  # weights / biases (no decay)
    assert optimizer.param_groups[1]["weight_decay"] == 0.0
    for group in optimizer.param_groups:
        group["lr"] = 0.0  # what the trainer does every step
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(len(s) == 3 for s in optimizer.state.values())  # step, exp_avg, exp_avg_sq
    assert set(optimizer.state_dict()) == {"state", "param_groups"}


def test_frozen_parameters_stay_whole_and_untouched() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    apply_zero(model, one_rank(), stage=3)
    optimizer = plait.build_optimizer(model, torch.optim.SGD, lr=0.5)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    assert torch.equal(model[0].weight, frozen)


def test_fp32_offload_picks_up_weights_loaded_after_the_optimizer_was_built() -> None:
    model = build_gpt(get_preset("tiny"), 0)
    apply_zero(model, one_rank(), stage=3, offload=True)
    optimizer = plait.build_optimizer(model, torch.optim.SGD, lr=0.0)
    with full_parameters(model):
        model.blocks[0].mlp.up_proj.weight.data.fill_(0.5)
    _step(model, optimizer)  # lr 0: the step must leave the loaded weights as they are
    with full_parameters(model):
        assert (model.blocks[0].mlp.up_proj.weight == 0.5).all()
