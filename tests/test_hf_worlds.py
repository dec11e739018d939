"""A transformers Llama through plait's public API on 2 processes matches one process.

One spawn (tests/worlds/hf_world.py): tp 2 with a user plan on transformers' own module
names (regions called with keyword inputs), dp 2 and ZeRO-3 × 2. `make test-all` only:
`make test` trains transformers models under the same layouts from their declared plans, and
a user's region plan against them (tests/test_hf_plans_worlds.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.parity import assert_losses_close
from tests.worldlib import run_world

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    _, reports = run_world("hf_world.py", 2, tmp_path_factory.mktemp("hf"))
    return reports


@pytest.mark.parametrize("run", ["tp_regions", "tp_no_regions"])
def test_tensor_parallel_llama_matches_one_process(world: list[dict[str, Any]], run: str) -> None:
    for report in world:
        assert_losses_close(report[run]["losses"], report["reference"]["losses"], rtol=1e-4)


def test_one_tp_all_reduce_per_region_in_backward(world: list[dict[str, Any]]) -> None:
    """Regions entered by keyword: attention and MLP each all-reduce their input gradient once.
    Without regions, q, k, v, gate and up each do it for their own copy of the input."""
    for report in world:
        layers = report["tp_regions"]["layers"]
        assert report["tp_regions"]["backward_tp_all_reduces"] == 2 * layers
        assert report["tp_no_regions"]["backward_tp_all_reduces"] == 5 * layers


@pytest.mark.parametrize("run", ["dp", "zero3"])
def test_data_parallel_llama_matches_one_process(world: list[dict[str, Any]], run: str) -> None:
    """Each dp rank's loss is the mean over its half of the batch; their mean is the global loss."""
    losses = [sum(step) / len(world) for step in zip(*(report[run]["losses"] for report in world))]
    assert_losses_close(losses, world[0]["reference"]["losses"], rtol=1e-5)
