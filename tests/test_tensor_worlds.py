"""Tensor and sequence parallelism in real multi-process worlds (Gloo, CPU).

Two spawns: tp = 2 and tp = 4 (the latter also runs dp 2 × tp 2 with SP). Each checks the
sharded layers, parity with one process and with torch.distributed.tensor.parallel, the
ledger against plait.estimate's tp traffic exactly, and activation bytes against its block.
"""

from __future__ import annotations

from typing import Any

import pytest

from plait.estimate.activations import llama_layer_bytes
from plait.estimate.layout import Workload, stages
from plait.estimate.traffic import tp_traffic
from plait.models.gpt.config import GPTConfig
from tests.parity import assert_losses_close
from tests.worldlib import run_world

RTOL = 1e-4
PLAIT_RUNS = {"tp_only": (False, True), "sp": (True, True), "sp_no_regather": (True, False)}


# tp 4 (and dp 2 × tp 2 inside it) is the long matrix (`make test-all`); `make test` trains
# dp × tp through `plait train` (the parity matrix, tests/matrix.py).
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def world(request: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tp = request.param
    args = ["--native"] + (["--dp-tp"] if tp == 4 else [])
    _, reports = run_world("tensor_world.py", tp, tmp_path_factory.mktemp(f"tp{tp}"), *args)
    return reports


def test_sharded_layers_match_dense(world: list[dict[str, Any]]) -> None:
    for report in world:
        worst = max(report["layers"].items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-5, worst


@pytest.mark.parametrize("run", [*PLAIT_RUNS, "native", "native_sp"])
def test_training_matches_one_process(world: list[dict[str, Any]], run: str) -> None:
    for report in world:
        ref, got = report["reference"], report[run]
        assert_losses_close(got["losses"], ref["losses"], rtol=RTOL)
        assert_losses_close(got["grad_norms"], ref["grad_norms"], rtol=RTOL)
        assert got["param_error"]["excess"] <= 1.0, got["param_error"]  # rtol 1e-4, atol 1e-6


def test_ledger_is_exactly_the_formula(world: list[dict[str, Any]]) -> None:
    for report in world:
        config, tp = GPTConfig(**report["config"]), report["tp"]
        for run, (sp, regather) in PLAIT_RUNS.items():
            work = Workload(tp=tp, sp=sp, micro_batch=report["batch"], seq_len=report["seq"], precision="fp32")
            expected = tp_traffic(config, work, stages(config, tp, 1)[0])["tp"]
            if not regather:  # apply_tensor_parallel(regather=False), the API's option: the saved
                # region inputs are whole, so backward skips their all-gathers (2 a block, 1 the head)
                act = report["batch"] * report["seq"] * config.d_model * 4
                expected["all_gather"] -= (tp - 1) / tp * (2 * config.n_layers + 1) * act
            assert report[run]["traffic"] == {"tp": pytest.approx(expected)}, run
        # SP saving whole inputs moves exactly the bytes of TP's all-reduces, as their two
        # halves; the loss's small all-reduces (3 floats a token) are the same in both.
        tp_only, sp = report["tp_only"]["traffic"]["tp"], report["sp_no_regather"]["traffic"]["tp"]
        loss = 2 * (tp - 1) / tp * 3 * report["batch"] * report["seq"] * 4
        assert sp["all_gather"] + sp["reduce_scatter"] == tp_only["all_reduce"] - loss


def test_activations_match_the_formula(world: list[dict[str, Any]]) -> None:
    report = world[0]
    config, tp, batch, seq = GPTConfig(**report["config"]), report["tp"], report["batch"], report["seq"]

    def predicted(tp: int, sp: bool = False, regather: bool = True) -> float:
        block = llama_layer_bytes(config, Workload(tp=tp, sp=sp, micro_batch=batch, seq_len=seq, precision="fp32"))
        whole_inputs = 0 if regather or not sp else 2 * batch * seq * config.d_model * 4 * (1 - 1 / tp)
        return block + whole_inputs

    measured = {"reference": report["reference_block_bytes"], "tp_only": report["tp_only"]["block_bytes"],
                "sp": report["sp"]["block_bytes"], "sp_no_regather": report["sp_no_regather"]["block_bytes"]}
    wanted = {"reference": predicted(1), "tp_only": predicted(tp), "sp": predicted(tp, True),
              "sp_no_regather": predicted(tp, True, False)}
    for name in measured:
        assert measured[name] == pytest.approx(wanted[name], rel=0.10), (name, measured[name], wanted[name])
    # The shape of the saving: SP splits everything by tp, TP alone only the regions' insides.
    assert measured["sp"] == pytest.approx(measured["reference"] / tp, rel=0.10)
    assert measured["tp_only"] > measured["sp_no_regather"] > measured["sp"]


def test_sp_with_an_uneven_sequence_names_the_numbers(world: list[dict[str, Any]]) -> None:
    message, tp = world[0]["bad_sequence"], world[0]["tp"]
    assert "17 tokens" in message and f"tp={tp}" in message


def test_dp_times_tp_with_sp_matches_one_process(world: list[dict[str, Any]]) -> None:
    if "dp_tp" not in world[0]:
        pytest.skip("the 4-rank world runs dp 2 × tp 2")
    for report in world:
        assert report["dp_tp"]["param_error"]["excess"] <= 1.0
        assert report["dp_tp"]["grad_norm_error"] < RTOL


def test_ranks_agree(world: list[dict[str, Any]]) -> None:
    for report in world[1:]:
        assert report["sp"]["losses"] == world[0]["sp"]["losses"]
        assert report["tp_only"]["traffic"] == world[0]["tp_only"]["traffic"]

