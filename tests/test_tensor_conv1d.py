"""Tensor parallelism of transformers' Conv1D and of fused projections, in one process.

Each rank's layer is cut from the same dense layer with a fake axis (rank r of 2, no group):
a column shard's output must be the dense output's slice, a row shard's partial sums must
add up to the dense output, and a fused q|k|v layer must give each rank its slice of each
of q, k and v. No collective runs: a column layer's entry is the identity in forward.
"""

from __future__ import annotations

import pytest
import torch

from plait.errors import PlaitError
from plait.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, layout_of, tensor_placement
from plait.parallel.tensor.plan import parse_style, resolve_plan
from plait.runtime.comm import Axis, Ledger

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from plait.models.hf.gpt2 import GPT2_PLAN, GPT2Adapter  # noqa: E402

pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


TP, E = 2, 8


def rank_axis(rank: int) -> Axis:
    return Axis("tp", TP, rank, None, Ledger())


def dense_conv1d(out: int, inp: int) -> Conv1D:
    torch.manual_seed(0)
    layer = Conv1D(out, inp)
    torch.nn.init.normal_(layer.bias)  # Conv1D starts with a zero bias: make it count
    return layer


def test_conv1d_layout_is_read_transposed() -> None:
    assert layout_of(dense_conv1d(3 * E, E)) == (E, 3 * E, 1)
    assert layout_of(torch.nn.Linear(E, 3 * E)) == (E, 3 * E, 0)


def test_conv1d_column_shard_gives_its_slice_of_outputs_and_weight_gradient() -> None:
    dense, x = dense_conv1d(2 * E, E), torch.randn(2, 5, E)
    full = dense(x)
    full.square().sum().backward()
    width = 2 * E // TP
    for rank in range(TP):
        layer = ColumnParallelLinear.from_dense(dense, rank_axis(rank), {})
        assert layer.weight.shape == (E, width) and layer.transposed
        y = layer(x)
        torch.testing.assert_close(y, full[..., rank * width:(rank + 1) * width].detach())
        y.square().sum().backward()
        torch.testing.assert_close(layer.weight.grad, dense.weight.grad[:, rank * width:(rank + 1) * width])


def test_conv1d_row_shards_add_up_to_the_dense_output() -> None:
    dense, x = dense_conv1d(E, 2 * E), torch.randn(2, 5, 2 * E)
    width, total = 2 * E // TP, 0
    for rank in range(TP):
        layer = RowParallelLinear.from_dense(dense, rank_axis(rank), {})
        assert layer.weight.shape == (width, E) and layer.transposed
        torch.testing.assert_close(layer.weight, dense.weight[rank * width:(rank + 1) * width])
        total = total + layer.partial(x[..., rank * width:(rank + 1) * width])
    torch.testing.assert_close(total + dense.bias, dense(x))


@pytest.mark.parametrize("kind", ["conv1d", "linear"])
def test_fused_split_gives_each_rank_its_q_k_v_slices(kind: str) -> None:
    dense = dense_conv1d(3 * E, E) if kind == "conv1d" else torch.nn.Linear(E, 3 * E)
    x = torch.randn(2, 5, E)
    q, k, v = dense(x).detach().split(E, dim=-1)
    width = E // TP
    for rank in range(TP):
        layer = ColumnParallelLinear.from_dense(dense, rank_axis(rank), {}, fused=3)
        mine = slice(rank * width, (rank + 1) * width)
        for got, part in zip(layer(x).split(width, dim=-1), (q, k, v)):
            torch.testing.assert_close(got, part[..., mine])


def test_fused_shards_join_back_into_the_full_tensor() -> None:
    full = torch.arange(4 * 12, dtype=torch.float32).reshape(4, 12)
    for dim, fused in ((1, 3), (0, 2), (1, 1)):
        shards = [tensor_placement("tp", dim, rank, TP, tuple(full.shape), fused) for rank in range(TP)]
        stacked = torch.stack([shard.take(full) for shard in shards])
        torch.testing.assert_close(shards[0].join(stacked), full)
    with pytest.raises(PlaitError, match="3 blocks per rank"):
        tensor_placement("tp", 1, 1, TP, (4, 12), 3).offsets  # noqa: B018 - not one block: see Placement.blocks


@pytest.mark.parametrize("dim, fused", [(1, 3), (0, 2), (1, 1)])
def test_any_block_of_a_slice_is_placed_in_the_full_tensor(dim: int, fused: int) -> None:
    """What checkpoints write: a block of a rank's slice (a ZeRO shard may cut anywhere) as
    blocks of the full tensor, cut where a fused slice's parts meet."""
    full = torch.arange(4 * 12, dtype=torch.float32).reshape(4, 12)
    if dim == 0:
        full = full.reshape(12, 4)
    for rank in range(TP):
        shard = tensor_placement("tp", dim, rank, TP, tuple(full.shape), fused)
        local = shard.take(full)
        for lo in range(local.shape[dim]):
            for hi in range(lo + 1, local.shape[dim] + 1):
                block = local.narrow(dim, lo, hi - lo)
                at = tuple(lo if d == dim else 0 for d in range(2))
                covered = 0
                for starts, lengths, where in shard.blocks(at, tuple(block.shape)):
                    expected = full.narrow(dim, where[dim], lengths[dim])
                    torch.testing.assert_close(block.narrow(dim, starts[dim], lengths[dim]), expected)
                    assert where[1 - dim] == 0 and lengths[1 - dim] == full.shape[1 - dim]
                    covered += lengths[dim]
                assert covered == hi - lo


def test_fused_style_parsing_and_refusals() -> None:
    assert parse_style("column") == ("column", 1) and parse_style("column:3") == ("column", 3)
    for bad in ("row:3", "column:0", "column:x", "colum:3"):
        with pytest.raises(PlaitError):
            parse_style(bad)


def test_gpt2_plan_covers_every_conv1d_once() -> None:
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=4, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    adapter = GPT2Adapter()
    styles = resolve_plan(model, adapter.tensor_plan(model, 2, False))
    conv1d = {name for name, module in model.named_modules() if isinstance(module, Conv1D)}
    assert conv1d == {name for name, style in styles.items() if style != "region"}
    assert styles["transformer.h.1.attn.c_attn"] == "column:3" and GPT2_PLAN == adapter.tensor_plan(model, 2, False)
    with_sp = resolve_plan(model, adapter.tensor_plan(model, 2, True))
    assert {name for name, style in with_sp.items() if style == "sequence"} == {
        f"transformer.h.{i}.ln_{j}" for i in range(2) for j in (1, 2)}
    with pytest.raises(PlaitError, match="n_head = 4 is not divisible by tp=3") as info:
        adapter.tensor_plan(model, 3, False)
    assert info.value.hint == "choose tp among 1, 2, 4"
    assert adapter.blocks(model) == list(model.transformer.h)
    adapter.after_tensor_parallel(model, rank_axis(0), False)
    adapter.after_tensor_parallel(model, rank_axis(0), False)  # twice: the same local sizes
    assert model.transformer.h[0].attn.split_size == 8 and model.transformer.h[0].attn.num_heads == 2


def test_fused_sizes_are_checked_per_part() -> None:
    from plait.parallel.tensor.plan import apply_tensor_parallel

    with pytest.raises(PlaitError, match=r"0.out_features / 3 \(one fused part\) = 2 is not divisible by tp=4"):
        apply_tensor_parallel(torch.nn.Sequential(torch.nn.Linear(8, 6)), Axis("tp", 4, 0, None, Ledger()),
                              plan={"0": "column:3"})
    with pytest.raises(PlaitError, match="0.out_features = 7 is not 3 equal parts"):
        apply_tensor_parallel(torch.nn.Sequential(torch.nn.Linear(8, 7)), rank_axis(0), plan={"0": "column:3"})
    with pytest.raises(PlaitError, match="is a ReLU, but style 'column' needs Linear or Conv1D"):
        resolve_plan(torch.nn.Sequential(torch.nn.ReLU()), {"0": "column:3"})
