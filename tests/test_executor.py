"""The executor's whole-weights assembly, in-process: blocks from any ranks tile each tensor,
and pieces that repeat or miss a block are refused rather than handed back as weights."""

from __future__ import annotations

import pytest
import torch

from plait.errors import PlaitError
from plait.parallel.executor import Assembly


pytestmark = pytest.mark.one_process  # no world, no command: may run beside another such file (tests/pairing.py)


def _pieces(full: torch.Tensor, rows: list[tuple[int, int]]) -> list:
    return [("w", full[a:b].clone(), (a, 0), tuple(full.shape)) for a, b in rows]


def test_blocks_from_two_ranks_in_any_order_give_the_whole_tensor() -> None:
    full = torch.arange(24.0).view(6, 4)
    whole = Assembly()
    whole.add(_pieces(full, [(3, 6)]))  # rank 1's block first
    whole.add(_pieces(full, [(0, 3)]) + [("b", torch.ones(()), (), ())])
    out = whole.finish()
    assert list(out) == ["b", "w"] and torch.equal(out["w"], full) and out["b"].item() == 1.0


def test_a_block_given_twice_is_refused() -> None:
    full = torch.zeros(4, 2)
    whole = Assembly()
    whole.add(_pieces(full, [(0, 2)]))
    with pytest.raises(PlaitError, match=r"block at \(0, 0\) twice"):
        whole.add(_pieces(full, [(0, 2)]))


def test_a_missing_block_is_refused() -> None:
    whole = Assembly()
    whole.add(_pieces(torch.zeros(4, 2), [(0, 2)]))
    with pytest.raises(PlaitError, match="covering 4 of 8 elements"):
        whole.finish()
