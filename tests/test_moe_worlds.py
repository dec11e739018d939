"""Expert parallelism trains the same model as one process: plait's MoE GPT with both
routers under ep 2 (dp 4), ep 4 and ep 2 × pp 2, through the real Trainer; the all-to-all's
bytes against the formula on the routing that happened; a router that sends everything to
one expert; a checkpoint moved between ep degrees. One 4-rank world (tests/worlds/moe_world.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.parity import PARAM_ATOL, assert_losses_close
from tests.worldlib import run_world

LAYOUTS = ("ep2", "ep4", "ep2-pp2")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("moe")
    (root / "corpus.txt").write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(600)))
    _, reports = run_world("moe_world.py", 4, root / "out", str(root / "out"), str(root / "corpus.txt"))
    return reports


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_parallel_trains_the_one_process_model(world: list[dict[str, Any]], router: str, layout: str) -> None:
    found = world[0][router]
    assert_losses_close(found[layout]["losses"], found["one"]["losses"])
    assert found[layout]["excess"] <= PARAM_ATOL, found[layout]["excess"]
    holding_layer0 = world[:2] if "pp" in layout else world  # pp: ranks 2 and 3 hold the second stage
    for rank in holding_layer0:  # every rank saw the same (global) routing, the one process's
        assert rank[router][layout]["routing"][0]["tokens_per_expert"][:1] == \
            found["one"]["routing"][0]["tokens_per_expert"][:1]


def test_the_sigmoid_router_bias_moved_and_the_softmax_router_has_a_balancing_loss(
        world: list[dict[str, Any]]) -> None:
    assert any(abs(b) > 0 for layer in world[0]["sigmoid"]["bias"] for b in layer)
    assert all(b == 0 for layer in world[0]["softmax"]["bias"] for b in layer)
    aux = [r["aux_loss"] for r in world[0]["softmax"]["one"]["routing"]]
    assert all(0.9 < a < 2.0 for a in aux), aux  # E·Σ f·P: 1 when balanced, at most E
    assert world[0]["sigmoid"]["one"]["routing"][0]["aux_loss"] is None


def test_the_ledger_counts_the_formula_on_the_routing_that_happened(world: list[dict[str, Any]]) -> None:
    for rank in world:
        layer = rank["layer"]
        assert layer["measured"]["all_to_all"] == pytest.approx(layer["formula"], rel=1e-12)
        assert layer["formula"] > 0
        # per MoE layer: forward 3 (counts, rows out, rows back), backward 2 (the reverse of each)
        assert layer["calls"] == {"all_to_all": 5 * layer["moe_layers"]}
    for rank in world:  # in training: the step's ep bytes against the formula on its routing
        for step, routing in enumerate(rank["softmax"]["ep2"]["routing"]):
            assert routing["alltoall_formula"] > 0, step


def test_ranks_that_receive_no_tokens_train_on(world: list[dict[str, Any]]) -> None:
    forced = world[0]["forced"]
    assert len(forced["losses"]) == 2 and all(loss == loss for loss in forced["losses"])
    for step in forced["routing"]:
        for layer in step["tokens_per_expert"]:
            assert layer[1:] == [0.0, 0.0, 0.0] and layer[0] > 0


def test_a_checkpoint_written_at_ep2_resumes_at_ep1_and_ep4(world: list[dict[str, Any]]) -> None:
    expected = world[0]["softmax"]["one"]["losses"][1:]
    for ep in ("ep1", "ep4"):
        assert_losses_close(world[0]["resumed"][ep], expected)
