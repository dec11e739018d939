"""Sharded safetensors written a tensor at a time (plait/train/checkpoint/shards.py): what
transformers writes for a large model, read back by safetensors, and refused when misused."""

from __future__ import annotations

import json
import math
import tempfile

import pytest
import torch
from hypothesis import given, settings, strategies as st

from plait.errors import PlaitError
from plait.train.checkpoint.shards import (INDEX, SINGLE, Entry, LazyWeights, ShardWriter, contiguous_runs, plan_files,
                                           read_weights, write_streamed)
from plait.train.config.check import parse_bytes


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _tensors() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a.weight": torch.randn(6, 4), "b.bias": torch.randn(3).bfloat16(), "c.count": torch.arange(5),
            "d.empty": torch.zeros(0, 2), "e.half": torch.randn(2, 2).half(), "f.flag": torch.tensor([True, False]),
            "g.scalar": torch.tensor(7)}  # BatchNorm's num_batches_tracked is 0-dim


@pytest.mark.parametrize("max_bytes, files", [(10**9, 1), (100, 2), (1, 7)])
def test_streamed_weights_read_back_equal_with_an_index_when_sharded(tmp_path, max_bytes, files):
    written = write_streamed(tmp_path, _tensors(), max_bytes)
    shards = sorted(p.name for p in tmp_path.glob("model*.safetensors"))
    if files == 1:
        assert shards == [SINGLE] and not (tmp_path / INDEX).exists()
    else:
        assert shards == [f"model-{i:05d}-of-{files:05d}.safetensors" for i in range(1, files + 1)]
        index = json.loads((tmp_path / INDEX).read_text())
        assert set(index["weight_map"]) == set(_tensors())
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _tensors().values())
    assert len(written) == files + (files > 1)
    back = read_weights(tmp_path)
    assert list(back) == sorted(_tensors())
    for name, tensor in _tensors().items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary file left


def test_a_rewrite_in_one_file_removes_the_earlier_index(tmp_path):
    write_streamed(tmp_path, _tensors(), 1)
    write_streamed(tmp_path, _tensors(), 10**9)
    assert not (tmp_path / INDEX).exists() and torch.equal(read_weights(tmp_path)["a.weight"], _tensors()["a.weight"])


def test_files_hold_at_most_the_size_or_one_larger_tensor():
    entries = [Entry(n, (k,), torch.float32) for n, k in [("a", 10), ("b", 10), ("c", 100), ("d", 1)]]
    assert [[e.name for e in f] for f in plan_files(entries, 80)] == [["a", "b"], ["c"], ["d"]]


def test_the_writer_refuses_a_tensor_out_of_order_or_of_another_shape(tmp_path):
    writer = ShardWriter(tmp_path, [Entry("a", (2,), torch.float32), Entry("b", (2,), torch.float32)], 10**9)
    with pytest.raises(PlaitError, match="expected a"):
        writer.write("b", torch.zeros(2))
    with pytest.raises(PlaitError, match="expected a"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(PlaitError, match="got 1 of 2 tensors"):
        writer.close()
    writer.abort()
    assert not list(tmp_path.iterdir())


def test_lazy_weights_read_only_what_is_asked():
    asked = []
    lazy = LazyWeights({"b": ((2,), torch.float32), "a": ((1,), torch.int64)},
                       lambda name: asked.append(name) or torch.zeros(2 if name == "b" else 1))
    assert list(lazy) == ["a", "b"] and len(lazy) == 2 and asked == []
    assert lazy["b"].shape == (2,) and asked == ["b"]
    with pytest.raises(KeyError):
        lazy["c"]


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MB", 5 * 10**8), ("2GiB", 2 * 2**30), ("64kb", 64000),
                                        ("1234", 1234), (" 3 MiB ", 3 * 2**20)])
def test_sizes_are_read_as_transformers_reads_them(text, size):
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["", "0", "-5GB", "5XB", "GB", "1.5GB", "five"])
def test_a_size_that_is_not_one_is_one_line(text):
    with pytest.raises(PlaitError, match="is not a size"):
        parse_bytes(text)


def test_a_rewrite_in_fewer_shards_leaves_none_of_the_earlier_ones(tmp_path):
    write_streamed(tmp_path, _tensors(), 1)  # seven shards
    write_streamed(tmp_path, _tensors(), 100)  # two
    assert sorted(p.name for p in tmp_path.glob("model*.safetensors")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert torch.equal(read_weights(tmp_path)["g.scalar"], torch.tensor(7))


def test_one_file_named_beside_other_weights_leaves_them_alone(tmp_path):
    """`plait ckpt export --to DIR/model.safetensors` writes one file of that name and removes
    nothing of what DIR held (another run's shards and index)."""
    write_streamed(tmp_path, _tensors(), 100)  # two shards and an index
    write_streamed(tmp_path, _tensors(), 2**63, single=SINGLE, replaces=False)
    assert (tmp_path / INDEX).is_file() and len(list(tmp_path.glob("model-*-of-*.safetensors"))) == 2
    assert (tmp_path / SINGLE).is_file()


def _tiles(shape: tuple[int, ...], cuts: list[list[int]]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(offsets, block shape) of the grid `cuts` makes of `shape` (each dimension's cut points)."""
    spans = [list(zip([0, *c], [*c, n])) for c, n in zip(cuts, shape)]
    grid = [[]]
    for dim in spans:
        grid = [g + [span] for g in grid for span in dim if span[1] > span[0]]
    return [(tuple(a for a, _ in g), tuple(b - a for a, b in g)) for g in grid]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3).flatmap(
    lambda shape: st.tuples(st.just(tuple(shape)),
                            st.tuples(*(st.lists(st.integers(1, max(1, n - 1)), max_size=2, unique=True).map(sorted)
                                        for n in shape)),
                            st.randoms(use_true_random=False))))
def test_blocks_written_in_any_order_make_the_whole_tensor(case):
    """A tensor cut into any grid of blocks (tp's rows or columns, ZeRO's row ranges, both),
    written block by block in any order where each lies, reads back as the whole tensor, and
    the runs of each block cover its elements exactly once."""
    shape, cuts, rng = case
    whole = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    after = torch.randn(2, 3)
    tiles = _tiles(shape, [[c for c in cut if c < n] for cut, n in zip(cuts, shape)])
    rng.shuffle(tiles)
    for offsets, block in tiles:
        covered = sorted(i for at, _, length in contiguous_runs(shape, block, offsets) for i in range(at, at + length))
        region = whole[tuple(slice(o, o + b) for o, b in zip(offsets, block))]
        assert covered == sorted(region.reshape(-1).long().tolist())
    with tempfile.TemporaryDirectory() as directory:
        writer = ShardWriter(directory, [Entry("a", shape, torch.float32), Entry("b", (2, 3), torch.float32)], 10**9)
        for offsets, block in tiles:
            writer.write_block("a", whole[tuple(slice(o, o + b) for o, b in zip(offsets, block))], offsets, shape)
        writer.write("b", after)
        writer.close()
        back = read_weights(directory)
        assert torch.equal(back["a"], whole) and torch.equal(back["b"], after)


def test_a_block_written_twice_or_a_tensor_left_short_is_refused(tmp_path):
    writer = ShardWriter(tmp_path, [Entry("a", (4, 2), torch.float32)], 10**9)
    writer.write_block("a", torch.ones(2, 2), (0, 0), (4, 2))
    with pytest.raises(PlaitError, match="block at \\(0, 0\\) twice"):
        writer.write_block("a", torch.ones(2, 2), (0, 0), (4, 2))
    with pytest.raises(PlaitError, match="got 0 of 1 tensors whole"):
        writer.close()
