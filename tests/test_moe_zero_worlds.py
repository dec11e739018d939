"""Expert parallelism under ZeRO trains the same model as one process: plait's MoE GPT with
both routers under dp 4 × ep 2 with ZeRO 1, 2, 3 and dp 4 × ep 4 with ZeRO 3, through the
real Trainer; expert groups cut over edp; a checkpoint written at ep 2 ZeRO 3 resumed at
ep 1 ZeRO 0 and ep 4 ZeRO 1. One 4-rank world (tests/worlds/moe_zero_world.py)."""

from __future__ import annotations

from typing import Any

import pytest

from plait.errors import PlaitError
from plait.layout import Layout
from tests.parity import PARAM_ATOL, assert_losses_close
from tests.worlds.moe_zero_world import FAST

LAYOUTS = ("ep2-zero1", "ep2-zero2", "ep2-zero3", "ep4-zero3")
NORM_RTOL = 1e-6  # fp64 sums of the same squares in another order (clipping is on: the norms are > 1)


@pytest.fixture(scope="module")
def world(moe_world: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ZeRO checks run inside tests/worlds/moe_world.py's spawn (one world for both files)."""
    return [rank["zero"] for rank in moe_world]


CASES = [(router, layout) for router in ("softmax", "sigmoid") for layout in LAYOUTS]


@pytest.mark.parametrize("router, layout", [c if c[1] in FAST[c[0]] else pytest.param(*c, marks=pytest.mark.slow)
                                            for c in CASES])
def test_expert_parallel_zero_trains_the_one_process_model(world: list[dict[str, Any]], request: pytest.FixtureRequest,
                                                           router: str, layout: str) -> None:
    if layout not in FAST[router]:  # make test-all's: the --extras world
        world = [rank["zero"] for rank in request.getfixturevalue("moe_extra")]
    found = world[0][router]
    assert_losses_close(found[layout]["losses"], found["one"]["losses"])
    assert found[layout]["excess"] <= PARAM_ATOL, found[layout]["excess"]
    # the norm clipping used: the experts' squares counted once (summed over dp, not also over ep)
    assert_losses_close(found[layout]["norms"], found["one"]["norms"], rtol=NORM_RTOL)
    assert min(found["one"]["norms"]) > 1.0  # so clipping scaled every step's update by it


@pytest.mark.parametrize("layout", FAST["softmax"])
def test_expert_groups_are_cut_over_edp_and_every_element_is_owned_once(world: list[dict[str, Any]],
                                                                        layout: str) -> None:
    ep = int(layout[2])
    groups = world[0]["softmax"][layout]["groups"]
    kinds = {(axis, n) for axis, n, _ in groups}
    assert kinds == {("dp", 4), ("edp", 4 // ep)}, groups
    if layout.endswith("zero3"):  # each MoE block: two groups, two registered shards
        assert {(axis, name) for axis, _, name in groups} == {("dp", "plait_shard"), ("edp", "plait_edp_shard")}
    owned = sum(rank["softmax"][layout]["owned"] for rank in world)
    assert owned == world[0]["softmax"]["one"]["numel"]


def test_a_checkpoint_written_at_ep2_zero3_resumes_at_ep1_zero0_and_ep4_zero1(world: list[dict[str, Any]]) -> None:
    expected = world[0]["sigmoid"]["one"]["losses"][1:]  # the router's bias moved at step 1: loaded too
    for layout in ("ep1-zero0", "ep4-zero1"):
        assert_losses_close(world[0]["resumed"][layout], expected)


def test_expert_parallelism_with_context_parallelism_is_still_refused() -> None:
    with pytest.raises(PlaitError, match="--ep 2 with --cp 2: expert parallelism with context parallelism "
                                         r"is not built yet \(hint: drop --cp"):
        Layout(dp=2, ep=2, cp=2)
    for zero in (1, 2, 3):
        assert Layout(dp=4, ep=2, zero=zero).zero == zero
