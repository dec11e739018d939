"""Each parameter's placement, in one process: what the splitting strategies record, and what
the consumers (checkpoint pieces, ZeRO's groups, gradient sync) read from it alone.

Layers are cut from one dense layer with a fake axis (rank r of 2, no group), experts with a
fake ep axis; a stand-in mesh answers the ranks the pieces ask for. No collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from plait.errors import PlaitError
from plait.parallel.data.sync import replicated_over
from plait.parallel.expert.plan import apply_expert_parallel
from plait.parallel.expert.shard import expert_placement
from plait.parallel.pieces import param_pieces
from plait.parallel.placement import Placement, Split, place, placement_of
from plait.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, shard_of
from plait.parallel.zero.shard import ShardAxes
from plait.runtime.comm import Axis, Ledger
from plait.runtime.mesh import EXPERT_SYNC, SYNC

pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


IN, OUT, EXPERTS = 8, 6, 4


def axis(name: str, size: int, rank: int) -> Axis:
    return Axis(name, size, rank, None, Ledger())


@dataclass
class StandInMesh:
    """The two questions pieces ask a mesh: an axis's size and this rank's index on it."""

    at: dict[str, tuple[int, int]] = field(default_factory=dict)  # axis: (size, rank); others (1, 0)

    def size(self, name: str) -> int:
        return self.at.get(name, (1, 0))[0]

    def rank(self, name: str) -> int:
        return self.at.get(name, (1, 0))[1]


class Experts(nn.Module):
    """The smallest experts module apply_expert_parallel accepts: num_experts and (experts, ...) weights."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.w = nn.Parameter(torch.arange(EXPERTS * 3 * 5, dtype=torch.float32).reshape(EXPERTS, 3, 5))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x


def dense(out: int = OUT) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(IN, out)


def stepped(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW after one step (lr 0: the weights stay): exp_avg and exp_avg_sq shaped as each
    parameter, and a scalar step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


# -- what each split records ---------------------------------------------------------------------
def test_a_plain_parameter_is_whole_and_replicated_over_the_data_axis() -> None:
    weight = dense().weight
    assert placement_of(weight) == Placement((OUT, IN), (), SYNC)
    assert placement_of(weight).axes == () and placement_of(weight).offsets == (0, 0)
    assert shard_of(weight) is None


def test_a_column_split_cuts_the_output_features_over_tp() -> None:
    layer = ColumnParallelLinear.from_dense(dense(), axis("tp", 2, 1), {})
    weight, bias = placement_of(layer.weight), placement_of(layer.bias)
    assert weight == Placement((OUT, IN), (Split("tp", 0, 1, 2),), SYNC)
    assert (weight.offsets, weight.local_shape) == ((3, 0), (3, IN))
    assert bias == Placement((OUT,), (Split("tp", 0, 1, 2),), SYNC) and bias.offsets == (3,)
    assert shard_of(layer.weight) is weight


def test_a_row_split_cuts_the_input_features_and_keeps_the_bias_whole() -> None:
    layer = RowParallelLinear.from_dense(dense(), axis("tp", 2, 1), {})
    weight = placement_of(layer.weight)
    assert weight.split("tp") == Split("tp", 1, 1, 2) and weight.full_shape == (OUT, IN)
    assert (weight.offsets, weight.local_shape) == ((0, 4), (OUT, 4))
    assert placement_of(layer.bias) == Placement((OUT,)) and shard_of(layer.bias) is None


def test_a_fused_qkv_split_is_a_block_of_each_part() -> None:
    """q|k|v of 4 rows each, over tp 2: rank 1 holds rows 2-3 of each part, rows 2, 6, 10 on."""
    full = dense(12)
    layer = ColumnParallelLinear.from_dense(full, axis("tp", 2, 1), {}, fused=3)
    weight = placement_of(layer.weight)
    assert weight.split("tp") == Split("tp", 0, 1, 2, fused=3) and weight.full_shape == (12, IN)
    assert weight.blocks((0, 0), (6, IN)) == [((0, 0), (2, IN), (2, 0)), ((2, 0), (2, IN), (6, 0)),
                                              ((4, 0), (2, IN), (10, 0))]
    torch.testing.assert_close(layer.weight.detach(), full.weight.detach()[[2, 3, 6, 7, 10, 11]])
    with pytest.raises(PlaitError, match="3 blocks per rank"):
        weight.offsets  # noqa: B018 - not one block


def test_experts_are_split_over_ep_on_dim_0_and_replicated_over_edp() -> None:
    model = nn.Sequential(Experts())
    apply_expert_parallel(model, axis("ep", 2, 1))
    placement = placement_of(model[0].w)
    assert placement == Placement((EXPERTS, 3, 5), (Split("ep", 0, 1, 2),), EXPERT_SYNC)
    assert placement == expert_placement(1, 2, (EXPERTS, 3, 5))
    assert (placement.offsets, placement.local_shape) == ((2, 0, 0), (2, 3, 5))
    assert shard_of(model[0].w) is None  # not a tensor-parallel slice


def test_a_placement_refuses_two_cuts_of_one_dimension_and_a_part_of_another_shape() -> None:
    with pytest.raises(PlaitError, match="twice"):
        Placement((4, 4), (Split("tp", 0, 0, 2), Split("ep", 0, 0, 2)))
    with pytest.raises(PlaitError, match="cannot be the part"):
        place(nn.Parameter(torch.zeros(3, 4)), Placement((4, 4), (Split("tp", 0, 0, 2),)))


def test_take_and_join_over_two_axes() -> None:
    """A future split on two axes (tp on dim 1, ep on dim 0): each rank's part, joined back per axis."""
    full = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    parts = {(e, t): Placement((4, 6), (Split("ep", 0, e, 2), Split("tp", 1, t, 2)), EXPERT_SYNC)
             for e in range(2) for t in range(2)}
    torch.testing.assert_close(parts[1, 0].take(full), full[2:, :3])
    assert parts[1, 0].offsets == (2, 0) and parts[1, 0].local_shape == (2, 3)
    rows = [parts[e, 0].join(torch.stack([parts[e, t].take(full) for t in range(2)]), "tp") for e in range(2)]
    torch.testing.assert_close(parts[0, 0].join(torch.stack(rows), "ep"), full)


# -- what the consumers read from it -------------------------------------------------------------------
def by_name(pieces: list) -> dict[str, list]:
    out: dict[str, list] = {}
    for piece in pieces:
        out.setdefault(piece.name, []).append(piece)
    return out


def test_pieces_of_tensor_parallel_slices_sit_at_their_offsets() -> None:
    """tp rank 1 of 2: the split layers' blocks at their offsets (q|k|v as three), written by
    this rank; the whole bias and Adam's step are tp rank 0's to write."""
    column, row, qkv = dense(), dense(), dense(12)
    tp = axis("tp", 2, 1)
    model = nn.ModuleDict({"col": ColumnParallelLinear.from_dense(column, tp, {}),
                           "row": RowParallelLinear.from_dense(row, tp, {}),
                           "qkv": ColumnParallelLinear.from_dense(qkv, tp, {}, fused=3)})
    pieces = by_name(param_pieces(model, stepped(model), StandInMesh({"tp": (2, 1)})))
    [col_w] = pieces["model/col.weight"]
    assert (col_w.offsets, col_w.full_shape, col_w.owned) == ((3, 0), (OUT, IN), True)
    torch.testing.assert_close(col_w.tensor, column.weight.detach()[3:])
    [row_w] = pieces["model/row.weight"]
    assert (row_w.offsets, row_w.full_shape, row_w.owned) == ((0, 4), (OUT, IN), True)
    [row_b] = pieces["model/row.bias"]
    assert (row_b.offsets, row_b.full_shape, row_b.owned) == ((0,), (OUT,), False)
    qkv_w = pieces["model/qkv.weight"]
    assert [(p.offsets, tuple(p.tensor.shape)) for p in qkv_w] == [((2, 0), (2, IN)), ((6, 0), (2, IN)),
                                                                   ((10, 0), (2, IN))]
    for piece in qkv_w:
        torch.testing.assert_close(piece.tensor, qkv.weight.detach()[piece.offsets[0]:piece.offsets[0] + 2])
    assert [p.offsets for p in pieces["optim/qkv.weight/exp_avg"]] == [(2, 0), (6, 0), (10, 0)]
    assert not pieces["optim/col.weight/step"][0].owned  # the same on every tp rank: tp rank 0 writes it


def test_pieces_of_experts_sit_at_their_experts_offset_and_spread_over_edp() -> None:
    """ep rank 1 of 2, edp rank 0 of 2: this rank's experts from expert 2 on; each replicate
    axis's tensors spread over its own ranks, the experts' step written by ep rank 0 alone."""
    model = nn.ModuleDict({"experts": Experts(), "a": dense(), "b": dense()})
    apply_expert_parallel(model, axis("ep", 2, 1))
    mesh = StandInMesh({"ep": (2, 1), EXPERT_SYNC: (2, 0), SYNC: (4, 1)})
    pieces = by_name(param_pieces(model, stepped(model), mesh))
    [experts] = pieces["model/experts.w"]
    assert (experts.offsets, experts.full_shape) == ((2, 0, 0), (EXPERTS, 3, 5))
    torch.testing.assert_close(experts.tensor, Experts().w.detach()[2:])
    # the only edp tensor goes to edp rank 0; of the dense ones, a.weight and b.weight (largest)
    # to dp × cp ranks 0 and 1, then a.bias and b.bias to ranks 2 and 3
    written = sorted(name for name, [piece] in pieces.items() if name.startswith("model/") and piece.owned)
    assert written == ["model/b.weight", "model/experts.w"]
    assert pieces["optim/experts.w/exp_avg"][0].owned and not pieces["optim/experts.w/step"][0].owned


def test_zero_and_gradient_sync_group_parameters_by_replicate_axis() -> None:
    model = nn.ModuleDict({"a": dense(), "experts": Experts()})
    apply_expert_parallel(model, axis("ep", 2, 0))
    dp, edp = axis("dp", 4, 0), axis(EXPERT_SYNC, 2, 0)
    axes = ShardAxes.of_model(model, dp, edp)
    params = list(model.parameters())
    assert axes.kinds(params) == [[model["a"].weight, model["a"].bias], [model["experts"].w]]
    assert axes.axis(model["experts"].w) is edp and axes.axis(model["a"].weight) is dp and axes.mean_over == 4
    with pytest.raises(PlaitError, match="edp axis"):
        ShardAxes.of_model(model, dp, None)
    assert replicated_over(model, {SYNC: dp, EXPERT_SYNC: edp}) == {
        model["a"].weight: SYNC, model["a"].bias: SYNC, model["experts"].w: EXPERT_SYNC}
    with pytest.raises(ValueError, match="replicated over edp"):
        replicated_over(model, {SYNC: dp, EXPERT_SYNC: None})
