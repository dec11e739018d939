"""Expert parallelism trains the same model as one process: plait's MoE GPT with both
routers under ep 2 (dp 4), ep 4 and ep 2 × pp 2, through the real Trainer; the all-to-all's
bytes against the formula on the routing that happened; a router that sends everything to
one expert; a checkpoint moved between ep degrees. One 4-rank world (tests/worlds/moe_world.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.hf_versions import declares_dispatched_experts, older_moe_reason
from tests.parity import PARAM_ATOL, PARAM_RTOL, assert_losses_close
from tests.worldlib import run_plait

transformers = pytest.importorskip("transformers")

LAYOUTS = ("ep2", "ep4", "ep2-pp2", "ep2-tp2")
# tp's row-parallel layers sum in another order; AdamW turns last-bit gradient differences of
# near-zero components into ~1e-5 (tests/parity.py; tests/matrix.py holds tp to 2e-5)
TP_PARAM_ATOL = 2e-5


@pytest.fixture(scope="module")
def root(moe_root: Path) -> Path:
    return moe_root


@pytest.fixture(scope="module")
def extra(moe_extra: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return moe_extra


@pytest.mark.slow
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("layout", ["ep2-recompute", "ep2-selective", "ep2-zero1"])
def test_expert_parallel_with_recompute_and_zero1_trains_the_one_process_model(
        extra: list[dict[str, Any]], router: str, layout: str) -> None:
    found = extra[0][router]
    assert_losses_close(found[layout]["losses"], found["one"]["losses"])
    assert found[layout]["excess"] <= PARAM_ATOL, found[layout]["excess"]
    for rank in extra:  # recomputation reruns the dispatch: its bytes are in the formula, counted once
        for routing in rank[router][layout]["routing"]:
            assert routing["alltoall_measured"] == pytest.approx(routing["alltoall_formula"], rel=1e-12)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_expert_parallel_in_16_bits_trains_the_one_process_model(extra: list[dict[str, Any]], router: str,
                                                                 precision: str) -> None:
    found = extra[0][f"{router}-{precision}"]
    assert_losses_close(found["ep2-zero1"]["losses"], found["one"]["losses"], rtol=2e-3)


@pytest.fixture(scope="module")
def world(moe_world: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return moe_world


CASES = [(router, layout) for router in ("softmax", "sigmoid") for layout in LAYOUTS]
FAST = [case for case in CASES if case != ("sigmoid", "ep4")]  # the sigmoid router at ep 4: make test-all's


@pytest.mark.parametrize("router, layout", [c if c in FAST else pytest.param(*c, marks=pytest.mark.slow)
                                            for c in CASES])
def test_expert_parallel_trains_the_one_process_model(world: list[dict[str, Any]], request: pytest.FixtureRequest,
                                                      router: str, layout: str) -> None:
    if (router, layout) not in FAST:  # make test-all's: the --extras world
        world = request.getfixturevalue("moe_extra")
    found = world[0][router]
    assert_losses_close(found[layout]["losses"], found["one"]["losses"])
    atol = TP_PARAM_ATOL if "tp" in layout else PARAM_ATOL
    assert found[layout]["excess"] <= atol, (found[layout]["excess"], found[layout]["worst"])
    holding_layer0 = world[:2] if "pp" in layout else world  # pp: ranks 2 and 3 hold the second stage
    for rank in holding_layer0:  # every rank saw the same (global) routing, the one process's
        assert rank[router][layout]["routing"][0]["tokens_per_expert"][:1] == \
            found["one"]["routing"][0]["tokens_per_expert"][:1]


@pytest.mark.parametrize("family, layout", [
    ("mixtral", "ep2"), ("mixtral", "ep2-pp2"), ("mixtral", "ep2-tp2"), ("mixtral", "ep2-zero3"),
    ("qwen2_moe", "ep2"), ("qwen2_moe", "ep2-pp2"), ("qwen2_moe", "ep2-tp2"),
    ("qwen2_moe", "ep2-zero3")])
def test_transformers_moe_models_train_the_one_process_model(world: list[dict[str, Any]], family: str,
                                                              layout: str) -> None:
    if not declares_dispatched_experts():
        pytest.skip(older_moe_reason())
    found = world[0][family]
    assert_losses_close(found[layout]["losses"], found["one"]["losses"])
    atol = TP_PARAM_ATOL if "tp" in layout else PARAM_ATOL
    assert found[layout]["excess"] <= atol, (found[layout]["excess"], found[layout]["worst"])
    routing = found[layout]["routing"][0]
    assert sum(routing["tokens_per_expert"][0]) == 8 * 16 * 2  # every token's two choices, counted once
    assert (routing["aux_loss"] is not None) == (family == "qwen2_moe")  # output_router_logits in its config


def test_an_expert_parallel_checkpoint_exports_to_from_pretrained(world: list[dict[str, Any]], root: Path) -> None:
    if not declares_dispatched_experts():
        pytest.skip(older_moe_reason())
    from safetensors.torch import load_file

    out = root / "out" / "mixtral"
    checkpoint = next((out / "ep2" / "checkpoints").glob("step-*"))
    done = run_plait("ckpt", "export", str(checkpoint), "--hf", str(root / "exported"))
    assert done.returncode == 0, done.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(root / "exported").state_dict()
    reference = load_file(str(out / "one.safetensors"))
    for name, value in reference.items():
        assert ((loaded[name] - value).abs() - PARAM_RTOL * value.abs()).max().item() <= PARAM_ATOL, name


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
    for rank in world:  # in training (both micro-batches, forward and backward): each step's ep bytes
        for layout in ("ep2", "ep2-pp2"):
            for step, routing in enumerate(rank["softmax"][layout]["routing"]):
                assert routing["alltoall_formula"] > 0, step
                assert routing["alltoall_measured"] == pytest.approx(routing["alltoall_formula"], rel=1e-12), step


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
